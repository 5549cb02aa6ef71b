"""Memory ceiling of a paged decode: the time to only read the bytes a decoder reads.

``stream_ms`` times a read-only Gluon kernel over a paged K/V cache with the fp8 decoder's access pattern: one
single-warp program per (batch, KV head, split), keys of each split in tiles of ``block_n`` rows through a 2-stage
cp.async ring of 16-byte copies, folded into registers by xor and nothing else; fp8 scales are added as bytes at
that kernel's rate. Ring depth, warps and tile width moved this ceiling by < 1% on the H200, so
one configuration stands for all. The ceiling's time over a decoder's is the share of the memory roofline the
decoder reaches; our bf16 decoder's time over the fp8 cache's ceiling is the largest fp8/bf16 speedup any fp8
kernel could show against it.

    PYTHONPATH=$PWD python bench/diagnostics/stream_ceiling.py [--B 64] [--L 4096] [--page 64]
"""
from __future__ import annotations

import torch
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench import common  # noqa: E402
from fmha_ops.kernels.gluon.decode import split_range  # noqa: E402


@gluon.jit
def _stream_kernel(K, V, BT, SEQ, OUT, stride_kp, stride_ks, stride_kh, stride_btb, NUM_KV_HEADS, NUM_SPLITS,
                   W: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr):
    """K/V: int32 views (num_pages, PAGE_SIZE, heads, W) of the caches, W words per key and row of heads; grid
    (B * heads, NUM_SPLITS); OUT int32 (B * heads, NUM_SPLITS)."""
    TW: gl.constexpr = W // 4 if W // 4 < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TW, TW], [1, 1], [1, 0])
    smem: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // NUM_KV_HEADS
    # the decoder's splits (no window, no key starts)
    _, _, start, end, n_tiles = split_range(SEQ, 0, SEQ, b, split, NUM_SPLITS, 2**31 - 1, 0, 1, BLOCK_N, False, False)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    off = gl.expand_dims(rows * stride_ks, 1) + gl.expand_dims(cols, 0) + (pid % NUM_KV_HEADS) * stride_kh
    k_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, W], smem)
    v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, W], smem)
    bt_row = BT + b * stride_btb
    acc = gl.zeros([BLOCK_N, W], gl.int32, layout)
    for it in range(n_tiles + STAGES - 1):  # tile `it` issued, tile it - STAGES + 1 folded
        gl.thread_barrier()  # the stage refilled below is folded
        n = start + it * BLOCK_N
        page = gl.load(bt_row + n // PAGE_SIZE, mask=n < end, other=0).to(gl.int64)
        ok = gl.expand_dims(n + rows < end, 1)
        base = page * stride_kp + (n % PAGE_SIZE) * stride_ks
        async_copy.async_copy_global_to_shared(k_smem.index(it % STAGES), K + base + off, mask=ok)
        async_copy.async_copy_global_to_shared(v_smem.index(it % STAGES), V + base + off, mask=ok)
        async_copy.commit_group()
        if it >= STAGES - 1:
            async_copy.wait_group(STAGES - 1)
            gl.thread_barrier()
            st = (it + 1) % STAGES
            acc = acc ^ k_smem.index(st).load(layout) ^ v_smem.index(st).load(layout)
    async_copy.wait_group(0)
    gl.store(OUT + pid * NUM_SPLITS + split, gl.sum(gl.sum(acc, 1), 0))


def stream_ms(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
              num_splits: int, scale_bytes: int = 0, block_n: int = 32) -> tuple[float, float]:
    """(do_bench ms, clean-L2 ms): CUDA-graph replays of the read-only kernel over K and V, each time scaled by
    (K/V bytes + ``scale_bytes``) / K/V bytes, i.e. fp8 scales counted as if read at the K/V stream's rate (the
    kernel itself reads no scales: its per-token 4-byte scale copies ran slower than the decoder's, which hides
    them).

    k_cache / v_cache: (num_pages, page_size, Hkv, D), any dtype, same strides, heads and D contiguous,
    D * itemsize a multiple of 16 bytes; rows shorter than 128 bytes are read as adjacent heads together (as the
    fp8 decoder does at D64); block_table int32 (B, pages per sequence); seqlens int32 (B,); num_splits as the
    decoder's split-K.
    """
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K and V caches must share strides"
    num_pages, page_size, hkv, d = k_cache.shape
    assert k_cache.stride(2) == d, "heads and D must be contiguous"
    block_n = min(block_n, page_size)
    assert page_size % block_n == 0, f"page_size {page_size} must be a multiple of the tile ({block_n} keys)"
    row = d * k_cache.element_size()
    merge = 1
    while row * merge < 128 and hkv % (2 * merge) == 0:
        merge *= 2
    rows = hkv // merge
    k = k_cache.view(torch.uint8).view(num_pages, page_size, rows, -1).view(torch.int32)
    v = v_cache.view(torch.uint8).view(num_pages, page_size, rows, -1).view(torch.int32)
    B = block_table.shape[0]
    out = torch.empty(B * rows, num_splits, device=k.device, dtype=torch.int32)

    def call():
        _stream_kernel[(B * rows, num_splits)](
            k, v, block_table, seqlens, out, k.stride(0), k.stride(1), k.stride(2), block_table.stride(0), rows,
            num_splits, W=k.shape[3], BLOCK_N=block_n, PAGE_SIZE=page_size, STAGES=2, num_warps=1)

    g = common.capture_graph(call)
    kv_bytes = 2 * hkv * d * k_cache.element_size() * int(seqlens.sum())
    factor = (kv_bytes + scale_bytes) / kv_bytes
    return common.time_ms(g.replay, warmup=10, rep=60) * factor, common.time_clean_l2_ms(g.replay) * factor


def main() -> None:
    """The ceiling of one paged decode shape (Hq/Hkv 32/8, D 128, one split) for bf16 and fp8 caches, TB/s."""
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=64)
    p.add_argument("--L", type=int, default=4096)
    p.add_argument("--page", type=int, default=64)
    args = p.parse_args()
    pages = args.B * args.L // args.page
    block_table = torch.randperm(pages, device="cuda").view(args.B, -1).to(torch.int32)
    seqlens = torch.full((args.B,), args.L, device="cuda", dtype=torch.int32)
    rows = []
    fp8_scale_bytes = 2 * args.B * 8 * args.L * 4  # float32 per token and KV head, for K and V
    for name, dtype, scale_bytes in (("bf16", torch.bfloat16, 0), ("fp8", torch.float8_e4m3fn, fp8_scale_bytes)):
        cache = torch.zeros(pages, args.page, 8, 128, device="cuda", dtype=dtype)
        ms, clean_ms = stream_ms(cache, cache.clone(), block_table, seqlens, 1, scale_bytes)
        nbytes = 2 * cache.numel() * cache.element_size() + scale_bytes
        rows.append({"cache": name, "ms": ms, "TBps": nbytes / ms / 1e9, "clean_TBps": nbytes / clean_ms / 1e9})
    common.print_table(rows, ["cache", "ms", "TBps", "clean_TBps"])


if __name__ == "__main__":
    main()
