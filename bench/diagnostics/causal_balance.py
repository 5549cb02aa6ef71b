"""Load balance of causal attention tiles over a GPU's CTA slots, simulated (any machine, no GPU): makespan over
the ideal (total work / slots) of the warp-specialized forward's tile schedules.

    python bench/diagnostics/causal_balance.py [--slots 264] [--rows 64] [--block-n 128] [--lag 2]
        [--shapes 4x32x4096,3x24x3000,4x32x2048,16x32x512]

A tile is ``--rows`` query rows of one (batch, head) and costs its key tiles + ``TILE_OVERHEAD`` (Q load,
epilogue); its keys stop at its last row (bottom-right causal, Mq = Mk). Schedules:

* ``strides``: a persistent grid, slot s runs tiles s, s + slots, .. (heaviest row block first per head);
* ``per_head``: tiles handed out in that order to whichever slot is free first (a grid of one CTA per tile, which
  the hardware hands out in order, or ``WsFwdConfig.dynamic`` without sections);
* ``sections``: the same, heaviest first across sections of 8 (batch, head) pairs (``WsFwdConfig.head_section``);
* ``dynamic``: ``sections`` on a persistent grid whose slots take their next tile ``--lag`` key tiles before the
  current one ends (the producer takes it once the current tile's loads are issued: ``WsFwdConfig.dynamic``).
"""
from __future__ import annotations

import argparse
import heapq

#: work of a tile beyond its key tiles, in key tiles (its Q load and its epilogue)
TILE_OVERHEAD = 0.3
#: (batch, head) pairs per section of the ``sections`` and ``dynamic`` schedules
SECTION = 8


def tile_work(batch: int, heads: int, n: int, rows: int, block_n: int, section: int) -> list[float]:
    """Work of each tile in hand-out order: row blocks heaviest first within each (batch, head) (``section`` 0) or
    across each section of ``section`` pairs, as ``attention_fwd_ws._tile_coords`` numbers them."""
    n_m = -(-n // rows)
    pairs = batch * heads
    work = []
    for t in range(n_m * pairs):
        if section:
            per = section * n_m
            in_section = min(pairs - t // per * section, section)
            pid_m = n_m - 1 - (t % per) // in_section
        else:
            pid_m = n_m - 1 - t % n_m
        work.append(-(-min(n, (pid_m + 1) * rows) // block_n) + TILE_OVERHEAD)
    return work


def strided(work: list[float], slots: int) -> float:
    """Makespan when slot s runs tiles s, s + slots, .."""
    load = [0.0] * slots
    for t, w in enumerate(work):
        load[t % slots] += w
    return max(load)


def greedy(work: list[float], slots: int, lag: float = 0.0) -> float:
    """Makespan when each tile in turn goes to the slot that asks first; a slot asks ``lag`` work before its
    current tile ends (at once for a shorter tile)."""
    asks = [(0.0, s, 0.0) for s in range(slots)]  # (time it asks, slot, time it is free)
    end = 0.0
    for w in work:
        ask, s, free = heapq.heappop(asks)
        done = max(ask, free) + w
        end = max(end, done)
        heapq.heappush(asks, (max(done - w, done - lag), s, done))
    return end


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=264, help="CTA slots: 132 SMs x 2 one-consumer CTAs")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--block-n", type=int, default=128)
    p.add_argument("--lag", type=float, default=2.0, help="key tiles left when a dynamic slot takes its next tile")
    p.add_argument("--shapes", default="4x32x4096,3x24x3000,4x32x2048,16x32x512", help="BxHxN, causal")
    a = p.parse_args()
    print(f"{'shape':>12} {'strides':>8} {'per_head':>8} {'sections':>8} {'dynamic':>8}")
    for shape in a.shapes.split(","):
        batch, heads, n = map(int, shape.split("x"))
        per_head = tile_work(batch, heads, n, a.rows, a.block_n, 0)
        sections = tile_work(batch, heads, n, a.rows, a.block_n, SECTION)
        ideal = sum(per_head) / a.slots
        spans = (strided(per_head, a.slots), greedy(per_head, a.slots), greedy(sections, a.slots),
                 greedy(sections, a.slots, a.lag))
        print(f"{shape + 'c':>12} " + " ".join(f"{s / ideal:8.3f}" for s in spans))


if __name__ == "__main__":
    main()
