"""Append new K/V tokens into a (paged) KV cache, quantizing per token when the cache is fp8."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fmha_ops.kernels.triton.launch import launch, pow2_width


@triton.jit
def _store_row(x, dst, scale_dst, ok, d_ok, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Store one (token, head) row ``x`` (masked lanes ``~d_ok`` hold 0) where ``ok``; fp8: quantized with the
    symmetric scale amax / FP8_MAX (1 for an all-zero row), written to ``scale_dst``."""
    if FP8:
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), 0)
        scale = tl.where(amax > 0.0, tl.math.div_rn(amax, FP8_MAX), 1.0)
        y = tl.clamp(tl.math.div_rn(xf, scale), -FP8_MAX, FP8_MAX)
        tl.store(dst, y.to(dst.dtype.element_ty), mask=ok & d_ok)
        tl.store(scale_dst, scale, mask=ok)
    else:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=ok & d_ok)


@triton.jit
def _kv_append_kernel(
    KN, VN, KC, VC, KS, VS, CSEQ, BT,
    stride_knb, stride_knm, stride_knh,
    stride_vnb, stride_vnm, stride_vnh,
    stride_kcp, stride_kcs, stride_kch,
    stride_vcp, stride_vcs, stride_vch,
    stride_ksp, stride_kss, stride_ksh,
    stride_vsp, stride_vss, stride_vsh,
    stride_btb,
    MNEW, NUM_PAGES, CAPACITY,
    D: tl.constexpr, DV: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = pid // MNEW
    t = pid % MNEW
    offs_d = tl.arange(0, pow2_width(D))
    d_ok = offs_d < D
    offs_dv = tl.arange(0, pow2_width(DV))
    dv_ok = offs_dv < DV
    pos = tl.load(CSEQ + b) + t
    # a position outside [0, CAPACITY) or on a block-table entry outside [0, NUM_PAGES) is not written
    ok = (pos >= 0) & (pos < CAPACITY)
    if PAGED:
        page = tl.load(BT + b * stride_btb + pos // PAGE_SIZE, mask=ok, other=0)
        ok = ok & (page >= 0) & (page < NUM_PAGES)
        page = page.to(tl.int64)
        slot = pos % PAGE_SIZE
    else:
        page = b.to(tl.int64)
        slot = pos
    k = tl.load(KN + b.to(tl.int64) * stride_knb + t * stride_knm + h * stride_knh + offs_d, mask=d_ok, other=0.0)
    v = tl.load(VN + b.to(tl.int64) * stride_vnb + t * stride_vnm + h * stride_vnh + offs_dv, mask=dv_ok, other=0.0)
    _store_row(k, KC + page * stride_kcp + slot * stride_kcs + h * stride_kch + offs_d,
               KS + page * stride_ksp + slot * stride_kss + h * stride_ksh, ok, d_ok, FP8, FP8_MAX)
    _store_row(v, VC + page * stride_vcp + slot * stride_vcs + h * stride_vch + offs_dv,
               VS + page * stride_vsp + slot * stride_vss + h * stride_vsh, ok, dv_ok, FP8, FP8_MAX)


def kv_append(k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None, k_scale=None,
              v_scale=None) -> None:
    """Write k_new (B, Mnew, Hkv, D) / v_new (B, Mnew, Hkv, Dv) into the cache at positions cache_seqlens[b] + 0..Mnew-1.

    Caches as in ``paged_decode``: paged (num_pages, page_size, Hkv, D) through ``block_table``
    int32 (B, max_pages_per_seq), or dense (B, Lmax, Hkv, D). An fp8 e4m3 cache gets each
    (token, head) row quantized with a symmetric scale amax / fp8_max (1 for an all-zero row),
    written to ``k_scale``/``v_scale`` float32 (cache shape without D), as
    ``fmha_ops.kv_cache.quantize_kv_fp8`` does. cache_seqlens: int32 (B,) lengths before the
    append. Any head dims D and Dv (the value's may differ from the key's; each row is padded to a power of two in registers); last dims contiguous.
    Index guards: a position outside [0, capacity) (max_pages_per_seq * page_size, or Lmax), or one
    whose block-table entry is not in [0, num_pages), is skipped, so nothing is written outside the
    cache (``fmha_ops.checks`` validates the indices on the host instead, on request).

    Example
    -------
    >>> kv_append(k_new, v_new, k_cache, v_cache, lengths, block_table=table)  # doctest: +SKIP
    """
    KVAppender(k_new, v_new, k_cache, v_cache, block_table=block_table, k_scale=k_scale, v_scale=v_scale)(
        k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale)


class KVAppender:
    """``kv_append``'s launch for calls of one layout: the checks, grid and constexprs made once from the tensors
    given here (``kv_append``'s), ``appender(k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, k_scale,
    v_scale)`` per call (tensors of these shapes and dtypes, ``block_table`` / scales given or None as here), each
    call's pointers, strides and sizes read from its own tensors. ``bound``: the launch is a ``BoundLaunch`` (a
    plan's repeated calls: the launch key is checked, not rebuilt).

    Example
    -------
    >>> append = KVAppender(k_new, v_new, k_cache, v_cache, block_table=table, bound=True)  # doctest: +SKIP
    >>> append(k_new, v_new, k_cache, v_cache, lengths, table, None, None)  # doctest: +SKIP
    """

    def __init__(self, k_new, v_new, k_cache, v_cache, *, block_table=None, k_scale=None, v_scale=None,
                 bound: bool = False) -> None:
        B, MNEW, HKV, D = k_new.shape
        fp8 = k_cache.element_size() == 1
        if any(t.stride(3) != 1 for t in (k_new, v_new, k_cache, v_cache)):
            raise ValueError("k_new, v_new, k_cache and v_cache must be contiguous in their last dim")
        DV = v_new.shape[3]
        if (v_new.shape[:3] != k_new.shape[:3] or k_cache.shape[2:] != (HKV, D)
                or v_cache.shape != k_cache.shape[:3] + (DV,)):
            raise ValueError(f"k_new {tuple(k_new.shape)}, v_new {tuple(v_new.shape)}: each new token needs the "
                             f"caches' {k_cache.shape[2]} heads of their head dims (k_cache "
                             f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)})")
        if fp8 and (k_scale is None or v_scale is None):
            raise ValueError(f"appending to an {k_cache.dtype} cache needs per-token k_scale and v_scale")
        paged = block_table is not None
        self._fp8, self._paged, self._new = fp8, paged, MNEW
        self._page_size = k_cache.shape[1] if paged else 1
        grid = (B * MNEW, HKV)
        fixed = dict(D=D, DV=DV, PAGE_SIZE=self._page_size, PAGED=paged, FP8=fp8,
                     FP8_MAX=float(torch.finfo(k_cache.dtype).max) if fp8 else 0.0, num_warps=1)
        kernel = launch(_kv_append_kernel)
        self._launch = (None if B * MNEW == 0 else kernel.bind(grid, **fixed) if bound
                        else functools.partial(kernel[grid], **fixed))

    def __call__(self, k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale) -> None:
        if self._launch is None:  # no new token
            return
        fp8, paged = self._fp8, self._paged
        ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)
        self._launch(
            k_new, v_new, k_cache, v_cache, ks, vs, cache_seqlens, block_table if paged else cache_seqlens,
            *k_new.stride()[:3], *v_new.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            *(k_scale.stride() if fp8 else (0, 0, 0)), *(v_scale.stride() if fp8 else (0, 0, 0)),
            block_table.stride(0) if paged else 0, self._new, k_cache.shape[0],
            block_table.shape[1] * self._page_size if paged else k_cache.shape[1])
