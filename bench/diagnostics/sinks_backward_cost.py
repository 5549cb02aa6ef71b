"""Where the time of a GPT-OSS training call with sinks goes: the route the selector takes, the Triton pair, and the
sinks' gradient from the backward's row sums (``TritonBwOp.apply_bw_sinks``) against the pass before it
(``fmha_ops.sinks.sink_grad`` after the backward).

    python bench/diagnostics/sinks_backward_cost.py [--out DIR] [--quick]

GPT-OSS heads (64 query / 8 KV heads of dim 64), bf16, bottom-right causal, full and a 128-token window. Per shape,
CUDA-event medians (ms) of:
* ``selected`` / ``selected_sinks``: ``memory_efficient_attention`` forward + backward as the selector routes it
  (``route`` / ``route_sinks``: the forward op; sdpa_cudnnF carries cuDNN's backward, triton_attnF pairs with
  triton_attnB);
* ``triton`` / ``triton_sinks``: the same forced to ``("triton_attnF", "triton_attnB")``: what sinks cost on one
  route, the sinks' gradient from the row sums rowsum(dO * O) that the backward's preprocess kernel writes;
* ``triton_sinks_before``: the same with the sinks' gradient as ``sink_grad`` after the backward (what backward ops
  without row sums of their own run: float32 copies of out and grad, their product, a row sum);
* ``sink_grad`` / ``from_delta``: the sinks' gradient alone, by ``sink_grad(out, grad, lse, sinks)`` (a pass over
  (B, M, Hq, Kv)) and by ``sink_grad_from_delta(delta, lse, sinks)`` on the (B, Hq, M) float32 row sums.
Ratios: ``ratio_triton`` = triton_sinks / triton (issue 38's bound: 1.03), ``ratio_before`` = triton_sinks_before /
triton.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import base_parser, out_dir, print_table, time_ms, write_json  # noqa: E402
import fmha_ops  # noqa: E402
from fmha_ops import LowerTriangularFromBottomRightMask  # noqa: E402
from fmha_ops.ops.base import AttentionBwOp  # noqa: E402
from fmha_ops.ops.triton_attention import TritonBwOp  # noqa: E402
from fmha_ops.sinks import sink_grad, sink_grad_from_delta  # noqa: E402

HQ, HKV, D = 64, 8, 64
WINDOW = 128
SHAPES = {"full": [(1, 8192), (8, 4096), (1, 32768)], "quick": [(1, 8192)]}
TRITON_PAIR = ("triton_attnF", "triton_attnB")


def _train(q, k, v, mask, grad, sinks, op=None):
    out = fmha_ops.memory_efficient_attention(q, k, v, mask, sinks=sinks, op=op)
    torch.autograd.backward(out, grad)


@contextlib.contextmanager
def sink_grad_after_backward():
    """Within the block triton_attnB gives the sinks' gradient as a backward op without row sums does: the base
    class's ``apply_bw_sinks`` (``sink_grad`` after ``apply_bw``)."""
    own = TritonBwOp.__dict__["apply_bw_sinks"]
    TritonBwOp.apply_bw_sinks = AttentionBwOp.__dict__["apply_bw_sinks"]
    try:
        yield
    finally:
        TritonBwOp.apply_bw_sinks = own


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
    with sink_grad_after_backward():
        row["triton_sinks_before"] = time_ms(lambda: _train(q, k, v, mask, grad, sinks, TRITON_PAIR))
    row["sink_grad"] = time_ms(lambda: sink_grad(out, grad, lse, sinks.detach()))
    row["from_delta"] = time_ms(lambda: sink_grad_from_delta(delta, lse, sinks.detach()))
    row["ratio_selected"] = row["selected_sinks"] / row["selected"]
    row["ratio_triton"] = row["triton_sinks"] / row["triton"]
    row["ratio_before"] = row["triton_sinks_before"] / row["triton"]
    return row


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    rows = [shape_row(b, n, w) for b, n in SHAPES["quick" if args.quick else "full"] for w in (None, WINDOW)]
    print_table(rows, ["shape", "route", "route_sinks", "selected", "selected_sinks", "ratio_selected", "triton",
                       "triton_sinks", "ratio_triton", "triton_sinks_before", "ratio_before", "sink_grad",
                       "from_delta"])
    if args.out:
        print(write_json(out_dir(args.out), "sinks_backward_cost", rows))


if __name__ == "__main__":
    main()
