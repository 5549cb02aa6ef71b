"""Context-parallel (ring) attention on W GPUs against one GPU running the whole sequence.

    torchrun --nproc-per-node 2 bench/context_parallel_bench.py [--tokens 131072] [--out DIR] [--no-record]
    torchrun --nproc-per-node 2 bench/context_parallel_bench.py --cpu --tokens 512 --no-record   # gloo smoke run

Causal, B=1, Hq=32, Hkv=8 (GQA 4), D=128, zigzag layout; bf16 and fp8 e4m3 (per-tensor descales, each rank
quantizing its own shards); forward, and forward + backward (fp8: backward on the dequantized values). The
one-GPU baseline is the same public call (``memory_efficient_attention``) over the whole sequence on rank 0
while the other ranks wait; cuDNN (SDPA) bf16 is shown beside it.

Timing: a fixed number of iterations with CUDA events on every rank, ranks aligned by a barrier before each
(``triton.testing.do_bench`` picks its repetition count per process, which would desynchronize the ring); the
slowest rank's median. speedup = t(one GPU) / t(ring); efficiency = speedup / W. ``xfer_ms`` is one ring
transfer of a K/V shard alone (what each step must hide), ``step_ms`` = t(ring) / W.
NCCL settings are left as the machine sets them (NCCL_NVLS_ENABLE=0 and the multicast-off variables).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fmha_ops  # noqa: E402
from bench import common  # noqa: E402
from fmha_ops import context_parallel as cp  # noqa: E402
from fmha_ops.context_parallel.ring import Packet, Ring  # noqa: E402
from fmha_ops.testing import transformer_like  # noqa: E402

COMMAND = "torchrun --nproc-per-node 2 bench/context_parallel_bench.py"
NAME = "context_parallel"
FP8_MAX = 448.0


def _timed(fn, device: torch.device, iters: int, warmup: int, barrier: bool = True) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls (CUDA events on CUDA, wall time on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if barrier:
            dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _slowest(ms: float | None, device: torch.device) -> float | None:
    t = torch.tensor([ms if ms is not None else -1.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return None if t.item() < 0 else t.item()


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (t.float().abs().amax() / FP8_MAX).clamp_min(1e-12).reshape(1)
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def _fwd_bwd(attn, leaves, grad):
    return lambda: torch.autograd.grad(attn(*leaves), leaves, grad)


def run_case(dtype_name: str, passes: str, args, device, rank, world) -> dict:
    n, hq, hkv, d = args.tokens, args.heads, args.kv_heads, args.dim
    q, k, v = transformer_like((1, n, hq, d), (1, n, hkv, d), dtype=torch.bfloat16, device=device)
    grad = torch.randn(1, n, hq, d, dtype=torch.bfloat16, device=device)
    shards = [cp.shard(t, rank, world) for t in (q, k, v)]
    grad_i = cp.shard(grad, rank, world)
    causal = fmha_ops.LowerTriangularMask()
    backward = passes == "fwd+bwd"
    fp8 = dtype_name == "fp8"
    if fp8:
        (q8, qs), (k8, ks), (v8, vs) = (_quantize(t) for t in (q, k, v))
        (qi, qis), (ki, kis), (vi, vis) = (_quantize(t) for t in shards)
        whole = lambda a, b, c: fmha_ops.memory_efficient_attention(  # noqa: E731
            a, b, c, causal, q_descale=qs, k_descale=ks, v_descale=vs)
        ring = lambda a, b, c: cp.attention(a, b, c, causal=True, q_descale=qis, k_descale=kis,  # noqa: E731
                                            v_descale=vis)
        whole_in, ring_in = [q8, k8, v8], [qi, ki, vi]
    else:
        whole = lambda a, b, c: fmha_ops.memory_efficient_attention(a, b, c, causal)  # noqa: E731
        ring = lambda a, b, c: cp.attention(a, b, c, causal=True)  # noqa: E731
        whole_in, ring_in = [q, k, v], shards
    if backward:
        whole_in = [t.detach().requires_grad_() for t in whole_in]
        ring_in = [t.detach().requires_grad_() for t in ring_in]
        whole_fn, ring_fn = _fwd_bwd(whole, whole_in, grad), _fwd_bwd(ring, ring_in, grad_i)
    else:
        whole_fn, ring_fn = (lambda: whole(*whole_in)), (lambda: ring(*ring_in))
    cudnn_fn = None
    if not fp8 and device.type == "cuda":
        sdpa = common.sdpa("CUDNN_ATTENTION")
        bhmk = [t.detach().transpose(1, 2).requires_grad_(backward) for t in (q, k, v)]
        cudnn = lambda a, b, c: sdpa(a, b, c, True, True)  # noqa: E731
        cudnn_fn = _fwd_bwd(cudnn, bhmk, grad.transpose(1, 2)) if backward else (lambda: cudnn(*bhmk))

    with fmha_ops.set_fp8_dequantized_backward(fp8 and backward):
        one = common.or_none(lambda: _timed(whole_fn, device, args.iters, args.warmup, barrier=False)) \
            if rank == 0 else None
        one_cudnn = common.or_none(lambda: _timed(cudnn_fn, device, args.iters, args.warmup, barrier=False)) \
            if rank == 0 and cudnn_fn is not None else None
        dist.barrier()
        ring_ms = _slowest(_timed(ring_fn, device, args.iters, args.warmup), device)
    one, one_cudnn = _slowest(one, device), _slowest(one_cudnn, device)
    kv_fields = [ring_in[1], ring_in[2]]
    packet = Packet([t.detach() for t in kv_fields])
    buf = packet.pack([t.detach() for t in kv_fields], device)
    xfer = None
    if world > 1:
        r = Ring(dist.group.WORLD, device)
        xfer = _slowest(_timed(lambda: r.start(buf).finish(), device, args.iters, args.warmup), device)
    flops = 4 * hq * n * n * d / 2 * (3.5 if backward else 1.0)  # causal; backward = 2.5x forward
    speedup = one / ring_ms if one and ring_ms else None
    return {
        "case": f"{dtype_name} {passes}", "tokens": n, "W": world, "one_gpu_ms": one, "one_gpu_cudnn_ms": one_cudnn,
        "ring_ms": ring_ms, "speedup": speedup, "efficiency": speedup / world if speedup else None,
        "ring_tflops_per_gpu": flops / (ring_ms * 1e-3) / 1e12 / world if ring_ms else None,
        "step_ms": ring_ms / world if ring_ms else None, "xfer_ms": xfer,
        "kv_mb_per_step": packet.nbytes / 1e6,
    }


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=131072, help="whole sequence length N (a multiple of 2W)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU processes (a smoke run of the plumbing)")
    args = p.parse_args()
    if args.cpu:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = [("bf16", "fwd"), ("bf16", "fwd+bwd"), ("fp8", "fwd"), ("fp8", "fwd+bwd")]
    if args.quick:
        cases = cases[:2]
    rows = []
    for dt, passes in cases:
        row = common.or_none(lambda: run_case(dt, passes, args, device, rank, world))
        if row is not None:
            rows.append(row)
            if rank == 0:
                print(f"{row['case']}: one GPU {row['one_gpu_ms']} ms, ring {row['ring_ms']} ms, "
                      f"speedup {row['speedup']}", flush=True)
    if rank == 0 and rows:
        cols = ["case", "tokens", "W", "one_gpu_ms", "one_gpu_cudnn_ms", "ring_ms", "speedup", "efficiency",
                "ring_tflops_per_gpu", "step_ms", "xfer_ms", "kv_mb_per_step"]
        common.print_table(rows, cols)
        out = common.out_dir(args.out)
        common.write_json(out, NAME, rows, {"args": vars(args)})
        png = common.bar_plot(out, NAME, rows, "case", ["speedup"], "speedup over one GPU",
                              f"ring attention, {args.tokens} tokens causal, {world} ranks")
        if not args.no_record and not args.cpu:
            body = (f"Causal, B=1, Hq={args.heads}, Hkv={args.kv_heads}, D={args.dim}, zigzag over {world} GPUs (NCCL); "
                    f"speedup = one GPU (same call, whole sequence) / ring; efficiency = speedup / W.\n\n"
                    + common.markdown_table(rows, cols))
            common.write_record(NAME, "Context-parallel ring attention", COMMAND, body,
                                png=os.path.basename(png) if png else None)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
