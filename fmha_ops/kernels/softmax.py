"""Constants and online-softmax pieces shared by the attention kernels (Triton and Gluon).

The kernels keep scores in log2 units (``exp2`` is the hardware exponential: one MUFU.EX2 per score), so the
softmax scale is multiplied by ``LOG2E`` once on the host and the natural-log LSE is recovered with ``LN2``
at the end. The ``@triton.jit`` helpers use only operations that Triton and Gluon share (no ``arange``,
no layouts), so a ``@gluon.jit`` kernel calls them too; their tiles are [rows, keys].

Online softmax over key tiles (per row: running max ``m``, running sum ``l``, accumulator ``acc``)::

    p, m, l, alpha = softmax_step(s, keep, m, l, qk_scale, ...)   # s: raw scores of one tile
    acc = acc * alpha[:, None] + p @ v
    ...
    out = acc * row_inverse(l)[:, None];  lse = natural_lse(m, l, P_SHIFT)

Attention sinks (GPT-OSS: one learned logit per query head that joins every row's softmax denominator and has
no value row) enter once, after the last tile: ``m, l, alpha = add_sink(m, l, sink * LOG2E, P_SHIFT)``, then
``acc * alpha`` as for a tile. The probabilities of the keys stay relative to the keys' own max until then, so a
large sink does not push them below fp8's normal range.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

#: log2(e): exp(x) = exp2(x * LOG2E); the host folds it into the softmax scale (scores in log2 units).
LOG2E = tl.constexpr(1.4426950408889634)
#: ln(2): a log2-domain log-sum-exp times LN2 is the natural-log LSE the API returns.
LN2 = tl.constexpr(0.6931471805599453)
#: the smallest normal float32: the least score multiplier ``softmax_step`` uses (see there)
MIN_QK_SCALE = tl.constexpr(1.1754943508222875e-38)
#: int32 scores (int8 QK^T) plus INT_BIAS, bitcast, are the float32 12582912.0 + s exactly for |s| <= 2**22
#: (the Gluon int8 path reads its scores so: ``attention_common.int_scores``)
INT_BIAS = tl.constexpr(0x4B400000)
#: what ``hide_keys`` writes into hidden int32 scores: below every score (|s| <= 2**22), and plus INT_BIAS the bits
#: of -inf (0xFF800000 - INT_BIAS as an int32), so a hidden score reads as -inf after the offset add
HIDDEN_INT_SCORE = tl.constexpr(0xB4400000 - 2 ** 32)
#: the Triton interpreter (CPU) runs no inline PTX: ``tanh`` takes exp2 there
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


def p_shift(v_dtype) -> int:
    """Exponent shift of P before its cast to the fp8 PV operand (0 when P is not fp8).

    P in [0, 1] times 2**P_SHIFT keeps small probabilities normal fp8 numbers: e4m3fn's largest value is 448,
    so 2**8 = 256 is the largest power of two that P = 1 may take; e4m3fnuz (max 240) takes 2**7 = 128.
    The kernels subtract the shift from the row max (no multiply) and from the LSE.
    """
    import torch

    return {torch.float8_e4m3fn: 8, torch.float8_e4m3fnuz: 7}.get(v_dtype, 0)


@triton.jit
def visible(rows, cols, seqlen_k, lo, hi, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """[rows, keys] bool: key ``cols[j]`` is inside the sequence (< ``seqlen_k``) and, for query ``rows[i]``,
    at least ``rows[i] + lo`` (``MASK_LEFT``) and at most ``rows[i] + hi`` (``MASK_RIGHT``). A causal mask is
    ``hi`` = the alignment offset; a window adds ``-window_left`` / ``+window_right`` to it."""
    keep = cols[None, :] < seqlen_k
    if MASK_RIGHT:
        keep = keep & (cols[None, :] <= rows[:, None] + hi)
    if MASK_LEFT:
        keep = keep & (cols[None, :] >= rows[:, None] + lo)
    return keep


#: one compare and one select per score (``_keep_or_hide``): keep $1 where $2 <= $3, else -inf / HIDDEN_INT_SCORE
_HIDE_F32_SIGNED = tl.constexpr("{ .reg .pred p; setp.le.s32 p, $2, $3; selp.f32 $0, $1, 0fFF800000, p; }")
_HIDE_F32_UNSIGNED = tl.constexpr("{ .reg .pred p; setp.le.u32 p, $2, $3; selp.f32 $0, $1, 0fFF800000, p; }")
_HIDE_I32_SIGNED = tl.constexpr("{ .reg .pred p; setp.le.s32 p, $2, $3; selp.b32 $0, $1, 0xB4400000, p; }")
_HIDE_I32_UNSIGNED = tl.constexpr("{ .reg .pred p; setp.le.u32 p, $2, $3; selp.b32 $0, $1, 0xB4400000, p; }")


@triton.jit
def _keep_or_hide(s, key, bound, UNSIGNED: tl.constexpr):
    """``s`` where ``key <= bound`` (as unsigned integers when ``UNSIGNED``), else hidden: -inf for float scores,
    ``HIDDEN_INT_SCORE`` for int32 ones. One compare and one select per score in one inline-asm statement on the
    GPU, an ordinary ``where`` in the interpreter."""
    if _INTERPRETED:
        if UNSIGNED:
            keep = key.to(tl.uint32, bitcast=True) <= bound.to(tl.uint32, bitcast=True)
        else:
            keep = key <= bound
        if s.dtype.is_int():
            out = tl.where(keep, s, HIDDEN_INT_SCORE)
        else:
            out = tl.where(keep, s, float("-inf"))
    elif s.dtype.is_int():
        out = tl.inline_asm_elementwise(_HIDE_I32_UNSIGNED if UNSIGNED else _HIDE_I32_SIGNED, "=r,r,r,r",
                                        [s, key, bound], dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = tl.inline_asm_elementwise(_HIDE_F32_UNSIGNED if UNSIGNED else _HIDE_F32_SIGNED, "=f,f,r,r",
                                        [s, key, bound], dtype=tl.float32, is_pure=True, pack=1)
    return out


@triton.jit
def hide_keys(s, rows, cols, seqlen_k, lo, hi, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """``s`` [rows, keys] with the scores of the keys ``visible`` hides set to -inf (same arguments); int32 scores
    (the int8 path's QK^T) to ``HIDDEN_INT_SCORE``.

    Each row's visible keys are one range [first, first + width]: the sequence end is folded into its last key,
    and a row that sees none gets first = -1 and width 0, which no key j >= 0 meets. Then a key is kept iff
    ``j - first <= width`` as unsigned integers: one compare and one select per score (``_keep_or_hide``; built
    from i1 tensors, LLVM packs the row masks into bit vectors and unpacks them per score: ~2x the instructions
    of an unmasked tile for a causal or window tile of the fp8 forward). Without a left bound (causal, no window)
    a key is kept iff j <= last, the row's last visible key: the same compare and select without the offset
    j - first, one integer add per score fewer. Without either mask only the sequence end applies: float scores
    take a plain ``where`` on the key index there (one compare per key, not per score)."""
    if MASK_RIGHT:
        last = tl.minimum(rows + hi, seqlen_k - 1)
    else:
        last = rows * 0 + (seqlen_k - 1)
    if MASK_LEFT:
        first = rows + lo
        width = last - first
        first = tl.where(width < 0, -1, first)
        width = tl.maximum(width, 0)
        offset = cols[None, :] - first[:, None]
        hidden = _keep_or_hide(s, offset, tl.broadcast_to(width[:, None], offset.shape), True)
    elif MASK_RIGHT or s.dtype.is_int():
        key = tl.broadcast_to(cols[None, :], s.shape)
        hidden = _keep_or_hide(s, key, tl.broadcast_to(last[:, None], s.shape), False)
    else:
        hidden = tl.where(cols[None, :] < seqlen_k, s, float("-inf"))
    return hidden


@triton.jit
def softmax_step(s, keep, m_i, l_i, qk_scale, OFF: tl.constexpr, P_SHIFT: tl.constexpr, MASKED: tl.constexpr):
    """One key tile of the online softmax.

    ``s`` [rows, keys] fp32 raw scores (``OFF`` added: the int8 path's conversion offset, else 0), scaled by
    ``qk_scale`` (>= 0, log2 units; ops with this softmax declare no negative softmax scale, descales are >= 0).
    ``MASKED``: some scores are hidden, either by ``keep`` (visible keys) or, with ``keep`` None, already -inf in
    ``s`` (``hide_keys``); rows may then have seen no key yet. ``m_i``, ``l_i``: the running row max and sum.
    Returns (p fp32 scaled by 2**P_SHIFT, new max, new sum, alpha: the factor that rescales the accumulator).
    qk_scale > 0 commutes with the row max, so one FMA per score feeds exp2, masked or not.
    """
    # a zero scale (softmax scale 0, or a zero descale: an all-zero token quantizes to descale 0) becomes the
    # smallest normal float: hidden scores stay -inf (0 * -inf would be NaN) and the visible ones weigh the same
    qk_scale = tl.maximum(qk_scale, MIN_QK_SCALE)
    if MASKED and keep is not None:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, (tl.max(s, 1) - OFF) * qk_scale)
    if MASKED:  # rows that have seen no key yet keep m = -inf; subtract 0 instead to avoid inf - inf
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    if OFF == 0.0:
        p = tl.math.exp2(s * qk_scale - (m_sub - P_SHIFT)[:, None])
    else:
        p = tl.math.exp2(s * qk_scale - (m_sub + (OFF * qk_scale - P_SHIFT))[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, m_new, l_i, alpha


@triton.jit
def add_sink(m_i, l_i, sink_log2, P_SHIFT: tl.constexpr):
    """(m, l, alpha) of rows once their sink logit ``sink_log2`` (log2 units, one per row or a scalar) joins the
    denominator: the running max becomes max(m, sink), the sum gains 2**(sink - m + P_SHIFT) (P's scale), and
    alpha rescales the accumulator to the new max. Rows that saw no key (m = -inf) get l = 2**P_SHIFT, alpha 0:
    out 0 and lse = the sink. A sink of -inf adds nothing."""
    m_new = tl.maximum(m_i, sink_log2)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_sub)
    return m_new, l_i * alpha + tl.math.exp2(sink_log2 - m_sub + P_SHIFT), alpha


@triton.jit
def row_inverse(l_i):
    """1 / l per row; rows that saw no key (l = 0) get 1, so their zero accumulator gives out = 0."""
    return 1.0 / tl.where(l_i == 0.0, 1.0, l_i)


@triton.jit
def natural_lse(m_i, l_i, P_SHIFT: tl.constexpr):
    """Natural-log LSE of rows from the log2-domain running max and sum (P scaled by 2**P_SHIFT);
    -inf for rows that saw no key."""
    empty = l_i == 0.0
    return tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i)) - P_SHIFT) * LN2)


@triton.jit
def tanh(x):
    """fp32 tanh: one MUFU.TANH (``tanh.approx.f32``, max relative error 2**-10.7, as FlashAttention's softcap)
    on the GPU; 1 - 2 / (exp2(2 x log2 e) + 1) in the interpreter."""
    if _INTERPRETED:
        return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
    else:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
