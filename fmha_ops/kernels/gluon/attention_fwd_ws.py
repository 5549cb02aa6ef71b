"""fp8 attention forward for Hopper (sm90) in Gluon, warp-specialized FA3 ping-pong (prototype, not yet run on a GPU).

Shapes, dtypes, layouts: those of ``attention_fwd.py`` (the one-warpgroup Gluon kernel).

* q (B, Mq, Hq, D), k (B, Mk, Hkv, D): ``float8_e4m3fn``, last dim contiguous, other strides free (multiples of 16
  bytes); D in {64, 128, 256}; Hq % Hkv == 0 (query head h reads kv head h // (Hq // Hkv)).
* v (B, Mk, Hkv, D) fp8, copied by ``transpose_v`` to (B, Hkv, D, L) so the PV wgmma gets a K-major B operand.
* descales float32: None, per tensor (numel 1) or per (batch, kv head) ``(B, Hkv)``.
* out bf16 (B, Mq, Hq, D); lse float32 (B, Hq, Mq), natural log (optional).
* causal is bottom-right aligned: query i sees key j iff j <= i + Mk - Mq; rows that see no key give
  out = 0 and lse = -inf. Any Mq, Mk: TMA zero padding handles partial tiles; O and LSE use masked stores.

One CTA (12 warps, one per SM) owns BLOCK_M = 128 query rows of one (batch, head), ``gl.warp_specialize``:

* producer = the default partition (the kernel's 4 warps, 24 registers after setmaxnreg; one thread issues):
  makes the TMA descriptors, loads the two 64-row Q tiles once, then streams K_0, then (K_{j+1}, V_j) per step
  through STAGES-deep shared-memory rings, each slot guarded by a full/empty mbarrier pair (full: TMA transaction
  bytes; empty: count 2, one arrive from each consumer once its wgmma has read the slot). It is not a 1-warp worker
  partition because ptxas serializes the consumers' pipelined wgmmas when a 24-register worker shares Triton's
  switch loop with them (bench/results/attention_fwd.md, "Warp-specialized ping-pong").
* two consumer warpgroups (4-warp worker partitions, 240 registers): consumer w owns rows 64w..64w+63 and the Q
  tile ``q_smem[w]``; its loop is that of ``attention_fwd.py`` with the wait pattern of the schedule (SCHEDULES):
  no in-flight wgmma across the softmax, P_j V_j in flight through softmax(S_{j+1}) (OVERLAP=1), or S_{j+1} and
  P_{j-1} V_{j-1} in flight through softmax(S_j) (OVERLAP=2, FA3 look-ahead).
* ping-pong (PINGPONG): the wgmma issue of each step is a critical section handed from one consumer to the other
  through two count-1 mbarriers (``turn[w]``: consumer w may issue; turn[0] pre-arrived), as FA3 does with named
  barriers, so that the tensor cores run one consumer's GEMMs while the other is in its softmax.
* the overlap schedules need ``_patch_ptx_regs`` (raises the idle worker register count in the PTX; see there).

Both consumers walk the same key tiles (the CTA's causal range), so the empty barriers and the turns stay in step;
rows of consumer 0 above the diagonal are masked.
Softmax in exp2 with scale * q_descale * k_descale folded into one multiplier; P is scaled by 2**P_SHIFT before the
fp8 cast and the shift is removed from the LSE (as in ``attention_fwd.py``).
"""
from __future__ import annotations

import contextlib
import inspect
import re
import zlib

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from .attention_fwd import _tile_softmax, compile_for_sm90, kernel_args, prepare_launch

