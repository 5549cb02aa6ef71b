"""Selector regret computed offline from a tuning table, leave-one-out: each measured grid point is hidden from
the table in turn and every op measured there is estimated from the rest (``method``: "nearest", the op's model
scaled by measured / model at the nearest measured buckets of the same kind; "factor", the op's model scaled by
its one median measured / model factor). regret = t(op ranked first) / t(fastest op measured there) - 1.
The summary splits the points into the interior of the grid (2048 tokens) and its edges (512 and 8192 tokens,
where an estimate extrapolates). ``--hide size``: each point hidden with every point of its kind at its lengths
(all GQA ratios), so an edge point is estimated from the other lengths only, as a call past the grid is.
``--measured selector.json``: also the regret the selector (``Selector.estimate`` on this table) would have on a
selector bench's measured prefill calls, data the table did not see. ``--recalibrate OUT``: write the table with
each op's calibration (median measured / model over its rows) recomputed under the current cost models (after
``python -m fmha_ops merge`` joined a table's pieces, each op's calibration over all its rows).

    python bench/diagnostics/selector_offline.py [--table fmha_ops/tuning/NVIDIA_H200.json] [--hide size]
        [--measured JSON] [--recalibrate OUT]

Needs no GPU: the points' problems are rebuilt from their bucket keys for the table's device (an sm90 GPU: the
H200's or the H100's table).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from registry import Arch, Selector, TuningTable, TuningTables  # noqa: E402
from registry.select import host_points, nearest_host, nearest_ratio  # noqa: E402

from fmha_ops.dispatch import REGISTRY  # noqa: E402
from fmha_ops.problem import Problem  # noqa: E402

TABLE = os.path.join(os.path.dirname(__file__), "..", "..", "fmha_ops", "tuning", "NVIDIA_H200.json")
#: the compute capability of the tables' GPUs (H100, H200)
SM90 = (9, 0)
H200 = Arch("cuda", SM90, name="NVIDIA H200")
METHODS = ("nearest", "factor")
#: what a leave-one-out run hides with each point: the point alone, or every point of its kind at its lengths
HIDE = ("bucket", "size")
#: the grid's lengths: the interior one and the edges (``summary``)
INTERIOR, EDGES = "q2048", ("q512", "q8192")


def problem_of(bucket: str, arch: Arch = H200) -> Problem | None:
    """The problem a tuning-grid bucket key describes (batch 1, all of batch x KV heads as heads); None for a key
    of another layout (windows, softcap)."""
    fields = bucket.split("|")
    if len(fields) != 10:
        return None
    dts, dims, bias, g, page, qkv, bh, q, k, grad = fields
    qd, kd, vd = (getattr(torch, name) for name in dts.split("/"))
    d, dv = (int(x) for x in dims[1:].split("/"))
    heads_kv, ratio, mq, mk = int(bh[2:]), int(g[1:]), int(q[1:]), int(k[1:])
    quantized = qd in (torch.int8, torch.float8_e4m3fn) or kd == torch.float8_e4m3fn
    return Problem(arch, qd, kd, vd, torch.bfloat16, 1, mq, mk, mq, heads_kv * ratio, heads_kv, d, dv, bias,
                   True, int(page[1:]), ("tensor",) * 3 if quantized else ("none",) * 3, qkv == "qkv1",
                   False, False, grad == "grad1", False, False)


def host_time(table: TuningTable, op, problem: Problem, hidden: frozenset[str] = frozenset()) -> float:
    """The op's host seconds at ``problem`` as the selector takes them: from its host rows of the problem's kind
    nearest in size (``nearest_host``; the rows of the buckets ``hidden`` left out), else its one measured host time,
    else its declared one."""
    rows = {b: t for b, t in table.host_timings.get(op.NAME, {}).items() if b not in hidden}
    return nearest_host(problem, host_points(problem, rows)) or table.host.get(op.NAME) or op.host_time(problem)


def estimate(op, problem: Problem, rows: dict[str, float], factor: float | None, method: str,
             host: float) -> float | None:
    """The op's estimate at ``problem`` from the measured ``rows`` (its own bucket hidden) by ``method``, at least
    its host time ``host`` (``host_time``)."""
    model = op.estimate(problem)
    if model is None or not math.isfinite(model):
        return None
    fitted = nearest_ratio(op, problem, rows, factor) if method == "nearest" else None
    ratio = fitted[0] if fitted else factor
    return max(model * (ratio or 1.0), host)


def arch_of(table: TuningTable) -> Arch:
    """The sm90 GPU ``table`` was measured on, named as the table's device (the selector finds the table by it)."""
    return Arch("cuda", SM90, name=table.device)


