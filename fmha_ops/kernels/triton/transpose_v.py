"""V (B, Mk, Hkv, Dv) -> (B, Hkv, Dv, L) with keys contiguous: the K-major B operand of the fp8 PV wgmma,
made once per call by the fp8 attention forwards (Triton and Gluon)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fmha_ops.kernels.triton.launch import cdiv, launch, next_pow2

#: VT sequence starts are multiples of this many keys (TMA box coordinates on the contiguous dim are 16-byte aligned)
KEY_ALIGN = 16
#: keys of one group reordered by ``key_order`` (the K extent of one fp8 wgmma)
KEY_GROUP = 32
_BLOCK_T = 128  # keys per program


@triton.jit
def _transpose_v_kernel(V, VT, CuK, CuVT, Mk, Hkv, stride_vb, stride_vm, stride_vh, stride_tb, stride_th, stride_td,
                        DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DV: tl.constexpr, VARLEN: tl.constexpr,
                        KEY_ORDER: tl.constexpr):
    """VT[b, h, d, dst + t] = V[b, src + t, h, d] for one (BLOCK_T tokens, BLOCK_DV channels) tile of a sequence.

    ``KEY_ORDER`` (dense only): key t = 32 j + 16 h + 8 g + 2 c + e goes to column 32 j + 16 h + 4 c + 2 g + e.
    Dense: the padding columns up to ``stride_td`` are written with zeros, so the store mask is a multiple of 16
    columns (``stride_td``, a multiple of ``KEY_ALIGN``) and the stores stay 16 bytes wide whatever Mk is (a mask
    at Mk = 1000 made them byte stores: 90 us for 16 MB on the H200 against 36 us for 64 MB at Mk = 4096).

    Varlen: the sequence's keys [src, end) are clamped to V's Mk rows and its VT columns to VT's row length
    ``stride_td`` (VT is contiguous), whatever the device-resident ``CuK`` / ``CuVT`` hold."""
    bh = tl.program_id(1)
    b = bh // Hkv
    h = (bh % Hkv).to(tl.int64)
    if VARLEN:
        src = tl.minimum(tl.maximum(tl.load(CuK + b), 0), Mk)
        n = tl.minimum(tl.maximum(tl.load(CuK + b + 1), src), Mk) - src
        dst = tl.load(CuVT + b)
        n = tl.minimum(n, stride_td - dst)
        b = 0
    else:
        src = 0
        n = Mk
        dst = 0
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask = (offs_t[:, None] < n) & (offs_d[None, :] < DV)
    b64 = tl.cast(b, tl.int64)
    x = tl.load(V + b64 * stride_vb + h * stride_vh + (src + offs_t[:, None]) * stride_vm + offs_d[None, :], mask=mask,
                other=0)
    if KEY_ORDER:  # rows t = 16 a + 8 g + 2 c + e to 16 a + 4 c + 2 g + e: a swap of two index bits' groups
        x = tl.reshape(tl.permute(tl.reshape(x, [BLOCK_T // 16, 2, 4, 2, BLOCK_DV]), (0, 2, 1, 3, 4)),
                       [BLOCK_T, BLOCK_DV])
    if VARLEN:
        store_mask = mask
    else:
        store_mask = (offs_t[:, None] < stride_td) & (offs_d[None, :] < DV)
    tl.store(VT + b64 * stride_tb + h * stride_th + offs_d[:, None] * stride_td + dst + offs_t[None, :], tl.trans(x),
             mask=tl.trans(store_mask))


def transpose_v(v: torch.Tensor, cu_seqlens_k=None, max_seqlen_k=None, key_order: bool = False):
    """V (B, Mk, Hkv, Dv), last dim contiguous -> (VT (B, Hkv, Dv, L) contiguous, cu_vt or None).

    Keys become the contiguous dim. Without varlen L = Mk rounded up to 16, padding written with zeros. With varlen
    (B == 1, cu_seqlens_k int32 (nseq + 1,) on v's device, max_seqlen_k a host int) each sequence starts at a
    multiple of 16 in VT; cu_vt (nseq + 1,) int32 holds those starts; padding is unwritten. Sequence bounds are
    clamped to V's rows (as the attention kernels clamp them), so no cu_seqlens_k makes the copy leave VT.

    ``key_order`` (no varlen): L = Mk rounded up to 32, and within each group of 32
    keys key 16 h + 8 g + 2 c + e sits at column 16 h + 4 c + 2 g + e (h, g, e in {0, 1}, c in 0..3): the order in
    which a thread's fp8 wgmma accumulator registers hold the scores, so P V needs no layout change of P.

    Example: ``vt, _ = transpose_v(v)`` for v (2, 100, 4, 128) gives vt (2, 4, 128, 112).
    """
    B, Mk, Hkv, Dv = v.shape
    varlen = cu_seqlens_k is not None
    if varlen and key_order:
        raise NotImplementedError("transpose_v: key_order is for dense V (cu_seqlens_k must be None)")
    if varlen:
        nseq = cu_seqlens_k.numel() - 1
        starts = cu_seqlens_k[:-1].clamp(0, Mk)
        lens = torch.maximum(cu_seqlens_k[1:].clamp(0, Mk), starts) - starts
        cu_vt = torch.zeros(nseq + 1, dtype=torch.int32, device=v.device)
        cu_vt[1:] = torch.cumsum((lens + KEY_ALIGN - 1) // KEY_ALIGN * KEY_ALIGN, 0)
        L, rows, grid_t = cdiv(Mk, KEY_ALIGN) * KEY_ALIGN + KEY_ALIGN * nseq, nseq, cdiv(max_seqlen_k, _BLOCK_T)
    else:
        L = cdiv(Mk, KEY_GROUP if key_order else KEY_ALIGN) * (KEY_GROUP if key_order else KEY_ALIGN)
        cu_vt, rows, grid_t = None, B, cdiv(L, _BLOCK_T)
    vt = torch.empty((B, Hkv, Dv, L), dtype=v.dtype, device=v.device)
    if vt.numel() == 0 or grid_t == 0:
        return vt, cu_vt
    BD = min(64, next_pow2(Dv))
    raw = torch.uint8 if v.element_size() == 1 else torch.int16
    launch(_transpose_v_kernel)[(grid_t, rows * Hkv, cdiv(Dv, BD))](
        v.view(raw), vt.view(raw), cu_seqlens_k, cu_vt, Mk, Hkv, v.stride(0), v.stride(1), v.stride(2),
        vt.stride(0), vt.stride(1), vt.stride(2), DV=Dv, BLOCK_T=_BLOCK_T, BLOCK_DV=BD, VARLEN=varlen,
        KEY_ORDER=key_order, num_warps=4)
    return vt, cu_vt
