"""What our FA3 op adds to FlashAttention-3's own call: FA3's ``flash_attn_func`` called directly against the same
kernels through ``memory_efficient_attention(op="fa3F")`` and through the public call's own choice, at the forward
anchors (bf16, and fp8 with (B, Hkv) descales), plus the outputs' agreement.

CUDA-event medians of back-to-back calls (``triton.testing.do_bench``, its L2 flush included), TFLOP/s =
4*B*H*N^2*D / t, halved when causal; ``host_us``: wall time per call of 200 back-to-back small calls (B1 N128 H8 D128)
issued without waiting. Needs a FlashAttention-3 build (``fmha-ops[fa3]``). Prints a table; writes fa3_adapter.json.

    PYTHONPATH=$PWD python bench/diagnostics/fa3_adapter.py [--out DIR]
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fmha_ops  # noqa: E402
from bench.common import attention_tflops, base_parser, out_dir, print_table, write_json  # noqa: E402
from fmha_ops.ops.fa3 import interface  # noqa: E402
from fmha_ops.quant import quantize_qkv_fp8  # noqa: E402
from fmha_ops.testing import error_report, transformer_like  # noqa: E402

#: (B, N, Hq, Hkv, D, causal): the forward anchors
SHAPES = ((4, 4096, 32, 32, 128, False), (4, 4096, 32, 32, 128, True), (2, 16384, 16, 16, 128, True),
          (4, 4096, 16, 16, 256, False), (3, 3000, 24, 8, 128, True), (8, 1000, 16, 16, 128, False),
          (16, 512, 32, 8, 64, True))
HOST_CALLS = 200


def host_us(fn) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    t = (time.perf_counter() - t0) / HOST_CALLS
    torch.cuda.synchronize()
    return t * 1e6


def main(argv=None) -> list[dict]:
    import triton

    args = base_parser(__doc__.splitlines()[0]).parse_args(argv)
    fa3 = interface()
    rows = []
    for b, n, hq, hkv, d, causal in SHAPES:
        q, k, v = transformer_like((b, n, hq, d), (b, n, hkv, d), device="cuda", seed=n + d)
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        bias = fmha_ops.LowerTriangularFromBottomRightMask() if causal else None
        for dtype, args_, kw in (("bf16", (q, k, v), {}),
                                 ("fp8", (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd))):
            calls = {"fa3_direct": lambda: fa3.flash_attn_func(*args_, causal=causal, **kw),
                     "fa3F": lambda: fmha_ops.memory_efficient_attention(*args_, bias, op="fa3F", **kw),
                     "public": lambda: fmha_ops.memory_efficient_attention(*args_, bias, **kw)}
            row = {"shape": f"{b}x{n}x{hq}/{hkv} D{d}{' causal' if causal else ''}", "dtype": dtype,
                   "public_op": fmha_ops.explain(*args_, bias, **kw).selected.NAME}
            outs = {name: fn() for name, fn in calls.items()}
            for name, fn in calls.items():
                row[name] = attention_tflops(b, hq, n, d, causal, triton.testing.do_bench(fn, return_mode="median"))
            row["fa3F/direct"] = row["fa3F"] / row["fa3_direct"]
            row["public/direct"] = row["public"] / row["fa3_direct"]
            row["cos_fa3F_vs_direct"] = error_report(outs["fa3F"], outs["fa3_direct"])["cos"]
            rows.append(row)
            print(row, flush=True)
    q = torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16)
    host = {"host_us_fa3_direct": host_us(lambda: fa3.flash_attn_func(q, q, q, causal=True)),
            "host_us_fa3F": host_us(lambda: fmha_ops.memory_efficient_attention(
                q, q, q, fmha_ops.LowerTriangularFromBottomRightMask(), op="fa3F")),
            "host_us_flash_attn_func_fa3F": host_us(lambda: fmha_ops.flash_attn_func(q, q, q, causal=True))}
    d = out_dir(args.out)
    write_json(d, "fa3_adapter", rows, {"host": host})
    print_table(rows, ["shape", "dtype", "public_op", "fa3_direct", "fa3F", "public", "fa3F/direct", "public/direct",
                       "cos_fa3F_vs_direct"])
    print(host)
    return rows


if __name__ == "__main__":
    main()