def hidden_with(bucket: str, buckets: set[str], hide: str) -> frozenset[str]:
    """The buckets a leave-one-out run hides with ``bucket`` (``HIDE``): itself, or with ``hide`` "size" every one
    of ``buckets`` that differs from it in the GQA ratio and batch x heads only (its kind at its lengths)."""
    if hide == "bucket":
        return frozenset([bucket])
    mine = bucket.split("|")
    return frozenset(b for b in buckets if len(f := b.split("|")) == len(mine)
                     and all(x == y for i, (x, y) in enumerate(zip(f, mine)) if i not in (3, 6)))


def leave_one_out(table: TuningTable, method: str, hide: str = "bucket") -> list[dict]:
    """One row per bucket measured for two or more ops: the op ranked first with that bucket hidden (with ``hide``
    "size": with the buckets ``hidden_with`` it), the fastest measured op, the regret."""
    buckets = sorted({b for rows in table.timings.values() for b in rows})
    arch, out = arch_of(table), []
    for bucket in buckets:
        problem = problem_of(bucket, arch)
        if problem is None:
            continue
        # what a call costs back to back: the device time, at least the op's measured host time
        times = {name: max(rows[bucket], host_time(table, REGISTRY.get(name), problem))
                 for name, rows in table.timings.items() if bucket in rows}
        if len(times) < 2:
            continue
        ests = {}
        hidden = hidden_with(bucket, set(buckets), hide)
        for name in times:
            op = REGISTRY.get(name)
            rows = {b: t for b, t in table.timings[name].items() if b not in hidden}
            ratios = [t / m for b, t in rows.items() if (p := problem_of(b, arch)) and (m := op.estimate(p))]
            e = estimate(op, problem, rows, statistics.median(ratios) if ratios else None, method,
                         host_time(table, op, problem, hidden=hidden))
            if e is not None:
                ests[name] = e
        if len(ests) < 2:
            continue
        picked, best = min(ests, key=ests.get), min(times, key=times.get)
        out.append({"bucket": bucket, "selected": picked, "best": best, "regret": times[picked] / times[best] - 1})
    return out


#: a selector bench prefill label: "prefill <dtype> B<b> N<n> H<hq>/<hkv> D<d>[ causal]"
_LABEL = re.compile(r"prefill (\S+) B(\d+) N(\d+) H(\d+)/(\d+) D(\d+)( causal)?$")
#: the selector bench's prefill dtypes: (q/k/v dtype, descale kind)
_DTYPES = {"bfloat16": (torch.bfloat16, "none"), "float16": (torch.float16, "none"),
           "fp8": (torch.float8_e4m3fn, "head"), "fp8_tensor": (torch.float8_e4m3fn, "tensor")}


def problem_of_label(label: str, arch: Arch = H200) -> Problem | None:
    """The problem of a selector bench prefill call's label (None for other calls: decode, backward, i8fp8)."""
    m = _LABEL.match(label)
    if not m or m.group(1) not in _DTYPES:
        return None
    dtype, descale = _DTYPES[m.group(1)]
    b, n, hq, hkv, d = (int(x) for x in m.groups()[1:6])
    return Problem(arch, dtype, dtype, dtype, torch.bfloat16, b, n, n, b * n, hq, hkv, d, d,
                   "causal_bottom_right" if m.group(7) else "none", True, 0, (descale,) * 3, False, False, False,
                   False, False, False)