WG_M = 64  # query rows per consumer warpgroup (one m64 wgmma)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty,
              m0, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """TMA partition (1 warp): Q once, then K_0, then (K_{j+1}, V_j) per step; waits on the empty barriers."""
    QB: gl.constexpr = q_desc.block_type.nbytes
    KB: gl.constexpr = k_desc.block_type.nbytes
    VB: gl.constexpr = v_desc.block_type.nbytes
    mbarrier.expect(q_bar, 2 * QB)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [m0 + 64, 0], q_bar, q_smem.index(1))
    # a fresh mbarrier counts its phase "-1" as complete: the first lap waits on parity 1 and passes
    mbarrier.wait(k_empty.index(0), 1)
    mbarrier.expect(k_full.index(0), KB)
    tma.async_copy_global_to_shared(k_desc, [0, 0], k_full.index(0), k_smem.index(0))
    for j in range(n_tiles):
        jn = j + 1
        if jn < n_tiles:
            s = jn % STAGES
            mbarrier.wait(k_empty.index(s), ((jn // STAGES) & 1) ^ 1)
            mbarrier.expect(k_full.index(s), KB)
            tma.async_copy_global_to_shared(k_desc, [jn * BLOCK_N, 0], k_full.index(s), k_smem.index(s))
        s = j % STAGES
        mbarrier.wait(v_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(v_full.index(s), VB)
        tma.async_copy_global_to_shared(v_desc, [0, j * BLOCK_N], v_full.index(s), v_smem.index(s))


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty, turn, Out, Lse, out_base, lse_base,
              stride_om, m0, n_tiles, Mq, Mk, diag, qk_scale, vd,
              WG: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, P_SHIFT: gl.constexpr, PINGPONG: gl.constexpr,
              OVERLAP: gl.constexpr):
    """Consumer warpgroup WG (4 warps): rows m0 + 64 WG .. + 63; see the module docstring.

    Iteration j: softmax(S_j) -> wait P_{j-1} V_{j-1} (already done unless OVERLAP) -> release its V slot ->
    rescale O -> P_j to fp8 -> [my turn] issue S_{j+1}, P_j V_j [pass the turn] -> wait S_{j+1} (OVERLAP: P_j V_j
    stays in flight through the next softmax; else both) -> release the K slot.
    """
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    s_row: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_col: gl.constexpr = gl.SliceLayout(0, o_layout)
    turn_mine = turn.index(WG)
    turn_other = turn.index(1 - WG)

    mw = m0 + WG * 64
    if CAUSAL:  # this warpgroup's own unmasked range (the tile count is the CTA's)
        full_end = gl.maximum(gl.minimum(Mk, mw + diag + 1), 0) // BLOCK_N * BLOCK_N
    else:
        full_end = Mk // BLOCK_N * BLOCK_N
    offs_m = mw + gl.arange(0, 64, layout=s_row)
    m_i = gl.full([64], float("-inf"), gl.float32, layout=s_row)
    l_i = gl.zeros([64], gl.float32, layout=s_row)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([64, HEAD_D], gl.float32, layout=o_layout)
    q_tile = q_smem.index(WG)
    tph = 0  # parity of this warpgroup's next turn

    # S_0
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_full.index(0), 0)
    if PINGPONG:
        mbarrier.wait(turn_mine, tph)
        tph ^= 1
    s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_other)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0))
    acc = warpgroup_mma_init(acc)

    if OVERLAP == 2:
        # look-ahead: S_{j+1} is issued before softmax(S_j), so the tensor cores hold S_{j+1} and P_{j-1} V_{j-1}
        # through the softmax; one wait(0) retires both (no wait(1) on a group issued in the previous iteration,
        # which is what makes ptxas serialize every wgmma with C7514)
        for j in range(n_tiles - 1):
            start_n = j * BLOCK_N
            ks = (j + 1) % STAGES
            vs = j % STAGES
            mbarrier.wait(k_full.index(ks), ((j + 1) // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn_mine, tph)
                tph ^= 1
            s_tok = warpgroup_mma(q_tile, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn_other)
            p, m_i, l_i, alpha = _tile_softmax(s, m_i, l_i, qk_scale, start_n, full_end, Mk, diag, offs_m, CAUSAL,
                                               P_SHIFT, BLOCK_N, s_layout)
            s, acc = warpgroup_mma_wait(0, deps=(s_tok, acc))
            mbarrier.arrive(k_empty.index(ks))
            mbarrier.arrive(v_empty.index((j + STAGES - 1) % STAGES), pred=j > 0)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row), 1)
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            mbarrier.wait(v_full.index(vs), (j // STAGES) & 1)
            acc = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), acc, is_async=True)
    else:
        for j in range(n_tiles - 1):
            start_n = j * BLOCK_N
            p, m_i, l_i, alpha = _tile_softmax(s, m_i, l_i, qk_scale, start_n, full_end, Mk, diag, offs_m, CAUSAL,
                                               P_SHIFT, BLOCK_N, s_layout)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            # P_{j-1} V_{j-1} has read V slot (j-1) % STAGES
            mbarrier.arrive(v_empty.index((j + STAGES - 1) % STAGES), pred=j > 0)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row), 1)
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            ks = (j + 1) % STAGES
            vs = j % STAGES
            mbarrier.wait(k_full.index(ks), ((j + 1) // STAGES) & 1)
            mbarrier.wait(v_full.index(vs), (j // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn_mine, tph)
                tph ^= 1
            s_tok = warpgroup_mma(q_tile, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn_other)
            if OVERLAP:
                s = warpgroup_mma_wait(1, deps=(s_tok, ))
            else:
                s, acc = warpgroup_mma_wait(0, deps=(s_tok, acc))
                acc = warpgroup_mma_init(acc)
            mbarrier.arrive(k_empty.index(ks))

    last = n_tiles - 1
    start_n = last * BLOCK_N
    p, m_i, l_i, alpha = _tile_softmax(s, m_i, l_i, qk_scale, start_n, full_end, Mk, diag, offs_m, CAUSAL,
                                       P_SHIFT, BLOCK_N, s_layout)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index((last + STAGES - 1) % STAGES), pred=last > 0)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row), 1)
    p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    vs = last % STAGES
    mbarrier.wait(v_full.index(vs), (last // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turn_mine, tph)
    acc = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_other)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(vs))

    # epilogue: plain stores from the accumulator layout (no TMA descriptor is used outside the partition that
    # made it on the device)
    empty = l_i == 0.0
    inv_l = 1.0 / gl.where(empty, 1.0, l_i)
    out = (acc * gl.expand_dims(gl.convert_layout(inv_l * vd, o_row), 1)).to(gl.bfloat16)
    rows = mw + gl.arange(0, 64, layout=o_row)
    cols = gl.arange(0, HEAD_D, layout=o_col)
    ptrs = Out + out_base + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, out, mask=gl.expand_dims(rows < Mq, 1))
    if WRITE_LSE:
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i)) - P_SHIFT) * 0.6931471805599453)
        gl.store(Lse + lse_base + offs_m, lse, mask=offs_m < Mq)


