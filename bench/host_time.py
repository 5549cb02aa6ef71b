"""Host time per call: public calls at sizes where the host, not the GPU, sets the pace, against SDPA's eager call
on the same tensors.

Host wall time of back-to-back calls (``bench.common.host_us``: ``time.perf_counter`` over ``--iters`` calls after a
warm-up, one synchronize after), microseconds per call. Writes host_time.json and .png into --out and the table to
bench/results/host_time.md (not with --quick or --no-record). Where the time of a call goes: ``bench/diagnostics/``
(``launch_overhead.py``, ``dispatch_overhead.py``).

    PYTHONPATH=$PWD python bench/host_time.py [--iters 400] [--out DIR]
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fmha_ops  # noqa: E402
from bench import common  # noqa: E402
from fmha_ops.testing import normal_qkv  # noqa: E402

COMMAND = "PYTHONPATH=$PWD python bench/host_time.py"
SMALL = (1, 128, 1, 64)  # B, M, H, D: GPU work of a few microseconds
TRAIN = (16, 1024, 8, 64)  # the training benchmark's attention shape


def _sdpa(q, k, v, causal: bool = False):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)


def _sdpa_causal(q, k, v):
    return _sdpa(q, k, v, causal=True)


def _fp8_causal(q, k, v):
    return fmha_ops.fp8_attention(q, k, v, causal=True)


def cases() -> dict:
    """name -> (our call, SDPA's call on the same tensors)."""
    small = tuple(normal_qkv(SMALL, SMALL, device="cuda"))
    train = tuple(normal_qkv(TRAIN, TRAIN, device="cuda"))
    grads = [t.clone().requires_grad_() for t in train]
    do = torch.randn_like(train[0])

    def fwd_bwd(attn):
        return lambda: torch.autograd.grad(attn(*grads), grads, do)

    shape = "x".join(map(str, TRAIN))
    return {
        f"memory_efficient_attention bf16 {'x'.join(map(str, SMALL))}": (
            lambda: fmha_ops.memory_efficient_attention(*small), lambda: _sdpa(*small)),
        f"fp8_attention forward {shape} causal": (lambda: _fp8_causal(*train), lambda: _sdpa_causal(*train)),
        f"fp8_attention forward + backward {shape} causal": (fwd_bwd(_fp8_causal), fwd_bwd(_sdpa_causal)),
    }


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=400)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/host_time.py needs a CUDA GPU")
    iters = 50 if args.quick else args.iters
    rows = []
    for name, (ours, ref) in cases().items():
        row = {"call": name, "ours_us": common.host_us(ours, iters), "sdpa_us": common.host_us(ref, iters)}
        row["ours_over_sdpa"] = row["ours_us"] / row["sdpa_us"]
        rows.append(row)
    common.print_table(rows, ["call", "ours_us", "sdpa_us", "ours_over_sdpa"])
    out = common.out_dir(args.out)
    env = common.environment()
    common.write_json(out, "host_time", rows)
    png = common.bar_plot(out, "host_time", rows, "call", ["ours_us", "sdpa_us"], "host us per call",
                          "host time per call")
    if not (args.no_record or args.quick):
        print("record:", record(rows, env, png))


def record(rows: list[dict], env: dict, png: str | None = None) -> str:
    """Write bench/results/host_time.md from ``rows`` (keys: call, ours_us, sdpa_us, ours_over_sdpa)."""
    table = common.markdown_table(rows, ["call", "ours_us", "sdpa_us", "ours_over_sdpa"],
                                  ["call", "ours (us)", "SDPA (us)", "ours / SDPA"])
    notes = ("Host wall time per call of back-to-back calls, microseconds; SDPA is torch's eager call on the same "
             "tensors.")
    return common.write_record("host_time", "Host time per call", COMMAND, table + "\n\n" + notes, env, png)


if __name__ == "__main__":
    main()
