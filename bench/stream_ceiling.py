"""Memory ceiling of a paged decode: the time to only read the bytes a decoder reads.

``stream_ms`` times a read-only Gluon kernel over a paged K/V cache (and its fp8 per-token scales) with the fp8
decoder's access pattern: one single-warp program per (batch, KV head, split), keys of each split in tiles of
``block_n`` rows through a 2-stage cp.async ring (16-byte copies for K/V rows, 4-byte ones for scales), folded into
registers by xor and nothing else. Ring depth, warps and tile width moved this ceiling by < 1% on the H200
(decode.md step 14), so one configuration stands for all. A decoder's time over this kernel's is the share of the
memory roofline it reaches; our bf16 decoder's time over the fp8 cache's ceiling is the largest fp8/bf16 speedup
any fp8 kernel could show against it.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from bench import common


@gluon.jit
def _issue(k_smem, v_smem, ks_smem, vs_smem, st, K, V, KS, VS, page, slot0, n, end, off, rows, srows, stride_kp,
           stride_ks, stride_sp, stride_ss, sc_off, SCALES: gl.constexpr):
    ok = gl.expand_dims(n + rows < end, 1)
    base = page * stride_kp + slot0 * stride_ks
    async_copy.async_copy_global_to_shared(k_smem.index(st), K + base + off, mask=ok)
    async_copy.async_copy_global_to_shared(v_smem.index(st), V + base + off, mask=ok)
    if SCALES:
        s_ok = n + srows < end
        s_ptr = page * stride_sp + (slot0 + srows) * stride_ss + sc_off
        async_copy.async_copy_global_to_shared(ks_smem.index(st), KS + s_ptr, mask=s_ok)
        async_copy.async_copy_global_to_shared(vs_smem.index(st), VS + s_ptr, mask=s_ok)


@gluon.jit
def _stream_kernel(K, V, KS, VS, BT, SEQ, OUT, stride_kp, stride_ks, stride_kh, stride_sp, stride_ss, stride_sh,
                   stride_btb, NUM_KV_HEADS, NUM_SPLITS, W: gl.constexpr, BLOCK_N: gl.constexpr,
                   PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, SCALES: gl.constexpr):
    """K/V: int32 views (num_pages, PAGE_SIZE, Hkv, W) of the caches, W words per key and head; KS/VS: int32 views
    of the scales (num_pages, PAGE_SIZE, Hkv) when SCALES; grid (B * Hkv, NUM_SPLITS); OUT int32 (B * Hkv, splits)."""
    TW: gl.constexpr = W // 4 if W // 4 < 32 else 32
    kv_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TW, TW], [1, 1], [1, 0])
    sc_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    kv_smem: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    sc_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // NUM_KV_HEADS
    h = pid % NUM_KV_HEADS
    seqlen = gl.load(SEQ + b)
    chunk = gl.cdiv(gl.cdiv(seqlen, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = gl.minimum(start + chunk, seqlen)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, kv_layout))
    off = gl.expand_dims(rows * stride_ks, 1) + gl.expand_dims(cols, 0) + h * stride_kh
    srows = gl.arange(0, BLOCK_N, layout=sc_layout)
    k_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, W], kv_smem)
    v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, W], kv_smem)
    ks_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], sc_smem)
    vs_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], sc_smem)
    bt_row = BT + b * stride_btb
    for i in gl.static_range(STAGES - 1):
        n = start + i * BLOCK_N
        page = gl.load(bt_row + n // PAGE_SIZE, mask=n < end, other=0).to(gl.int64)
        _issue(k_smem, v_smem, ks_smem, vs_smem, i, K, V, KS, VS, page, n % PAGE_SIZE, n, end, off, rows, srows,
               stride_kp, stride_ks, stride_sp, stride_ss, h * stride_sh, SCALES)
        async_copy.commit_group()
    acc = gl.zeros([BLOCK_N, W], gl.int32, kv_layout)
    sacc = gl.zeros([BLOCK_N], gl.int32, sc_layout)
    for it in range(n_tiles):
        gl.thread_barrier()
        n = start + (it + STAGES - 1) * BLOCK_N
        page = gl.load(bt_row + n // PAGE_SIZE, mask=n < end, other=0).to(gl.int64)
        _issue(k_smem, v_smem, ks_smem, vs_smem, (it + STAGES - 1) % STAGES, K, V, KS, VS, page, n % PAGE_SIZE, n,
               end, off, rows, srows, stride_kp, stride_ks, stride_sp, stride_ss, h * stride_sh, SCALES)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        st = it % STAGES
        acc = acc ^ k_smem.index(st).load(kv_layout) ^ v_smem.index(st).load(kv_layout)
        if SCALES:
            sacc = sacc ^ ks_smem.index(st).load(sc_layout) ^ vs_smem.index(st).load(sc_layout)
    async_copy.wait_group(0)
    gl.store(OUT + pid * NUM_SPLITS + split, gl.sum(gl.sum(acc, 1), 0) ^ gl.sum(sacc, 0))


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.uint8).view(torch.int32)


def stream_ms(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
              num_splits: int, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
              block_n: int = 32) -> tuple[float, float]:
    """(do_bench ms, clean-L2 ms) of CUDA-graph replays of the read-only kernel.

    k_cache / v_cache: (num_pages, page_size, Hkv, D), any dtype, same strides, D * itemsize a multiple of 16 bytes;
    block_table int32 (B, pages per sequence); seqlens int32 (B,); k_scale / v_scale: float32 (num_pages,
    page_size, Hkv) with equal strides, or None; num_splits as the decoder's split-K.
    """
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K and V caches must share strides"
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    block_n = min(block_n, page_size)
    assert page_size % block_n == 0, f"page_size {page_size} must be a multiple of the tile ({block_n} keys)"
    k, v = _words(k_cache), _words(v_cache)
    scales = k_scale is not None
    ks = _words(k_scale) if scales else k
    vs = _words(v_scale) if scales else v
    assert not scales or k_scale.stride() == v_scale.stride(), "K and V scales must share strides"
    B = block_table.shape[0]
    out = torch.empty(B * hkv, num_splits, device=k.device, dtype=torch.int32)
    sc_strides = (ks.stride(0), ks.stride(1), ks.stride(2)) if scales else (0, 0, 0)

    def call():
        _stream_kernel[(B * hkv, num_splits)](
            k, v, ks, vs, block_table, seqlens, out, k.stride(0), k.stride(1), k.stride(2), *sc_strides,
            block_table.stride(0), hkv, num_splits, W=k.shape[3], BLOCK_N=block_n, PAGE_SIZE=page_size, STAGES=2,
            SCALES=scales, num_warps=1)

    g = common.capture_graph(call)
    return common.time_ms(g.replay, warmup=10, rep=60), common.time_clean_l2_ms(g.replay)
