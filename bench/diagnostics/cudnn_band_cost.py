"""What cuDNN's band alignment and sinks cost our cuDNN-frontend ops (cudnnF / cudnnB) against torch's cuDNN path on
the same kernels, at GPT-OSS training shapes.

    python bench/diagnostics/cudnn_band_cost.py [--out DIR] [--quick]

GPT-OSS heads (64 query / 8 KV heads of dim 64), bf16, causal at Mq == Mk, full and a 128-token window. Per shape,
CUDA-event medians (ms) of the forward alone (``*_fwd``) and the forward + backward (``*_train``) of:
* ``torch``: ``sdpa_cudnnF`` (torch's cuDNN path, ``set_causal_mask``: top-left), no sinks, full attention only;
* ``top_left`` / ``top_left_sinks``: cudnnF + cudnnB as ``band`` passes them now (Mq == Mk: ``TOP_LEFT``), without
  and with sinks (the backward through ``apply_bw_sinks``: dSink_token included);
* ``bottom_right`` / ``bottom_right_sinks``: the same with the band forced to ``BOTTOM_RIGHT`` (what the ops passed
  before; the same keys at Mq == Mk);
* ``triton`` / ``triton_sinks``: the Triton pair (triton_attnF + triton_attnB).
The ops are called directly (``apply`` / ``apply_bw_sinks``), not through the public call, so that each variant
builds its own graphs. The selector's cost model (``fmha_ops.ops.cudnn_sdpa``, its measured comment) takes from
these rows what cuDNN skips under each band and what its sinks add.
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
from fmha_ops.inputs import make_inputs  # noqa: E402
from fmha_ops.ops import cudnn_sdpa  # noqa: E402
from fmha_ops.ops.cudnn_sdpa import CudnnSdpaBwOp, CudnnSdpaFwOp  # noqa: E402
from fmha_ops.ops.triton_attention import TritonBwOp, TritonFwOp  # noqa: E402

HQ, HKV, D = 64, 8, 64
WINDOW = 128
SHAPES = {"full": [(1, 8192), (8, 4096)], "quick": [(1, 8192)]}


@contextlib.contextmanager
def band_alignment(alignment: str):
    """Within the block the cuDNN ops pass every band with ``alignment`` (same bounds); the graph caches are
    emptied on entry and exit so that no graph built under the other alignment is reused."""
    own = cudnn_sdpa.call_band

    def forced(inp):
        b = own(inp)
        return b if b.alignment is None else b._replace(alignment=alignment)

    cudnn_sdpa.FORWARD_GRAPHS.release()
    cudnn_sdpa.BACKWARD_GRAPHS.release()
    cudnn_sdpa.call_band = forced
    try:
        yield
    finally:
        cudnn_sdpa.call_band = own
        cudnn_sdpa.FORWARD_GRAPHS.release()
        cudnn_sdpa.BACKWARD_GRAPHS.release()


def op_times(fw, bw, inp, grad) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of the forward op ``fw`` then the backward op ``bw`` on ``inp``."""
    def forward():
        return fw.apply(inp, True)

    def train():
        out, lse = forward()
        if inp.sinks is None:
            bw.apply_bw(inp, out, lse, grad)
        else:
            bw.apply_bw_sinks(inp, out, lse, grad)

    return time_ms(forward), time_ms(train)


def shape_row(b: int, n: int, window: int | None) -> dict:
    mask = LowerTriangularFromBottomRightMask()
    if window is not None:
        mask = mask.make_local_attention(window)
    q = torch.randn(b, n, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, n, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(HQ, device="cuda")
    grad = torch.randn_like(q)
    plain, with_sinks = make_inputs(q, k, v, mask), make_inputs(q, k, v, mask, sinks=sinks)
    plain.validate()
    with_sinks.validate()
    row = {"shape": f"{b}x{n} {'full' if window is None else f'window {window}'}"}
    if window is None:
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def torch_train():
            out = fmha_ops.memory_efficient_attention(qg, kg, vg, fmha_ops.LowerTriangularMask(), op="sdpa_cudnnF")
            torch.autograd.backward(out, grad)

        row["torch_fwd"] = time_ms(lambda: fmha_ops.memory_efficient_attention(q, k, v, fmha_ops.LowerTriangularMask(),
                                                                               op="sdpa_cudnnF"))
        row["torch_train"] = time_ms(torch_train)
    for alignment, name in (("TOP_LEFT", "top_left"), ("BOTTOM_RIGHT", "bottom_right")):
        with band_alignment(alignment):
            for inp, suffix in ((plain, ""), (with_sinks, "_sinks")):
                row[f"{name}{suffix}_fwd"], row[f"{name}{suffix}_train"] = op_times(CudnnSdpaFwOp, CudnnSdpaBwOp,
                                                                                  inp, grad)
    for inp, suffix in ((plain, ""), (with_sinks, "_sinks")):
        row[f"triton{suffix}_fwd"], row[f"triton{suffix}_train"] = op_times(TritonFwOp, TritonBwOp, inp, grad)
    return row


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    rows = [shape_row(b, n, w) for b, n in SHAPES["quick" if args.quick else "full"] for w in (None, WINDOW)]
    columns = ["shape"] + [f"{name}_{part}" for part in ("fwd", "train") for name in (
        "torch", "top_left", "top_left_sinks", "bottom_right", "bottom_right_sinks", "triton", "triton_sinks")]
    print_table(rows, columns)
    if args.out:
        print(write_json(out_dir(args.out), "cudnn_band_cost", rows))


if __name__ == "__main__":
    main()
