"""Warp-specialized fp8 attention forward for Hopper (sm90) in Gluon: a TMA producer warp and one or two
consumer warpgroups that ping-pong their softmax against each other's wgmmas.

Shapes, dtypes, layouts: those of ``kernels/gluon/attention_fwd.py`` (q, k (B, M, H, D) fp8 e4m3fn with the
last dim contiguous, V transposed by ``transpose_v``, descales per tensor or per (batch, kv head), bf16 out,
float32 natural-log LSE (B, Hq, Mq), bottom-right causal, any Mq / Mk).

One CTA owns ``CONSUMERS * BLOCK_M`` query rows of one (batch, query head):

* the producer partition (one warp, few registers) loads each consumer's Q tile once, then streams K and V^T
  tiles through ``STAGES``-deep shared-memory rings (TMA; ``*_ready`` mbarriers count the bytes, ``*_empty``
  mbarriers take one arrival per consumer, so every consumer reads every tile);
* each consumer partition (one warpgroup, BLOCK_M = 64 rows) runs, per key tile j: issue S_{j+1} = Q K_{j+1}^T
  and O += P_j V_j as async wgmmas, wait for S_{j+1} only, release its K slot, softmax(S_{j+1}) while P_j V_j
  still runs, wait for it, release its V slot, rescale O (the intra-warpgroup overlap);
* with two or three consumers, "turn" mbarriers order the wgmma issue: consumer c issues its pair, then hands
  the turn to consumer c + 1 (round robin), so one warpgroup's softmax runs under the others' GEMMs (ping-pong).

Both consumers walk the same key tiles (the CTA's last row bounds them under causal masking; a consumer whose
rows see fewer keys masks the extra tile), so the rings and turns stay in step. Softmax in exp2 with
scale * q_descale * k_descale folded into one multiplier; P is scaled by 2**P_SHIFT before the fp8 cast.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..attention_host import ensure_allocator, fp8_forward_args
from ..softmax import LOG2E, natural_lse, p_shift, row_inverse
from ..triton.launch import cdiv, launch
from ..triton.transpose_v import transpose_v
from .attention_fwd import tile_softmax

HEAD_DIMS = (64, 128, 256)
_P_SHIFT = p_shift(torch.float8_e4m3fn)
#: rows of one consumer warpgroup (one m64 wgmma)
WG_ROWS = gl.constexpr(64)
#: warps of one consumer partition (a warpgroup)
WG_WARPS = gl.constexpr(4)
#: registers of the producer warp: the hardware minimum (it only issues TMA and waits on mbarriers)
PRODUCER_REGS = gl.constexpr(24)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, m0,
              n_tiles, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
              CONSUMERS: gl.constexpr):
    """Q tiles once, then K_j, V_j for every key tile, each into its ring slot once all consumers freed it."""
    for c in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bars.index(c), WG_ROWS * HEAD_D)
        tma.async_copy_global_to_shared(q_desc, [m0 + c * WG_ROWS, 0], q_bars.index(c), q_smem.index(c))
    TILE_BYTES: gl.constexpr = BLOCK_N * HEAD_D
    for j in range(n_tiles):
        slot = j % STAGES
        # a fresh mbarrier has completed the phase before its first: the first round passes at once
        free_phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), free_phase)
        mbarrier.expect(k_ready.index(slot), TILE_BYTES)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free_phase)
        mbarrier.expect(v_ready.index(slot), TILE_BYTES)
        tma.async_copy_global_to_shared(v_desc, [0, j * BLOCK_N], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _take_turn(turn_bars, turn, C: gl.constexpr, CONSUMERS: gl.constexpr):
    """Wait until consumer ``C`` may issue its ``turn``-th wgmma group: consumers take turns in the order 0, 1, ..
    (a fresh mbarrier counts as having completed the phase before its first, so consumer 0 starts at once)."""
    if CONSUMERS > 1:
        mbarrier.wait(turn_bars.index(C), (turn & 1) ^ (1 if C == 0 else 0))


@gluon.jit
def _pass_turn(turn_bars, C: gl.constexpr, CONSUMERS: gl.constexpr):
    """Hand the tensor cores to the next consumer once this one's wgmmas are issued."""
    if CONSUMERS > 1:
        mbarrier.arrive(turn_bars.index((C + 1) % CONSUMERS), count=1)


