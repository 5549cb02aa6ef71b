"""Where the time of a GPT-OSS training call with sinks goes: the route the selector takes, the Triton pair, and the
sinks' gradient (``fmha_ops.sinks.sink_grad``) against the same gradient from the backward's row sums.

    python bench/diagnostics/sinks_backward_cost.py [--out DIR] [--quick]

GPT-OSS heads (64 query / 8 KV heads of dim 64), bf16, bottom-right causal, full and a 128-token window. Per shape,
CUDA-event medians (ms) of:
* ``selected`` / ``selected_sinks``: ``memory_efficient_attention`` forward + backward as the selector routes it
  (``route`` / ``route_sinks``: the forward op; sdpa_cudnnF carries cuDNN's backward, triton_attnF pairs with
  triton_attnB);
* ``triton`` / ``triton_sinks``: the same forced to ``("triton_attnF", "triton_attnB")``: what sinks cost on one
  route (the sinks' gradient included);
* ``sink_grad``: ``sink_grad(out, grad, lse, sinks)`` alone, as the autograd function runs it after the backward
  (float32 copies of out and grad, their product, a row sum: a pass over (B, M, Hq, Kv));
* ``from_delta``: the same gradient from the (B, Hq, M) float32 row sums rowsum(dO * O) that the Triton backward's
  preprocess kernel already writes: what the sinks' gradient would cost if the backward returned it.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import base_parser, out_dir, print_table, time_ms, write_json  # noqa: E402
import fmha_ops  # noqa: E402
from fmha_ops import LowerTriangularFromBottomRightMask  # noqa: E402
from fmha_ops.sinks import sink_grad  # noqa: E402

HQ, HKV, D = 64, 8, 64
WINDOW = 128
SHAPES = {"full": [(1, 8192), (8, 4096), (1, 32768)], "quick": [(1, 8192)]}
TRITON_PAIR = ("triton_attnF", "triton_attnB")


def _train(q, k, v, mask, grad, sinks, op=None):
    out = fmha_ops.memory_efficient_attention(q, k, v, mask, sinks=sinks, op=op)
    torch.autograd.backward(out, grad)


def shape_row(b: int, n: int, window: int | None) -> dict:
    mask = LowerTriangularFromBottomRightMask()
    if window is not None:
        mask = mask.make_local_attention(window)
    q = torch.randn(b, n, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, n, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sinks = torch.randn(HQ, device="cuda", requires_grad=True)
    grad = torch.randn_like(q)
    with torch.no_grad():
        out, lse = fmha_ops.memory_efficient_attention_partial(q, k, v, mask, sinks=sinks)
    delta = (grad.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # what the preprocess writes
    explained = fmha_ops.explain(q, k, v, mask, sinks=sinks)
    row = {"shape": f"{b}x{n} {'full' if window is None else f'window {window}'}",
           "route_sinks": explained.selected.NAME if explained.selected else None,
           "route": fmha_ops.explain(q, k, v, mask).selected.NAME}
    row["selected"] = time_ms(lambda: _train(q, k, v, mask, grad, None))
    row["selected_sinks"] = time_ms(lambda: _train(q, k, v, mask, grad, sinks))
    row["triton"] = time_ms(lambda: _train(q, k, v, mask, grad, None, TRITON_PAIR))
    row["triton_sinks"] = time_ms(lambda: _train(q, k, v, mask, grad, sinks, TRITON_PAIR))
    row["sink_grad"] = time_ms(lambda: sink_grad(out, grad, lse, sinks.detach()))
    weight = torch.exp(sinks.detach()[None, :, None] - lse)
    row["from_delta"] = time_ms(lambda: -(torch.where(torch.isfinite(lse), weight, 0.0) * delta).sum((0, 2)))
    row["ratio_selected"] = row["selected_sinks"] / row["selected"]
    row["ratio_triton"] = row["triton_sinks"] / row["triton"]
    return row


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    rows = [shape_row(b, n, w) for b, n in SHAPES["quick" if args.quick else "full"] for w in (None, WINDOW)]
    print_table(rows, ["shape", "route", "route_sinks", "selected", "selected_sinks", "ratio_selected", "triton",
                       "triton_sinks", "ratio_triton", "sink_grad", "from_delta"])
    if args.out:
        print(write_json(out_dir(args.out), "sinks_backward_cost", rows))


if __name__ == "__main__":
    main()
