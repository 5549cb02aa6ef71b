"""Fused quantization of one attention call's q, k, v (the training path): two launches in all.

``quantize_qkv`` quantizes q and k per block of rows and head (int8 or fp8; q times the softmax scale,
k minus its mean over the sequence: smooth-K) and v per channel (fp8), and writes the dequantized values
the quantized forward attends to (for the straight-through backward):

1. ``_kv_stats_kernel``: per (batch, kv head) and chunk of the sequence (up to 32 chunks per head), the
   column sums of k and the column amax of |v|;
2. ``_quantize_qkv_kernel``: one program per block of rows of q, k or v (one launch for all three);
   k and v programs first reduce the partials to k's mean and v's channel descale. v is written
   transposed, (B, Hkv, Dv, L) with keys contiguous: the K-major operand of the fp8 PV product, so the
   attention kernel needs no separate transpose.

Every element is read from memory once (k and v twice: stats, then quantize; a per-block amax reads its
block a second time from cache) and written once narrow and once in the input dtype. int8 rounds half away
from zero; fp8 saturates to the format's max and rounds to nearest even. Descales: amax / qmax (1 for an
all-zero group).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fmha_ops.kernels.triton.launch import cdiv, launch, next_pow2

_ROWS = 128  # rows per v program
_TILE = 2048  # elements per register tile: 16 per thread with 4 warps, so many programs stay resident
_MAX_SPLITS = 32  # partials per (batch, kv head), so each k/v program reduces few
_STATS_PROGRAMS = 1024  # stats programs to aim for (no tiling won at every shape: bench/quantize_bench.py)


@triton.jit
def _kv_stats_kernel(K, V, KSUM, VMAX, stride_kb, stride_km, stride_kh, stride_vb, stride_vm, stride_vh,
                     M, H, CHUNK, NS,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     SUB: tl.constexpr):
    """KSUM[bh, s, :D] = sum of k rows, VMAX[bh, s, :DV] = max |v| over rows [s*CHUNK, (s+1)*CHUNK).

    One load of SUB rows per tensor and step, reduced to column vectors at once: a load's vectors are all
    issued before their first use (many 16-byte loads in flight per thread; separate small loads were
    issued one at a time, each consumed before the next, sm90 SASS)."""
    h = tl.program_id(0)  # heads fastest: programs running together read neighbouring bytes of the same rows
    s = tl.program_id(1)
    bh = tl.program_id(2) * H + h
    b = tl.program_id(2).to(tl.int64)
    start = s * CHUNK
    n = tl.minimum(CHUNK, M - start)
    k_ptr = K + b * stride_kb + h * stride_kh + start.to(tl.int64) * stride_km
    v_ptr = V + b * stride_vb + h * stride_vh + start.to(tl.int64) * stride_vm
    r = tl.arange(0, SUB)
    cols_k = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    ksum = tl.zeros([BLOCK_D], tl.float32)
    vmax = tl.zeros([BLOCK_DV], tl.float32)
    for m0 in range(0, n, SUB):
        rows = m0 + r
        ok = (rows < n)[:, None]
        kx = tl.load(k_ptr + rows[:, None] * stride_km + cols_k[None, :], mask=ok & (cols_k < D)[None, :], other=0.0)
        vx = tl.load(v_ptr + rows[:, None] * stride_vm + cols_v[None, :], mask=ok & (cols_v < DV)[None, :], other=0.0)
        ksum += tl.sum(kx.to(tl.float32), 0)
        vmax = tl.maximum(vmax, tl.max(tl.abs(vx.to(tl.float32)), 0))
    out = (bh * NS + s).to(tl.int64)
    tl.store(KSUM + out * BLOCK_D + cols_k, ksum)
    tl.store(VMAX + out * BLOCK_DV + cols_v, vmax)


@triton.jit
def _reduce_partials(P, bh, NS, BLOCK_D: tl.constexpr, MAX: tl.constexpr):
    """Sum (or max, ``MAX``) of the NS partial rows P[bh, :NS, :BLOCK_D]."""
    s = tl.arange(0, 16)
    cols = tl.arange(0, BLOCK_D)
    acc = tl.zeros([16, BLOCK_D], tl.float32)
    for s0 in range(0, NS, 16):
        x = tl.load(P + (bh * NS + s0 + s).to(tl.int64)[:, None] * BLOCK_D + cols[None, :],
                    mask=(s0 + s < NS)[:, None], other=0.0)
        acc = tl.maximum(acc, x) if MAX else acc + x
    return tl.max(acc, 0) if MAX else tl.sum(acc, 0)


@triton.jit
def _load_block_rows(x_ptr, rows, stride_m, cols, n, scale, mu,
                     D: tl.constexpr, SMOOTH: tl.constexpr):
    """x[rows] * scale (- mu), float32, 0 outside the n rows and D columns."""
    ok = (rows < n)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=ok, other=0.0).to(tl.float32) * scale
    if SMOOTH:
        x = tl.where(ok, x - mu[None, :], 0.0)
    return x, ok


@triton.jit
def _quantize_block(X, XQ, XH, DS, STATS, i, NB, M, H, NS,
                    stride_xb, stride_xm, stride_xh, stride_qb, stride_qm, stride_qh, stride_qd,
                    scale, inv_scale, qmax,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
                    SMOOTH: tl.constexpr, PER_CHANNEL: tl.constexpr, INT8: tl.constexpr):
    """Block ``i`` (= (b * NB + blk) * H + h: heads fastest, so programs running together read neighbouring
    bytes of the same rows) of x (B, M, H, D): BLOCK rows of one head, in SUB-row tiles
    (small tiles keep registers low and many programs resident; a per-block amax reads the block twice,
    the second time from cache).

    Writes XQ (strides b, m, h, d), XH (x's dtype, contiguous (B, M, H, D)) and the descale: per block
    DS (B, H, NB), or per channel (``PER_CHANNEL``, from the amax partials STATS) DS (B, H, D).
    ``SMOOTH`` subtracts the mean (from the sum partials STATS) first.
    """
    BIG: tl.constexpr = min(BLOCK, 8192 // BLOCK_D)  # rows per amax load (4 x _TILE): all in flight together
    h = i % H
    blk = (i // H) % NB
    b = (i // (H * NB)).to(tl.int64)
    bh = b * H + h
    row0 = blk.to(tl.int64) * BLOCK
    n = M - row0
    x_ptr = X + (b * stride_xb + row0 * stride_xm + h * stride_xh)
    q_ptr = XQ + (b * stride_qb + row0 * stride_qm + h * stride_qh)
    h_ptr = XH + ((b * M + row0) * H + h) * D
    r = tl.arange(0, SUB)
    cols = tl.arange(0, BLOCK_D)
    mu = tl.zeros([BLOCK_D], tl.float32)
    if SMOOTH:
        mu = _reduce_partials(STATS, bh, NS, BLOCK_D, False) / M
    if PER_CHANNEL:
        amax = _reduce_partials(STATS, bh, NS, BLOCK_D, True)
        ds = tl.where(amax > 0.0, amax / qmax, 1.0)
        if blk == 0:
            tl.store(DS + bh.to(tl.int64) * D + cols, ds, mask=cols < D)
        inv = (1.0 / ds)[None, :]
        deq = (ds * inv_scale)[None, :]
    else:
        amax = 0.0
        for j in tl.static_range(BLOCK // BIG):
            x, ok = _load_block_rows(x_ptr, j * BIG + tl.arange(0, BIG), stride_xm, cols, n, scale, mu, D, SMOOTH)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), 1), 0))
        ds = tl.where(amax > 0.0, amax / qmax, 1.0)
        tl.store(DS + bh * NB + blk, ds)
        inv = 1.0 / ds
        deq = ds * inv_scale
    for j in tl.static_range(BLOCK // SUB):
        rows = j * SUB + r
        x, ok = _load_block_rows(x_ptr, rows, stride_xm, cols, n, scale, mu, D, SMOOTH)
        y = tl.minimum(tl.maximum(x * inv, -qmax), qmax)
        if INT8:
            y = y + tl.where(y >= 0.0, 0.5, -0.5)  # the int8 cast truncates toward zero
        yq = y.to(XQ.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :] * stride_qd, yq, mask=ok)
        tl.store(h_ptr + rows[:, None] * (H * D) + cols[None, :], (yq.to(tl.float32) * deq).to(XH.dtype.element_ty),
                 mask=ok)


@triton.jit
def _quantize_qkv_kernel(
    Q, K, V, Q8, K8, V8, QH, KH, VH, QD, KD, VD, KSUM, VMAX,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_km, stride_kh, stride_vb, stride_vm, stride_vh,
    stride_tb, stride_th, stride_td,
    Mq, Mk, Hq, Hkv, NBQ, NBK, NQ, NK, NS, scale, inv_scale, qk_max, v_max,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    Q_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr, SUB: tl.constexpr, SUB_V: tl.constexpr,
    INT8: tl.constexpr,
):
    """Programs [0, NQ) quantize q blocks, [NQ, NQ + NK) k blocks, the rest v blocks (written transposed)."""
    pid = tl.program_id(0)
    if pid < NQ:
        _quantize_block(Q, Q8, QH, QD, QD, pid, NBQ, Mq, Hq, NS, stride_qb, stride_qm, stride_qh,
                        Mq * Hq * D, Hq * D, D, 1, scale, inv_scale, qk_max,
                        D, BLOCK_D, Q_BLOCK, SUB, False, False, INT8)
    elif pid < NQ + NK:
        _quantize_block(K, K8, KH, KD, KSUM, pid - NQ, NBK, Mk, Hkv, NS, stride_kb, stride_km, stride_kh,
                        Mk * Hkv * D, Hkv * D, D, 1, 1.0, 1.0, qk_max,
                        D, BLOCK_D, K_BLOCK, SUB, True, False, INT8)
    else:
        _quantize_block(V, V8, VH, VD, VMAX, pid - NQ - NK, tl.cdiv(Mk, V_BLOCK), Mk, Hkv, NS,
                        stride_vb, stride_vm, stride_vh, stride_tb, 1, stride_th, stride_td, 1.0, 1.0, v_max,
                        DV, BLOCK_DV, V_BLOCK, SUB_V, False, True, False)


def kv_stats(k: torch.Tensor, v: torch.Tensor):
    """Partials over chunks of the sequence: (ksum (B * Hkv, NS, next_pow2(D)) column sums of k,
    vmax (B * Hkv, NS, next_pow2(Dv)) column amax of |v|), float32; NS = 0 for an empty sequence."""
    B, Mk, Hkv, D = k.shape
    Dv = v.shape[3]
    bd, bdv = next_pow2(D), next_pow2(Dv)
    step = min(_ROWS, max(8, 4 * _TILE // max(bd, bdv)))  # rows per load (8192 elements); chunks are whole steps
    splits = min(cdiv(Mk, step), _MAX_SPLITS, max(1, cdiv(_STATS_PROGRAMS, B * Hkv)))
    chunk = cdiv(cdiv(Mk, max(splits, 1)), step) * step
    ns = cdiv(Mk, chunk) if Mk else 0
    ksum = torch.empty((B * Hkv, ns, bd), dtype=torch.float32, device=k.device)
    vmax = torch.empty((B * Hkv, ns, bdv), dtype=torch.float32, device=k.device)
    if ns and B * Hkv:
        launch(_kv_stats_kernel)[(Hkv, ns, B)](
            k, v, ksum, vmax, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            Mk, Hkv, chunk, ns, D=D, DV=Dv, BLOCK_D=bd, BLOCK_DV=bdv, SUB=step, num_warps=4)
    return ksum, vmax


def _sub_rows(block_d: int) -> int:
    """Rows per register tile of ``block_d`` columns."""
    return min(_ROWS, max(8, _TILE // block_d))


def _qmax(dtype: torch.dtype) -> float:
    return 127.0 if dtype == torch.int8 else torch.finfo(dtype).max


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_dtype: torch.dtype, v_dtype: torch.dtype, *,
                 scale: float, q_block: int, k_block: int):
    """q (B, Mq, Hq, D), k (B, Mk, Hkv, D), v (B, Mk, Hkv, Dv), bf16/fp16/fp32, last dim contiguous.

    Returns ((q8, k8, v8), (qd, kd, vd), (qh, kh, vh)):
    q8 = quantize(q * scale) and k8 = quantize(k - mean_seq(k)) in ``qk_dtype`` (int8 or fp8), contiguous,
    descales qd (B, Hq, cdiv(Mq, q_block)) and kd (B, Hkv, cdiv(Mk, k_block)); v8 fp8 ``v_dtype`` per channel
    with vd (B, Hkv, Dv), as a (B, Mk, Hkv, Dv) view of (B, Hkv, Dv, L) storage (keys contiguous, L = Mk rounded
    up to 16); qh ~ q (0 if scale is 0), kh ~ k - mean_seq(k), vh ~ v: the dequantized values in the inputs'
    dtypes, contiguous.
    """
    B, Mq, Hq, D = q.shape
    _, Mk, Hkv, Dv = v.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "last dims must be contiguous"
    assert q_block & (q_block - 1) == 0 and k_block & (k_block - 1) == 0, "block sizes must be powers of 2"
    dev = q.device
    nbq, nbk, nbv = cdiv(Mq, q_block), cdiv(Mk, k_block), cdiv(Mk, _ROWS)
    q8 = torch.empty((B, Mq, Hq, D), dtype=qk_dtype, device=dev)
    k8 = torch.empty((B, Mk, Hkv, D), dtype=qk_dtype, device=dev)
    v8t = torch.empty((B, Hkv, Dv, cdiv(Mk, 16) * 16), dtype=v_dtype, device=dev)
    qh, kh, vh = torch.empty_like(q8, dtype=q.dtype), torch.empty_like(k8, dtype=k.dtype), torch.empty(
        (B, Mk, Hkv, Dv), dtype=v.dtype, device=dev)
    qd = torch.empty((B, Hq, nbq), dtype=torch.float32, device=dev)
    kd = torch.empty((B, Hkv, nbk), dtype=torch.float32, device=dev)
    vd = (torch.empty if Mk else torch.ones)((B, Hkv, Dv), dtype=torch.float32, device=dev)
    bd, bdv = next_pow2(D), next_pow2(Dv)
    ksum, vmax = kv_stats(k, v)
    ns = ksum.shape[1]
    nq, nk, nv = B * Hq * nbq, B * Hkv * nbk, B * Hkv * nbv
    if nq + nk + nv:
        launch(_quantize_qkv_kernel)[(nq + nk + nv,)](
            q, k, v, q8, k8, v8t, qh, kh, vh, qd, kd, vd, ksum, vmax,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), v8t.stride(0), v8t.stride(1), v8t.stride(2),
            Mq, Mk, Hq, Hkv, nbq, nbk, nq, nk, ns, scale, 1.0 / scale if scale else 0.0,
            _qmax(qk_dtype), _qmax(v_dtype),
            D=D, DV=Dv, BLOCK_D=bd, BLOCK_DV=bdv, Q_BLOCK=q_block, K_BLOCK=k_block, V_BLOCK=_ROWS,
            SUB=min(_sub_rows(bd), q_block, k_block), SUB_V=_sub_rows(bdv), INT8=qk_dtype == torch.int8, num_warps=4)
    v8 = v8t.permute(0, 3, 1, 2)[:, :Mk]
    return (q8, k8, v8), (qd, kd, vd), (qh, kh, vh)
