"""Triton attention backward (bf16/fp16): BMHK layout, GQA/MQA, causal (both alignments), varlen.

Three launches, deterministic (no atomics):

- ``_bwd_preprocess``: ``delta = rowsum(dO * O)`` in float32, laid out like ``lse``.
- ``_bwd_dkdv``: one program per (key block, kv head, batch); loops over the q heads of the
  kv head's group and over query blocks, accumulating dK and dV in float32 registers
  (so GQA sums need no atomics).
- ``_bwd_dq``: one program per (query block, q head, batch); loops over key blocks.

Causal masks are applied only on the diagonal blocks (and bounds masks only on tail blocks).

A fused 5-matmul variant (dQ by TMA reduce-add / pointer atomics from the dK/dV program) was measured on the
H200 and removed: 0.55-0.9x this pair.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fmha_ops.kernels.softmax import LOG2E, tanh, visible
from fmha_ops.kernels.triton.launch import cdiv, launch, next_pow2, pow2_width


@dataclass(frozen=True)
class BwdConfig:
    """Tile sizes, warps and pipeline stages of the dK/dV kernel (``*_kv``: query rows x keys per tile) and the
    dQ kernel (``*_q``). The defaults' reasons are H200 sweeps (TFLOP/s credited, ``bench/attention_bwd_bench.py``)."""

    block_m_kv: int
    block_n_kv: int
    warps_kv: int
    stages_kv: int
    block_m_q: int
    block_n_q: int
    warps_q: int
    stages_q: int


DEFAULT_CONFIGS = {  # by max(D, Dv)
    # not timed: the D128 tiles
    16: BwdConfig(64, 128, 8, 3, 128, 64, 8, 3),
    32: BwdConfig(64, 128, 8, 3, 128, 64, 8, 3),
    # dK/dV 32x128 / 4 warps: 193.6 vs 174.6 (64x128 / 8) at 16x8x1024 causal; dQ 64x64 / 4 within noise
    64: BwdConfig(32, 128, 4, 3, 128, 64, 8, 3),
    # dK/dV 32x128 -12%, 64x64 -40%; dQ 128x32 -5%; 2 stages instead of 3 -5%
    128: BwdConfig(64, 128, 8, 3, 128, 64, 8, 3),
    # 64x64 spills 516 bytes yet runs 236 vs 128-132 for spill-free 16x64; dQ 64x64 / 64x32 15-35% slower
    256: BwdConfig(64, 64, 8, 2, 128, 32, 8, 2),
}
NONCAUSAL_CONFIGS = {  # one-warpgroup dK/dV tiles, faster without a mask, slower on causal diagonals
    # 340.9 vs 324.8 at 4x32x4096 (causal: 59, from the masked diagonal tiles)
    64: BwdConfig(64, 128, 4, 3, 128, 64, 8, 3),
    # 397.1 vs 366-375 at 4x32x4096, 415.9 vs 372-381 at 2x16x16384
    128: BwdConfig(64, 64, 4, 2, 128, 64, 8, 3),
}


def default_config(head_dim: int, causal: bool) -> BwdConfig:
    """Tiles for max(D, Dv) = ``head_dim``, from the H200 sweeps of ``bench/attention_bwd_bench.py``."""
    return (None if causal else NONCAUSAL_CONFIGS.get(head_dim)) or DEFAULT_CONFIGS[head_dim]


@triton.jit
def _seq_bounds(cu_ptr, b, M, IS_VARLEN: tl.constexpr):
    """(row offset of sequence b in the packed tensor, its length); varlen bounds are clamped to the tensor's M
    rows (an empty or reversed range has length 0), whatever the device-resident ``cu_ptr`` holds."""
    if IS_VARLEN:
        start = tl.minimum(tl.maximum(tl.load(cu_ptr + b), 0), M)
        length = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1), start), M) - start
        return start.to(tl.int64), length
    else:
        return 0, M


@triton.jit
def _probs(s, lse2, qk_scale, softcap_log2, SOFTCAP: tl.constexpr):
    """(p, t) of raw scores ``s`` against log2-domain LSEs ``lse2`` broadcast to ``s``: p = exp2(s * qk_scale -
    lse2); SOFTCAP: t = tanh(s * qk_scale), p = exp2(c log2e * t - lse2), and d(capped score)/d(scaled score) is
    1 - t^2 (without SOFTCAP t is ``s``, not read)."""
    if SOFTCAP:
        t = tanh(s * qk_scale)
        return tl.math.exp2(t * softcap_log2 - lse2), t
    else:
        return tl.math.exp2(s * qk_scale - lse2), s