def held_out(table: TuningTable, measured: list[dict]) -> list[dict]:
    """One row per measured prefill call of a selector bench JSON (``rows``: label, ``times_us`` per op): the op
    ``Selector.estimate`` ranks first with ``table``, the fastest measured op, the regret."""
    with tempfile.TemporaryDirectory() as folder:
        table.save(os.path.join(folder, "table.json"))
        selector = Selector(REGISTRY, TuningTables([folder]))
        arch, out = arch_of(table), []
        for row in measured:
            problem = problem_of_label(row["call"], arch)
            times = row["times_us"]
            if problem is None or len(times) < 2:
                continue
            ests = {name: selector.estimate(REGISTRY.get(name), problem)[0] for name in times}
            ests = {name: e for name, e in ests.items() if e is not None}
            picked, best = min(ests, key=ests.get), min(times, key=times.get)
            out.append({"call": row["call"], "selected": picked, "best": best,
                        "regret": times[picked] / times[best] - 1})
        return out


def summary(rows: list[dict]) -> dict:
    """Median and worst regret and the misses over 3% of ``leave_one_out`` rows: all, the grid's interior
    (``INTERIOR``) and its edges (``EDGES``)."""
    def stats(regrets: list[float]) -> dict:
        return {"points": len(regrets), "median": statistics.median(regrets), "worst": max(regrets),
                "misses_over_3pct": sum(r > 0.03 for r in regrets)}

    def at(lengths) -> list[float]:
        return [r["regret"] for r in rows if r["bucket"].split("|")[7] in lengths]

    return {"all": stats([r["regret"] for r in rows]), "interior": stats(at((INTERIOR,))), "edge": stats(at(EDGES))}


def recalibrated(table: TuningTable) -> TuningTable:
    """``table`` with each op's calibration the median measured / model over its rows under the current cost
    models (the rows ``problem_of`` rebuilds); ops of decode rows only (q1: models that read no roofline) keep
    theirs."""
    calibration, arch = dict(table.calibration), arch_of(table)
    for name, rows in table.timings.items():
        op = REGISTRY.get(name)
        if all("|q1|" in b for b in rows):
            continue
        ratios = [t / m for b, t in rows.items() if (p := problem_of(b, arch)) and (m := op.estimate(p))]
        if ratios:
            calibration[name] = statistics.median(ratios)
    return TuningTable(table.device, table.versions, table.timings, calibration, table.host, table.host_timings)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default=TABLE)
    parser.add_argument("--hide", choices=HIDE, default="bucket", help="what each point is hidden with")
    parser.add_argument("--measured", default=None, help="a selector bench's selector.json (held-out calls)")
    parser.add_argument("--recalibrate", default=None, metavar="OUT", help="write the recalibrated table here")
    args = parser.parse_args(argv)
    table = TuningTable.load(args.table)
    out = {}
    for method in METHODS:
        rows = leave_one_out(table, method, args.hide)
        for r in sorted(rows, key=lambda r: -r["regret"])[:6]:
            print(f"{method:8s} {r['regret']:6.1%} {r['selected']:>16s} vs {r['best']:<16s} {r['bucket']}")
        out[method] = summary(rows)
    print(f"\nleave-one-out (hide {args.hide}) | points | median | worst | misses > 3%")
    for method, parts in out.items():
        for part, st in parts.items():
            print(f"{method} {part} | {st['points']} | {st['median']:.1%} | {st['worst']:.1%} | "
                  f"{st['misses_over_3pct']}")
    if args.measured:
        with open(args.measured) as f:
            rows = held_out(table, json.load(f)["rows"])
        for r in rows:
            print(f"held-out {r['regret']:6.1%} {r['selected']:>16s} vs {r['best']:<16s} {r['call']}")
        regrets = [r["regret"] for r in rows]
        out["held_out"] = {"calls": len(rows), "median": statistics.median(regrets), "worst": max(regrets)}
        print(f"held-out: {out['held_out']}")
    if args.recalibrate:
        fresh = recalibrated(table)
        for name in sorted(fresh.calibration):
            print(f"calibration {name}: {table.calibration.get(name, float('nan')):.3f} -> "
                  f"{fresh.calibration[name]:.3f}")
        fresh.save(args.recalibrate)
    return out


if __name__ == "__main__":
    main()
