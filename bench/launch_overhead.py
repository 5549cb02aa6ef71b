"""Host time per call on the GPU machine: Triton kernel launches (Triton's own path, ``CachedKernel``, the compiled
kernel's runner alone) and whole calls at small sizes, where the host, not the GPU, sets the pace.

Host wall time of back-to-back calls (``time.perf_counter`` over ``--iters`` calls after a warm-up, then one sync;
per-call microseconds); the GPU work of every case is far shorter than its host time. Compared in the same run
with SDPA's eager call on the same tiny tensors. Prints a table, writes launch_overhead.json and .png.

    PYTHONPATH=$PWD python bench/launch_overhead.py [--out DIR]
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fmha_ops  # noqa: E402
from bench import common  # noqa: E402
from fmha_ops.kernels.triton import attention_fwd as af  # noqa: E402
from fmha_ops.kernels.triton.launch import launch  # noqa: E402


def host_us(fn, iters: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def captured_launch(fn, call):
    """(CachedKernel, grid, args, kwargs) of ``fn``'s launch inside ``call()``."""
    ck = launch(fn)
    seen = {}
    real = ck._launch

    def spy(grid, args, kwargs):
        seen.update(grid=grid, args=args, kwargs=kwargs)
        return real(grid, args, kwargs)

    ck._launch = spy
    try:
        call()
    finally:
        del ck._launch
    return ck, seen["grid"], seen["args"], seen["kwargs"]


def launch_rows(iters: int) -> list[dict]:
    q8, k8, v8 = (torch.randn(1, 128, 1, 64, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
    ds = torch.ones(1, 1, device="cuda")
    cases = {
        "attention fwd (4 host TMA descriptors)": (af._attn_fwd_kernel, lambda: af.attention_forward(
            q8, k8, v8, scale=0.125, causal=True, q_descale=ds, k_descale=ds, v_descale=ds)),
        "V transpose (pointers)": (af._transpose_v_kernel, lambda: af.transpose_v(v8)),
    }
    rows = []
    for name, (fn, call) in cases.items():
        ck, grid, args, kwargs = captured_launch(fn, call)
        kernel, rest = next(v for v in ck._cache.values())
        full = list(args) + [kwargs[n] if n in kwargs else d for n, d in rest]
        grid3 = (*grid, 1, 1)[:3]
        rows.append({"case": f"launch: {name}", "args": len(args) + len(kwargs),
                     "triton_us": host_us(lambda: fn[grid](*args, **kwargs), iters),
                     "cached_us": host_us(lambda: ck[grid](*args, **kwargs), iters),
                     "runner_us": host_us(lambda: kernel[grid3](*full), iters)})
    return rows


def call_rows(iters: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    small = [torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    train = [torch.randn(16, 1024, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    grads = [t.clone().requires_grad_() for t in train]
    do = torch.randn_like(train[0])

    def fwd_bwd(attn):
        return lambda: torch.autograd.grad(attn(*grads), grads, do)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    def fp8(q, k, v):
        return fmha_ops.fp8_attention(q, k, v, causal=True)

    cases = {
        "memory_efficient_attention bf16 1x128x1x64": (lambda: fmha_ops.memory_efficient_attention(*small),
                                                        lambda: sdpa(*small)),
        "fp8_attention fwd 16x1024x8x64 causal": (lambda: fp8(*train), lambda: sdpa(*train)),
        "fp8_attention fwd+bwd 16x1024x8x64 causal": (fwd_bwd(fp8), fwd_bwd(sdpa)),
    }
    return [{"case": name, "ours_us": host_us(ours, iters), "sdpa_us": host_us(ref, iters)}
            for name, (ours, ref) in cases.items()]


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    launches = launch_rows(args.iters)
    common.print_table(launches, ["case", "args", "triton_us", "cached_us", "runner_us"])
    calls = call_rows(max(args.iters // 5, 50))
    for r in calls:
        r["ours_over_sdpa"] = r["ours_us"] / r["sdpa_us"]
    common.print_table(calls, ["case", "ours_us", "sdpa_us", "ours_over_sdpa"])
    out = common.out_dir(args.out)
    common.write_json(out, "launch_overhead", launches + calls)
    common.bar_plot(out, "launch_overhead", launches, "case", ["triton_us", "cached_us", "runner_us"], "host us",
                    "Triton launch host time (H200 host)")


if __name__ == "__main__":
    main()