@gluon.jit
def _attn_fwd_ws_kernel(
    Q, K, VT, Out, Lse, QD, KD, VD, sm_scale_log2,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_km, stride_kh,
    stride_vb, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh,
    Mq, Mk, Hq, GROUP,
    HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, P_SHIFT: gl.constexpr, PINGPONG: gl.constexpr,
    OVERLAP: gl.constexpr, CONSUMER_REGS: gl.constexpr, IDLE_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    # IDLE_REGS: _ptx_patch_key(idle): the idle worker register count that _patch_ptx_regs writes into the PTX and
    # a checksum of the patch code (0: unpatched). Only a cache-key marker: Triton's cache key covers the kernel
    # source, not the PTX hook.
    BLOCK_M: gl.constexpr = 128
    pid_m = gl.program_id(0)
    if CAUSAL:  # longest rows first
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    b = bh // Hq
    hq = bh % Hq
    hkv = hq // GROUP
    m0 = pid_m * BLOCK_M
    b64 = b.to(gl.int64)
    diag = Mk - Mq
    if CAUSAL:
        kv_end = gl.maximum(gl.minimum(Mk, m0 + BLOCK_M + diag), 0)
    else:
        kv_end = Mk
    # at least one (then fully masked) tile, so rows that see no key take the masked path: out 0, lse -inf
    n_tiles = gl.maximum(gl.cdiv(kv_end, BLOCK_N), 1)

    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_D], gl.float8e4nv)
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], gl.float8e4nv)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_D, BLOCK_N], gl.float8e4nv)
    # made on the device by the default warps, which are also the producer partition that uses them
    q_desc = tma.make_tensor_descriptor(Q + b64 * stride_qb + hq.to(gl.int64) * stride_qh, shape=[Mq, HEAD_D],
                                        strides=[stride_qm, 1], block_shape=[64, HEAD_D], layout=q_sl)
    k_desc = tma.make_tensor_descriptor(K + b64 * stride_kb + hkv.to(gl.int64) * stride_kh, shape=[Mk, HEAD_D],
                                        strides=[stride_km, 1], block_shape=[BLOCK_N, HEAD_D], layout=k_sl)
    # V^T (B, Hkv, D, L): keys contiguous; shape Mk (not L) so the padding columns read as zeros
    v_desc = tma.make_tensor_descriptor(VT + b64 * stride_vb + hkv.to(gl.int64) * stride_vh, shape=[HEAD_D, Mk],
                                        strides=[stride_vd, 1], block_shape=[HEAD_D, BLOCK_N], layout=v_sl)

    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, HEAD_D], q_sl)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_D], k_sl)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_D, BLOCK_N], v_sl)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrive per consumer warpgroup (thread 0 of each)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    mbarrier.arrive(turn.index(0))  # consumer 0 takes the first turn
    fence_async_shared()

    qd = gl.load(QD + b * qd_sb + hkv * qd_sh)
    kd = gl.load(KD + b * kd_sb + hkv * kd_sh)
    vd = gl.load(VD + b * vd_sb + hkv * vd_sh)
    qk_scale = qd * kd * sm_scale_log2
    out_base = b64 * stride_ob + hq.to(gl.int64) * stride_oh
    lse_base = b64 * stride_lb + hq.to(gl.int64) * stride_lh

    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    # default partition (the kernel's 4 warps) = TMA producer, left with 24 registers; two 4-warp consumer workers
    gl.warp_specialize([
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty, m0,
                     n_tiles, BLOCK_N, STAGES)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty, turn, Out, Lse, out_base,
                     lse_base, stride_om, m0, n_tiles, Mq, Mk, diag, qk_scale, vd,
                     WG0, HEAD_D, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, P_SHIFT, PINGPONG, OVERLAP)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty, turn, Out, Lse, out_base,
                     lse_base, stride_om, m0, n_tiles, Mq, Mk, diag, qk_scale, vd,
                     WG1, HEAD_D, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, P_SHIFT, PINGPONG, OVERLAP)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_full.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_full.index(i))
        mbarrier.invalidate(v_empty.index(i))
    mbarrier.invalidate(turn.index(0))
    mbarrier.invalidate(turn.index(1))


