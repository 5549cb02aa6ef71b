"""Triton attention forward for fp8, i8fp8 (SageAttention-like) and bf16/fp16 inputs.

One kernel, specialised by ``tl.constexpr`` switches:

* fp8: q/k/v ``float8_e4m3fn`` (or ``float8_e4m3fnuz``); QK^T and PV on the fp8 tensor cores,
  P quantised to fp8 (scaled by 2**P_SHIFT so small probabilities stay normal numbers).
* i8fp8: q/k ``int8`` (QK^T accumulated in int32), v fp8, P as for fp8.
* bf16/fp16: q/k/v of that dtype, P cast to it.

Softmax runs in fp32 with exp2 (the online-softmax step and the LSE epilogue of ``kernels/softmax.py``, shared
with the Gluon kernel); q*k descales and the softmax scale are folded into one
multiplier per tile, the v descale is applied once at the end. Tiles move with TMA tensor
descriptors, whose zero padding and store clipping handle partial blocks, sequence ends and head
dims below the power-of-two block width. Without varlen the launcher makes them on the host (one
per tensor, over (B, H, rows, cols)); varlen bounds are per sequence, so there each program makes
its own on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fmha_ops.kernels.attention_host import descale_args, ensure_allocator
from fmha_ops.kernels.softmax import LOG2E, add_sink, hide_keys, natural_lse, p_shift, row_inverse, softmax_step, tanh
from fmha_ops.kernels.triton.launch import cdiv, host_descriptor, launch, next_pow2, pow2_width
from fmha_ops.kernels.triton.transpose_v import transpose_v
from fmha_ops.quant import K_SCALE_BLOCK, Q_SCALE_BLOCK

_Q_SCALE_BLOCK = tl.constexpr(Q_SCALE_BLOCK)
_K_SCALE_BLOCK = tl.constexpr(K_SCALE_BLOCK)


@triton.jit
def _head_desc(base, rows, cols, stride, R: tl.constexpr, C: tl.constexpr):
    """Device-made descriptor over one head's (rows, cols) matrix (row stride ``stride``), [R, C] tiles."""
    return tl.make_tensor_descriptor(base, shape=[rows, cols], strides=[stride, 1], block_shape=[R, C])


@triton.jit
def _load(desc, b, h, r, c, R: tl.constexpr, C: tl.constexpr, VARLEN: tl.constexpr):
    """An [R, C] tile at (r, c) of head (b, h): a host descriptor (dense batches) spans (B, H, rows, cols), a
    device one (varlen) was made for the head."""
    if VARLEN:
        return desc.load([r, c])
    else:
        return desc.load([b, h, r, c]).reshape(R, C)