@gluon.jit
def _pv_operand(p, p_layout: gl.constexpr, BLOCK_N: gl.constexpr, KEY_ORDER: gl.constexpr):
    """P (fp32, S accumulator layout) as the fp8 A operand of the PV wgmma. With ``KEY_ORDER`` V^T's keys are
    stored in the accumulator's order within each 32-key group (``transpose_v(key_order=True)``): operand slot
    16h + 4c + 2g + e holds key 16h + 8g + 2c + e, exactly the keys a thread's accumulator registers hold, so
    the conversion moves no data between threads."""
    p8 = p.to(gl.float8e4nv)
    if KEY_ORDER:
        rows: gl.constexpr = p8.shape[0]
        p8 = p8.reshape([rows, BLOCK_N // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([rows, BLOCK_N])
    return gl.convert_layout(p8, p_layout)


@gluon.jit
def _consumer(C: gl.constexpr, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, v_ready, k_empty, v_empty,
              turn_bars, o_desc, lse_ptr, qk_scale, out_scale, m0, n_tiles, Mq, Mk,
              HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
              CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, P_SHIFT: gl.constexpr, KEY_ORDER: gl.constexpr):
    """Rows ``m0 + C * WG_ROWS ..`` of the output: the online softmax over all ``n_tiles`` key tiles."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WG_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WG_WARPS, 1],
                                                       instr_shape=[16, HEAD_D, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    s_row: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)

    row0 = m0 + C * WG_ROWS
    diag = Mk - Mq
    if CAUSAL:  # tiles before full_end need no mask for any row of this warpgroup
        full_end = gl.maximum(gl.minimum(Mk, row0 + diag + 1), 0) // BLOCK_N * BLOCK_N
    else:
        full_end = Mk // BLOCK_N * BLOCK_N
    offs_m = row0 + gl.arange(0, WG_ROWS, layout=s_row)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=s_row)
    l_i = gl.zeros([WG_ROWS], gl.float32, layout=s_row)
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([WG_ROWS, HEAD_D], gl.float32, layout=o_layout)
    q_tile = q_smem.index(C)

    # S_0 alone (nothing to overlap with yet)
    mbarrier.wait(q_bars.index(C), 0)
    mbarrier.wait(k_ready.index(0), 0)
    _take_turn(turn_bars, 0, C, CONSUMERS)
    s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _pass_turn(turn_bars, C, CONSUMERS)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = tile_softmax(s, m_i, l_i, qk_scale, 0, full_end, Mk, diag, offs_m, CAUSAL, P_SHIFT,
                                      BLOCK_N, s_layout)

    for j in range(n_tiles - 1):
        p8 = _pv_operand(p, p_layout, BLOCK_N, KEY_ORDER)
        ks = (j + 1) % STAGES
        vs = j % STAGES
        mbarrier.wait(k_ready.index(ks), ((j + 1) // STAGES) & 1)
        mbarrier.wait(v_ready.index(vs), (j // STAGES) & 1)
        _take_turn(turn_bars, j + 1, C, CONSUMERS)
        s_tok = warpgroup_mma(q_tile, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), acc, is_async=True)
        _pass_turn(turn_bars, C, CONSUMERS)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(ks), count=1)
        p, m_i, l_i, alpha = tile_softmax(s, m_i, l_i, qk_scale, (j + 1) * BLOCK_N, full_end, Mk, diag, offs_m,
                                          CAUSAL, P_SHIFT, BLOCK_N, s_layout)
        acc = warpgroup_mma_wait(0, deps=(o_tok, ))
        mbarrier.arrive(v_empty.index(vs), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row), 1)

    last = n_tiles - 1
    vs = last % STAGES
    p8 = _pv_operand(p, p_layout, BLOCK_N, KEY_ORDER)
    mbarrier.wait(v_ready.index(vs), (last // STAGES) & 1)
    _take_turn(turn_bars, n_tiles, C, CONSUMERS)
    o_tok = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), acc, is_async=True)
    _pass_turn(turn_bars, C, CONSUMERS)
    acc = warpgroup_mma_wait(0, deps=(o_tok, ))
    mbarrier.arrive(v_empty.index(vs), count=1)

    out = acc * gl.expand_dims(gl.convert_layout(row_inverse(l_i) * out_scale, o_row), 1)
    o_tile = o_smem.index(C)
    o_tile.store(out.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0, 0], o_tile)
    if WRITE_LSE:
        gl.store(lse_ptr + offs_m, natural_lse(m_i, l_i, P_SHIFT), mask=offs_m < Mq)
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_fwd_ws_kernel(
    Q, K, VT, Out, Lse, QD, KD, VD, sm_scale_log2, vt_len,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_km, stride_kh,
    stride_vb, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh,
    Mq, Mk, Hq, GROUP,
    HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, P_SHIFT: gl.constexpr,
    KEY_ORDER: gl.constexpr,
):
    BLOCK_M: gl.constexpr = CONSUMERS * WG_ROWS
    pid_m = gl.program_id(0)
    if CAUSAL:  # longest rows first
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    b = bh // Hq
    hq = bh % Hq
    hkv = hq // GROUP
    m0 = pid_m * BLOCK_M
    b64 = b.to(gl.int64)
    if CAUSAL:
        kv_end = gl.maximum(gl.minimum(Mk, m0 + BLOCK_M + Mk - Mq), 0)
    else:
        kv_end = Mk
    # at least one (then fully masked) tile, so rows that see no key take the masked path: out 0, lse -inf
    n_tiles = gl.maximum(gl.cdiv(kv_end, BLOCK_N), 1)

    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, HEAD_D], gl.float8e4nv)
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], gl.float8e4nv)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_D, BLOCK_N], gl.float8e4nv)
    o_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, HEAD_D], gl.bfloat16)
    q_desc = tma.make_tensor_descriptor(Q + b64 * stride_qb + hq.to(gl.int64) * stride_qh, shape=[Mq, HEAD_D],
                                        strides=[stride_qm, 1], block_shape=[WG_ROWS, HEAD_D], layout=q_sl)
    k_desc = tma.make_tensor_descriptor(K + b64 * stride_kb + hkv.to(gl.int64) * stride_kh, shape=[Mk, HEAD_D],
                                        strides=[stride_km, 1], block_shape=[BLOCK_N, HEAD_D], layout=k_sl)
    # V^T (B, Hkv, D, L): keys contiguous. In key order its padding is written (zeros) and keys move within their
    # 32-key group, so all L columns are read; otherwise the shape is Mk so the unwritten padding reads as zeros
    v_desc = tma.make_tensor_descriptor(VT + b64 * stride_vb + hkv.to(gl.int64) * stride_vh, shape=[HEAD_D, vt_len],
                                        strides=[stride_vd, 1], block_shape=[HEAD_D, BLOCK_N], layout=v_sl)
    o_desc = tma.make_tensor_descriptor(Out + b64 * stride_ob + hq.to(gl.int64) * stride_oh, shape=[Mq, HEAD_D],
                                        strides=[stride_om, 1], block_shape=[WG_ROWS, HEAD_D], layout=o_sl)

    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [CONSUMERS, WG_ROWS, HEAD_D], q_sl)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_D], k_sl)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_D, BLOCK_N], v_sl)
    o_smem = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, WG_ROWS, HEAD_D], o_sl)
    q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_bars.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(turn_bars.index(c), count=1)

    qd = gl.load(QD + b * qd_sb + hkv * qd_sh)
    kd = gl.load(KD + b * kd_sb + hkv * kd_sh)
    vd = gl.load(VD + b * vd_sb + hkv * vd_sh)
    qk_scale = qd * kd * sm_scale_log2
    lse_ptr = Lse + b64 * stride_lb + hq.to(gl.int64) * stride_lh

    # constexprs travel as arguments of each partition function (a tuple built here would make them tensors)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn_bars,
                         o_desc, lse_ptr, qk_scale, vd, m0, n_tiles, Mq, Mk, HEAD_D, BLOCK_N, STAGES, CONSUMERS,
                         CAUSAL, WRITE_LSE, P_SHIFT, KEY_ORDER)),
            (_consumer, (1, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn_bars,
                         o_desc, lse_ptr, qk_scale, vd, m0, n_tiles, Mq, Mk, HEAD_D, BLOCK_N, STAGES, CONSUMERS,
                         CAUSAL, WRITE_LSE, P_SHIFT, KEY_ORDER)),
            (_consumer, (2, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn_bars,
                         o_desc, lse_ptr, qk_scale, vd, m0, n_tiles, Mq, Mk, HEAD_D, BLOCK_N, STAGES, CONSUMERS,
                         CAUSAL, WRITE_LSE, P_SHIFT, KEY_ORDER)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty,
                         m0, n_tiles, BLOCK_N, HEAD_D, STAGES, CONSUMERS)),
        ], [WG_WARPS, WG_WARPS, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    elif CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn_bars,
                         o_desc, lse_ptr, qk_scale, vd, m0, n_tiles, Mq, Mk, HEAD_D, BLOCK_N, STAGES, CONSUMERS,
                         CAUSAL, WRITE_LSE, P_SHIFT, KEY_ORDER)),
            (_consumer, (1, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn_bars,
                         o_desc, lse_ptr, qk_scale, vd, m0, n_tiles, Mq, Mk, HEAD_D, BLOCK_N, STAGES, CONSUMERS,
                         CAUSAL, WRITE_LSE, P_SHIFT, KEY_ORDER)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty,
                         m0, n_tiles, BLOCK_N, HEAD_D, STAGES, CONSUMERS)),
        ], [WG_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn_bars,
                         o_desc, lse_ptr, qk_scale, vd, m0, n_tiles, Mq, Mk, HEAD_D, BLOCK_N, STAGES, CONSUMERS,
                         CAUSAL, WRITE_LSE, P_SHIFT, KEY_ORDER)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty,
                         m0, n_tiles, BLOCK_N, HEAD_D, STAGES, CONSUMERS)),
        ], [1], [PRODUCER_REGS])

    for c in gl.static_range(CONSUMERS):
        mbarrier.invalidate(q_bars.index(c))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))
    for c in gl.static_range(CONSUMERS):
        mbarrier.invalidate(turn_bars.index(c))


@dataclass(frozen=True)
class WsFwdConfig:
    """Schedule of the warp-specialized kernel."""

    #: consumer warpgroups per CTA (64 query rows each), taking turns at the tensor cores: 2 or 3 in one CTA per
    #: SM (``maxnreg`` 168 / 128), 1 runs two CTAs per SM
    consumers: int = 2
    #: keys per tile
    block_n: int = 128
    #: K / V ring depth
    stages: int = 2
    #: register budget per thread of the whole CTA (``maxnreg``): 65536 / threads / CTAs per SM, rounded to 8
    maxnreg: int = 168
    #: registers of a worker consumer warpgroup (setmaxnreg); the default partition gets what is left
    consumer_regs: int = 240
    #: V^T's keys in the S accumulator's order (``transpose_v(key_order=True)``): P feeds the PV wgmma from its
    #: own registers; False converts P's layout through warp shuffles
    key_order: bool = True


#: ``maxnreg`` and consumer registers of three-consumer schedules: four warpgroups in 65536 registers
THREE_CONSUMER_MAXNREG = 128
THREE_CONSUMER_REGS = 160
#: ``maxnreg`` of single-consumer schedules: 128 fits two 8-warp CTAs per SM; D256's wgmmas need more (one CTA)
SINGLE_CONSUMER_MAXNREG = {64: 128, 128: 128, 256: 168}


def default_config(head_dim: int, causal: bool) -> WsFwdConfig:
    """Schedule for head dim ``head_dim``."""
    return WsFwdConfig(block_n=128 if head_dim <= 128 else 64)


def attention_forward(q, k, v, *, scale: float, causal: bool = False, q_descale=None, k_descale=None,
                      v_descale=None, return_lse: bool = False, config: WsFwdConfig | None = None, out=None):
    """fp8 attention forward on Hopper, warp-specialized (module docstring: shapes, dtypes, layouts).

    Returns (out bf16 (B, Mq, Hq, D), lse float32 (B, Hq, Mq) natural log, or None). ``config`` overrides
    ``default_config``; ``out`` is an optional preallocated bf16 output.

    Example::

        q, k, v = (torch.randn(2, 4096, 16, 128, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
        out, _ = attention_forward(q, k, v, scale=128 ** -0.5, causal=True)
    """
    B, Mq, Hq, D = q.shape
    Mk, Hkv = k.shape[1], k.shape[2]
    cfg = config or default_config(D, causal)
    if cfg.consumers not in (1, 2, 3) or cfg.stages < 2:
        raise ValueError(f"config {cfg}: consumers must be 1, 2 or 3 and stages >= 2")
    prep = fp8_forward_args(q, k, v, q_descale, k_descale, v_descale, return_lse, out, HEAD_DIMS)
    if prep.done:
        return prep.out, prep.lse
    out, lse = prep.out, prep.lse
    ensure_allocator()
    vt, _ = transpose_v(v, key_order=cfg.key_order)
    launch(_attn_fwd_ws_kernel)[(cdiv(Mq, cfg.consumers * WG_ROWS.value), B * Hq)](
        q, k, vt, out, lse if lse is not None else prep.qd, prep.qd, prep.kd, prep.vd, scale * LOG2E.value,
        vt.shape[3] if cfg.key_order else Mk,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        vt.stride(0), vt.stride(1), vt.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
        *prep.descale_strides,
        Mq, Mk, Hq, Hq // Hkv,
        HEAD_D=D, BLOCK_N=cfg.block_n, STAGES=cfg.stages, CONSUMERS=cfg.consumers, CONSUMER_REGS=cfg.consumer_regs,
        CAUSAL=causal, WRITE_LSE=return_lse, P_SHIFT=_P_SHIFT, KEY_ORDER=cfg.key_order, num_warps=WG_WARPS.value,
        maxnreg=cfg.maxnreg,
    )
    return out, lse


def compile_sm90(head_dim: int = 128, causal: bool = False, write_lse: bool = False,
                 config: WsFwdConfig | None = None):
    """Compile the kernel ahead of time for sm90 (no GPU needed); returns the CompiledKernel (asm: ttgir, ptx,
    cubin; ``n_regs``, ``n_spills``).

    Example: ``compile_sm90(128, causal=True).n_spills`` -> 0.
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config or default_config(head_dim, causal)
    const = {"HEAD_D": head_dim, "BLOCK_N": cfg.block_n, "STAGES": cfg.stages, "CONSUMERS": cfg.consumers,
             "CONSUMER_REGS": cfg.consumer_regs, "CAUSAL": causal, "WRITE_LSE": write_lse, "P_SHIFT": _P_SHIFT,
             "KEY_ORDER": cfg.key_order}
    i32 = ("vt_len", "stride_qb", "stride_qm", "stride_qh", "stride_kb", "stride_km", "stride_kh", "stride_vb",
           "stride_vh", "stride_vd", "stride_ob", "stride_om", "stride_oh", "stride_lb", "stride_lh",
           "qd_sb", "qd_sh", "kd_sb", "kd_sh", "vd_sb", "vd_sh", "Mq", "Mk", "Hq", "GROUP")
    sig = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "VT": "*fp8e4nv", "Out": "*bf16", "Lse": "*fp32", "QD": "*fp32",
           "KD": "*fp32", "VD": "*fp32", "sm_scale_log2": "fp32", **dict.fromkeys(i32, "i32"),
           **dict.fromkeys(const, "constexpr")}
    src = GluonASTSource(_attn_fwd_ws_kernel, sig, constexprs={(list(sig).index(n),): v for n, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": WG_WARPS.value, "maxnreg": cfg.maxnreg})