# --------------------------------------------------------------------------------------- register patch (PTX)
#
# ptxas (CUDA 12.8/13 as shipped with triton 3.6) judges a worker partition's in-flight wgmma pipeline against the
# smallest register count that any setmaxnreg of Triton's warp-specialize switch loop sets, i.e. the idle count of
# the worker warps (Triton: 1.5 * maxnreg - 128 = 120 for 12 warps), not against the partition's own 240. The
# OVERLAP schedule (P V in flight through the softmax) needs ~190 live registers, so it is serialized (C7512) unless
# the idle count is raised. _patch_ptx_regs does that and lowers the default warps' count in the prologue so that
# the CTA's pool (maxnreg * 384 threads) still covers every phase:
#   prologue: 4 default warps at PARENT + 8 idle workers at IDLE <= pool
#   region:   producer at 24 + 2 consumers at CONSUMER_REGS      <= pool (Triton's own allocation)
# Equal-count setmaxnreg (the switch-loop header re-executed at IDLE) is what Triton already emits.

_SETMAXNREG = re.compile(r"^(\s*)setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", re.MULTILINE)


def _patch_ptx_regs(ptx: str, idle: int) -> str:
    """Raise the idle worker register count of a 12-warp (4 default + 8 worker warps) kernel to ``idle``.

    Triton's lowering: worker warps branch from the entry to the switch loop, whose header does
    ``setmaxnreg.dec lowRegs`` (first from maxnreg, then again at lowRegs after each partition returned with its own
    ``dec lowRegs``); the default warps go ``inc 256`` for the prologue and back to 256 after the region. Here the
    worker warps get ``inc idle`` on their way from the entry to the loop, every lowRegs becomes ``idle`` (the
    header's ``dec`` is then an equal-count one, as in Triton's own loop), and the default warps' 256 becomes what
    the pool leaves them. (ptxas accepts the pipelined consumers only with a ``dec`` at the loop header: an
    ``inc idle`` there brings C7512 back.)
    """
    maxnreg = int(re.search(r"^\.maxnreg (\d+)", ptx, re.MULTILINE).group(1))
    pool = maxnreg * 12 * 32
    parent = (pool - idle * 8 * 32) // (4 * 32) // 8 * 8
    assert parent >= 64, f"idle {idle} leaves {parent} registers to the prologue"
    low = (maxnreg - (256 - maxnreg) * 4 // 8) // 8 * 8  # Triton's lowRegs for 4 default + 8 worker warps
    # entry: `setp.lt.u32 %p, %warp, 4; @%p bra DEFAULT; bra.uni WORKERS;`
    entry = re.search(r"setp\.lt\.u32\s+(%p\d+), %r\d+, 4;\s*\n\s*@\1 bra\s+\$\w+;\s*\n(\s*)bra\.uni\s+\$\w+;", ptx)
    assert entry, "warp-specialize entry branch not found"
    direction = "inc" if idle > maxnreg else "dec"
    at = entry.end() - len(entry.group(0).split("\n")[-1])
    ptx = ptx[:at] + f"{entry.group(2)}setmaxnreg.{direction}.sync.aligned.u32 \t{idle};\n" + ptx[at:]
    out, seen_parent = [], False
    for line in ptx.split("\n"):
        m = _SETMAXNREG.match(line)
        if m:
            ind, direction, val = m.group(1), m.group(2), int(m.group(3))
            if val == 256:  # default warps: prologue (from maxnreg), then back from the producer's count
                direction = ("inc" if parent > maxnreg else "dec") if not seen_parent else "inc"
                seen_parent = True
                line = f"{ind}setmaxnreg.{direction}.sync.aligned.u32 \t{parent};"
            elif val == low:
                line = f"{ind}setmaxnreg.{direction}.sync.aligned.u32 \t{idle};"
        out.append(line)
    return "\n".join(out)


def _ptx_patch_key(idle: int) -> int:
    """IDLE_REGS constexpr: idle count and a checksum of the patch code, so that a changed patch recompiles."""
    if not idle:
        return 0
    return idle * 2**32 + zlib.crc32(inspect.getsource(_patch_ptx_regs).encode())


@contextlib.contextmanager
def _ptx_patch_hook(idle: int):
    """Install a stages hook that patches this kernel's PTX (and nothing else) while compiling."""
    from triton import knobs

    prev = knobs.runtime.add_stages_inspection_hook

    def hook(backend, stages, options, language, capability):
        if prev is not None:
            prev(backend, stages, options, language, capability)
        make_ptx = stages["ptx"]

        def ptx_stage(src, metadata):
            text = make_ptx(src, metadata)
            if idle and ".entry _attn_fwd_ws_kernel" in text:
                text = _patch_ptx_regs(text, idle)
            return text

        stages["ptx"] = ptx_stage

    knobs.runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = prev


SCHEDULES = {  # name -> (PINGPONG, OVERLAP); OVERLAP 1 and 2 need the idle-register PTX patch
    "pingpong": (True, 0),            # FA3 ping-pong only: compiles clean without any patch
    "pingpong_overlap": (True, 1),    # + intra-warpgroup overlap (P_j V_j in flight through softmax(S_{j+1}))
    "pingpong_lookahead": (True, 2),  # + FA3 look-ahead (S_{j+1} and P_{j-1} V_{j-1} in flight over softmax(S_j))
    "overlap": (False, 1),            # intra-warpgroup overlap, consumers not alternating
    "lookahead": (False, 2),
    "plain": (False, 0),              # warp specialization alone
}


def default_config(head_dim: int, causal: bool) -> dict:
    """BLOCK_M 128 (two consumer warpgroups of 64 rows), one CTA per SM (12 warps, 168 registers at launch).

    idle_regs: the smallest idle count that removed C7512 for the overlap schedules in compile_sm90 sweeps (192 at
    D <= 128, 208 at D 256, causal with LSE the largest), plus 8 of margin.
    """
    if head_dim <= 128:
        return {"block_n": 128, "stages": 2, "consumer_regs": 240, "idle_regs": 200, "schedule": "pingpong"}
    return {"block_n": 64, "stages": 2, "consumer_regs": 240, "idle_regs": 216, "schedule": "pingpong"}


def attention_forward(q, k, v, *, scale: float, causal: bool = False, q_descale=None, k_descale=None,
                      v_descale=None, return_lse: bool = False, block_m=None, block_n=None, stages=None, out=None,
                      schedule=None, consumer_regs=None, idle_regs=None):
    """fp8 attention forward on Hopper, warp-specialized (see the module docstring for shapes, dtypes, layouts).

    Same arguments as ``attention_forward.attention_forward`` (block_m must be None or 128) plus ``schedule``
    (a key of SCHEDULES), ``consumer_regs`` and ``idle_regs`` (the PTX register patch; 0 disables it).
    Returns (out bf16 (B, Mq, Hq, D), lse float32 (B, Hq, Mq) natural log, or None).
    """
    assert block_m in (None, 128), "BLOCK_M is 128 (two consumer warpgroups of 64 rows)"
    cfg = default_config(q.shape[3], causal)
    BN = block_n or cfg["block_n"]
    ST = stages or cfg["stages"]
    assert ST >= 2, "the K/V rings need at least 2 stages"
    pingpong, overlap = SCHEDULES[schedule or cfg["schedule"]]
    idle = (cfg["idle_regs"] if idle_regs is None else idle_regs) if overlap else 0
    L = prepare_launch(q, k, v, q_descale, k_descale, v_descale, return_lse, out)
    if L.vt is None:
        return L.out, L.lse
    with _ptx_patch_hook(idle):
        _attn_fwd_ws_kernel[(triton.cdiv(L.Mq, 128), L.B * L.Hq)](
            *kernel_args(q, k, L, scale),
            HEAD_D=L.D, BLOCK_N=BN, STAGES=ST, CAUSAL=causal, WRITE_LSE=return_lse, P_SHIFT=8,
            PINGPONG=pingpong, OVERLAP=overlap, CONSUMER_REGS=consumer_regs or cfg["consumer_regs"],
            IDLE_REGS=_ptx_patch_key(idle), num_warps=4,
        )
    return L.out, L.lse


def compile_sm90(head_dim=128, block_n=None, stages=None, causal=False, write_lse=False, schedule=None,
                 consumer_regs=None, idle_regs=None):
    """Compile the kernel ahead of time for sm90 (no GPU needed); returns the CompiledKernel (asm: ptx, cubin).

    Same configuration and PTX patch as ``attention_forward``; ``ptxas -v`` on asm["ptx"] gives the register and
    wgmma-serialization report.
    """
    cfg = default_config(head_dim, causal)
    pingpong, overlap = SCHEDULES[schedule or cfg["schedule"]]
    idle = (cfg["idle_regs"] if idle_regs is None else idle_regs) if overlap else 0
    const = {"HEAD_D": head_dim, "BLOCK_N": block_n or cfg["block_n"], "STAGES": stages or cfg["stages"],
             "CAUSAL": causal, "WRITE_LSE": write_lse, "P_SHIFT": 8, "PINGPONG": pingpong, "OVERLAP": overlap,
             "CONSUMER_REGS": consumer_regs or cfg["consumer_regs"], "IDLE_REGS": _ptx_patch_key(idle),
             "num_warps": 4}
    with _ptx_patch_hook(idle):
        return compile_for_sm90(_attn_fwd_ws_kernel, const, 4)