@triton.jit
def _tile(acc, l_i, m_i, q, k_desc, v_desc, kd_ptr, qk_scale, softcap_log2, k_row0, v_row0, start_n, seqlen_k,
          lo, hi, offs_m, b, hkv, MASKED, MAY_BE_EMPTY: tl.constexpr, MASK_LEFT: tl.constexpr,
          MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, K_BLOCKSCALE: tl.constexpr, V_T: tl.constexpr,
          P_SHIFT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, VARLEN: tl.constexpr):
    """One BLOCK_N step of the online softmax (``softmax_step``); scores are in log2 units after ``qk_scale``
    (SOFTCAP: ``softcap_log2 * tanh(qk_scale * s)``). MASKED (a constexpr, or a runtime flag per tile): the
    sequence end and the [i + lo, i + hi] key range of ``hide_keys`` apply (boundary tiles). MAY_BE_EMPTY: rows may
    have seen no key yet (a masked tile ran or may run before this one)."""
    BLOCK_D: tl.constexpr = q.shape[1]
    k = _load(k_desc, b, hkv, k_row0 + start_n, 0, BLOCK_N, BLOCK_D, VARLEN)
    if q.dtype == tl.int8:
        # int32 -> fp32 without I2F (16/clk/SM, as slow as exp2): |s| < 2**22 for D <= 256, so adding
        # 1.5 * 2**23 puts s in the mantissa of a float worth OFF + s; the scaling FMA removes OFF
        s = (tl.dot(q, k.T, out_dtype=tl.int32) + 0x4B400000).to(tl.float32, bitcast=True)
        OFF: tl.constexpr = 12582912.0
    else:
        s = tl.dot(q, k.T)
        OFF: tl.constexpr = 0.0
    if K_BLOCKSCALE:  # one k descale per tile: K_SCALE_BLOCK is a multiple of BLOCK_N
        qk_scale = qk_scale * tl.load(kd_ptr + start_n // _K_SCALE_BLOCK)
    if SOFTCAP:  # capped scores, already in log2 units
        s = tanh((s - OFF) * qk_scale) * softcap_log2
    if MASKED:
        s = hide_keys(s, offs_m, start_n + tl.arange(0, BLOCK_N), seqlen_k, lo, hi, MASK_LEFT, MASK_RIGHT)
    if SOFTCAP:
        p, m_i, l_i, alpha = softmax_step(s, None, m_i, l_i, 1.0, 0.0, P_SHIFT, MAY_BE_EMPTY)
    else:
        p, m_i, l_i, alpha = softmax_step(s, None, m_i, l_i, qk_scale, OFF, P_SHIFT, MAY_BE_EMPTY)
    if V_T:
        v = _load(v_desc, b, hkv, 0, v_row0 + start_n, BLOCK_DV, BLOCK_N, VARLEN).T
    else:
        v = _load(v_desc, b, hkv, k_row0 + start_n, 0, BLOCK_N, BLOCK_DV, VARLEN)
    if P_SHIFT != 0 or not v.dtype.is_fp8():  # fp8 P (shifted), or P in v's 16-bit dtype
        p = p.to(v.dtype)
    else:  # fp8 v with a 16-bit PV product
        p = p.to(tl.float16)
        v = v.to(tl.float16)
    acc = tl.dot(p, v, acc * alpha[:, None])
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, QD, KD, VD, CuQ, CuK, CuVT, Sinks, sm_scale_log2, softcap_log2,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_km, stride_kh,
    stride_vb, stride_vm, stride_vh,
    stride_ob, stride_om, stride_oh,
    qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh,
    Mq, Mk, Hq, GROUP, window_left, window_right,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, V_T: tl.constexpr, P_SHIFT: tl.constexpr,
    Q_BLOCKSCALE: tl.constexpr, K_BLOCKSCALE: tl.constexpr, V_PER_CHANNEL: tl.constexpr, WRITE_LSE: tl.constexpr,
    Q_DESCALED: tl.constexpr, K_DESCALED: tl.constexpr, V_DESCALED: tl.constexpr,
    ONE_LOOP: tl.constexpr, SINKS: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (sequence, q head).

    Mask: key j is visible from query i iff j < seqlen_k and, with ``i_al = i + diag`` (``diag`` = seqlen_k -
    seqlen_q when BOTTOM_RIGHT, else 0), ``j >= i_al - window_left`` (MASK_LEFT) and ``j <= i_al + window_right``
    (MASK_RIGHT; causal: window_right = 0). Key tiles wholly outside that range are not visited; tiles that it
    covers for every row run unmasked. SOFTCAP: scores s become c * tanh(s / c) (``sm_scale_log2`` is then the
    natural scale / c and ``softcap_log2`` = c * log2 e). Dtypes select the path: int8 q (i8fp8: int32 QK^T),
    ``P_SHIFT`` > 0 (fp8 P for the PV product, scaled by 2**P_SHIFT), else P in v's dtype. Q/K/V_DESCALED False:
    that descale is 1 and its pointer is never read (a placeholder). VARLEN: sequence b spans rows
    [CuQ[b], CuQ[b+1]) of batch 0 (bounds clamped to the tensors' rows) and descriptors are made per head on the
    device; else Q, K, V, Out are host descriptors over (B, H, rows, cols). ONE_LOOP: the key tiles run in one loop
    in key order, masking the boundary ones by a runtime test (one pipeline fill per program); else the unmasked
    interior and the boundary tiles run in two loops. SINKS: ``Sinks[hq]`` (float32, natural log) joins every row's
    denominator after the last tile (``add_sink``); the LSE includes it.
    """
    BLOCK_D: tl.constexpr = pow2_width(D)
    BLOCK_DV: tl.constexpr = pow2_width(DV)
    pid_m = tl.program_id(0)
    if MASK_RIGHT:  # the last query blocks see the most keys: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = bh // Hq
    hq = bh % Hq
    hkv = hq // GROUP
    if VARLEN:  # sequence bounds clamped to the tensors, whatever CuQ / CuK hold
        q_start = tl.minimum(tl.maximum(tl.load(CuQ + b), 0), Mq)
        seqlen_q = tl.minimum(tl.maximum(tl.load(CuQ + b + 1), q_start), Mq) - q_start
        k_start = tl.minimum(tl.maximum(tl.load(CuK + b), 0), Mk)
        seqlen_k = tl.minimum(tl.maximum(tl.load(CuK + b + 1), k_start), Mk) - k_start
        if V_T:
            v_start = tl.load(CuVT + b)
        else:
            v_start = k_start
        tensor_b = 0  # the packed sequences all live in batch 0
    else:
        q_start = 0
        seqlen_q = Mq
        k_start = 0
        seqlen_k = Mk
        v_start = 0
        tensor_b = b
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    b64 = tl.cast(tensor_b, tl.int64)
    if BOTTOM_RIGHT:
        diag = seqlen_k - seqlen_q
    else:
        diag = 0
    lo = diag - window_left  # row i sees keys [i + lo, i + hi]
    hi = diag + window_right
    # key tiles: [kv_start, full_start) lower boundary, [full_start, full_end) seen whole by every row (unmasked),
    # [full_end, kv_end) upper boundary and the sequence's partial last tile
    if MASK_RIGHT:
        kv_end = tl.maximum(tl.minimum(seqlen_k, m0 + BLOCK_M + hi), 0)
        full_end = tl.maximum(tl.minimum(seqlen_k, m0 + hi + 1), 0) // BLOCK_N * BLOCK_N
    else:
        kv_end = seqlen_k
        full_end = seqlen_k // BLOCK_N * BLOCK_N
    if MASK_LEFT:
        kv_start = tl.minimum(tl.maximum(m0 + lo, 0), kv_end) // BLOCK_N * BLOCK_N
        full_start = tl.minimum(tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 + lo, 0), BLOCK_N) * BLOCK_N, kv_end)
        full_end = tl.maximum(full_end, full_start)
    else:
        kv_start = 0
        full_start = 0

    if VARLEN:
        q_desc = _head_desc(Q + b64 * stride_qb + hq.to(tl.int64) * stride_qh, q_start + seqlen_q, D, stride_qm,
                            BLOCK_M, BLOCK_D)
        k_desc = _head_desc(K + b64 * stride_kb + hkv.to(tl.int64) * stride_kh, k_start + seqlen_k, D, stride_km,
                            BLOCK_N, BLOCK_D)
        v_base = V + b64 * stride_vb + hkv.to(tl.int64) * stride_vh
        if V_T:  # V is (B, Hkv, DV, L), keys contiguous (the K-major operand the fp8 wgmma needs), L = stride_vm
            v_desc = _head_desc(v_base, DV, tl.minimum(v_start + seqlen_k, stride_vm), stride_vm, BLOCK_DV, BLOCK_N)
        else:
            v_desc = _head_desc(v_base, k_start + seqlen_k, DV, stride_vm, BLOCK_N, BLOCK_DV)
        o_desc = _head_desc(Out + b64 * stride_ob + hq.to(tl.int64) * stride_oh, q_start + seqlen_q, DV, stride_om,
                            BLOCK_M, BLOCK_DV)
    else:  # Q, K, V, Out are descriptors over (B, H, rows, cols), made by the launcher
        q_desc = Q
        k_desc = K
        v_desc = V
        o_desc = Out

    if Q_BLOCKSCALE:
        qk_scale = tl.load(QD + b * qd_sb + hq * qd_sh + m0 // _Q_SCALE_BLOCK) * sm_scale_log2
    elif Q_DESCALED:
        qk_scale = tl.load(QD + b * qd_sb + hkv * qd_sh) * sm_scale_log2
    else:
        qk_scale = sm_scale_log2
    kd_ptr = KD + b * kd_sb + hkv * kd_sh
    if K_DESCALED and not K_BLOCKSCALE:
        qk_scale = qk_scale * tl.load(kd_ptr)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    q = _load(q_desc, tensor_b, hq, q_start + m0, 0, BLOCK_M, BLOCK_D, VARLEN)

    if ONE_LOOP:  # all tiles in key order; the lower boundary comes first, so rows may see no key until later
        for start_n in tl.range(kv_start, kv_end, BLOCK_N):
            boundary = (start_n < full_start) | (start_n >= full_end)
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, k_desc, v_desc, kd_ptr, qk_scale, softcap_log2, k_start, v_start,
                                  start_n, seqlen_k, lo, hi, offs_m, tensor_b, hkv, boundary, True, MASK_LEFT,
                                  MASK_RIGHT, SOFTCAP, K_BLOCKSCALE, V_T, P_SHIFT, BLOCK_N, BLOCK_DV, VARLEN)
    else:
        # the unmasked interior first, then the boundary tiles (below full_start and from full_end) in one loop:
        # each loop pays its own pipeline fill, and a window has boundary tiles on both sides
        for start_n in tl.range(full_start, full_end, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, k_desc, v_desc, kd_ptr, qk_scale, softcap_log2, k_start, v_start,
                                  start_n, seqlen_k, lo, hi, offs_m, tensor_b, hkv, False, False, MASK_LEFT,
                                  MASK_RIGHT, SOFTCAP, K_BLOCKSCALE, V_T, P_SHIFT, BLOCK_N, BLOCK_DV, VARLEN)
        n_lower = tl.cdiv(full_start - kv_start, BLOCK_N)
        n_boundary = n_lower + tl.cdiv(kv_end - full_end, BLOCK_N)
        for t in tl.range(0, n_boundary):
            start_n = tl.where(t < n_lower, kv_start + t * BLOCK_N, full_end + (t - n_lower) * BLOCK_N)
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, k_desc, v_desc, kd_ptr, qk_scale, softcap_log2, k_start, v_start,
                                  start_n, seqlen_k, lo, hi, offs_m, tensor_b, hkv, True, True, MASK_LEFT,
                                  MASK_RIGHT, SOFTCAP, K_BLOCKSCALE, V_T, P_SHIFT, BLOCK_N, BLOCK_DV, VARLEN)

    if SINKS:
        m_i, l_i, alpha = add_sink(m_i, l_i, tl.load(Sinks + hq) * LOG2E, P_SHIFT)
        acc = acc * alpha[:, None]
    inv_l = row_inverse(l_i)
    vd_ptr = VD + b * vd_sb + hkv * vd_sh
    if V_PER_CHANNEL:
        offs_dv = tl.arange(0, BLOCK_DV)
        vd = tl.load(vd_ptr + offs_dv, mask=offs_dv < DV, other=0.0)
        out = acc * inv_l[:, None] * vd[None, :]
    elif V_DESCALED:
        out = acc * (inv_l * tl.load(vd_ptr))[:, None]
    else:
        out = acc * inv_l[:, None]
    out = out.to(o_desc.dtype)
    if VARLEN:
        o_desc.store([q_start + m0, 0], out)
    else:
        o_desc.store([tensor_b, hq, m0, 0], out.reshape(1, 1, BLOCK_M, BLOCK_DV))
    if WRITE_LSE:  # lse (B, Hq, Mq) contiguous
        lse = natural_lse(m_i, l_i, P_SHIFT)
        tl.store(Lse + (b64 * Hq + hq) * Mq + q_start + offs_m, lse, mask=offs_m < seqlen_q)


_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


@dataclass(frozen=True)
class FwdConfig:
    """Tiles and launch options of ``_attn_fwd_kernel``; the defaults' reasons are H200 sweeps (fp8 D128
    4x32x4096 TFLOP/s, ``bench/attention_fwd_bench.py --sweep``)."""

    #: query rows per program: 64 = one warpgroup, two programs per SM overlap one's softmax with the other's
    #: MMAs (64x128/4 warps 751 vs 128x128/8 warps 590)
    block_m: int
    #: keys per tile: 128 at D <= 128 (64 keys 711, 256 keys 476), 64 at D256 (register file); bf16: see
    #: ``default_config``
    block_n: int
    num_warps: int = 4
    #: K/V pipeline depth: 3 (2 stages 672, 4 stages 482; D256 2 stages 774 vs 908)
    num_stages: int = 3
    #: register cap per thread (None: the compiler's choice)
    maxnreg: int | None = None
    #: the key tiles in one loop, boundary tiles masked by a runtime test, instead of an unmasked interior loop and
    #: a boundary loop (each loop fills its own pipeline: a window's program runs few tiles)
    one_loop: bool = False


def default_config(head_dim: int, causal: bool, seqlen_k: int = 0, quantized: bool = False,
                   windowed: bool = False) -> FwdConfig:
    """Tiles for max(D, Dv) = ``head_dim`` (H200 sweeps, ``bench/attention_fwd_bench.py --sweep``).

    Causal at head dim <= 128 takes 64-key tiles below 4096 keys (``seqlen_k``), where the masked diagonal
    tiles weigh more (16x8x1024 D64 259 vs 248 TFLOP/s; from 4096 keys 128-key tiles win, 2x16x16384 750 vs
    701). ``quantized`` (fp8 or i8fp8 inputs) at head dim <= 64 without a causal mask caps registers at 128,
    which fits a fourth program per SM (fp8 544 vs 534, i8fp8 490 vs 471).

    bf16/fp16 (not ``quantized``) tiles are twice the bytes: at D128 64x128 tiles with 3 stages fill one SM's
    shared memory (one program of 4 warps per SM), 64x64 tiles fit two (TFLOP/s, 64x64 vs 64x128: 4x4096x32
    535 vs 447, causal 496 vs 398; 1x16x32768 causal 500 vs 444, with a 4096-key window 523 vs 399; 128x128 /
    8 warps 502 / 460 / 530 / 465); at D64 128-key tiles take 2 stages (4x4096x16 464 vs 432, causal 402 vs 381).

    ``windowed`` (a local window bounds the keys) runs the key tiles in one loop (``FwdConfig.one_loop``): a
    window's program visits few tiles, boundary ones on both sides (1x16x32768 D128 causal, 4096-key window: fp8
    777 vs 770 TFLOP/s, bf16 520 vs 516; 4 stages 512, 2 stages 716, 64-key tiles 730, 128x128 / 8 warps 625).
    """
    if head_dim > 128:
        return FwdConfig(block_m=64, block_n=64, one_loop=windowed)
    block_n = 64 if causal and seqlen_k < 4096 else 128
    if not quantized:
        if head_dim > 64:
            return FwdConfig(block_m=64, block_n=64, one_loop=windowed)
        return FwdConfig(block_m=64, block_n=block_n, num_stages=2 if block_n == 128 else 3, one_loop=windowed)
    return FwdConfig(block_m=64, block_n=block_n, maxnreg=128 if head_dim <= 64 and not causal else None,
                     one_loop=windowed)


def _desc4(t, shape, strides, block):
    """Host TMA descriptor over ``t`` seen as (B, H, rows, cols) (``strides`` of the first three; cols are
    contiguous), loading [1, 1, *block] tiles; out-of-bounds rows and cols read as 0, stores are clipped."""
    return host_descriptor(t, shape, (*strides, 1), (1, 1, *block))


def _block_descale_args(t, shape, scale_block, tile):
    """(tensor, stride_b, stride_h) for a per-block descale of ``shape``; one scale block spans whole tiles."""
    assert t.shape == shape and (shape[-1] == 1 or t.stride(-1) == 1), (tuple(t.shape), shape)
    assert scale_block % tile == 0, (scale_block, tile)
    return t, t.stride(0), t.stride(1)


def attention_forward(q, k, v, *, scale: float, causal: bool = False, causal_bottom_right: bool = True,
                      q_descale=None, k_descale=None, v_descale=None,
                      window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                      out_dtype=None, return_lse=False, pv_fp8: bool = True, sinks=None,
                      v_transposed: bool | None = None, config: FwdConfig | None = None, out=None):
    """Attention forward, BMHK layout.

    q: (B, Mq, Hq, D), k: (B, Mk, Hkv, D), v: (B, Mk, Hkv, Dv); last dim contiguous, other strides free; v may
    instead be keys-contiguous (v.stride(1) == 1: a view of a (B, Hkv, Dv, L) tensor, read as is; not with varlen);
    Hq % Hkv == 0 (query head h reads kv head h // (Hq // Hkv)); D, Dv multiples of 16, <= 256.
    dtypes: fp8/fp8/fp8 (e4m3fn or e4m3fnuz), int8/int8/fp8 (i8fp8) -> bf16 by default; bf16 or fp16 for all
    three -> same dtype. Computes softmax(scale * (q*qd)(k*kd)^T) (v*vd) with float32 descales:
    None, numel 1, (B, Hkv) (q indexed by its kv head; (nseq, Hkv) for varlen); for fp8 or int8 q/k also per block
    along the sequence, q_descale (B, Hq, cdiv(Mq, Q_SCALE_BLOCK)), k_descale (B, Hkv, cdiv(Mk, K_SCALE_BLOCK));
    v_descale may be per channel (B, Hkv, Dv).
    Varlen: B == 1, sequences packed along dim 1, cu_seqlens_q/k int32 (nseq + 1,) on the device,
    max_seqlen_q/k host ints (per-block descales are not supported with varlen). The kernel clamps each
    sequence's bounds to the tensors' rows, so no cu_seqlens content makes it access memory outside them.
    Causal: key j visible to query i iff j <= i + Mk - Mq (bottom-right, FA2/FA3) or j <= i (top-left);
    rows that see no key give out = 0 and lse = -inf.
    Local window (-1 = unbounded): key j is also visible only if i_al - window_left <= j <= i_al + window_right,
    i_al = i + Mk - Mq (per sequence) unless the mask is causal top-left (i_al = i); key tiles outside the window
    are skipped. ``softcap`` > 0: scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2).
    ``sinks``: float32 (Hq,) attention sinks (GPT-OSS), one logit per query head in the scaled scores' natural
    units (not capped), added to every row's softmax denominator without a value row; the LSE includes it, and a
    row that sees no key gets out 0 and lse = its sink.
    Returns (out (B, Mq, Hq, Dv), lse float32 natural log (B, Hq, Mq) or None).
    Options: pv_fp8=False runs PV in fp16 for fp8 v (more accurate, slower); v_transposed (default: True for fp8
    v on CUDA) copies a last-dim-contiguous V to (B, Hkv, Dv, Mk) first; ``config`` overrides ``default_config``;
    ``out`` is an optional preallocated (B, Mq, Hq, Dv) output.

    Example::

        q, k, v = (torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = attention_forward(q, k, v, scale=128 ** -0.5, causal=True, return_lse=True)
        out, _ = attention_forward(q, k, v, scale=128 ** -0.5, causal=True, window_left=255, softcap=50.0)
    """
    B, Mq, Hq, D = q.shape
    _, Mk, Hkv, Dv = v.shape
    assert k.shape[:3] == v.shape[:3] and k.shape[3] == D and k.shape[0] == B, "q/k/v shapes disagree"
    assert Hq % Hkv == 0, "Hq must be a multiple of Hkv"
    v_keys = v.stride(-1) != 1
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q/k last dim must be contiguous"
    assert not v_keys or v.stride(1) == 1 or Mk <= 1, "v must be contiguous in its last dim or keys-contiguous"
    assert D % 16 == 0 and Dv % 16 == 0 and D <= 256 and Dv <= 256, "head dims must be multiples of 16, <= 256"
    assert window_left >= -1 and window_right >= -1, "window sizes are >= 0, or -1 for unbounded"
    assert softcap >= 0.0 and softcap != float("inf"), "softcap must be finite and >= 0 (0 = off)"
    assert sinks is None or (sinks.shape == (Hq,) and sinks.dtype == torch.float32 and sinks.stride(0) == 1), \
        "sinks must be float32 (Hq,), contiguous"
    qk_int8 = q.dtype == torch.int8
    fp8_v = v.dtype in _FP8
    if qk_int8:
        assert k.dtype == torch.int8 and fp8_v, "i8fp8 needs int8 q/k and fp8 v"
    else:
        assert q.dtype == k.dtype == v.dtype, "q/k/v dtypes must match (except int8 q/k with fp8 v)"
        assert fp8_v or q.dtype in (torch.bfloat16, torch.float16), f"unsupported dtype {q.dtype}"
    if out_dtype is None:
        out_dtype = torch.bfloat16 if fp8_v else q.dtype
    varlen = cu_seqlens_q is not None
    if varlen:
        assert B == 1 and cu_seqlens_k is not None and max_seqlen_q is not None, \
            "varlen needs B == 1, cu_seqlens_k, max_seqlen_q"
        nseq = cu_seqlens_q.numel() - 1
        grid_m = max_seqlen_q
    else:
        nseq = B
        grid_m = Mq
    device = q.device
    cfg = config or default_config(max(D, Dv), causal, (max_seqlen_k or 0) if varlen else Mk, fp8_v,
                                   window_left >= 0 or window_right >= 0)
    BM, BN = cfg.block_m, cfg.block_n
    if v_transposed is None:
        v_transposed = v_keys or (fp8_v and device.type == "cuda")
    assert v_transposed or not v_keys, "a keys-contiguous v is read transposed (v_transposed=False impossible)"
    assert not (varlen and v_keys), "a keys-contiguous v is not supported with varlen"

    if out is None:
        out = torch.empty((B, Mq, Hq, Dv), dtype=out_dtype, device=device)
    else:
        assert out.shape == (B, Mq, Hq, Dv) and out.stride(-1) == 1, "out must be (B, Mq, Hq, Dv), last dim contiguous"
    lse = torch.empty((B, Hq, Mq), dtype=torch.float32, device=device) if return_lse else None

    # descales: an absent one is 1 in the kernel (not loaded), its pointer a placeholder (``out``)
    q_block = q_descale is not None and q_descale.dim() == 3
    k_block = k_descale is not None and k_descale.dim() == 3
    assert not (varlen and (q_block or k_block)), "per-block descales are not supported with varlen"
    if q_block:
        qd, qd_sb, qd_sh = _block_descale_args(q_descale, (B, Hq, cdiv(Mq, Q_SCALE_BLOCK)), Q_SCALE_BLOCK, BM)
    else:
        qd, qd_sb, qd_sh = (out, 0, 0) if q_descale is None else descale_args(q_descale, nseq, Hkv, "q_descale")
    if k_block:
        kd, kd_sb, kd_sh = _block_descale_args(k_descale, (B, Hkv, cdiv(Mk, K_SCALE_BLOCK)), K_SCALE_BLOCK, BN)
    else:
        kd, kd_sb, kd_sh = (out, 0, 0) if k_descale is None else descale_args(k_descale, nseq, Hkv, "k_descale")
    v_chan = v_descale is not None and v_descale.dim() == 3
    if v_chan:
        assert v_descale.shape == (nseq, Hkv, Dv) and v_descale.stride(-1) == 1 and v_descale.dtype == torch.float32
        vd, vd_sb, vd_sh = v_descale, v_descale.stride(0), v_descale.stride(1)
    else:
        vd, vd_sb, vd_sh = (out, 0, 0) if v_descale is None else descale_args(v_descale, nseq, Hkv, "v_descale")

    if out.numel() == 0:
        if lse is not None:
            lse.fill_(float("-inf"))
        return out, lse
    if varlen and device.type == "cuda":  # only varlen programs make their descriptors on the device
        ensure_allocator()
    if v_keys:
        v_arg, v_strides, cu_vt = v, (v.stride(0), v.stride(3), v.stride(2)), None
    elif v_transposed:
        vt, cu_vt = transpose_v(v, cu_seqlens_k, max_seqlen_k)
        v_arg, v_strides = vt, (vt.stride(0), vt.stride(2), vt.stride(1))
    else:
        v_arg, v_strides = v, (v.stride(0), v.stride(1), v.stride(2))

    # a window bounds the keys right of the diagonal (causal: right = 0) and left of it
    mask_right = causal or window_right >= 0
    right = 0 if causal else max(window_right, 0)
    mask_left = window_left >= 0
    scale_log2, softcap_log2 = (scale / softcap, softcap * LOG2E.value) if softcap else (scale * LOG2E.value, 0.0)
    shift = p_shift(v.dtype) if pv_fp8 else 0  # 2**8 for e4m3fn (max 448), 2**7 for e4m3fnuz (max 240)
    BD, BDV = next_pow2(D), next_pow2(Dv)
    if varlen:  # per-sequence bounds: each program makes its descriptors on the device
        qkvo = (q, k, v_arg, out)
    else:  # one descriptor per tensor, spanning (B, H, rows, cols)
        Mk1 = max(Mk, 1)  # never read when Mk == 0; a descriptor needs positive sizes
        sb, srow, sh = v_strides
        qkvo = (_desc4(q, (B, Hq, Mq, D), (q.stride(0), q.stride(2), q.stride(1)), (BM, BD)),
                _desc4(k, (B, Hkv, Mk1, D), (k.stride(0), k.stride(2), k.stride(1)), (BN, BD)),
                _desc4(v_arg, (B, Hkv, Dv, Mk1) if v_transposed else (B, Hkv, Mk1, Dv), (sb, sh, srow),
                       (BDV, BN) if v_transposed else (BN, BDV)),
                _desc4(out, (B, Hq, Mq, Dv), (out.stride(0), out.stride(2), out.stride(1)), (BM, BDV)))
    grid = (cdiv(grid_m, BM), nseq * Hq)
    launch(_attn_fwd_kernel)[grid](
        *qkvo, lse if lse is not None else qd, qd, kd, vd,
        cu_seqlens_q if varlen else qd, cu_seqlens_k if varlen else qd, cu_vt if varlen and v_transposed else qd,
        qd if sinks is None else sinks, scale_log2, softcap_log2,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        *v_strides,
        out.stride(0), out.stride(1), out.stride(2),
        qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh,
        Mq, Mk, Hq, Hq // Hkv, min(max(window_left, 0), Mq + Mk), min(right, Mq + Mk),
        D=D, DV=Dv, BLOCK_M=BM, BLOCK_N=BN,
        MASK_LEFT=mask_left, MASK_RIGHT=mask_right, BOTTOM_RIGHT=causal_bottom_right, SOFTCAP=softcap > 0,
        VARLEN=varlen,
        V_T=v_transposed, P_SHIFT=shift, Q_BLOCKSCALE=q_block, K_BLOCKSCALE=k_block, V_PER_CHANNEL=v_chan,
        WRITE_LSE=return_lse, Q_DESCALED=q_descale is not None, K_DESCALED=k_descale is not None,
        V_DESCALED=v_descale is not None, ONE_LOOP=cfg.one_loop, SINKS=sinks is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        maxnreg=cfg.maxnreg,
    )
    return out, lse
