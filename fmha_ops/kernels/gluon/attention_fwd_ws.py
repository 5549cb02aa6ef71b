"""Warp-specialized 8-bit attention forward for Hopper (sm90) in Gluon: a TMA producer and one to three consumer
warpgroups that ping-pong their softmax against each other's wgmmas.

Shapes, dtypes, layouts: those of ``kernels/gluon/attention_common.py`` (q, k, v (B, M, H, D) fp8 e4m3fn with the
last dim contiguous, descales per tensor or per (batch, kv head), bf16 out or fp8 out in v's units, float32
natural-log LSE (B, Hq, Mq), bottom-right causal, any Mq / Mk); i8fp8: q and k int8 instead (QK^T on the s8
wgmma, int32 accumulators; ``QK_INT8``, the same kernel body), v fp8.

A tile is ``CONSUMERS * WG_ROWS`` query rows of one (batch, query head); tiles are numbered with a head's row
blocks consecutive (``_tile_coords``). CTA p runs tiles p, p + grid, ..: with a grid of one CTA per tile each runs
one, with a persistent grid (``WsFwdConfig.persistent``: ``ctas_per_sm()`` CTAs per SM) each runs several and the
rings, turns and Q buffers run on from one tile to the next; with ``WsFwdConfig.dynamic`` a persistent CTA runs
tile p and then those its producer takes from a launch-wide atomic counter as it gets through them. q, k, v (or V^T), out are read and written through
host TMA descriptors of the whole 4-D tensors ([1, rows, 1, D] boxes; V^T [1, 1, D, keys]), so a CTA changes
(batch, head) by its coordinates alone.

* the producer partition loads each consumer's Q tile once that consumer released the previous one, then streams
  K and V^T tiles through ``STAGES``-deep shared-memory rings (TMA; ``*_ready`` mbarriers count the bytes,
  ``*_empty`` mbarriers take one arrival per consumer, so every consumer reads every tile). V^T comes either from
  ``transpose_v`` (a separate launch; the producer is one warp) or, with ``v_transpose``, from v itself: the
  producer is a warpgroup that loads raw key x channel tiles and writes them transposed (and, with ``key_order``,
  with the keys of each 16-key group in the S accumulator's order) into the V^T ring;
* each consumer partition (one warpgroup, BLOCK_M = 64 rows) runs, per key tile j: issue S_{j+1} = Q K_{j+1}^T
  and O += P_j V_j as async wgmmas, wait for S_{j+1} only, release its K slot, softmax(S_{j+1}) while P_j V_j
  still runs, wait for it, release its V slot, rescale O (the intra-warpgroup overlap); it releases its Q tile
  after the tile's last S, and stores O by TMA, waiting for that store only before it writes its output buffer
  again (the next tile's epilogue);
* with two or three consumers, "turn" mbarriers order the wgmma issue: consumer c issues its pair, then hands
  the turn to consumer c + 1 (round robin), so one warpgroup's softmax runs under the others' GEMMs (ping-pong);
  with ``WsFwdConfig.free_issue`` they issue without turns; with ``WsFwdConfig.early_p8`` P's fp8 conversion
  comes at the end of the previous iteration, out of the turn.

Both consumers walk the same key tiles (the CTA's last row bounds them under causal masking; a consumer whose
rows see fewer keys masks the extra tile), so the rings and turns stay in step. Softmax in exp2 with
scale * q_descale * k_descale folded into one multiplier; P is scaled by 2**P_SHIFT before the fp8 cast. Each
thread reduces its own scores of a row first (both parts of a 192-key tile), so a tile's row max costs one
cross-lane reduction, and keeps its share of the row sum until the epilogue adds the four lanes of a row; with
``WsFwdConfig.row_sum_mma`` the row sums come from the tensor cores instead (P times a tile of ones beside P V).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..attention_host import fp8_forward_args
from ..tile_counter import tile_counters
from ..softmax import HIDDEN_INT_SCORE, LOG2E, MIN_QK_SCALE, hide_keys, natural_lse, p_shift, row_inverse
from ..triton.launch import cdiv, host_descriptor, launch
from ..triton.transpose_v import transpose_v
from .attention_common import (
    acc_layout,
    fp8_tile_layout,
    INT_OFF,
    head_descales,
    int_scores,
    key_tiles,
    out_tile_layout,
    p_operand_layout,
    unmasked_end,
)

HEAD_DIMS = (64, 128, 256)
_P_SHIFT = p_shift(torch.float8_e4m3fn)
#: rows of one consumer warpgroup (one m64 wgmma)
WG_ROWS = gl.constexpr(64)
#: warps of one consumer partition (a warpgroup)
WG_WARPS = gl.constexpr(4)
#: registers of the producer warp: the hardware minimum (it only issues TMA and waits on mbarriers)
PRODUCER_REGS = gl.constexpr(24)
#: channels of one raw V box (keys x V_CHUNK) that a transposing producer moves at a time
V_CHUNK = gl.constexpr(64)
#: slots of the tile ring (``WsFwdConfig.dynamic``): the producer may publish the next tile while the consumers
#: have yet to read the current one
TILE_SLOTS = gl.constexpr(2)
#: columns of the tile of ones that P's row sums are taken with on the tensor cores (``WsFwdConfig.row_sum_mma``):
#: the narrowest fp8 wgmma, m64n8k32
SUM_N = gl.constexpr(8)
#: e4m3 1.0 as a byte (exponent 7 = the bias, mantissa 0): the tile of ones is stored as these bytes. A float
#: splat converted in the kernel (``gl.full(.., 1.0, gl.float32).to(gl.float8e4nv)``) compiles (ptxas, Triton 3.6)
#: to ``F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R18, R18, R18, R1``: the upper half of each stored word comes
#: from R1 (the stack pointer), not a second pair of ones (an earlier try filled its tile so; its sums came out
#: 12-17x too large on the H100)
E4M3_ONE = gl.constexpr(0x38)


def _box_layout(rows, cols, dtype, channels_last):
    """(shape, NVMMA layout) of the 4-D TMA box that one [rows, cols] shared tile is: [1, rows, 1, cols] of a
    (B, M, H, D) tensor (``channels_last``) or [1, 1, rows, cols] of V^T (B, H, D, L). The host descriptor and
    the kernel's view of the tile take the same layout (the 2-D tile's swizzle, leading unit dims added)."""
    shape = [1, rows, 1, cols] if channels_last else [1, 1, rows, cols]
    return shape, gl.NVMMASharedLayout.get_default_for(shape, dtype)


box_layout = gluon.constexpr_function(_box_layout)


@gluon.jit
def _box(tile, CHANNELS_LAST: gl.constexpr = True):
    """A 2-D shared tile seen as the 4-D box of its host descriptor (``box_layout``): the same bytes."""
    box: gl.constexpr = box_layout(tile.shape[0], tile.shape[1], tile.dtype, CHANNELS_LAST)
    return tile._reinterpret(tile.dtype, box[0], box[1])


@gluon.jit
def _load_k(k_desc, kb_desc, k_smem, kb_smem, k_ready, k_empty, kv, b, hkv, n0, BLOCK_A: gl.constexpr,
            BLOCK_B: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """Keys [n0, n0 + BLOCK_A + BLOCK_B) of (b, hkv) into ring slot ``kv % STAGES`` (the last ``BLOCK_B`` into
    ``kb_smem``) once every consumer freed it (a fresh mbarrier has completed the phase before its first, so the
    first round passes at once)."""
    slot = kv % STAGES
    mbarrier.wait(k_empty.index(slot), ((kv // STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(slot), (BLOCK_A + BLOCK_B) * HEAD_D)
    tma.async_copy_global_to_shared(k_desc, [b, n0, hkv, 0], k_ready.index(slot), _box(k_smem.index(slot)))
    if BLOCK_B > 0:
        tma.async_copy_global_to_shared(kb_desc, [b, n0 + BLOCK_A, hkv, 0], k_ready.index(slot),
                                        _box(kb_smem.index(slot)))


@gluon.jit
def _load_v_rows(v_desc, v_raw, raw_ready, kv, b, hkv, n0, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                 STAGES: gl.constexpr):
    """Keys [n0, n0 + BLOCK_N) of v (as stored: keys x channels) into raw slot ``kv % STAGES``, in
    ``V_CHUNK``-channel boxes."""
    slot = kv % STAGES
    mbarrier.expect(raw_ready.index(slot), BLOCK_N * HEAD_D)
    for c in gl.static_range(HEAD_D // V_CHUNK):
        tma.async_copy_global_to_shared(v_desc, [b, n0, hkv, c * V_CHUNK], raw_ready.index(slot),
                                        _box(v_raw.index(slot * (HEAD_D // V_CHUNK) + c)))


@gluon.jit
def _transpose_v_tile(v_raw, v_smem, raw_ready, v_ready, v_empty, kv, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                      STAGES: gl.constexpr, KEY_ORDER: gl.constexpr, num_warps: gl.constexpr):
    """V tile from raw slot ``kv % STAGES`` (keys x channels) into V^T slot ``kv % STAGES`` (channels x keys,
    the K-major B operand of the fp8 PV wgmma), through registers, once every consumer freed that slot.

    ``KEY_ORDER``: within each 16-key group key 8 g + 2 c + e goes to column 4 c + 2 g + e (the order of
    ``transpose_v(key_order=True)``); each thread holds 16 whole keys, so the reorder stays in its registers."""
    slot = kv % STAGES
    phase = (kv // STAGES) & 1
    # each thread moves 16 keys x 4 channels: 4-byte rows in, 16-byte key runs out
    raw_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[16, 4], threads_per_warp=[2, 16],
                                                warps_per_cta=[num_warps, 1], order=[0, 1])
    mbarrier.wait(raw_ready.index(slot), phase)
    mbarrier.wait(v_empty.index(slot), phase ^ 1)
    for c in gl.static_range(HEAD_D // V_CHUNK):
        rows = v_raw.index(slot * (HEAD_D // V_CHUNK) + c).load(raw_layout)
        if KEY_ORDER:
            rows = rows.reshape([BLOCK_N // 16, 2, 4, 2, V_CHUNK]).permute((0, 2, 1, 3, 4)).reshape([BLOCK_N, V_CHUNK])
        v_smem.index(slot).slice(c * V_CHUNK, V_CHUNK, dim=0).store(gl.permute(rows, (1, 0)))
    # the PV wgmma reads V^T through the async proxy; the next TMA load reuses the raw slot
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(v_ready.index(slot), count=1)


@gluon.jit
def ones_tile(KEYS: gl.constexpr):
    """A [``SUM_N``, KEYS] fp8 tile of ones in its own shared allocation (``fp8_tile_layout``'s swizzle, as a
    TMA-loaded K-major B operand): the B operand of P's row-sum wgmma. Written by the calling warps as
    ``E4M3_ONE`` bytes and fenced for the wgmmas' async-proxy reads; a warp of another partition may read it once
    a barrier orders it after this call (``warp_specialize``'s start does)."""
    tile = gl.allocate_shared_memory(gl.float8e4nv, [SUM_N, KEYS], fp8_tile_layout(SUM_N, KEYS))
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
    tile.store(gl.full([SUM_N, KEYS], E4M3_ONE, gl.int8, layout).to(gl.float8e4nv, bitcast=True))
    fence_async_shared()
    return tile


@gluon.jit
def _tile_coords(t, n_m, n_total, Hq, GROUP, CAUSAL: gl.constexpr, HEAD_SECTION: gl.constexpr):
    """(b, hq, hkv, m-block) of tile ``t``: the m-blocks of one (batch, head) are consecutive tiles (CTAs working
    at once share K / V through L2); under causal masking the longest rows come first, within each (batch, head)
    or, with ``HEAD_SECTION`` > 0, across each section of that many (batch, head) pairs (the heaviest m-block of
    every pair of the section, then the next one down)."""
    if CAUSAL and HEAD_SECTION > 0:
        per = HEAD_SECTION * n_m
        section = t // per
        heads = gl.minimum(n_total // n_m - section * HEAD_SECTION, HEAD_SECTION)
        r = t - section * per
        pid_m = n_m - 1 - r // heads
        bh = section * HEAD_SECTION + r % heads
    else:
        bh = t // n_m
        pid_m = t % n_m
        if CAUSAL:
            pid_m = n_m - 1 - pid_m
    hq = bh % Hq
    return bh // Hq, hq, hq // GROUP, pid_m


@gluon.jit
def _load_tile(t, kv, i, ring, n_m, n_total, Mq, Mk, Hq, GROUP, BLOCK_N: gl.constexpr, BLOCK_B: gl.constexpr,
               HEAD_D: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
               V_TRANSPOSE: gl.constexpr, KEY_ORDER: gl.constexpr, HEAD_SECTION: gl.constexpr):
    """Tile ``t``, the ``i``-th of this CTA, its key tiles from ring position ``kv``: its Q tiles once the
    consumers are done with the previous ones, then K_j, V_j for every key tile, each into its ring slot once all
    consumers freed it. ``ring``: the descriptors, shared buffers and barriers (``_producer``). Returns the key
    tiles loaded.

    ``V_TRANSPOSE``: v arrives as stored (keys x channels) and this partition (a warpgroup) transposes each tile
    in shared memory, loading tile j + 1 before it transposes tile j; otherwise V^T tiles arrive by TMA.
    ``BLOCK_B`` > 0 (a key tile in two parts, not with ``V_TRANSPOSE``): the last ``BLOCK_B`` keys of each K and
    V^T tile go to ``kb_smem`` / ``vb_smem`` through their own descriptors, under the same barriers."""
    (q_desc, k_desc, kb_desc, v_desc, vb_desc, q_smem, k_smem, kb_smem, v_smem, vb_smem, v_raw, q_bars, q_empty,
     k_ready, v_ready, k_empty, v_empty, raw_ready) = ring
    BLOCK_M: gl.constexpr = CONSUMERS * WG_ROWS
    BLOCK_A: gl.constexpr = BLOCK_N - BLOCK_B
    b, hq, hkv, pid_m = _tile_coords(t, n_m, n_total, Hq, GROUP, CAUSAL, HEAD_SECTION)
    m0 = pid_m * BLOCK_M
    n_tiles = key_tiles(m0, BLOCK_M, Mq, Mk, BLOCK_N, CAUSAL)
    for c in gl.static_range(CONSUMERS):
        mbarrier.wait(q_empty.index(c), (i & 1) ^ 1)
        mbarrier.expect(q_bars.index(c), WG_ROWS * HEAD_D)
        tma.async_copy_global_to_shared(q_desc, [b, m0 + c * WG_ROWS, hq, 0], q_bars.index(c),
                                        _box(q_smem.index(c)))
    if V_TRANSPOSE:
        _load_k(k_desc, kb_desc, k_smem, kb_smem, k_ready, k_empty, kv, b, hkv, 0, BLOCK_A, BLOCK_B, HEAD_D,
                STAGES)
        _load_v_rows(v_desc, v_raw, raw_ready, kv, b, hkv, 0, BLOCK_N, HEAD_D, STAGES)
        for j in range(n_tiles):
            if j + 1 < n_tiles:
                _load_k(k_desc, kb_desc, k_smem, kb_smem, k_ready, k_empty, kv + j + 1, b, hkv,
                        (j + 1) * BLOCK_N, BLOCK_A, BLOCK_B, HEAD_D, STAGES)
                _load_v_rows(v_desc, v_raw, raw_ready, kv + j + 1, b, hkv, (j + 1) * BLOCK_N, BLOCK_N, HEAD_D,
                             STAGES)
            _transpose_v_tile(v_raw, v_smem, raw_ready, v_ready, v_empty, kv + j, BLOCK_N, HEAD_D, STAGES,
                              KEY_ORDER, gl.num_warps())
    else:
        for j in range(n_tiles):
            _load_k(k_desc, kb_desc, k_smem, kb_smem, k_ready, k_empty, kv + j, b, hkv, j * BLOCK_N, BLOCK_A,
                    BLOCK_B, HEAD_D, STAGES)
            slot = (kv + j) % STAGES
            mbarrier.wait(v_empty.index(slot), (((kv + j) // STAGES) & 1) ^ 1)
            mbarrier.expect(v_ready.index(slot), BLOCK_N * HEAD_D)
            tma.async_copy_global_to_shared(v_desc, [b, hkv, 0, j * BLOCK_N], v_ready.index(slot),
                                            _box(v_smem.index(slot), False))
            if BLOCK_B > 0:
                tma.async_copy_global_to_shared(vb_desc, [b, hkv, 0, j * BLOCK_N + BLOCK_A], v_ready.index(slot),
                                                _box(vb_smem.index(slot), False))
    return n_tiles


@gluon.jit
def _publish_tile(sched, t, i):
    """Hand tile ``t``, this CTA's ``i``-th (``t`` >= the tile count: no more), to the consumers through slot
    ``i % TILE_SLOTS`` of the tile ring once every consumer has read that slot's previous tile. The mbarrier
    arrive releases the shared store at CTA scope and the consumers' wait acquires it."""
    tile_smem, tile_ready, tile_empty = sched
    slot = i % TILE_SLOTS
    mbarrier.wait(tile_empty.index(slot), ((i // TILE_SLOTS) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    tile_smem.index(slot).store(gl.full([1], t, gl.int32, layout))
    mbarrier.arrive(tile_ready.index(slot), count=1)


@gluon.jit
def _take_tile(sched, i):
    """This CTA's ``i``-th tile as ``_publish_tile`` handed it over; frees its slot for the producer."""
    tile_smem, tile_ready, tile_empty = sched
    slot = i % TILE_SLOTS
    mbarrier.wait(tile_ready.index(slot), (i // TILE_SLOTS) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    t = gl.max(tile_smem.index(slot).load(layout), 0)
    mbarrier.arrive(tile_empty.index(slot), count=1)
    return t


@gluon.jit
def _retire(Counter):
    """Count this CTA out of the launch (``Counter[1]``); the last one resets both counters to 0 for the next
    launch. Memory order: a CTA's last take from ``Counter[0]`` happens before its count-out (one elected thread
    issues each scalar atomic, and the take's result reaches the partition through shared memory and a barrier
    before the count-out is issued); the count-outs are acq_rel read-modify-writes of one address, so the last
    one acquires every other CTA's release and its reset comes after every take of this launch. The next launch
    on the stream starts after this one has ended and sees the zeros."""
    done = gl.atomic_add(Counter + 1, 1, sem="acq_rel")
    if done == gl.num_programs(0) - 1:
        gl.atomic_xchg(Counter, 0, sem="relaxed")
        gl.atomic_xchg(Counter + 1, 0, sem="relaxed")


@gluon.jit
def _producer(q_desc, k_desc, kb_desc, v_desc, vb_desc, q_smem, k_smem, kb_smem, v_smem, vb_smem, v_raw, q_bars,
              q_empty, k_ready, v_ready, k_empty, v_empty, raw_ready, sched, Counter, n_m, n_total, Mq, Mk, Hq,
              GROUP, BLOCK_N: gl.constexpr, BLOCK_B: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
              CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, V_TRANSPOSE: gl.constexpr, KEY_ORDER: gl.constexpr,
              HEAD_SECTION: gl.constexpr, DYNAMIC: gl.constexpr):
    """The loads of this CTA's tiles (``_load_tile``; ``kv`` counts key tiles over the CTA's tiles: the rings run
    on across tiles, so the next tile's loads overlap this one's last GEMMs).

    Which tiles: ``program_id``, + ``num_programs``, .. or, with ``DYNAMIC``, ``program_id`` first and then
    ``num_programs`` + a take from the launch's tile counter ``Counter[0]`` (a relaxed atomic add: only its
    uniqueness matters), taken once the current tile's loads are issued (the consumers still have the ring's
    tiles to work through) and handed to the consumers through the tile ring ``sched`` (``_publish_tile``)."""
    ring = (q_desc, k_desc, kb_desc, v_desc, vb_desc, q_smem, k_smem, kb_smem, v_smem, vb_smem, v_raw, q_bars,
            q_empty, k_ready, v_ready, k_empty, v_empty, raw_ready)
    kv = 0
    i = 0
    t = gl.program_id(0)
    if DYNAMIC:
        _publish_tile(sched, t, i)
    while t < n_total:
        kv += _load_tile(t, kv, i, ring, n_m, n_total, Mq, Mk, Hq, GROUP, BLOCK_N, BLOCK_B, HEAD_D, STAGES,
                         CONSUMERS, CAUSAL, V_TRANSPOSE, KEY_ORDER, HEAD_SECTION)
        i += 1
        if DYNAMIC:
            t = gl.num_programs(0) + gl.atomic_add(Counter, 1, sem="relaxed")
            _publish_tile(sched, t, i)
        else:
            t += gl.num_programs(0)
    if DYNAMIC:
        _retire(Counter)


@gluon.jit
def _take_turn(turn_bars, turn, C: gl.constexpr, CONSUMERS: gl.constexpr, FREE_ISSUE: gl.constexpr):
    """Wait until consumer ``C`` may issue its ``turn``-th wgmma group: consumers take turns in the order 0, 1, ..
    (a fresh mbarrier counts as having completed the phase before its first, so consumer 0 starts at once); with
    ``FREE_ISSUE`` they do not take turns (``WsFwdConfig.free_issue``)."""
    if CONSUMERS > 1 and not FREE_ISSUE:
        mbarrier.wait(turn_bars.index(C), (turn & 1) ^ (1 if C == 0 else 0))


@gluon.jit
def _pass_turn(turn_bars, C: gl.constexpr, CONSUMERS: gl.constexpr, FREE_ISSUE: gl.constexpr):
    """Hand the tensor cores to the next consumer once this one's wgmmas are issued (not with ``FREE_ISSUE``)."""
    if CONSUMERS > 1 and not FREE_ISSUE:
        mbarrier.arrive(turn_bars.index((C + 1) % CONSUMERS), count=1)


@gluon.jit
def _pv_operand(p, p_layout: gl.constexpr, BLOCK_N: gl.constexpr, KEY_ORDER: gl.constexpr):
    """P (fp32, S accumulator layout) as the fp8 A operand of the PV wgmma. With ``KEY_ORDER`` V^T's keys are
    stored in the accumulator's order within each 32-key group (``transpose_v(key_order=True)``): operand slot
    16h + 4c + 2g + e holds key 16h + 8g + 2c + e, exactly the keys a thread's accumulator registers hold, so
    the conversion moves no data between threads."""
    return _pv_arrange(p.to(gl.float8e4nv), p_layout, BLOCK_N, KEY_ORDER)


@gluon.jit
def _pv_arrange(p8, p_layout: gl.constexpr, BLOCK_N: gl.constexpr, KEY_ORDER: gl.constexpr):
    """P (fp8, or fp32 to be packed by ``_p8_packed``; S accumulator layout) in the A operand layout of the PV wgmma,
    keys in ``KEY_ORDER``'s order (``_pv_operand``)."""
    if KEY_ORDER:
        rows: gl.constexpr = p8.shape[0]
        p8 = p8.reshape([rows, BLOCK_N // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([rows, BLOCK_N])
    return gl.convert_layout(p8, p_layout)


@gluon.jit
def _p8_packed(p):
    """P (fp32, any layout) as fp8 with each 4 consecutive elements of a thread packed into the first one's register
    (the other three zero): a float32 tensor, so a loop carries P's fp8 bytes in a quarter of P's registers (an fp8
    tensor is carried as one register per byte). ``_p8_unpacked`` inverts it."""
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $5, $4; cvt.rn.satfinite.e4m3x2.f32 hi, $7, $6; "
        "mov.b32 $0, {lo, hi}; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }",
        "=r,=r,=r,=r,r,r,r,r", [p], dtype=gl.float32, is_pure=True, pack=4)


@gluon.jit
def _p8_unpacked(x):
    """The fp8 tensor that ``_p8_packed`` packed into ``x``."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [x], dtype=gl.float8e4nv, is_pure=True,
                                     pack=4)


@gluon.jit
def _p_carried(p, p_layout: gl.constexpr, BLOCK_N: gl.constexpr, KEY_ORDER: gl.constexpr, EARLY_P8: gl.constexpr):
    """What the key loop carries of P (fp32, S accumulator layout) to its next P V: with ``EARLY_P8`` the fp8
    operand, converted now (outside the turn) and packed four to a register (``_p8_packed``); else P itself."""
    if EARLY_P8:
        carried = _p8_packed(_pv_arrange(p, p_layout, BLOCK_N, KEY_ORDER))
    else:
        carried = p
    return carried


@gluon.jit
def _p_operand(carried, p_layout: gl.constexpr, BLOCK_N: gl.constexpr, KEY_ORDER: gl.constexpr,
               EARLY_P8: gl.constexpr):
    """The fp8 A operand of the P V wgmma from what ``_p_carried`` kept."""
    if EARLY_P8:
        p8 = _p8_unpacked(carried)
    else:
        p8 = _pv_operand(carried, p_layout, BLOCK_N, KEY_ORDER)
    return p8


@gluon.jit
def _quad_partials(x, MAX: gl.constexpr):
    """Row maxima (``MAX``) or sums of ``x`` ([64, N], wgmma accumulator layout) within each thread: [64, 4], the
    four lanes that share a row on the second axis. A thread holds keys 8j + 2 (lane % 4) + e of its rows, so the
    reshape moves no data; only a reduction of the result over its second axis shuffles between lanes. Integer
    maxima run as one chain over a thread's keys of a row (ptxas fuses pairs of them into VIMNMX3); float maxima
    pair by pair first, which ran faster than one chain for fp8 (H100, CUDA graphs: 565 against 545 TFLOP/s at
    4x16x4096 D64, 755 against 731 at 3x24/8x3000 causal)."""
    y = x.reshape([x.shape[0], x.shape[1] // 8, 4, 2])
    if MAX and x.dtype.is_int():
        part = gl.max(y.permute((0, 2, 1, 3)).reshape([x.shape[0], 4, x.shape[1] // 4]), 2)
    elif MAX:
        part = gl.max(gl.max(y, 3), 1)
    else:
        part = gl.sum(gl.sum(y, 3), 1)
    return part


@gluon.jit
def _tile_softmax_step(s_a, s_b, m_i, l_q, qk_scale, P_SHIFT: gl.constexpr, OFF: gl.constexpr,
                       MASKED: gl.constexpr, BLOCK_B: gl.constexpr, SUM_ROWS: gl.constexpr):
    """``softmax_step`` over one S tile, in two parts when ``BLOCK_B`` > 0 (``s_b`` is ignored otherwise): each
    thread takes the max over its scores of both parts first, so one cross-lane reduction per row serves the whole
    tile, and the row sums stay per lane (``l_q``, [64, 4] as ``_quad_partials`` gives; the epilogue adds the
    four), so the sums cost no shuffles at all: 4 shuffles per tile and thread instead of 16 for 192-key tiles.
    Int32 scores (``OFF`` > 0, the int8 path) take their row max as integers, where ptxas fuses two maxima into
    one VIMNMX3 (FMNMX has no three-input form on sm90), and are read as float (``int_scores``) after it.
    ``SUM_ROWS`` False leaves ``l_q`` as it is (the row sums come from the tensor cores: ``_row_sums``).
    Returns (p_a, p_b, m, l_q, alpha)."""
    a_row: gl.constexpr = gl.SliceLayout(1, s_a.type.layout)
    q_layout: gl.constexpr = l_q.type.layout
    qk_scale = gl.maximum(qk_scale, MIN_QK_SCALE)
    part = _quad_partials(s_a, True)
    if BLOCK_B > 0:
        part = gl.maximum(part, gl.convert_layout(_quad_partials(s_b, True), part.type.layout))
    row_max = gl.convert_layout(gl.max(part, 1), a_row)
    if OFF > 0:
        row_max = gl.where(row_max == HIDDEN_INT_SCORE, float("-inf"), row_max.to(gl.float32))
        s_a = int_scores(s_a)
        if BLOCK_B > 0:
            s_b = int_scores(s_b)
    m_new = gl.maximum(m_i, row_max * qk_scale)
    if MASKED:  # rows that have seen no key yet: avoid inf - inf
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    bias = m_sub + (OFF * qk_scale - P_SHIFT)
    p_a = gl.exp2(s_a * qk_scale - gl.expand_dims(bias, 1))
    if SUM_ROWS:
        sums = gl.convert_layout(_quad_partials(p_a, False), q_layout)
    if BLOCK_B > 0:
        b_row: gl.constexpr = gl.SliceLayout(1, s_b.type.layout)
        p_b = gl.exp2(s_b * qk_scale - gl.expand_dims(gl.convert_layout(bias, b_row), 1))
        if SUM_ROWS:
            sums = sums + gl.convert_layout(_quad_partials(p_b, False), q_layout)
    else:
        p_b = p_a
    alpha = gl.exp2(m_i - m_sub)
    if SUM_ROWS:
        l_q = l_q * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, q_layout)), 1) + sums
    return p_a, p_b, m_new, l_q, alpha


@gluon.jit
def _tile_softmax(s_a, s_b, m_i, l_q, qk_scale, start_n, full_end, seqlen_k, hi, offs_m,
                  CAUSAL: gl.constexpr, P_SHIFT: gl.constexpr, BLOCK_A: gl.constexpr, BLOCK_B: gl.constexpr,
                  OFF: gl.constexpr, SUM_ROWS: gl.constexpr):
    """``_tile_softmax_step`` of the S tile of keys [start_n, + BLOCK_A) in ``s_a`` ([64, BLOCK_A]) and, when
    ``BLOCK_B`` > 0, the next ``BLOCK_B`` in ``s_b``, with the key / causal masks only on tiles at or past
    ``full_end``. The whole step sits in each branch: a step after the branches' join is scheduled after the
    wait for P V, which then no longer overlaps the softmax. Returns (p_a, p_b, m, l_q, alpha)."""
    if start_n >= full_end:
        a_layout: gl.constexpr = acc_layout(WG_WARPS, BLOCK_A)
        cols_a = start_n + gl.arange(0, BLOCK_A, layout=gl.SliceLayout(0, a_layout))
        s_a = hide_keys(s_a, offs_m, cols_a, seqlen_k, 0, hi, False, CAUSAL)
        if BLOCK_B > 0:
            b_layout: gl.constexpr = acc_layout(WG_WARPS, BLOCK_B)
            cols_b = start_n + BLOCK_A + gl.arange(0, BLOCK_B, layout=gl.SliceLayout(0, b_layout))
            s_b = hide_keys(s_b, gl.convert_layout(offs_m, gl.SliceLayout(1, b_layout)), cols_b, seqlen_k, 0, hi,
                            False, CAUSAL)
        p_a, p_b, m_i, l_q, alpha = _tile_softmax_step(s_a, s_b, m_i, l_q, qk_scale, P_SHIFT, OFF, True, BLOCK_B,
                                                       SUM_ROWS)
    else:
        p_a, p_b, m_i, l_q, alpha = _tile_softmax_step(s_a, s_b, m_i, l_q, qk_scale, P_SHIFT, OFF, False, BLOCK_B,
                                                       SUM_ROWS)
    return p_a, p_b, m_i, l_q, alpha


@gluon.jit
def _row_sums(p8, p8_b, ones_smem, onesb_smem, acc_l, BLOCK_B: gl.constexpr):
    """Issue acc_l += P times ones as async wgmmas (m64n8k32, A = the fp8 P V operand ``p8``, and ``p8_b`` for a two-part
    tile's second part, from registers; B = ``ones_tile``): every column of acc_l ([64, ``SUM_N``] float32) gains
    each row's sum of P. Returns the token of the last."""
    sum_p: gl.constexpr = p_operand_layout(WG_WARPS, SUM_N)
    tok = warpgroup_mma(gl.convert_layout(p8, sum_p), ones_smem.permute((1, 0)), acc_l, is_async=True)
    if BLOCK_B > 0:
        tok = warpgroup_mma(gl.convert_layout(p8_b, sum_p), onesb_smem.permute((1, 0)), tok, is_async=True)
    return tok


@gluon.jit
def _consumer_tile(C: gl.constexpr, q_smem, k_smem, kb_smem, v_smem, vb_smem, ones_smem, onesb_smem, q_bars,
                   q_empty, k_ready, v_ready, k_empty, v_empty, turn_bars, qk_scale, m0, n_tiles, kv, turn, i, Mq,
                   Mk, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_B: gl.constexpr, STAGES: gl.constexpr,
                   CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, P_SHIFT: gl.constexpr, KEY_ORDER: gl.constexpr,
                   QK_INT8: gl.constexpr, FREE_ISSUE: gl.constexpr, EARLY_P8: gl.constexpr,
                   ROW_SUM_MMA: gl.constexpr):
    """The online softmax of rows ``m0 + C * WG_ROWS ..`` over their ``n_tiles`` key tiles, the ``i``-th tile of
    this CTA; ``kv`` and ``turn`` are the ring position and the turn count it starts at. ``QK_INT8``: int8 q / k,
    S accumulated in int32 (s8 wgmma), its row max taken on integers, then read as ``int_scores``. ``BLOCK_B``
    > 0: each key tile is two parts, ``BLOCK_N - BLOCK_B`` keys then ``BLOCK_B`` (tiles of 192 keys as 128 + 64:
    Gluon tensors are powers of two), two S wgmmas and two P V wgmmas per tile, one softmax over both.
    ``ROW_SUM_MMA``: P's row sums accumulate on the tensor cores (``_row_sums``, issued after each P V, waited for
    and rescaled by alpha with it, as the O accumulator) instead of in the softmax. Returns (acc, m, l, offs_m)."""
    BLOCK_A: gl.constexpr = BLOCK_N - BLOCK_B
    s_layout: gl.constexpr = acc_layout(WG_WARPS, BLOCK_A)
    o_layout: gl.constexpr = acc_layout(WG_WARPS, HEAD_D)
    p_layout: gl.constexpr = p_operand_layout(WG_WARPS, HEAD_D)
    s_row: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)

    row0 = m0 + C * WG_ROWS
    diag = Mk - Mq
    full_end = unmasked_end(row0, Mq, Mk, BLOCK_N, CAUSAL)  # no tile before it needs a mask for these rows
    offs_m = row0 + gl.arange(0, WG_ROWS, layout=s_row)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=s_row)
    l_q = gl.zeros_like(_quad_partials(gl.zeros([WG_ROWS, BLOCK_A], gl.float32, layout=s_layout), False))
    s_dtype: gl.constexpr = gl.int32 if QK_INT8 else gl.float32
    s_zero = gl.zeros([WG_ROWS, BLOCK_A], s_dtype, layout=s_layout)
    if BLOCK_B > 0:
        sb_zero = gl.zeros([WG_ROWS, BLOCK_B], s_dtype, layout=acc_layout(WG_WARPS, BLOCK_B))
    OFF: gl.constexpr = INT_OFF if QK_INT8 else 0.0
    acc = gl.zeros([WG_ROWS, HEAD_D], gl.float32, layout=o_layout)
    # the row-sum wgmmas' accumulator: each row's sum of P in every column
    acc_l = gl.zeros([WG_ROWS, SUM_N], gl.float32, layout=acc_layout(WG_WARPS, SUM_N))
    # wgmma groups issued after a tile's S: its P V parts, and as many row-sum wgmmas with ROW_SUM_MMA
    PV_GROUPS: gl.constexpr = (2 if BLOCK_B > 0 else 1) * (2 if ROW_SUM_MMA else 1)
    SUM_ROWS: gl.constexpr = not ROW_SUM_MMA
    q_tile = q_smem.index(C)

    # S_0 alone (nothing to overlap with yet)
    ks = kv % STAGES
    mbarrier.wait(q_bars.index(C), i & 1)
    mbarrier.wait(k_ready.index(ks), (kv // STAGES) & 1)
    _take_turn(turn_bars, turn, C, CONSUMERS, FREE_ISSUE)
    s_tok = warpgroup_mma(q_tile, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if BLOCK_B > 0:
        sb_tok = warpgroup_mma(q_tile, kb_smem.index(ks).permute((1, 0)), sb_zero, use_acc=False, is_async=True)
    _pass_turn(turn_bars, C, CONSUMERS, FREE_ISSUE)
    if BLOCK_B > 0:
        s, s_b = warpgroup_mma_wait(0, deps=(s_tok, sb_tok))
    else:
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(ks), count=1)
    if BLOCK_B == 0:
        s_b = s
    p, p_b, m_i, l_q, alpha = _tile_softmax(s, s_b, m_i, l_q, qk_scale, 0, full_end, Mk, diag, offs_m, CAUSAL,
                                            P_SHIFT, BLOCK_A, BLOCK_B, OFF, SUM_ROWS)

    pk = _p_carried(p, p_layout, BLOCK_A, KEY_ORDER, EARLY_P8)
    pk_b = _p_carried(p_b, p_layout, BLOCK_B, KEY_ORDER, EARLY_P8) if BLOCK_B > 0 else pk
    for j in range(n_tiles - 1):
        p8 = _p_operand(pk, p_layout, BLOCK_A, KEY_ORDER, EARLY_P8)
        p8_b = _p_operand(pk_b, p_layout, BLOCK_B, KEY_ORDER, EARLY_P8) if BLOCK_B > 0 else p8
        ks = (kv + j + 1) % STAGES
        vs = (kv + j) % STAGES
        mbarrier.wait(k_ready.index(ks), ((kv + j + 1) // STAGES) & 1)
        mbarrier.wait(v_ready.index(vs), ((kv + j) // STAGES) & 1)
        _take_turn(turn_bars, turn + j + 1, C, CONSUMERS, FREE_ISSUE)
        s_tok = warpgroup_mma(q_tile, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if BLOCK_B > 0:
            sb_tok = warpgroup_mma(q_tile, kb_smem.index(ks).permute((1, 0)), sb_zero, use_acc=False,
                                   is_async=True)
        o_tok = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), acc, is_async=True)
        if BLOCK_B > 0:
            o_tok = warpgroup_mma(p8_b, vb_smem.index(vs).permute((1, 0)), o_tok, is_async=True)
        if ROW_SUM_MMA:
            l_tok = _row_sums(p8, p8_b, ones_smem, onesb_smem, acc_l, BLOCK_B)
        _pass_turn(turn_bars, C, CONSUMERS, FREE_ISSUE)
        if BLOCK_B > 0:  # the two S parts done; P V (and the row sums) may still run
            s, s_b = warpgroup_mma_wait(PV_GROUPS, deps=(s_tok, sb_tok))
        else:
            s = warpgroup_mma_wait(PV_GROUPS, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(ks), count=1)
        if BLOCK_B == 0:
            s_b = s
        p, p_b, m_i, l_q, alpha = _tile_softmax(s, s_b, m_i, l_q, qk_scale, (j + 1) * BLOCK_N, full_end, Mk, diag,
                                                offs_m, CAUSAL, P_SHIFT, BLOCK_A, BLOCK_B, OFF, SUM_ROWS)
        if ROW_SUM_MMA:
            acc, acc_l = warpgroup_mma_wait(0, deps=(o_tok, l_tok))
        else:
            acc = warpgroup_mma_wait(0, deps=(o_tok, ))
        # after that wait: the wgmmas just waited for read the registers an early conversion may take
        pk = _p_carried(p, p_layout, BLOCK_A, KEY_ORDER, EARLY_P8)
        if BLOCK_B > 0:
            pk_b = _p_carried(p_b, p_layout, BLOCK_B, KEY_ORDER, EARLY_P8)
        mbarrier.arrive(v_empty.index(vs), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row), 1)
        if ROW_SUM_MMA:
            acc_l = acc_l * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc_l.type.layout)), 1)
    # every S of this tile is done: the producer may load the next tile's Q while the last P V and the epilogue run
    mbarrier.arrive(q_empty.index(C), count=1)

    last = kv + n_tiles - 1
    vs = last % STAGES
    p8 = _p_operand(pk, p_layout, BLOCK_A, KEY_ORDER, EARLY_P8)
    p8_b = _p_operand(pk_b, p_layout, BLOCK_B, KEY_ORDER, EARLY_P8) if BLOCK_B > 0 else p8
    mbarrier.wait(v_ready.index(vs), (last // STAGES) & 1)
    _take_turn(turn_bars, turn + n_tiles, C, CONSUMERS, FREE_ISSUE)
    o_tok = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), acc, is_async=True)
    if BLOCK_B > 0:
        o_tok = warpgroup_mma(p8_b, vb_smem.index(vs).permute((1, 0)), o_tok, is_async=True)
    if ROW_SUM_MMA:
        l_tok = _row_sums(p8, p8_b, ones_smem, onesb_smem, acc_l, BLOCK_B)
    _pass_turn(turn_bars, C, CONSUMERS, FREE_ISSUE)
    if ROW_SUM_MMA:
        acc, acc_l = warpgroup_mma_wait(0, deps=(o_tok, l_tok))
    else:
        acc = warpgroup_mma_wait(0, deps=(o_tok, ))
    mbarrier.arrive(v_empty.index(vs), count=1)
    if ROW_SUM_MMA:
        l_i = gl.max(acc_l, 1)  # every column holds the row's sum (the max picks one exactly)
    else:
        l_i = gl.sum(l_q, 1)
    return acc, m_i, gl.convert_layout(l_i, s_row), offs_m


@gluon.jit
def _consume_tile(C: gl.constexpr, t, kv, turn, i, smem, scalars, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_B: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                  WRITE_LSE: gl.constexpr, P_SHIFT: gl.constexpr, KEY_ORDER: gl.constexpr, OUT_FP8: gl.constexpr,
                  QK_INT8: gl.constexpr, DIRECT_STORE: gl.constexpr, HEAD_SECTION: gl.constexpr,
                  FREE_ISSUE: gl.constexpr, EARLY_P8: gl.constexpr, ROW_SUM_MMA: gl.constexpr):
    """Consumer ``C``'s rows ``C * WG_ROWS ..`` of tile ``t``, the ``i``-th of this CTA, from ring position ``kv``
    and turn ``turn``: their output through ``o_smem`` and a TMA store that runs on while the next tile starts
    (waited for before ``o_smem`` is written again), or with ``DIRECT_STORE`` from its registers straight to
    ``Out`` (no output tile in shared memory). Returns the key tiles consumed."""
    (q_smem, k_smem, kb_smem, v_smem, vb_smem, o_smem, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
     turn_bars, ones_smem, onesb_smem) = smem
    (o_desc, Out, Lse, QD, KD, VD, sm_scale_log2, stride_ob, stride_om, stride_oh, stride_lb, stride_lh, qd_sb, qd_sh,
     kd_sb, kd_sh, vd_sb, vd_sh, n_m, n_total, Mq, Mk, Hq, GROUP) = scalars
    BLOCK_M: gl.constexpr = CONSUMERS * WG_ROWS
    o_layout: gl.constexpr = acc_layout(WG_WARPS, HEAD_D)
    o_tile = o_smem.index(C)
    b, hq, hkv, pid_m = _tile_coords(t, n_m, n_total, Hq, GROUP, CAUSAL, HEAD_SECTION)
    m0 = pid_m * BLOCK_M
    n_tiles = key_tiles(m0, BLOCK_M, Mq, Mk, BLOCK_N, CAUSAL)
    qk_scale, vd = head_descales(QD, KD, VD, b, hkv, qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh, sm_scale_log2)
    if OUT_FP8:  # an fp8 output stays in v's units (attention = out * v_descale)
        vd = vd * 0.0 + 1.0
    acc, m_i, l_i, offs_m = _consumer_tile(C, q_smem, k_smem, kb_smem, v_smem, vb_smem, ones_smem, onesb_smem,
                                           q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, turn_bars, qk_scale,
                                           m0, n_tiles, kv, turn, i, Mq, Mk, HEAD_D, BLOCK_N, BLOCK_B, STAGES,
                                           CONSUMERS, CAUSAL, P_SHIFT, KEY_ORDER, QK_INT8, FREE_ISSUE, EARLY_P8,
                                           ROW_SUM_MMA)
    inv = gl.convert_layout(row_inverse(l_i) * vd, gl.SliceLayout(1, o_layout))
    if DIRECT_STORE:
        rows = gl.convert_layout(offs_m, gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
        base = Out + b.to(gl.int64) * stride_ob + hq.to(gl.int64) * stride_oh
        gl.store(base + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0),
                 (acc * gl.expand_dims(inv, 1)).to(Out.dtype.element_ty), mask=gl.expand_dims(rows < Mq, 1))
    else:
        tma.store_wait(pendings=0)  # the previous tile's store has read o_tile
        gl.thread_barrier()
        o_tile.store((acc * gl.expand_dims(inv, 1)).to(o_tile.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [b, m0 + C * WG_ROWS, hq, 0], _box(o_tile))
    if WRITE_LSE:
        lse_ptr = Lse + b.to(gl.int64) * stride_lb + hq.to(gl.int64) * stride_lh
        gl.store(lse_ptr + offs_m, natural_lse(m_i, l_i, P_SHIFT), mask=offs_m < Mq)
    return n_tiles


@gluon.jit
def _consumer(C: gl.constexpr, smem, scalars, sched, n_total, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_B: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
              WRITE_LSE: gl.constexpr, P_SHIFT: gl.constexpr, KEY_ORDER: gl.constexpr, OUT_FP8: gl.constexpr,
              QK_INT8: gl.constexpr, DIRECT_STORE: gl.constexpr, HEAD_SECTION: gl.constexpr,
              DYNAMIC: gl.constexpr, FREE_ISSUE: gl.constexpr, EARLY_P8: gl.constexpr, ROW_SUM_MMA: gl.constexpr):
    """Consumer ``C`` over this CTA's tiles (``_consume_tile``): ``program_id``, + ``num_programs``, .. or, with
    ``DYNAMIC``, those the producer hands over through the tile ring ``sched`` until one past the last tile.
    ``smem`` and ``scalars``: the kernel's shared buffers and barriers and its runtime arguments, as tuples (every
    consumer takes the same; the constexprs travel one by one, as a tuple would make them tensors)."""
    kv = 0
    turn = 0
    i = 0
    if DYNAMIC:
        t = _take_tile(sched, i)
    else:
        t = gl.program_id(0)
    while t < n_total:
        n_tiles = _consume_tile(C, t, kv, turn, i, smem, scalars, HEAD_D, BLOCK_N, BLOCK_B, STAGES, CONSUMERS,
                                CAUSAL, WRITE_LSE, P_SHIFT, KEY_ORDER, OUT_FP8, QK_INT8, DIRECT_STORE, HEAD_SECTION,
                                FREE_ISSUE, EARLY_P8, ROW_SUM_MMA)
        kv += n_tiles
        turn += n_tiles + 1
        i += 1
        if DYNAMIC:
            t = _take_tile(sched, i)
        else:
            t += gl.num_programs(0)
    tma.store_wait(pendings=0)


#: Mk is not specialized on divisibility by 16: with that hint ptxas spilled the dense 192-key fp8 consumer (1008 B of
#: spill stores, 488-530 TFLOP/s on the H100 against 730-791 for the int8 tiles) and the one-consumer schedules (4 B);
#: without it neither spills
@gluon.jit(do_not_specialize=["Mk"])
def _attn_fwd_ws_kernel(
    q_desc, k_desc, kb_desc, v_desc, vb_desc, o_desc, Out, Lse, QD, KD, VD, Counter, sm_scale_log2,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh, qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh,
    n_m, n_total, Mq, Mk, Hq, GROUP,
    HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_B: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, P_SHIFT: gl.constexpr, KEY_ORDER: gl.constexpr,
    V_TRANSPOSE: gl.constexpr, OUT_FP8: gl.constexpr, PERSISTENT: gl.constexpr, QK_INT8: gl.constexpr,
    DIRECT_STORE: gl.constexpr, HEAD_SECTION: gl.constexpr, DYNAMIC: gl.constexpr, FREE_ISSUE: gl.constexpr,
    EARLY_P8: gl.constexpr, ROW_SUM_MMA: gl.constexpr,
):
    """Tiles ``program_id(0)``, + ``num_programs(0)``, .. of the ``n_total`` (batch, head, ``CONSUMERS * WG_ROWS``-row
    block) tiles (``_tile_coords``): one per CTA with a grid of ``n_total``, several with a persistent grid; with
    ``DYNAMIC`` (a persistent grid) the producer takes tiles from the int32 counters ``Counter`` [2] (zeros at
    launch, zeros again at exit: ``_retire``) and hands them to the consumers (``_publish_tile``), else ``Counter``
    is unused.
    ``BLOCK_B`` > 0: key tiles of ``BLOCK_N`` keys in two parts (``_consumer_tile``), the second read through
    ``kb_desc`` / ``vb_desc``; otherwise those are unused copies of ``k_desc`` / ``v_desc``. ``ROW_SUM_MMA``: the
    tiles of ones that every consumer's row-sum wgmmas read, written here before the partitions start."""
    BLOCK_A: gl.constexpr = BLOCK_N - BLOCK_B
    qk_dtype: gl.constexpr = gl.int8 if QK_INT8 else gl.float8e4nv  # (8-bit tiles share the fp8 tiles' swizzle)
    q_smem = gl.allocate_shared_memory(qk_dtype, [CONSUMERS, WG_ROWS, HEAD_D], fp8_tile_layout(WG_ROWS, HEAD_D))
    k_smem = gl.allocate_shared_memory(qk_dtype, [STAGES, BLOCK_A, HEAD_D], fp8_tile_layout(BLOCK_A, HEAD_D))
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_D, BLOCK_A], fp8_tile_layout(HEAD_D, BLOCK_A))
    if BLOCK_B > 0:
        kb_smem = gl.allocate_shared_memory(qk_dtype, [STAGES, BLOCK_B, HEAD_D], fp8_tile_layout(BLOCK_B, HEAD_D))
        vb_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_D, BLOCK_B],
                                            fp8_tile_layout(HEAD_D, BLOCK_B))
    else:
        kb_smem = k_smem
        vb_smem = v_smem
    if ROW_SUM_MMA:
        ones_smem = ones_tile(BLOCK_A)
        onesb_smem = ones_tile(BLOCK_B) if BLOCK_B > 0 else ones_smem
    else:
        ones_smem = q_smem  # unused
        onesb_smem = q_smem
    o_dtype: gl.constexpr = gl.float8e4nv if OUT_FP8 else gl.bfloat16
    o_layout: gl.constexpr = out_tile_layout(WG_ROWS, HEAD_D, o_dtype)
    if V_TRANSPOSE:  # raw v tiles (keys x channels) in V_CHUNK-channel boxes
        v_raw = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * (HEAD_D // V_CHUNK), BLOCK_N, V_CHUNK],
                                          fp8_tile_layout(BLOCK_N, V_CHUNK))
        # one tile per CTA: the output tiles reuse the raw ring where it is large enough (a consumer stores its
        # tile after its last PV wgmma, which waited for the last V^T tile, so every raw load and read is over)
        if DIRECT_STORE:
            o_smem = q_smem  # unused: the consumers store from their registers
        elif not PERSISTENT and STAGES * BLOCK_A >= CONSUMERS * WG_ROWS * o_dtype.primitive_bitwidth // 8:
            o_smem = v_raw._reinterpret(o_dtype, [CONSUMERS, WG_ROWS, HEAD_D], o_layout)
        else:
            o_smem = gl.allocate_shared_memory(o_dtype, [CONSUMERS, WG_ROWS, HEAD_D], o_layout)
    else:
        v_raw = v_smem
        if DIRECT_STORE:
            o_smem = q_smem  # unused: the consumers store from their registers
        else:
            o_smem = gl.allocate_shared_memory(o_dtype, [CONSUMERS, WG_ROWS, HEAD_D], o_layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    raw_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    if DYNAMIC:  # the tile ring: tile indices the producer hands to the consumers
        tile_smem = gl.allocate_shared_memory(gl.int32, [TILE_SLOTS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        tile_ready = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
        tile_empty = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(TILE_SLOTS):
            mbarrier.init(tile_ready.index(s), count=1)
            mbarrier.init(tile_empty.index(s), count=CONSUMERS)
    else:
        tile_smem = q_bars  # unused
        tile_ready = q_bars
        tile_empty = q_bars
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_bars.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
        mbarrier.init(turn_bars.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
        mbarrier.init(raw_ready.index(i), count=1)

    # constexprs travel as arguments of each partition function (a tuple built here would make them tensors)
    smem = (q_smem, k_smem, kb_smem, v_smem, vb_smem, o_smem, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
            turn_bars, ones_smem, onesb_smem)
    scalars = (o_desc, Out, Lse, QD, KD, VD, sm_scale_log2, stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
               qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh, n_m, n_total, Mq, Mk, Hq, GROUP)
    sched = (tile_smem, tile_ready, tile_empty)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (0, smem, scalars, sched, n_total, HEAD_D, BLOCK_N, BLOCK_B, STAGES, CONSUMERS, CAUSAL,
                         WRITE_LSE, P_SHIFT, KEY_ORDER, OUT_FP8, QK_INT8, DIRECT_STORE, HEAD_SECTION, DYNAMIC,
                         FREE_ISSUE, EARLY_P8, ROW_SUM_MMA)),
            (_consumer, (1, smem, scalars, sched, n_total, HEAD_D, BLOCK_N, BLOCK_B, STAGES, CONSUMERS, CAUSAL,
                         WRITE_LSE, P_SHIFT, KEY_ORDER, OUT_FP8, QK_INT8, DIRECT_STORE, HEAD_SECTION, DYNAMIC,
                         FREE_ISSUE, EARLY_P8, ROW_SUM_MMA)),
            (_consumer, (2, smem, scalars, sched, n_total, HEAD_D, BLOCK_N, BLOCK_B, STAGES, CONSUMERS, CAUSAL,
                         WRITE_LSE, P_SHIFT, KEY_ORDER, OUT_FP8, QK_INT8, DIRECT_STORE, HEAD_SECTION, DYNAMIC,
                         FREE_ISSUE, EARLY_P8, ROW_SUM_MMA)),
            (_producer, (q_desc, k_desc, kb_desc, v_desc, vb_desc, q_smem, k_smem, kb_smem, v_smem, vb_smem, v_raw,
                         q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, raw_ready, sched, Counter, n_m,
                         n_total, Mq, Mk, Hq, GROUP, BLOCK_N, BLOCK_B, HEAD_D, STAGES, CONSUMERS, CAUSAL,
                         V_TRANSPOSE, KEY_ORDER, HEAD_SECTION, DYNAMIC)),
        ], [WG_WARPS, WG_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    elif CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, smem, scalars, sched, n_total, HEAD_D, BLOCK_N, BLOCK_B, STAGES, CONSUMERS, CAUSAL,
                         WRITE_LSE, P_SHIFT, KEY_ORDER, OUT_FP8, QK_INT8, DIRECT_STORE, HEAD_SECTION, DYNAMIC,
                         FREE_ISSUE, EARLY_P8, ROW_SUM_MMA)),
            (_consumer, (1, smem, scalars, sched, n_total, HEAD_D, BLOCK_N, BLOCK_B, STAGES, CONSUMERS, CAUSAL,
                         WRITE_LSE, P_SHIFT, KEY_ORDER, OUT_FP8, QK_INT8, DIRECT_STORE, HEAD_SECTION, DYNAMIC,
                         FREE_ISSUE, EARLY_P8, ROW_SUM_MMA)),
            (_producer, (q_desc, k_desc, kb_desc, v_desc, vb_desc, q_smem, k_smem, kb_smem, v_smem, vb_smem, v_raw,
                         q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, raw_ready, sched, Counter, n_m,
                         n_total, Mq, Mk, Hq, GROUP, BLOCK_N, BLOCK_B, HEAD_D, STAGES, CONSUMERS, CAUSAL,
                         V_TRANSPOSE, KEY_ORDER, HEAD_SECTION, DYNAMIC)),
        ], [WG_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, smem, scalars, sched, n_total, HEAD_D, BLOCK_N, BLOCK_B, STAGES, CONSUMERS, CAUSAL,
                         WRITE_LSE, P_SHIFT, KEY_ORDER, OUT_FP8, QK_INT8, DIRECT_STORE, HEAD_SECTION, DYNAMIC,
                         FREE_ISSUE, EARLY_P8, ROW_SUM_MMA)),
            (_producer, (q_desc, k_desc, kb_desc, v_desc, vb_desc, q_smem, k_smem, kb_smem, v_smem, vb_smem, v_raw,
                         q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, raw_ready, sched, Counter, n_m,
                         n_total, Mq, Mk, Hq, GROUP, BLOCK_N, BLOCK_B, HEAD_D, STAGES, CONSUMERS, CAUSAL,
                         V_TRANSPOSE, KEY_ORDER, HEAD_SECTION, DYNAMIC)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])

    for c in gl.static_range(CONSUMERS):
        mbarrier.invalidate(q_bars.index(c))
        mbarrier.invalidate(q_empty.index(c))
        mbarrier.invalidate(turn_bars.index(c))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))
        mbarrier.invalidate(raw_ready.index(i))
    if DYNAMIC:
        for s in gl.static_range(TILE_SLOTS):
            mbarrier.invalidate(tile_ready.index(s))
            mbarrier.invalidate(tile_empty.index(s))


@dataclass(frozen=True)
class WsFwdConfig:
    """Schedule of the warp-specialized kernel."""

    #: consumer warpgroups per CTA (64 query rows each), taking turns at the tensor cores: 2 or 3 in one CTA per
    #: SM (``maxnreg`` 168 / 128), 1 runs two CTAs per SM
    consumers: int = 2
    #: keys per tile: a power of two, or (two-part tiles, V^T from ``transpose_v``) a power of two plus a smaller
    #: one such as 192 = 128 + 64 (FA3 takes 224 at D128 fp8; 256 spills here)
    block_n: int = 128
    #: K / V ring depth
    stages: int = 2
    #: register budget per thread of the whole CTA (``maxnreg``): 65536 / threads / CTAs per SM, rounded to 8
    maxnreg: int = 168
    #: registers of a worker consumer warpgroup (setmaxnreg); the default partition gets what is left
    consumer_regs: int = 240
    #: V^T's keys in the S accumulator's order (``transpose_v(key_order=True)``): P feeds the PV wgmma from its
    #: own registers; False converts P's layout through warp shuffles (H200, D128, two consumers, CUDA-event
    #: medians: key order 0.99x / 1.03x / 1.06x at 4x32x4096, the same causal, 2x16x16384)
    key_order: bool = False
    #: the producer warpgroup transposes V tiles in shared memory (v is read as stored, no ``transpose_v``
    #: launch, no V^T copy in global memory); False reads V^T made by ``transpose_v``
    v_transpose: bool = False
    #: a persistent grid: ``ctas_per_sm()`` CTAs per SM each walk tiles t, t + grid, .. (the rings and turns run on
    #: across tiles, so one tile's loads and epilogue overlap its neighbour's GEMMs); False: one CTA per tile
    persistent: bool = False
    #: consumers store their output from registers (no output tile in shared memory and no TMA store), which
    #: frees CONSUMERS x 64 x D x 2 bytes: room for a second one-consumer CTA per SM with 192-key tiles
    direct_store: bool = False
    #: causal tiles in order of decreasing rows across sections of this many (batch, head) pairs (0: within each
    #: pair). A grid of one CTA per tile is handed out in tile order as SMs free up, so heavy tiles first across a
    #: section balances the SMs while 8 heads' K / V stay in L2: makespan over the ideal, simulated for 4x32x4096,
    #: 3x24x3000 and 4x32x2048 causal (64-row tiles, 264 CTA slots): 1.001 / 1.023 / 1.017 with sections of 8
    #: against 1.035 / 1.089 / 1.072 per pair, and 1.12 / 1.09 / 1.21 for the persistent grid's fixed strides
    head_section: int = 0
    #: on a persistent grid: each CTA's producer takes its next tile from a launch-wide atomic counter once it has
    #: issued the current tile's loads and hands it to the consumers through shared memory, so a CTA that finishes
    #: early takes more tiles while the rings and turns still run on across its tiles (a grid of tiles balances
    #: alike but loses that overlap). Makespan over the ideal with ``head_section`` 8, simulated at 4x32x4096,
    #: 3x24x3000, 4x32x2048 and 16x32x512 causal (bench/diagnostics/causal_balance.py: 64-row tiles, 264 CTA
    #: slots, a tile taken 2 key tiles before the current one ends): 1.001 / 1.023 / 1.017 / 1.057, against
    #: 1.12 / 1.09 / 1.21 / 1.58 for the fixed strides. The counters: ``kernels/tile_counter.py``
    dynamic: bool = False
    #: consumers issue their wgmmas without taking turns (no ping-pong: no turn mbarrier wait, arrive and
    #: warpgroup barrier per key tile), as FA3's fp8 forward at D64 does with its three consumer warpgroups
    #: (bench/diagnostics/fa3_profile.md, "Main loop SASS"); with one consumer it changes nothing
    free_issue: bool = False
    #: P's fp8 conversion at the end of each key-loop iteration (after the P V wait) instead of before the next
    #: iteration's wgmmas: ptxas places a conversion that shares a block with the turn's mbarrier wait after that
    #: wait (inside the turn), but keeps one before the loop's back branch. The loop carries P packed four fp8 to a
    #: register (``_p8_packed``). Unmasked key-loop iteration, turn wait to last wgmma (sass_compare.py
    #: ``issue_span``): 126 -> 53 instructions at D64, 123 -> 63 at D128, 90 -> 43 at D256 (FA3 fp8: 41 / 55 / 56),
    #: no more instructions or registers, and less spilled (stack 8 -> 0 B at D128, 40 -> 8 B at D256)
    early_p8: bool = False
    #: P's row sums on the tensor cores: each consumer adds P times a tile of ones in shared memory (an m64n8k32
    #: fp8 wgmma per key part, A = the P V operand from registers) to a float32 accumulator that is waited for and
    #: rescaled with O, instead of one FADD per score in the softmax. The sums are then those of the fp8 P that
    #: P V weighs V with: the output stays a convex combination of V's rows, and the LSE takes P's rounding (float64
    #: simulation of N(0, 1) scores: up to ~0.03 on rows of 2-5 keys, 0.005 on rows of 1000). Unmasked key-loop
    #: iteration of the long-key schedules (sass_compare.py): 606 -> 518 instructions at D64, 647 -> 563 at D128,
    #: 550 -> 510 at D256 (int8: 471 -> 414, 703 -> 619, 581 -> 540), FADD 98 -> 4 per 192-key tile, 6-9 more
    #: instructions in the turn; stack 8 -> 0 B at D128 fp8, 40 -> 104 B at D256 fp8 (8 -> 8 B with ``early_p8``)
    row_sum_mma: bool = False

    @property
    def block_b(self) -> int:
        """Keys of a key tile's second part: 0 when ``block_n`` is a power of two, else ``block_n`` less the
        largest power of two below it (192 = 128 + 64)."""
        return self.block_n - (1 << (self.block_n.bit_length() - 1))

    def shared_bytes(self, head_dim: int, out_bytes: int = 2) -> int:
        """Shared memory of one persistent CTA (8-bit Q, K and V^T tiles, raw V tiles when ``v_transpose``, the
        output tiles of ``out_bytes`` per element unless ``direct_store``, the tiles of ones of ``row_sum_mma``, one
        slack KiB for barriers and alignment)."""
        rows = self.consumers * WG_ROWS.value
        ring = self.stages * self.block_n * head_dim
        out_tile = 0 if self.direct_store else out_bytes
        ones = SUM_N.value * self.block_n if self.row_sum_mma else 0
        return rows * head_dim * (1 + out_tile) + ring * (3 if self.v_transpose else 2) + ones + SMEM_SLACK

    def ctas_per_sm(self, head_dim: int, out_bytes: int = 2) -> int:
        """CTAs resident per SM in a persistent grid: what both the register budget (``maxnreg`` for every thread
        of the CTA's warpgroups) and shared memory (``shared_bytes``) allow. A persistent CTA never exits early,
        so a grid of more CTAs than fit would leave the extra ones waiting for the others' last tile."""
        warps = WG_WARPS.value * self.consumers + self.producer_warps
        threads = -(-warps // WG_WARPS.value) * WG_WARPS.value * 32
        by_smem = SMEM_PER_SM // (self.shared_bytes(head_dim, out_bytes) + SMEM_PER_CTA_RESERVED)
        return max(1, min(65536 // (self.maxnreg * threads), by_smem))

    @property
    def producer_warps(self) -> int:
        """Warps of the producer partition: one issues TMA; a warpgroup also transposes V."""
        return WG_WARPS.value if self.v_transpose else 1

    @property
    def producer_regs(self) -> int:
        """Registers per producer thread: what the consumers leave of the 64K register file."""
        return TRANSPOSER_REGS if self.v_transpose else PRODUCER_REGS.value


#: shared memory of an sm90 SM, the driver's reservation per CTA, and what ``WsFwdConfig.shared_bytes`` adds for
#: barriers and alignment
SMEM_PER_SM = 233472
SMEM_PER_CTA_RESERVED = 1024
SMEM_SLACK = 1024
#: ``maxnreg`` and consumer registers of three-consumer schedules: four warpgroups in 65536 registers
THREE_CONSUMER_MAXNREG = 128
THREE_CONSUMER_REGS = 160
#: ``maxnreg`` of single-consumer schedules: 128 fits two 8-warp CTAs per SM; D256's wgmmas need more (one CTA)
SINGLE_CONSUMER_MAXNREG = {64: 128, 128: 128, 256: 168}
#: registers per thread of a transposing producer warpgroup: 512 per thread-slot of three warpgroups (65536 /
#: 128) less two consumers' 240
TRANSPOSER_REGS = 32


#: keys per sequence from which a call at D <= 128 (not causal) takes 192-key tiles
LONG_KEYS = 4096
#: (batch, head) pairs per section of the causal schedules' heaviest-first tile order
CAUSAL_HEAD_SECTION = 8


def default_config(head_dim: int, causal: bool, seqlen_k: int | None = None, qk_int8: bool = False) -> WsFwdConfig:
    """Schedule for head dim ``head_dim`` and ``seqlen_k`` keys per sequence (None: a long sequence), fp8 q/k or
    int8 (``qk_int8``): the same schedules but at D64 with long keys.

    H200, kernel time replayed from CUDA graphs (TFLOP/s, D128; bench/diagnostics/fa3_profile.md): at D <= 128 one
    consumer per CTA, two CTAs per SM, on a persistent grid, V^T from ``transpose_v`` in the accumulator's key
    order: fp8 590 / 683 / 772 / 695 / 782 at 8x16x1000, 3x24/8x3000 causal, 4x32x4096 (causal) and 2x16x16384,
    against 528 / 576 / 760 / 654 / 782 for the earlier per-length choice; the in-kernel V transpose on the same
    grid runs 25-32% slower. With ``LONG_KEYS`` keys or more, not causal: 192-key tiles (128 + 64) on two
    consumers, whose row max and row sums cost one cross-lane reduction per tile (H100, same run: fp8 824 / 857
    against 808 / 820 for one consumer at 4x32x4096 and 2x16x16384, int8 804 / 885); int8 q/k issue their wgmmas
    there without taking turns (``free_issue``; H100, two runs: 839 / 858 and 842 / 890 against 811 / 852 and
    816 / 793 taking turns; fp8 taking turns 873 / 889 against 818 / 892). Int8 q/k at
    D64 take three consumers on 128-key tiles there (H100, two runs at 4x16x4096 and 2x16x16384: 546 / 629 and
    545 / 637 against 510 / 553 and 504 / 556 for two consumers; fp8 558 / 643 against 563 / 646, so fp8
    keeps two on 192-key tiles). D256: two consumers,
    128-key tiles in the accumulator's key order (H100, same run: fp8 1099 / 936 at 4x16x4096 and 2x16x8192 causal,
    int8 1158 / 1001, against 919 / 886 and 896 / 866 for 64-key tiles; 96-key tiles 1008 / 892), on the persistent
    grid when not causal and on a grid of tiles when causal (fp8 1105 against 1043 dense, 982 against 941 causal;
    int8 1092 / 1083 and 1028 / 979). The fp8 build spills 104 B there and still wins: the O rescale of 256 channels
    per tile is what 128 keys amortize.

    Causal tiles go heaviest first across sections of ``CAUSAL_HEAD_SECTION`` (batch, head) pairs (H100, same run,
    CUDA graphs, against FA3 fp8): D256 on its grid of tiles, fp8 1056 against 1003 per pair at 2x16x8192 (FA3
    1083), int8 1061 against 1036; at D <= 128 the persistent grid's CTAs take them from a launch-wide counter
    (``WsFwdConfig.dynamic``): fp8 741 / 734 against 697 / 722 on fixed strides at 4x32x4096 and 3x24/8x3000 (FA3
    792 / 735), and at short lengths fp8 414 / 220 / 247 / 113 against 396 / 175 / 215 / 111 at 8x16x1000,
    2x12/4x1500 D64, 16x32/8x512 D64 and 32x16x256 D64 (int8 392 / 204 / 230 / 106 against 372 / 160 / 197 / 102)."""
    if head_dim not in (64, 128):  # D256 (other head dims are rejected later)
        return WsFwdConfig(block_n=128, persistent=not causal, key_order=True,
                           head_section=CAUSAL_HEAD_SECTION if causal else 0)
    if not causal and (seqlen_k is None or seqlen_k >= LONG_KEYS):
        if qk_int8 and head_dim == 64:
            return WsFwdConfig(consumers=3, block_n=128, maxnreg=THREE_CONSUMER_MAXNREG,
                               consumer_regs=THREE_CONSUMER_REGS, persistent=True, key_order=True)
        return WsFwdConfig(block_n=192, persistent=True, key_order=True, free_issue=qk_int8)
    return WsFwdConfig(consumers=1, block_n=128, maxnreg=SINGLE_CONSUMER_MAXNREG[head_dim], key_order=True,
                       persistent=True, dynamic=causal, head_section=CAUSAL_HEAD_SECTION if causal else 0)


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether TMA can read ``t`` (B, M, H, D) as stored: 16-byte aligned base and strides."""
    return t.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in t.stride()[:3])


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (cached)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


_GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.int8: gl.int8, torch.bfloat16: gl.bfloat16}


def _descriptor(t: torch.Tensor, rows: int, cols: int, channels_last: bool = True):
    """Host TMA descriptor of a 4-D tensor (B, M, H, D) in [1, rows, 1, cols] boxes (``channels_last``) or of V^T
    (B, H, D, L) in [1, 1, rows, cols] boxes, with ``box_layout``'s shared layout (encoded once per tensor
    address and geometry by the cached launch)."""
    shape, layout = _host_box(rows, cols, t.dtype, channels_last)
    return host_descriptor(t, t.shape, t.stride(), shape, layout)


@functools.lru_cache(maxsize=None)
def _host_box(rows: int, cols: int, dtype: torch.dtype, channels_last: bool):
    """``_box_layout`` for a host descriptor, computed once per geometry (a layout costs ~microseconds)."""
    shape, layout = _box_layout(rows, cols, _GL_DTYPES[dtype], channels_last)
    return tuple(shape), layout


def attention_forward(q, k, v, *, scale: float, causal: bool = False, q_descale=None, k_descale=None,
                      v_descale=None, return_lse: bool = False, config: WsFwdConfig | None = None, out=None,
                      out_dtype: torch.dtype = torch.bfloat16):
    """fp8 attention forward on Hopper, warp-specialized (module docstring: shapes, dtypes, layouts).

    Returns (out (B, Mq, Hq, D), lse float32 (B, Hq, Mq) natural log, or None). ``out_dtype``: bfloat16, or
    float8_e4m3fn in v's units (attention = out.float() * v_descale). ``config`` overrides ``default_config``;
    ``out`` is an optional preallocated ``out_dtype`` output. With ``config.v_transpose`` v is read
    as stored when its strides are multiples of 16 elements (TMA); other v strides are copied by
    ``transpose_v`` first (the same result).

    Example::

        q, k, v = (torch.randn(2, 4096, 16, 128, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
        out, _ = attention_forward(q, k, v, scale=128 ** -0.5, causal=True)
    """
    B, Mq, Hq, D = q.shape
    Mk, Hkv = k.shape[1], k.shape[2]
    cfg = config or default_config(D, causal, Mk, q.dtype == torch.int8)
    if cfg.consumers not in (1, 2, 3) or cfg.stages < 2:
        raise ValueError(f"config {cfg}: consumers must be 1, 2 or 3 and stages >= 2")
    if cfg.dynamic and not cfg.persistent:
        raise ValueError(f"config {cfg}: dynamic tiles need persistent=True (a grid of tiles is handed out in "
                         "order by the hardware already)")
    block_b = cfg.block_b
    if block_b and (block_b & (block_b - 1) or block_b < 16 or cfg.v_transpose):
        raise ValueError(f"config {cfg}: block_n must be a power of two or one plus a smaller one >= 16 (e.g. 192), "
                         "the latter with v_transpose=False")
    prep = fp8_forward_args(q, k, v, q_descale, k_descale, v_descale, return_lse, out, HEAD_DIMS, out_dtype,
                            int8_qk=True)
    if prep.done:
        return prep.out, prep.lse
    out, lse = prep.out, prep.lse
    v_transpose = cfg.v_transpose and _tma_ready(v)
    block_a = cfg.block_n - block_b
    k_desc = _descriptor(k, block_a, D)
    if v_transpose:
        v_desc = vb_desc = _descriptor(v, cfg.block_n, V_CHUNK.value)
    else:
        vt, _ = transpose_v(v, key_order=cfg.key_order)
        vt = vt if cfg.key_order else vt[..., :Mk]
        v_desc = vb_desc = _descriptor(vt, D, block_a, channels_last=False)
        if block_b:
            vb_desc = _descriptor(vt, D, block_b, channels_last=False)
    n_m = cdiv(Mq, cfg.consumers * WG_ROWS.value)
    n_total = n_m * B * Hq
    if cfg.persistent:
        grid = min(n_total, _sm_count(q.device) * cfg.ctas_per_sm(D, out.element_size()))
    else:
        grid = n_total
    producer_warps = WG_WARPS.value if v_transpose else 1
    producer_regs = TRANSPOSER_REGS if v_transpose else PRODUCER_REGS.value
    launch(_attn_fwd_ws_kernel)[(grid,)](
        _descriptor(q, WG_ROWS.value, D), k_desc, _descriptor(k, block_b, D) if block_b else k_desc, v_desc, vb_desc,
        _descriptor(out, WG_ROWS.value, D), out,
        lse if lse is not None else prep.qd, prep.qd, prep.kd, prep.vd,
        tile_counters(q.device) if cfg.dynamic else prep.qd, scale * LOG2E.value,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0, *prep.descale_strides,
        n_m, n_total, Mq, Mk, Hq, Hq // Hkv,
        HEAD_D=D, BLOCK_N=cfg.block_n, BLOCK_B=block_b, STAGES=cfg.stages, CONSUMERS=cfg.consumers,
        CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_WARPS=producer_warps, PRODUCER_REGS=producer_regs, CAUSAL=causal, WRITE_LSE=return_lse,
        P_SHIFT=_P_SHIFT, KEY_ORDER=cfg.key_order, V_TRANSPOSE=v_transpose, OUT_FP8=out.dtype == torch.float8_e4m3fn,
        PERSISTENT=cfg.persistent, QK_INT8=q.dtype == torch.int8, DIRECT_STORE=cfg.direct_store,
        HEAD_SECTION=cfg.head_section if causal else 0, DYNAMIC=cfg.dynamic, FREE_ISSUE=cfg.free_issue,
        EARLY_P8=cfg.early_p8, ROW_SUM_MMA=cfg.row_sum_mma,
        num_warps=WG_WARPS.value,
        maxnreg=cfg.maxnreg,
    )
    return out, lse


#: int32 scalar arguments of the kernel (their names in kernel order), for ahead-of-time compiles
_INT_ARGS = ("stride_ob", "stride_om", "stride_oh", "stride_lb", "stride_lh", "qd_sb", "qd_sh", "kd_sb", "kd_sh",
             "vd_sb", "vd_sh", "n_m", "n_total", "Mq", "Mk", "Hq", "GROUP")


def compile_sm90(head_dim: int = 128, causal: bool = False, write_lse: bool = False,
                 config: WsFwdConfig | None = None, out_fp8: bool = False, qk_int8: bool = False,
                 launch_ints: dict | None = None):
    """Compile the kernel ahead of time for sm90 (no GPU needed); returns the CompiledKernel (asm: ttgir, ptx,
    cubin). ``launch_ints``: values of the int arguments (``_INT_ARGS`` names) to specialize on as a launch does
    (1 made a constexpr, multiples of 16 marked divisible, but for the kernel's ``do_not_specialize`` ones; the
    pointers marked 16-byte aligned): the register allocation, hence spills, can differ from the unspecialized
    compile's.

    Example: ``"wgmma" in compile_sm90(128, causal=True).asm["ptx"]`` -> True.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config or default_config(head_dim, causal, qk_int8=qk_int8)
    const = {"HEAD_D": head_dim, "BLOCK_N": cfg.block_n, "BLOCK_B": cfg.block_b, "STAGES": cfg.stages,
             "CONSUMERS": cfg.consumers,
             "CONSUMER_REGS": cfg.consumer_regs, "PRODUCER_WARPS": cfg.producer_warps,
             "PRODUCER_REGS": cfg.producer_regs, "CAUSAL": causal, "WRITE_LSE": write_lse, "P_SHIFT": _P_SHIFT,
             "KEY_ORDER": cfg.key_order, "V_TRANSPOSE": cfg.v_transpose, "OUT_FP8": out_fp8,
             "PERSISTENT": cfg.persistent, "QK_INT8": qk_int8, "DIRECT_STORE": cfg.direct_store,
             "HEAD_SECTION": cfg.head_section if causal else 0, "DYNAMIC": cfg.dynamic, "FREE_ISSUE": cfg.free_issue,
             "EARLY_P8": cfg.early_p8, "ROW_SUM_MMA": cfg.row_sum_mma}

    def desc(rows, cols, dtype, channels_last=True):
        shape, layout = _box_layout(rows, cols, dtype, channels_last)
        name = {gl.float8e4nv: "fp8e4nv", gl.int8: "i8", gl.bfloat16: "bf16"}[dtype]
        return f"tensordesc<{name}{list(shape)},{layout!r}>"

    block_a, block_b = cfg.block_n - cfg.block_b, cfg.block_b or cfg.block_n
    v = (desc(cfg.block_n, V_CHUNK.value, gl.float8e4nv) if cfg.v_transpose
         else desc(head_dim, block_a, gl.float8e4nv, False))
    vb = v if cfg.v_transpose else desc(head_dim, block_b, gl.float8e4nv, False)
    qk = gl.int8 if qk_int8 else gl.float8e4nv
    sig = {"q_desc": desc(WG_ROWS.value, head_dim, qk), "k_desc": desc(block_a, head_dim, qk),
           "kb_desc": desc(block_b, head_dim, qk), "v_desc": v, "vb_desc": vb,
           "o_desc": desc(WG_ROWS.value, head_dim, gl.float8e4nv if out_fp8 else gl.bfloat16),
           "Out": "*fp8e4nv" if out_fp8 else "*bf16", "Lse": "*fp32", "QD": "*fp32", "KD": "*fp32", "VD": "*fp32",
           "Counter": "*i32" if cfg.dynamic else "*fp32", "sm_scale_log2": "fp32", **dict.fromkeys(_INT_ARGS, "i32")}
    kept = {p.name for p in _attn_fwd_ws_kernel.params if p.do_not_specialize}
    attrs = {}  # a launch's 16-byte aligned tensors: their pointers are marked divisible too
    if launch_ints is not None:
        attrs = {(list(sig).index(name),): [["tt.divisibility", 16]] for name in ("Out", "Lse", "QD", "KD", "VD", "Counter")}
    for name, value in (launch_ints or {}).items():
        if name in kept:
            continue
        if value == 1:
            sig[name], const[name] = "constexpr", 1
        elif value % 16 == 0:
            attrs[(list(sig).index(name),)] = [["tt.divisibility", 16]]
    sig.update(dict.fromkeys(const, "constexpr"))
    src = GluonASTSource(_attn_fwd_ws_kernel, sig, constexprs={(list(sig).index(n),): v for n, v in const.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": WG_WARPS.value, "maxnreg": cfg.maxnreg})
