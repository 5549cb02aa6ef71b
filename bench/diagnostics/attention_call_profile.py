"""Where one attention call's time goes: torch.profiler over forward+backward of each training variant.

Shape: the training benchmark's attention (B=16, N=1024, H=8, D=64, causal, bf16 q/k/v with grads).
Prints, per variant, the profiler table sorted by device time (kernels, their counts and times), the
wall time per call (host included) and the GPU time of CUDA-graph replays of the forward and forward+backward, and writes attention_call_profile.json. With ``--cprofile`` also the
host side: cProfile over 50 calls per variant, the top functions by own time into attention_call_cprofile.txt.

    PYTHONPATH=$PWD python bench/diagnostics/attention_call_profile.py --out DIR
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench import common


def variants():
    import fmha_ops

    return {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2),
        "fp8": lambda q, k, v: fmha_ops.fp8_attention(q, k, v, causal=True),
        "i8fp8": lambda q, k, v: fmha_ops.i8fp8_attention(q, k, v, causal=True),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--shape", default="16,1024,8,64", help="B,N,H,D")
    p.add_argument("--cprofile", action="store_true", help="also profile the host side (Python) with cProfile")
    args = p.parse_args()
    host_report = io.StringIO()
    B, N, H, D = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    do = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    rows = []
    for name, fn in variants().items():
        def step(fn=fn):
            out = fn(q, k, v)
            torch.autograd.grad(out, (q, k, v), do)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) / 20 * 1e3
        gpu_ms = common.time_ms(step)
        graphs = {"fwd": common.capture_graph(lambda fn=fn: fn(q, k, v)), "fwd_bwd": common.capture_graph(step)}
        graph_ms = {part: common.time_ms(g.replay) for part, g in graphs.items()}
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(f"\n=== {name}: wall {wall_ms:.3f} ms per fwd+bwd (host included), do_bench {gpu_ms:.3f} ms, "
              f"graph replay fwd {graph_ms['fwd']:.4f} ms, fwd+bwd {graph_ms['fwd_bwd']:.4f} ms")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=60))
        kernels = [(e.key, e.count / 5, e.device_time_total / 5 / 1e3) for e in prof.key_averages()
                   if e.device_time_total > 0 and e.cpu_time_total == 0]
        rows.append({"variant": name, "wall_ms": wall_ms, "do_bench_ms": gpu_ms, "graph_fwd_ms": graph_ms["fwd"],
                     "graph_fwd_bwd_ms": graph_ms["fwd_bwd"],
                     "kernels": sorted(kernels, key=lambda x: -x[2])[:20]})
        if args.cprofile:
            prof_host = cProfile.Profile()
            prof_host.enable()
            for _ in range(50):
                step()
            torch.cuda.synchronize()
            prof_host.disable()
            host_report.write(f"\n=== {name}: 50 calls of forward+backward\n")
            pstats.Stats(prof_host, stream=host_report).sort_stats("tottime").print_stats(40)
    out = common.out_dir(args.out)
    common.write_json(out, "attention_call_profile", rows)
    if args.cprofile:
        with open(os.path.join(out, "attention_call_cprofile.txt"), "w") as fh:
            fh.write(host_report.getvalue())


if __name__ == "__main__":
    main()
