"""Forward tile check at one shape, on the training path's inputs (quantize_smooth: per-block q/k, per-channel v).

Times ``attention_forward`` for a few (block_m, block_n, warps, stages) in alternating order, twice, to tell a
real tile effect from run noise; each call is captured in a CUDA graph and the replay is timed, so a small
shape measures the GPU, not the host launch path (eager timing of a ~0.1 ms call measures Python). python bench/fwd_tile_check.py [--shape 16,8,1024,64] [--causal] [--out DIR]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.common import base_parser, capture_graph, out_dir, print_table, time_ms, write_json
from fmha_ops.kernels.triton.attention_fwd import attention_forward
from fmha_ops.quantized import quantize_smooth

TILES = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (64, 128, 4, 3), (64, 128, 4, 2), (128, 64, 8, 2)]


def main():
    p = base_parser(__doc__)
    p.add_argument("--shape", default="16,8,1024,64", help="B,H,N,D")
    p.add_argument("--causal", action="store_true")
    args = p.parse_args()
    B, H, N, D = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    for qk_dtype in (torch.float8_e4m3fn, torch.int8):
        (q8, k8, v8), ds, _ = quantize_smooth(q, k, v, D ** -0.5, qk_dtype)
        rows = {t: {"dtype": str(qk_dtype), "tile": "x".join(map(str, t))} for t in TILES}
        for rep in range(2):
            for t in (TILES if rep == 0 else TILES[::-1]):
                bm, bn, w, s = t
                graph = capture_graph(lambda: attention_forward(
                    q8, k8, v8, scale=1.0, causal=args.causal, block_m=bm, block_n=bn, num_warps=w, num_stages=s,
                    **ds))
                rows[t][f"us_{rep}"] = time_ms(graph.replay) * 1e3
                rows[t]["tflops"] = 4 * B * H * N * N * D / (2 if args.causal else 1) / (rows[t][f"us_{rep}"] * 1e6)
        print_table(list(rows.values()), ["dtype", "tile", "us_0", "us_1", "tflops"])
        write_json(out_dir(args.out), f"fwd_tile_check_{'i8' if qk_dtype == torch.int8 else 'fp8'}", list(rows.values()))


if __name__ == "__main__":
    main()
