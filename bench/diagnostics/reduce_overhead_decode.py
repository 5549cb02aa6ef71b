"""Where the time of a decode step compiled with ``torch.compile(mode="reduce-overhead")`` goes, and whether it replays.

``flash_attn_with_kvcache`` on a bf16 paged cache and on an fp8 cache (``kv_cache.build_fp8_paged_cache``) in one
function, compiled fullgraph with mode="reduce-overhead" before any eager call at these shapes; prints the seconds of
each of the first calls (trace + inductor compile + warm-up, CUDA-graph recording, replays) as they finish, then the
error of every replay against eager and inductor's cudagraph skip count.

    PYTHONPATH=$PWD python bench/diagnostics/reduce_overhead_decode.py [--compile-threads 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-threads", type=int, default=1, help="inductor compile threads (1: no worker pool)")
    args = p.parse_args()
    t0 = time.perf_counter()
    import fmha_ops
    from fmha_ops.kv_cache import build_fp8_paged_cache
    from fmha_ops.testing import error_report
    from torch._dynamo.utils import counters

    torch._inductor.config.compile_threads = args.compile_threads
    B, L, Hq, Hkv, D, page = 4, 300, 12, 3, 128, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    k, v = (torch.randn(B, L, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k8, v8, ks, vs, table = build_fp8_paged_cache(k, v, page)
    per_seq = table.shape[1]
    kp, vp = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, per_seq * page - L)).view(B * per_seq, page, Hkv, D)
              [table.flatten().argsort()] for t in (k, v))
    q = torch.randn(B, 1, Hq, D, device="cuda", generator=g, dtype=torch.bfloat16)
    lens = torch.tensor([300, 17, 1, 256], dtype=torch.int32, device="cuda")
    print(f"setup {time.perf_counter() - t0:.1f} s", flush=True)

    def step(q, lens):
        bf16 = fmha_ops.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=table, causal=True)
        fp8 = fmha_ops.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, causal=True,
                                               k_descale=ks, v_descale=vs)
        return bf16, fp8

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    outs = []
    for i in range(4):
        q.copy_(torch.randn(q.shape, generator=g, device="cuda", dtype=q.dtype))
        lens.copy_(torch.randint(0, L + 1, lens.shape, generator=g, device="cuda", dtype=torch.int32))
        t = time.perf_counter()
        got = [o.clone() for o in compiled(q, lens)]
        torch.cuda.synchronize()
        print(f"compiled call {i}: {time.perf_counter() - t:.2f} s", flush=True)
        outs.append((got, q.clone(), lens.clone()))
    for i, (got, qi, li) in enumerate(outs):
        want = step(qi, li)
        rel = [error_report(h.float(), w.float())["rel"] for h, w in zip(got, want)]
        print(f"call {i} rel vs eager: bf16 {rel[0]:.2e} fp8 {rel[1]:.2e}", flush=True)
    print(f"cudagraph skips {counters['inductor']['cudagraph_skips']}; total {time.perf_counter() - t0:.1f} s",
          flush=True)


if __name__ == "__main__":
    main()
