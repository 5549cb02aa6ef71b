"""The training path's quantization pass (``quantize_qkv``: kv stats + fused quantize) against the copy roofline.

Per shape (B, N, H, D; q/k/v bf16 of that shape): CUDA-graph replay time of ``quantize_qkv`` for int8 and fp8
q/k, of its stats launch (``kv_stats``: k and v read once) alone, and of ``torch.clone`` of q, k and v (the device's read+write copy speed on the
same bytes). Bytes moved by the pass: q, k, v read, k and v read again (stats), the narrow copies and the
dequantized bf16 copies written. Prints a table, writes quantize_bench.json and quantize_bench.png into --out and
the record bench/results/quantize.md (not with --quick, --no-record or a --module other than the shipped one).

    PYTHONPATH=$PWD python bench/quantize_bench.py [--module bench.some_candidate]
"""
from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench import common

SHAPES = [(16, 1024, 8, 64), (4, 4096, 32, 128), (1, 16384, 16, 128), (2, 8192, 8, 256)]
SHIPPED = "fmha_ops.kernels.triton.quantize"
RECORD = common.Record(
    "quantize", "Quantization pass of the training path", "PYTHONPATH=$PWD python bench/quantize_bench.py",
    {"shape": "shape (B x N x H x D)", "MB_moved": "MB moved", "int8_us": "int8 q/k (us)", "int8_TBps": "TB/s",
     "fp8_us": "fp8 q/k (us)", "fp8_TBps": "TB/s", "copy_TBps": "clone q,k,v TB/s"},
    "`quantize_qkv` of bf16 q, k, v (the training path's pass: k/v stats, then one fused quantize that also writes "
    "the dequantized bf16 copies the backward reads), CUDA-graph replay; clone: `torch.clone` of q, k and v, the "
    "copy speed on the same device.")


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--module", default=SHIPPED,
                   help="module providing quantize_qkv (to compare a candidate)")
    args = p.parse_args()
    mod = importlib.import_module(args.module)
    fp8 = torch.float8_e4m3fn
    rows = []
    for B, N, H, D in SHAPES[:1] if args.quick else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        elems = q.numel()
        moved = elems * (2 * 3 + 2 * 2 + 1 * 3 + 2 * 3)
        row = {"shape": f"{B}x{N}x{H}x{D}", "MB_moved": moved / 1e6}
        for name, dt in (("int8", torch.int8), ("fp8", fp8)):
            ms, _ = common.time_graph_ms(lambda dt=dt: mod.quantize_qkv(q, k, v, dt, fp8, scale=D ** -0.5,
                                                                           q_block=128, k_block=128))
            row[f"{name}_us"] = ms * 1e3
            row[f"{name}_TBps"] = moved / ms / 1e9
        stats_ms, _ = common.time_graph_ms(lambda: mod.kv_stats(k, v))
        row["stats_us"] = stats_ms * 1e3
        row["stats_TBps"] = 4 * elems / stats_ms / 1e9
        copy_ms, _ = common.time_graph_ms(lambda: (q.clone(), k.clone(), v.clone()))
        row["copy_qkv_us"] = copy_ms * 1e3
        row["copy_TBps"] = 4 * elems * 3 / copy_ms / 1e9
        rows.append(row)
    cols = ["shape", "MB_moved", "int8_us", "int8_TBps", "fp8_us", "fp8_TBps", "stats_us", "stats_TBps", "copy_qkv_us",
            "copy_TBps"]
    common.print_table(rows, cols)
    out = common.out_dir(args.out)
    common.write_json(out, "quantize_bench", rows, {"module": args.module})
    png = common.bar_plot(out, "quantize_bench", rows, "shape", ["int8_TBps", "fp8_TBps", "copy_TBps"], "TB/s",
                          "quantize_qkv bandwidth vs torch clone (H200, graph replay)")
    if not (args.no_record or args.quick or args.module != SHIPPED):
        print("record:", RECORD.write(rows, common.environment(), png))


if __name__ == "__main__":
    main()