@triton.jit
def _load_lse2(lse_row_ptr, ok):
    """log2-domain LSE; out-of-range rows and rows that see no key (lse = -inf) become +inf, so p = 0."""
    lse = tl.load(lse_row_ptr, mask=ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E


@triton.jit
def _bwd_preprocess(o_ptr, do_ptr, delta_ptr, M,
                    s_ob, s_om, s_oh, s_dob, s_dom, s_doh, s_eb, s_eh,
                    BLOCK_M: tl.constexpr, HEAD_DIM_V: tl.constexpr):
    """delta = rowsum(dO * O), float32, laid out like lse."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, pow2_width(HEAD_DIM_V))
    ok = (offs_m < M)[:, None] & (offs_d < HEAD_DIM_V)[None, :]
    o = tl.load(o_ptr + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(do_ptr + b * s_dob + h * s_doh + offs_m[:, None] * s_dom + offs_d[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + b * s_eb + h * s_eh + offs_m, delta, mask=offs_m < M)


@triton.jit
def _load_rows(base, rows, stride, cols, n_rows, N_COLS: tl.constexpr, MASKED: tl.constexpr):
    """Tile base[rows, cols] (row stride ``stride``); MASKED: rows >= n_rows read as 0; ``cols`` past a head dim
    ``N_COLS`` below the tile's power-of-two width read as 0 (a compile-time switch: no mask at 64, 128...)."""
    PAD: tl.constexpr = cols.shape[0] != N_COLS
    ptrs = base + rows[:, None] * stride + cols[None, :]
    if MASKED and PAD:
        return tl.load(ptrs, mask=(rows < n_rows)[:, None] & (cols < N_COLS)[None, :], other=0.0)
    elif MASKED:
        return tl.load(ptrs, mask=(rows < n_rows)[:, None], other=0.0)
    elif PAD:
        return tl.load(ptrs, mask=(cols < N_COLS)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, s_qm, s_dom, s_lm,
                start_n, lo, hi, q_len, qk_scale, softcap_log2, d_lo, d_hi,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                NUM_STAGES: tl.constexpr, MASKED: tl.constexpr, DIAG: tl.constexpr, MASK_LEFT: tl.constexpr,
                MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr):
    """Accumulate dK, dV of one key block over query blocks [lo, hi).
    MASKED: bounds masks on the loads; with DIAG also the key range [i + d_lo, i + d_hi] of query i (its
    MASK_LEFT / MASK_RIGHT sides)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, pow2_width(HEAD_DIM))
    offs_dv = tl.arange(0, pow2_width(HEAD_DIM_V))
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=NUM_STAGES):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(q_base, offs_m, s_qm, offs_d, q_len, HEAD_DIM, MASKED)
        do = _load_rows(do_base, offs_m, s_dom, offs_dv, q_len, HEAD_DIM_V, MASKED)
        if MASKED:
            ok = offs_m < q_len
            delta = tl.load(delta_base + offs_m, mask=ok, other=0.0)
        else:
            ok = offs_m >= 0
            delta = tl.load(delta_base + offs_m)
        lse2 = _load_lse2(lse_base + offs_m * s_lm, ok)
        p_t, t_t = _probs(tl.dot(k, tl.trans(q)), lse2[None, :], qk_scale, softcap_log2, SOFTCAP)
        if MASKED and DIAG:  # p_t is [keys, queries]
            if MASK_RIGHT:
                p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + d_hi, p_t, 0.0)
            if MASK_LEFT:
                p_t = tl.where(offs_n[:, None] >= offs_m[None, :] + d_lo, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _query_blocks(start_n, q_len, d_lo, d_hi, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(q_lo, q_mid, q_full, q_end) for key block ``start_n`` when query i sees keys [i + d_lo, i + d_hi]:
    query blocks [q_lo, q_mid) cross the right bound (masked), [q_mid, q_full) see the whole key block,
    [q_full, q_end) cross the left bound (masked); queries outside [q_lo, q_end) see none of its keys."""
    if MASK_RIGHT:
        q_lo = tl.maximum(start_n - d_hi, 0) // BLOCK_M * BLOCK_M
        q_mid = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - d_hi, 0), BLOCK_M) * BLOCK_M, q_len)
    else:
        q_lo = 0
        q_mid = 0
    if MASK_LEFT:
        q_end = tl.minimum(tl.maximum(start_n + BLOCK_N - d_lo, q_mid), q_len)
        q_full = tl.minimum(tl.maximum(tl.maximum(start_n - d_lo + 1, 0) // BLOCK_M * BLOCK_M, q_mid), q_end)
    else:
        q_end = q_len
        q_full = q_len
    return q_lo, q_mid, q_full, q_end


@triton.jit
def _store_kv_grads(dk, dv, dk_ptr, dv_ptr, b, hk, k_start, start_n, k_len,
                    s_dkb, s_dkm, s_dkh, s_dvb, s_dvm, s_dvh,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr):
    """Store one key block's dK (already scaled) and dV rows, masked at the sequence end and the head dims."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, pow2_width(HEAD_DIM))
    offs_dv = tl.arange(0, pow2_width(HEAD_DIM_V))
    n_ok = offs_n < k_len
    tl.store(dk_ptr + b * s_dkb + hk * s_dkh + (k_start + offs_n[:, None]) * s_dkm + offs_d[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=n_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(dv_ptr + b * s_dvb + hk * s_dvh + (k_start + offs_n[:, None]) * s_dvm + offs_dv[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=n_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


@triton.jit
def _bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr,
              s_qb, s_qm, s_qh, s_kb, s_km, s_kh, s_vb, s_vm, s_vh, s_dob, s_dom, s_doh,
              s_lb, s_lh, s_lm, s_eb, s_eh,
              s_dkb, s_dkm, s_dkh, s_dvb, s_dvm, s_dvh,
              Mq, Mk, qk_scale, sm_scale, softcap_log2, window_left, window_right,
              GROUP, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
              SOFTCAP: tl.constexpr, IS_VARLEN: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              NUM_STAGES: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len = _seq_bounds(cu_q_ptr, b, Mq, IS_VARLEN)
    k_start, k_len = _seq_bounds(cu_k_ptr, b, Mk, IS_VARLEN)
    if start_n >= k_len:
        return
    b = b.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, pow2_width(HEAD_DIM))
    offs_dv = tl.arange(0, pow2_width(HEAD_DIM_V))
    n_ok = offs_n < k_len
    k = tl.load(k_ptr + b * s_kb + hk * s_kh + (k_start + offs_n[:, None]) * s_km + offs_d[None, :],
                mask=n_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    v = tl.load(v_ptr + b * s_vb + hk * s_vh + (k_start + offs_n[:, None]) * s_vm + offs_dv[None, :],
                mask=n_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0)
    dk = tl.zeros([BLOCK_N, pow2_width(HEAD_DIM)], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, pow2_width(HEAD_DIM_V)], dtype=tl.float32)
    diag = k_len - q_len if BOTTOM_RIGHT else 0
    d_lo = diag - window_left  # query i sees keys [i + d_lo, i + d_hi]
    d_hi = diag + window_right
    WINDOWED: tl.constexpr = MASK_LEFT or MASK_RIGHT
    if WINDOWED:
        q_lo, q_mid, q_full, q_end = _query_blocks(start_n, q_len, d_lo, d_hi, MASK_LEFT, MASK_RIGHT,
                                                   BLOCK_M, BLOCK_N)
    else:  # full query blocks unmasked, then the tail block
        q_full = q_len // BLOCK_M * BLOCK_M
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = q_ptr + b * s_qb + h * s_qh + q_start * s_qm
        do_base = do_ptr + b * s_dob + h * s_doh + q_start * s_dom
        lse_base = lse_ptr + b * s_lb + h * s_lh + q_start * s_lm
        delta_base = delta_ptr + b * s_eb + h * s_eh + q_start
        if WINDOWED:  # boundary blocks masked; between them bounds masks only (a loop without them costs spills)
            if MASK_RIGHT:
                dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, s_qm, s_dom, s_lm,
                                     start_n, q_lo, q_mid, q_len, qk_scale, softcap_log2, d_lo, d_hi,
                                     BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_V, NUM_STAGES, True, True, MASK_LEFT,
                                     MASK_RIGHT, SOFTCAP)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, s_qm, s_dom, s_lm,
                                 start_n, q_mid, q_full, q_len, qk_scale, softcap_log2, d_lo, d_hi,
                                 BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_V, NUM_STAGES, True, False, MASK_LEFT,
                                 MASK_RIGHT, SOFTCAP)
            if MASK_LEFT:
                dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, s_qm, s_dom, s_lm,
                                     start_n, q_full, q_end, q_len, qk_scale, softcap_log2, d_lo, d_hi,
                                     BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_V, NUM_STAGES, True, True, MASK_LEFT,
                                     MASK_RIGHT, SOFTCAP)
        else:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, s_qm, s_dom, s_lm,
                                 start_n, 0, q_full, q_len, qk_scale, softcap_log2, d_lo, d_hi,
                                 BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_V, NUM_STAGES, False, False, MASK_LEFT,
                                 MASK_RIGHT, SOFTCAP)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, s_qm, s_dom, s_lm,
                                 start_n, q_full, q_len, q_len, qk_scale, softcap_log2, d_lo, d_hi,
                                 BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_V, NUM_STAGES, True, False, MASK_LEFT,
                                 MASK_RIGHT, SOFTCAP)
    _store_kv_grads(dk * sm_scale, dv, dk_ptr, dv_ptr, b, hk, k_start, start_n, k_len,
                    s_dkb, s_dkm, s_dkh, s_dvb, s_dvm, s_dvh, BLOCK_N, HEAD_DIM, HEAD_DIM_V)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_km, s_vm,
              start_m, lo, hi, k_len, qk_scale, softcap_log2, d_lo, d_hi,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              NUM_STAGES: tl.constexpr, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
              SOFTCAP: tl.constexpr):
    """Accumulate dQ of one query block over key blocks [lo, hi). MASKED: bounds masks and the key range
    [i + d_lo, i + d_hi] of query i (its MASK_LEFT / MASK_RIGHT sides)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, pow2_width(HEAD_DIM))
    offs_dv = tl.arange(0, pow2_width(HEAD_DIM_V))
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, offs_n, s_km, offs_d, k_len, HEAD_DIM, MASKED)
        v = _load_rows(v_base, offs_n, s_vm, offs_dv, k_len, HEAD_DIM_V, MASKED)
        p, t = _probs(tl.dot(q, tl.trans(k)), lse2[:, None], qk_scale, softcap_log2, SOFTCAP)
        if MASKED:
            p = tl.where(visible(offs_m, offs_n, k_len, d_lo, d_hi, MASK_LEFT, MASK_RIGHT), p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr,
            s_qb, s_qm, s_qh, s_kb, s_km, s_kh, s_vb, s_vm, s_vh, s_dob, s_dom, s_doh,
            s_lb, s_lh, s_lm, s_eb, s_eh, s_dqb, s_dqm, s_dqh,
            Mq, Mk, qk_scale, sm_scale, softcap_log2, window_left, window_right,
            GROUP, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
            SOFTCAP: tl.constexpr, IS_VARLEN: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
            NUM_STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    if MASK_RIGHT:  # the last query blocks see the most keys: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len = _seq_bounds(cu_q_ptr, b, Mq, IS_VARLEN)
    k_start, k_len = _seq_bounds(cu_k_ptr, b, Mk, IS_VARLEN)
    if start_m >= q_len:
        return
    b = b.to(tl.int64)
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, pow2_width(HEAD_DIM))
    offs_dv = tl.arange(0, pow2_width(HEAD_DIM_V))
    ok = offs_m < q_len
    q_ok = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * s_qb + h * s_qh + (q_start + offs_m[:, None]) * s_qm + offs_d[None, :],
                mask=q_ok, other=0.0)
    do = tl.load(do_ptr + b * s_dob + h * s_doh + (q_start + offs_m[:, None]) * s_dom + offs_dv[None, :],
                 mask=ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0)
    lse2 = _load_lse2(lse_ptr + b * s_lb + h * s_lh + (q_start + offs_m) * s_lm, ok)
    delta = tl.load(delta_ptr + b * s_eb + h * s_eh + q_start + offs_m, mask=ok, other=0.0)
    k_base = k_ptr + b * s_kb + hk * s_kh + k_start * s_km
    v_base = v_ptr + b * s_vb + hk * s_vh + k_start * s_vm
    diag = k_len - q_len if BOTTOM_RIGHT else 0
    d_lo = diag - window_left  # query i sees keys [i + d_lo, i + d_hi]
    d_hi = diag + window_right
    # key blocks: [kv_start, full_start) lower boundary (masked), [full_start, full_end) seen whole by every row,
    # [full_end, kv_end) upper boundary / sequence tail (masked)
    if MASK_RIGHT:
        kv_end = tl.minimum(tl.maximum(start_m + BLOCK_M + d_hi, 0), k_len)
        full_end = tl.minimum(tl.maximum(start_m + 1 + d_hi, 0), k_len) // BLOCK_N * BLOCK_N
    else:
        kv_end = k_len
        full_end = k_len // BLOCK_N * BLOCK_N
    dq = tl.zeros([BLOCK_M, pow2_width(HEAD_DIM)], dtype=tl.float32)
    if MASK_LEFT:
        kv_start = tl.minimum(tl.maximum(start_m + d_lo, 0), kv_end) // BLOCK_N * BLOCK_N
        full_start = tl.minimum(tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + d_lo, 0), BLOCK_N) * BLOCK_N, kv_end)
        full_end = tl.maximum(full_end, full_start)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_km, s_vm, start_m, kv_start, full_start, k_len,
                       qk_scale, softcap_log2, d_lo, d_hi, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_V, NUM_STAGES,
                       True, MASK_LEFT, MASK_RIGHT, SOFTCAP)
    else:
        full_start = 0
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_km, s_vm, start_m, full_start, full_end, k_len,
                   qk_scale, softcap_log2, d_lo, d_hi, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_V, NUM_STAGES,
                   False, MASK_LEFT, MASK_RIGHT, SOFTCAP)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_km, s_vm, start_m, full_end, kv_end, k_len,
                   qk_scale, softcap_log2, d_lo, d_hi, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_V, NUM_STAGES,
                   True, MASK_LEFT, MASK_RIGHT, SOFTCAP)
    dq = dq * sm_scale
    tl.store(dq_ptr + b * s_dqb + h * s_dqh + (q_start + offs_m[:, None]) * s_dqm + offs_d[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=q_ok)


def attention_backward(do, q, k, v, out, lse, *, scale: float, causal: bool = False, causal_bottom_right: bool = True,
                       window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                       dq=None, dk=None, dv=None, delta=None, config: BwdConfig | None = None):
    """Gradients (dq, dk, dv) of ``out = softmax(scale * q @ k^T [+ mask]) @ v``.

    Layout BMHK: ``q``, ``do``, ``out`` (B, Mq, Hq, D) / (B, Mq, Hq, Dv); ``k`` (B, Mk, Hkv, D);
    ``v`` (B, Mk, Hkv, Dv); bf16 or fp16, last dim contiguous, other strides arbitrary.
    D, Dv multiples of 16 up to 256 (tiles of the next power of two; K=192 / Kv=128 as DeepSeek-V3); Hq a multiple
    of Hkv (GQA/MQA: dk/dv summed over each group).
    ``lse``: float32 natural-log row logsumexp of the scaled scores, (B, Hq, Mq); rows with
    ``lse = -inf`` (no visible key) get zero gradient.
    Varlen: B == 1, int32 ``cu_seqlens_q``/``cu_seqlens_k`` of length nseq + 1, lse (1, Hq, total_q).
    Causal: query i sees key j iff ``j <= i + Mk - Mq`` (bottom-right, FlashAttention) or ``j <= i``
    (top-left, xformers), per sequence. Local window and ``softcap`` as in ``attention_forward`` (the same
    arguments the forward got): blocks outside the window are skipped; softcap c differentiates
    c * tanh(scale * q.k / c). Varlen sequence bounds are clamped to the tensors' rows in the kernels.
    ``dq``/``dk``/``dv``: optional outputs (shapes of q/k/v, last dim contiguous), else allocated
    like q/k/v. ``delta``: optional float32 output shaped like ``lse`` (last dim contiguous) that receives the row
    sums rowsum(dO * O) the kernels read, for every row of ``out`` (the sinks' gradient is a weighted sum of them,
    ``sinks.sink_grad_from_delta``). Returns (dq, dk, dv). ``config``: tiles of the two kernels (default
    ``default_config``).

    Example::

        out, lse = attention_forward(q, k, v, scale=s, causal=True, return_lse=True)
        dq, dk, dv = attention_backward(torch.randn_like(out), q, k, v, out, lse, scale=s, causal=True)
    """
    B, Mq, Hq, D = q.shape
    _, Mk, Hkv, Dv = v.shape
    assert Hq % Hkv == 0 and D % 16 == 0 and Dv % 16 == 0 and 0 < D <= 256 and 0 < Dv <= 256, (D, Dv)
    cfg = config or default_config(next_pow2(max(D, Dv)), causal)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    for t in (do, q, k, v, out, dq, dk, dv):
        assert t.stride(-1) == 1
    varlen = cu_seqlens_q is not None
    if varlen:
        assert B == 1 and cu_seqlens_k is not None
        nseq = cu_seqlens_q.numel() - 1
        max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if max_seqlen_q is None else max_seqlen_q
        max_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if max_seqlen_k is None else max_seqlen_k
    else:
        nseq, max_q, max_k = B, Mq, Mk
        cu_seqlens_q = cu_seqlens_k = q  # unused placeholder pointer

    if delta is None:
        delta = torch.empty(lse.shape, device=q.device, dtype=torch.float32)
    else:
        assert delta.dtype == torch.float32 and delta.shape == lse.shape and delta.stride(-1) == 1
    pre_block = 64
    if out.numel():  # every row: a caller's delta is defined wherever out is
        launch(_bwd_preprocess)[(cdiv(Mq, pre_block), Hq, B)](
            out, do, delta, Mq, out.stride(0), out.stride(1), out.stride(2),
            do.stride(0), do.stride(1), do.stride(2), delta.stride(0), delta.stride(1),
            BLOCK_M=pre_block, HEAD_DIM_V=Dv, num_warps=4)
    if q.numel() == 0 or k.numel() == 0 or nseq == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv

    def bstride(t):  # varlen sequences all live in batch 0
        return 0 if varlen else t.stride(0)

    # a window bounds the keys right of the diagonal (causal: right = 0) and left of it
    right = 0 if causal else min(max(window_right, 0), Mq + Mk)
    window = (min(max(window_left, 0), Mq + Mk), right)
    meta = {"GROUP": Hq // Hkv, "MASK_LEFT": window_left >= 0, "MASK_RIGHT": causal or window_right >= 0,
            "BOTTOM_RIGHT": causal_bottom_right, "SOFTCAP": softcap > 0, "IS_VARLEN": varlen,
            "HEAD_DIM": D, "HEAD_DIM_V": Dv}
    qk_scale, softcap_log2 = (scale / softcap, softcap * LOG2E.value) if softcap else (scale * LOG2E.value, 0.0)

    common = (bstride(q), q.stride(1), q.stride(2), bstride(k), k.stride(1), k.stride(2),
              bstride(v), v.stride(1), v.stride(2), bstride(do), do.stride(1), do.stride(2),
              bstride(lse), lse.stride(1), lse.stride(2), bstride(delta), delta.stride(1))
    launch(_bwd_dkdv)[(cdiv(max_k, cfg.block_n_kv), Hkv, nseq)](
        q, k, v, do, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, *common,
        bstride(dk), dk.stride(1), dk.stride(2), bstride(dv), dv.stride(1), dv.stride(2),
        Mq, Mk, qk_scale, scale, softcap_log2, *window,
        BLOCK_M=cfg.block_m_kv, BLOCK_N=cfg.block_n_kv, NUM_STAGES=cfg.stages_kv, num_warps=cfg.warps_kv, **meta)
    launch(_bwd_dq)[(cdiv(max_q, cfg.block_m_q), Hq, nseq)](
        q, k, v, do, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, *common,
        bstride(dq), dq.stride(1), dq.stride(2),
        Mq, Mk, qk_scale, scale, softcap_log2, *window,
        BLOCK_M=cfg.block_m_q, BLOCK_N=cfg.block_n_q, NUM_STAGES=cfg.stages_q, num_warps=cfg.warps_q, **meta)
    return dq, dk, dv

