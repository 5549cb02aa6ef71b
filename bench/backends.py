"""The public API against the strongest installed kernels, same process: bf16 forward and backward through
``memory_efficient_attention`` next to SDPA cuDNN and FlashAttention-4, and fp8 with per-tensor descales next
to our Triton fp8 op and cuDNN's fp8 forward.

    python bench/backends.py [--quick] [--out DIR]

TFLOP/s = 4*B*H*N^2*D / t, halved when causal; backward 2.5x that count. Every column is timed through
``memory_efficient_attention`` (``op=`` for the single-backend columns, the selector for ``api``), CUDA
events (do_bench median). Ratios: ``api/best`` = api / max(cuDNN, FA4) (bf16) and api / max(ours, cuDNN fp8)
(fp8). Columns of a backend that is not installed are empty. ``forward_columns`` / ``backward_columns`` /
``fp8_columns`` are what the forward and backward benchmarks add to their rows.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    attention_tflops,
    base_parser,
    environment_line,
    or_none,
    out_dir,
    print_table,
    time_ms,
    write_json,
)
import fmha_ops  # noqa: E402
from fmha_ops import attn_bias as ab  # noqa: E402
from fmha_ops.quant import quantize_fp8_tensor  # noqa: E402
from fmha_ops.testing import normal_qkv  # noqa: E402

SHAPES = [  # B, Hq, Hkv, N, D, causal: the shapes of the backends' comparison in BENCHMARKS.md
    (4, 32, 32, 4096, 128, False),
    (4, 32, 32, 4096, 128, True),
    (2, 16, 16, 16384, 128, False),
    (4, 16, 16, 4096, 64, False),
    (4, 16, 16, 4096, 256, False),
    (8, 16, 16, 1000, 128, False),
    (4, 32, 8, 4096, 128, False),
]
BACKWARD_FLOPS = 2.5  # backward FLOPs per forward FLOP


def _available(name: str) -> bool:
    return fmha_ops.get_op(name).available() is None


def _mask(causal: bool):
    return ab.LowerTriangularFromBottomRightMask() if causal else None


def _ratio(num, *dens):
    dens = [d for d in dens if d]
    return num / max(dens) if num and dens else None


def forward_columns(q, k, v, causal: bool) -> dict:
    """bf16 forward TFLOP/s: ``api`` (the selector's op, named in ``api_op``), ``cudnn``, ``fa4``, ``api/best``."""
    b, n, hq, d = q.shape
    bias = _mask(causal)
    tf = lambda ms: attention_tflops(b, hq, n, d, causal, ms)  # noqa: E731
    run = lambda op: tf(or_none(lambda: time_ms(  # noqa: E731
        lambda: fmha_ops.memory_efficient_attention(q, k, v, bias, op=op))))
    row = {"api_op": fmha_ops.explain(q, k, v, bias).selected.NAME, "api": run(None), "cudnn": run("sdpa_cudnnF"),
           "fa4": run("fa4F") if _available("fa4F") else None}
    row["api/best"] = _ratio(row["api"], row["cudnn"], row["fa4"])
    return row


def backward_columns(q, k, v, causal: bool) -> dict:
    """bf16 backward TFLOP/s (2.5x the forward count): ``api_bw`` (selected pair), ``cudnn_bw``, ``fa4_bw``."""
    b, n, hq, d = q.shape
    bias = _mask(causal)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def run(op):
        out = fmha_ops.memory_efficient_attention(qg, kg, vg, bias, op=op)
        grad = torch.randn_like(out)
        ms = or_none(lambda: time_ms(lambda: torch.autograd.grad(out, (qg, kg, vg), grad, retain_graph=True)))
        flops = attention_tflops(b, hq, n, d, causal, ms)
        return flops * BACKWARD_FLOPS if flops else None

    row = {"api_bw": or_none(lambda: run(None)), "cudnn_bw": or_none(lambda: run("sdpa_cudnnF")),
           "fa4_bw": or_none(lambda: run(("fa4F", "fa4B"))) if _available("fa4F") else None}
    row["api_bw/best"] = _ratio(row["api_bw"], row["cudnn_bw"], row["fa4_bw"])
    return row


def fp8_columns(q, k, v, causal: bool) -> dict:
    """fp8 (per-tensor descales, bf16 out) TFLOP/s: ``api_fp8``, ``ours_fp8`` (triton_fp8F), ``cudnn_fp8``."""
    b, n, hq, d = q.shape
    bias = _mask(causal)
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8_tensor(t) for t in (q, k, v))
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    tf = lambda ms: attention_tflops(b, hq, n, d, causal, ms)  # noqa: E731
    run = lambda op: tf(or_none(lambda: time_ms(  # noqa: E731
        lambda: fmha_ops.memory_efficient_attention(q8, k8, v8, bias, op=op, **kw))))
    row = {"api_fp8_op": or_none(lambda: fmha_ops.explain(q8, k8, v8, bias, **kw).selected.NAME),
           "api_fp8": run(None), "ours_fp8": run("triton_fp8F"),
           "cudnn_fp8": run("cudnn_fp8F") if _available("cudnn_fp8F") else None}
    row["api_fp8/best"] = _ratio(row["api_fp8"], row["ours_fp8"], row["cudnn_fp8"])
    return row


COLUMNS = ["shape", "api_op", "api", "cudnn", "fa4", "api/best", "api_bw", "cudnn_bw", "fa4_bw", "api_bw/best",
           "api_fp8_op", "api_fp8", "ours_fp8", "cudnn_fp8", "api_fp8/best"]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    rows = []
    for B, Hq, Hkv, N, D, causal in SHAPES[:2] if args.quick else SHAPES:
        q, k, v = normal_qkv((B, N, Hq, D), (B, N, Hkv, D), dtype=torch.bfloat16, device="cuda")
        row = {"shape": f"{B}x{Hq}/{Hkv}x{N}x{D}{' causal' if causal else ''}"}
        for columns in (forward_columns, backward_columns, fp8_columns):
            row.update(columns(q, k, v, causal))
        print(row, flush=True)
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    print_table(rows, COLUMNS)
    for key in ("api/best", "api_bw/best", "api_fp8/best"):
        got = [r[key] for r in rows if r.get(key)]
        if got:
            print(f"{key}: min {min(got):.3f} over {len(got)} shapes (target >= 0.97)")
    print(environment_line())
    write_json(out_dir(args.out), "backends", rows)


if __name__ == "__main__":
    main()
