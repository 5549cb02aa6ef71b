"""fp8-KV paged decode in Gluon (sm90): one-warp programs (two at D256), fp8 K and V into mma.sync operands.

A split-K decoder with the arguments and outputs of ``kernels/triton/decode.py``'s: q (B, Mq, Hq, D) bf16/fp16 with
Mq * Hq / Hkv <= 16 rows per KV head and D in {64, 128, 256}; K/V caches fp8 e4m3fn (num_pages, page_size, Hkv, D)
with a block table, or dense (B, Lmax, Hkv, D), D contiguous; float32 scales per token and KV head, any strides
(keys contiguous per head, as ``kv_cache.quantize_kv_fp8`` lays them out, lets a tile's scales move in 16-byte
copies). With several splits it writes the float32 workspace that ``kernels.triton.decode.reduce_splits`` combines.
Index guards as the Triton decoder's: lengths clamped to [0, capacity], a program's keys stop at its split's first
block-table entry outside [0, num_pages) (``valid_end``, once per program).

Why Gluon: Triton converts the fp8 V tile either byte by byte into the mma operand (V's reduction dim, the keys,
is not contiguous) or through a fp16 copy in shared memory (the decoder's main stall). Here the
shared-memory views are permuted so that each thread's operand bytes are contiguous: the QK^T reduction dim is
permuted for q and K alike (logical k = 16s + 8h + 2t + e reads d = t * W/4 + 4s + 2h + e, W the tile width),
and PV's output columns are permuted (n = 8j + g holds tile column (W/8) g + j, un-permuted at the store). K and
V then reach registers by 16-byte shared loads, V's key pairs by byte permutes, both through the packed e4m3 ->
f16 cvt. Tiles of BLOCK_N keys stream through a STAGES-deep cp.async ring (K, V and their scales); no cross-warp
synchronisation; with pages shorter than a tile, each row's page id comes from the block table. At D64 a program
takes two adjacent KV heads (``heads_per_program``) as one 128-byte tile per key: each head's query rows hold
their q in that head's half of the reduction dim and zeros in the other's. At D256 two warps split the mma N
(``warps_per_program``): half of QK^T's keys and half of PV's columns each. Numerics as the Triton decoder: fp16
products with float32 accumulation, V scales folded into P relative to the tile's largest (the accumulator is
kept in units of it), exp2 online softmax. Local windows, softcap and key starts as the Triton decoder's: with
``window_left`` >= 0 the splits cut only the keys some query of the sequence sees, scores s become c * tanh(s / c)
with softcap c, and with ``key_start`` (FlashAttention's ``cache_leftpad``) keys below a sequence's start are masked
out and the splits cut only the keys from its tile on (tiles wholly below it are not read).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..softmax import LN2, LOG2E, tanh
from ..triton.launch import launch as launch_cached

HEAD_DIMS = (64, 128, 256)
ROWS = gl.constexpr(16)  # the mma M: query rows per KV head a program can hold
SCAN = gl.constexpr(512)  # block-table entries checked per step of a program's prologue (``valid_end``)


@gluon.constexpr_function
def _v_pairs_layout(block_n, d, warps):
    """Lane (g, t) of warp w in V's permuted [BLOCK_N, D] view holds what mma's B operand needs (keys
    16kb + 8h + 2t + e, columns 8 warps j + 8w + g), its registers ordered j, then e, h, kb: the D/(8 warps)
    columns j of one key are contiguous bytes of shared memory (one 16-byte load at 128 bytes per warp), and the
    two keys of a pair follow each other."""
    regs = [[0, 8 * warps << i] for i in range((d // (8 * warps)).bit_length() - 1)] + [[1, 0], [8, 0]]
    regs += [[16 << i, 0] for i in range((block_n // 16).bit_length() - 1)]
    warp_bases = [[0, 8 << i] for i in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], warp_bases, [], [block_n, d])


@gluon.constexpr_function
def _v_pairs_asm(d):
    """PTX for one key pair of ``_v_pairs_layout``: D/32 words of key 2i and D/32 of key 2i+1 in, D/8 f16x2 out,
    output j = (key 2i, key 2i+1) of column j: two byte permutes and four packed cvts per four columns."""
    words = d // 32
    lines = ["{", ".reg .b32 p<2>;", ".reg .b16 h<4>;"]
    for w in range(words):
        e, o = f"${d // 8 + w}", f"${d // 8 + words + w}"
        lines += [f"prmt.b32 p0, {e}, {o}, 0x5140;", f"prmt.b32 p1, {e}, {o}, 0x7362;",
                  "mov.b32 {h0, h1}, p0;", "mov.b32 {h2, h3}, p1;"]
        lines += [f"cvt.rn.f16x2.e4m3x2 ${4 * w + i}, h{i};" for i in range(4)]
    return "\n".join(lines + ["}"])


@gluon.constexpr_function
def _v_pairs_constraints(d):
    return ",".join(["=r"] * (d // 8) + ["r"] * (d // 16))


@gluon.jit
def _v_operand(v8, b_op: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, WARPS: gl.constexpr):
    """fp8 V tile ``v8`` (``_v_pairs_layout``) -> the fp16 B operand of PV. The asm writes column j's key pair into
    one register, so its output element 2j + e, labelled with its input's coordinates (key bit = the element
    index's top bit, column j' = its other bits), holds (key e, column j); the reshape/permute below only renames
    the registers to what they hold: the key bit is j''s lowest bit, j's top bit is the key bit, j's other bits
    are j''s upper bits (each warp holds D / WARPS columns)."""
    DW: gl.constexpr = D // WARPS
    pairs = gl.inline_asm_elementwise(_v_pairs_asm(DW), _v_pairs_constraints(DW), [v8],
                                      dtype=gl.float16, is_pure=True, pack=DW // 4)
    pairs = gl.reshape(pairs, [BLOCK_N // 2, 2, DW // 16, 2, 8 * WARPS])
    return gl.convert_layout(gl.reshape(gl.permute(pairs, [0, 3, 1, 2, 4]), [BLOCK_N, D]), b_op)


@gluon.jit
def _issue(k_smem, v_smem, ks_smem, vs_smem, st, K, V, KS, VS, kv_page, sc_page, slot0, n0, end, hkv0, off_k, off_v,
           rows, stride_kp, stride_ks, stride_vp, stride_vs, stride_ksp, stride_kss, stride_ksh, stride_vsp,
           stride_vss, stride_vsh, D: gl.constexpr, HEADS: gl.constexpr, BLOCK_N: gl.constexpr,
           PAGE_SIZE: gl.constexpr, STRADDLE: gl.constexpr, sc_layout: gl.constexpr, SC_VEC: gl.constexpr):
    """cp.async of one tile (BLOCK_N keys from ``slot0`` of page ``kv_page`` / ``sc_page``, or with STRADDLE the
    page of each row; keys >= ``end`` zero-filled) of K and V (``K`` / ``V`` at head hkv0; with HEADS = 2 the
    next head adjacent in memory) and the scales of each head into ring stage ``st``; scales SC_VEC per copy (keys contiguous), masked
    per copy, so up to SC_VEC - 1 past ``end`` arrive too (the caller zeroes them)."""
    ok = gl.expand_dims(n0 + rows < end, 1)
    if STRADDLE:
        kv_page = gl.expand_dims(kv_page, 1)
    async_copy.async_copy_global_to_shared(
        k_smem.index(st), K + (kv_page * stride_kp + slot0 * stride_ks) + off_k, mask=ok)
    async_copy.async_copy_global_to_shared(
        v_smem.index(st), V + (kv_page * stride_vp + slot0 * stride_vs) + off_v, mask=ok)
    r = gl.arange(0, BLOCK_N, layout=sc_layout)
    ok_r = n0 + r // SC_VEC * SC_VEC < end
    if STRADDLE:
        r = r % PAGE_SIZE
    for h in gl.static_range(HEADS):
        async_copy.async_copy_global_to_shared(
            ks_smem.index(st * HEADS + h),
            KS + (sc_page * stride_ksp + slot0 * stride_kss + (hkv0 + h) * stride_ksh) + r * stride_kss, mask=ok_r)
        async_copy.async_copy_global_to_shared(
            vs_smem.index(st * HEADS + h),
            VS + (sc_page * stride_vsp + slot0 * stride_vss + (hkv0 + h) * stride_vsh) + r * stride_vss, mask=ok_r)


@gluon.jit
def _key_scales(smem, cols, end, SC_VEC: gl.constexpr):
    """One head's per-key scales of a ring stage in the mma's column layout; with copies of SC_VEC > 1 the scales
    past ``end`` came along with the last copy: whatever they hold is replaced by 0."""
    sc = smem.load(cols.type.layout)
    if SC_VEC > 1:
        sc = gl.where(cols < end, sc, 0.0)
    return sc


@gluon.jit
def valid_end(bt_row, start, end, NUM_PAGES, PAGE_SIZE: gl.constexpr, WARPS: gl.constexpr):
    """``end``, or the first key of [start, end) whose block-table entry is not a page of the pool (entries are
    int32 in [0, NUM_PAGES)): a program's keys stop there, so no copy leaves the pool. Checked once per
    program, SCAN entries per step, so the key loop carries no guard."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    last = gl.cdiv(end, PAGE_SIZE)
    cut = last
    for p0 in range(start // PAGE_SIZE, last, SCAN):
        idx = p0 + gl.arange(0, SCAN, layout=layout)
        inside = idx < last
        page = gl.load(bt_row + idx, mask=inside, other=0)
        bad = inside & (page.to(gl.uint32, bitcast=True) >= NUM_PAGES.to(gl.uint32, bitcast=True))
        cut = gl.minimum(cut, gl.min(gl.where(bad, idx, last), 0))
    return gl.minimum(end, gl.maximum(cut * PAGE_SIZE, start))


@gluon.jit
def split_range(SEQ, SEQ_OFFSET, KEY_START, b, split, NUM_SPLITS, CAPACITY, WINDOW_LEFT, MQ: gl.constexpr,
                BLOCK_N: gl.constexpr, WINDOW: gl.constexpr, HAS_KEY_START: gl.constexpr):
    """(seqlen, key_start, start, end, tiles) of split ``split`` of sequence ``b``: splits of whole BLOCK_N-key
    tiles, the last ones possibly empty; the length SEQ[b] + SEQ_OFFSET clamped to [0, CAPACITY] (block-table reads
    stay inside its row); with HAS_KEY_START the sequence's first key KEY_START[b] clamped to [0, seqlen] (else 0).
    The splits start at the tile holding the first key (and with a WINDOW, the first key the sequence's first query
    sees)."""
    seqlen = gl.minimum(gl.maximum(gl.load(SEQ + b) + SEQ_OFFSET, 0), CAPACITY)
    if HAS_KEY_START:
        key_start = gl.minimum(gl.maximum(gl.load(KEY_START + b), 0), seqlen)
    else:
        key_start = 0
    if WINDOW:
        first = gl.maximum(gl.maximum(seqlen - MQ - WINDOW_LEFT, 0), key_start) // BLOCK_N * BLOCK_N
    else:
        first = key_start // BLOCK_N * BLOCK_N
    chunk = gl.cdiv(gl.cdiv(seqlen - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    end = gl.minimum(start + chunk, seqlen)
    return seqlen, key_start, start, end, gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)


@gluon.jit
def _tile_origin(bt_row, b, n, end, kv_rows, sc_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                 PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, STRADDLE: gl.constexpr, SC_VEC: gl.constexpr):
    """(page in K/V's row layout, page in the scales' layout, first slot) of the tile starting at key ``n``; with
    STRADDLE (pages shorter than the tile) the page of every row and slot 0; page 0 past ``end`` (masked; for the
    scales per copy of SC_VEC rows, which share a page)."""
    if STRADDLE:
        sc_rows = gl.arange(0, BLOCK_N, layout=sc_layout)
        kv_page = gl.load(bt_row + (n + kv_rows) // PAGE_SIZE, mask=n + kv_rows < end, other=0).to(gl.int64)
        sc_page = gl.load(bt_row + (n + sc_rows) // PAGE_SIZE, mask=n + sc_rows // SC_VEC * SC_VEC < end,
                          other=0).to(gl.int64)
        return kv_page, sc_page, 0
    elif PAGED:  # the slot as n // BLOCK_N * BLOCK_N: the compiler keeps its alignment (n % PAGE_SIZE loses it)
        page = gl.load(bt_row + n // PAGE_SIZE, mask=n < end, other=0).to(gl.int64)
        return page, page, n // BLOCK_N % (PAGE_SIZE // BLOCK_N) * BLOCK_N
    else:
        return b.to(gl.int64), b.to(gl.int64), n


@gluon.jit(do_not_specialize=["Q_ROWS", "NUM_PAGES", "CAPACITY", "WINDOW_LEFT", "SEQ_OFFSET"])
def _decode_fp8_kernel(
    Q, K, V, KS, VS, SEQ, BT, OUT, LSE, KEY_START,
    stride_qb, stride_qm, stride_qh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    stride_btb,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lh, stride_lm,
    qk_scale, softcap_log2, NUM_KV_HEADS, NUM_SPLITS, NUM_PAGES, CAPACITY, Q_ROWS, WINDOW_LEFT, SEQ_OFFSET,
    G: gl.constexpr, MQ: gl.constexpr, D: gl.constexpr, HEADS: gl.constexpr, WARPS: gl.constexpr,
    BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, PARTIAL: gl.constexpr,
    STAGES: gl.constexpr, PDL: gl.constexpr, SC_VEC: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
    STORE_LSE: gl.constexpr, HAS_KEY_START: gl.constexpr,
):
    STRADDLE: gl.constexpr = PAGED and PAGE_SIZE < BLOCK_N  # a tile spans BLOCK_N / PAGE_SIZE pages
    # HEADS (1 or 2) adjacent KV heads per program: the tile is DT = HEADS * D bytes of each key; query row r
    # belongs to head r // RB of the program, and its q sits block-diagonally in the QK^T reduction dim (zeros
    # against the other heads' K), so one mma serves every head; PV's output columns of other heads are not stored
    DT: gl.constexpr = HEADS * D
    RB: gl.constexpr = ROWS // HEADS
    # WARPS (1 or 2) split the mma N: QK^T's keys and PV's output columns (D256: each warp the D128 program's work)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    v_layout: gl.constexpr = _v_pairs_layout(BLOCK_N, DT, WARPS)
    kv_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (DT // 16), DT // 16], [WARPS, 1], [1, 0])
    sc_layout: gl.constexpr = gl.BlockedLayout([SC_VEC], [32], [WARPS], [0])
    # 16-byte chunks XOR-swizzled by row: the operand loads of rows 2t, 2t+1, ... hit different banks
    kv_smem: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [1, 0])
    sc_smem: gl.constexpr = gl.SwizzledSharedLayout(SC_VEC, 1, 1, [0])

    if PDL:  # the split reduce may launch now and wait for this grid on the device (programmatic dependent launch)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
    pid_bh = gl.program_id(0)
    split = gl.program_id(1)
    b = pid_bh // (NUM_KV_HEADS // HEADS)
    hkv0 = (pid_bh % (NUM_KV_HEADS // HEADS)) * HEADS
    seqlen, key_start, start, end, n_tiles = split_range(SEQ, SEQ_OFFSET, KEY_START, b, split, NUM_SPLITS, CAPACITY,
                                                         WINDOW_LEFT, MQ, BLOCK_N, WINDOW, HAS_KEY_START)
    K = K + hkv0 * stride_kh  # the program's (first) KV head
    V = V + hkv0 * stride_vh
    bt_row = BT + b * stride_btb
    if PAGED:
        end = valid_end(bt_row, start, end, NUM_PAGES, PAGE_SIZE, WARPS)
        n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)

    # q in the A-operand layout with the reduction dim permuted like K's view below
    qr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, a_op))
    qk = gl.arange(0, DT, layout=gl.SliceLayout(0, a_op))
    qd = ((qk // 2) % 4) * (DT // 4) + (qk // 16) * 4 + ((qk // 8) % 2) * 2 + qk % 2
    q_row = (qr % RB // G) * stride_qm + ((hkv0 + qr // RB) * G + qr % RB % G) * stride_qh
    q_ptr = Q + b.to(gl.int64) * stride_qb + gl.expand_dims(q_row, 1) + gl.expand_dims(qd % D, 0)
    # Q_ROWS (= G * MQ per head) is a runtime value so that the padding rows are registers, not constant zeros
    # that would be rematerialised into a register quad before every QK^T mma
    q_ok = gl.expand_dims(qr % RB < Q_ROWS, 1) & (gl.expand_dims(qd // D, 0) == gl.expand_dims(qr // RB, 1))
    q = gl.load(q_ptr, mask=q_ok, other=0.0).to(gl.float16)

    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, DT], kv_smem)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, DT], kv_smem)
    ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES * HEADS, BLOCK_N], sc_smem)
    vs_smem = gl.allocate_shared_memory(gl.float32, [STAGES * HEADS, BLOCK_N], sc_smem)
    kv_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    kv_cols = gl.arange(0, DT, layout=gl.SliceLayout(0, kv_layout))
    kv_slots = kv_rows % PAGE_SIZE if STRADDLE else kv_rows  # each row's slot from the tile's first
    off_k = gl.expand_dims(kv_slots * stride_ks, 1) + gl.expand_dims(kv_cols, 0)
    off_v = gl.expand_dims(kv_slots * stride_vs, 1) + gl.expand_dims(kv_cols, 0)

    for i in gl.static_range(STAGES - 1):  # prologue; groups past the end are empty but keep the count
        kv_page, sc_page, slot0 = _tile_origin(bt_row, b, start + i * BLOCK_N, end, kv_rows, sc_layout, BLOCK_N,
                                               PAGE_SIZE, PAGED, STRADDLE, SC_VEC)
        _issue(k_smem, v_smem, ks_smem, vs_smem, i, K, V, KS, VS, kv_page, sc_page, slot0, start + i * BLOCK_N, end,
               hkv0, off_k, off_v, kv_rows, stride_kp, stride_ks, stride_vp, stride_vs, stride_ksp, stride_kss,
               stride_ksh, stride_vsp, stride_vss, stride_vsh, D, HEADS, BLOCK_N, PAGE_SIZE, STRADDLE, sc_layout, SC_VEC)
        async_copy.commit_group()

    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    row_head = gl.expand_dims(rows // RB, 1)
    qi = rows % RB // G  # query token and head of each row
    qh = (hkv0 + rows // RB) * G + rows % RB % G
    last_key = seqlen - MQ + qi  # query row r sees keys <= its position
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, mma))
    acc = gl.zeros([ROWS, DT], gl.float32, mma)
    unit = gl.to_tensor(1.0)
    # the page id of the tile issued next iteration is loaded one iteration ahead, off the issue's path
    kv_next, sc_next, slot_next = _tile_origin(bt_row, b, start + (STAGES - 1) * BLOCK_N, end, kv_rows, sc_layout,
                                               BLOCK_N, PAGE_SIZE, PAGED, STRADDLE, SC_VEC)
    for it in range(n_tiles):
        gl.thread_barrier()  # every thread is done with the stage refilled below
        n_issue = start + (it + STAGES - 1) * BLOCK_N
        kv_page, sc_page, slot0 = kv_next, sc_next, slot_next
        kv_next, sc_next, slot_next = _tile_origin(bt_row, b, n_issue + BLOCK_N, end, kv_rows, sc_layout, BLOCK_N,
                                                   PAGE_SIZE, PAGED, STRADDLE, SC_VEC)
        _issue(k_smem, v_smem, ks_smem, vs_smem, (it + STAGES - 1) % STAGES, K, V, KS, VS, kv_page, sc_page, slot0,
               n_issue, end, hkv0, off_k, off_v, kv_rows, stride_kp, stride_ks, stride_vp, stride_vs, stride_ksp,
               stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh, D, HEADS, BLOCK_N, PAGE_SIZE, STRADDLE,
               sc_layout, SC_VEC)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()  # tile `it` visible to every thread
        st = it % STAGES

        kt = (k_smem.index(st).reshape([BLOCK_N, 4, DT // 16, 2, 2]).permute([0, 2, 3, 1, 4])
              .reshape([BLOCK_N, DT]).permute([1, 0]).load(b_op))
        s = mma_v2(q, kt.to(gl.float16), gl.zeros([ROWS, BLOCK_N], gl.float32, mma))
        # per-key scales of the first head, [1, BLOCK_N]; of each row's head ([ROWS, BLOCK_N]) with two heads
        cols = start + it * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        ks = _key_scales(ks_smem.index(st * HEADS), cols, end, SC_VEC)
        vs = _key_scales(vs_smem.index(st * HEADS), cols, end, SC_VEC)
        v_max = gl.max(vs, 0)
        if HEADS == 2:
            ks1 = _key_scales(ks_smem.index(st * 2 + 1), cols, end, SC_VEC)
            vs1 = _key_scales(vs_smem.index(st * 2 + 1), cols, end, SC_VEC)
            v_max = gl.maximum(v_max, gl.max(vs1, 0))
        v_max = gl.where(v_max > 0.0, v_max, 1.0)
        k_sc = gl.expand_dims(ks * qk_scale, 0)
        v_sc = gl.expand_dims(vs / v_max, 0)
        if HEADS == 2:
            k_sc = gl.where(row_head == 1, gl.expand_dims(ks1 * qk_scale, 0), k_sc)
            v_sc = gl.where(row_head == 1, gl.expand_dims(vs1 / v_max, 0), v_sc)
        if SOFTCAP:  # qk_scale is then the natural scale / c: c * tanh(scale * q.k / c) in log2 units
            s = tanh(s * k_sc) * softcap_log2
        else:
            s = s * k_sc
        # keys of the sequence's rows: below the end (past it K is zero-filled) and, with starts, from the start on
        key_ok = cols < end
        if HAS_KEY_START:
            key_ok = key_ok & (cols >= key_start)
        if MQ > 1 or WINDOW:
            visible = (gl.expand_dims(cols, 0) <= gl.expand_dims(last_key, 1)) & gl.expand_dims(key_ok, 0)
            if WINDOW:
                visible = visible & (gl.expand_dims(cols, 0) >= gl.expand_dims(last_key - WINDOW_LEFT, 1))
            s = gl.where(visible, s, float("-inf"))
        else:  # one FMA per score (the product above and this sum): the keys not in the rows get -inf
            s = s + gl.expand_dims(gl.where(key_ok, 0.0, float("-inf")), 0)
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        # V scales enter P relative to the tile's largest (fp16 P cannot overflow); acc is kept in that unit
        pv = gl.convert_layout((p * v_sc).to(gl.float16), a_op)
        v8 = (v_smem.index(st).reshape([BLOCK_N, 8, WARPS, DT // (8 * WARPS)]).permute([0, 3, 2, 1])
              .reshape([BLOCK_N, DT]).load(v_layout))
        acc = mma_v2(pv, _v_operand(v8, b_op, BLOCK_N, DT, WARPS), acc * gl.expand_dims(alpha * (unit / v_max), 1))
        unit = v_max
        m_i = m_new
    async_copy.wait_group(0)

    seen = l_i > 0.0
    o = acc * gl.expand_dims(gl.where(seen, unit / gl.where(seen, l_i, 1.0), 0.0), 1)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    row_ok = rows % RB < Q_ROWS
    if STORE_LSE:
        gl.store(LSE + split * stride_ls + b * stride_lb + qh * stride_lh + qi * stride_lm, lse, mask=row_ok)
    # PV's output column n = 8 WARPS a + 8 w + c is tile column (DT / 8) c + (DT / (8 WARPS)) w + a (head col // D,
    # dim col % D): undo that permutation by renaming, then store whole rows (16-byte chunks per thread) instead
    # of the mma layout's scattered 4-byte pieces (one sector per element)
    o = gl.reshape(gl.permute(gl.reshape(o, [ROWS, DT // (8 * WARPS), WARPS, 8]), [0, 3, 2, 1]), [ROWS, DT])
    if not PARTIAL:
        o = o.to(OUT.dtype.element_ty)
    TC: gl.constexpr = DT // (4 * WARPS) if DT // (4 * WARPS) < 32 else 32
    out_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TC, TC], [1, WARPS], [1, 0])
    o = gl.convert_layout(o, out_layout)
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_layout))
    col = gl.arange(0, DT, layout=gl.SliceLayout(0, out_layout))
    row_off = (r % RB // G) * stride_om + ((hkv0 + r // RB) * G + r % RB % G) * stride_oh
    o_ok = gl.expand_dims(r % RB < Q_ROWS, 1)
    if HEADS == 1:
        o_ptr = gl.expand_dims(row_off, 1) + gl.expand_dims(col, 0)
    else:  # row r holds head r // RB: its columns are the tile's of that head
        o_ptr = gl.expand_dims(row_off, 1) + gl.expand_dims(col % D, 0)
        o_ok = o_ok & (gl.expand_dims(col // D, 0) == gl.expand_dims(r // RB, 1))
    gl.store(OUT + split.to(gl.int64) * stride_os + b.to(gl.int64) * stride_ob + o_ptr, o, mask=o_ok)


def heads_per_program(head_dim: int, num_kv_heads: int, q_rows_per_kv_head: int, heads_adjacent: bool = True) -> int:
    """KV heads one program takes: two adjacent heads at D64 when their query rows fit the 16-row mma together
    and each key's heads are contiguous in both caches (``heads_adjacent``: a 128-byte tile per key, the D128
    program's work serves both heads), else one."""
    pair = head_dim == 64 and num_kv_heads % 2 == 0 and q_rows_per_kv_head <= ROWS.value // 2
    return 2 if pair and heads_adjacent else 1


def warps_per_program(head_dim: int) -> int:
    """Warps of one program: two at D256 (each takes half of QK^T's keys and half of PV's columns), else one."""
    return 2 if head_dim == 256 else 1


@dataclass(frozen=True)
class TileConfig:
    """Tile config of ``_decode_fp8_kernel``: keys per tile and the depth of the cp.async ring."""

    block_n: int
    stages: int


def tile_config(page_size: int | None, tile_width: int, keys_per_program: int = 0,
                vector_scales: bool = False) -> TileConfig | None:
    """The TileConfig for a page size (None: dense cache), tile width (head dim x heads per program), keys
    per program and whether scales move in 16-byte copies, or None for pages the tiles cannot cover. Measured on
    the H200, 4 programs per SM: 32-key tiles; 128-byte rows take 3 stages when the scales come in 16-byte copies
    and a program walks >= 1536 keys (4% faster than 2 at B64/L4096; no gain at 1024 keys), else 2 (with 4-byte
    scale copies 3 stages ran 5% slower: the scales' L1 traffic); 64-byte rows 3 (6-11% faster). Pages of 1-16
    keys: 32-key tiles spanning pages (p16: 1.70x bf16 against 1.68x with 16-key tiles); other multiples of 16:
    16-key tiles, 4 stages, 8 per SM."""
    if page_size is None or page_size % 32 == 0 or 32 % page_size == 0:
        if tile_width <= 64:
            return TileConfig(32, 3)
        return TileConfig(32, 3 if tile_width == 128 and vector_scales and keys_per_program >= 1536 else 2)
    if page_size % 16 == 0:
        return TileConfig(16, 4)
    return None


def takes_shape(head_dim: int, q_rows_per_kv_head: int, page_size: int | None) -> bool:
    """Whether the kernel handles this shape: D 64/128/256, <= 16 query rows per KV head, pages its tiles cover
    (``page_size`` None: a dense cache)."""
    return head_dim in HEAD_DIMS and q_rows_per_kv_head <= ROWS and tile_config(page_size, head_dim) is not None


def resident_programs(page_size: int | None, tile_width: int) -> int:
    """Programs per SM of the one-warp programs: 4 with 32-key tiles (8 fit, but B64/L4096 and B128/L1024 ran
    5-10% faster as one wave of 4 per SM than with the splits that fill 8), 8 with 16-key tiles (B64/L4096:
    1.64x bf16 with 8, 1.40x with 4). The kernel is latency bound: its time follows waves of these programs."""
    return 4 if tile_config(page_size, tile_width).block_n == 32 else 8


def programs_per_split(batch: int, num_kv_heads: int, heads: int) -> int:
    """Programs launched per key split: one per (sequence, group of ``heads`` KV heads)."""
    return batch * num_kv_heads // heads


def heads_adjacent(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether each key's heads are contiguous in both caches (stride of the head dim = D)."""
    return all(t.stride(2) == t.shape[3] for t in (k_cache, v_cache))


def vector_scales(k_scale: torch.Tensor, v_scale: torch.Tensor) -> bool:
    """Whether a tile's scales can move 4 per copy: each head's keys contiguous (stride 1 along the slots) in
    both tensors and slot counts (page sizes) a multiple of 4 (a copy stays in one page and in bounds)."""
    return all(t.stride(1) == 1 and t.shape[1] % 4 == 0 for t in (k_scale, v_scale))


class FP8Decoder:
    """``launch``'s kernel for calls of one layout: tile choices, grid and constexprs made once from the tensors and
    settings given here (``launch``'s), ``decoder(q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table, out,
    lse, out_strides, lse_strides, key_start)`` per call, each call's pointers, strides and sizes read from its own
    tensors. Calls pass tensors of the shapes given here (``key_start`` given or None as here); one whose caches or
    scales have other strides (which the heads per program and the scale copies are chosen from) runs a decoder of
    its own. ``bound``: the launch is a ``BoundLaunch`` (a plan's repeated calls: the launch key is checked, not
    rebuilt).

    Example
    -------
    >>> decoder = FP8Decoder(q, k8, v8, k_scale, v_scale, table, 128 ** -0.5 * 1.4426950408889634, 1, 64,
    ...                      bound=True)  # doctest: +SKIP
    >>> decoder(q, k8, v8, k_scale, v_scale, lengths, table, out, lse, (0, *out.stride()[:3]),
    ...         (0, *lse.stride()), None)  # doctest: +SKIP
    """

    def __init__(self, q, k_cache, v_cache, k_scale, v_scale, block_table, qk_scale_log2: float, num_splits: int,
                 page_size: int | None, pdl: bool = False, *, window_left: int = -1, softcap: float = 0.0,
                 store_lse: bool = True, seqlen_offset: int = 0, key_start: torch.Tensor | None = None,
                 bound: bool = False) -> None:
        B, MQ, HQ, D = q.shape
        hkv = k_cache.shape[2]
        heads = heads_per_program(D, hkv, MQ * (HQ // hkv), heads_adjacent(k_cache, v_cache))
        warps = warps_per_program(D)
        paged = page_size is not None
        capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
        vec = vector_scales(k_scale, v_scale)
        keys = capacity if window_left < 0 else min(capacity, window_left + MQ)
        tiles = tile_config(page_size, heads * D, -(-keys // num_splits), vec)
        qk_scale, softcap_log2 = ((qk_scale_log2 / (LOG2E.value * softcap), softcap * LOG2E.value) if softcap
                                  else (qk_scale_log2, 0.0))
        self._paged, self._page_size = paged, page_size or 1
        self._strides = (k_cache.stride(), v_cache.stride(), k_scale.stride(), v_scale.stride())
        self._settings = (qk_scale_log2, num_splits, page_size, pdl, dict(
            window_left=window_left, softcap=softcap, store_lse=store_lse, seqlen_offset=seqlen_offset))
        self._constants = (qk_scale, softcap_log2, hkv, num_splits)
        self._tail = (MQ * (HQ // hkv), max(window_left, 0), seqlen_offset)
        grid = (programs_per_split(B, hkv, heads), num_splits)
        fixed = dict(G=HQ // hkv, MQ=MQ, D=D, HEADS=heads, WARPS=warps, BLOCK_N=tiles.block_n,
                     PAGE_SIZE=page_size or 1, PAGED=paged, PARTIAL=num_splits > 1, STAGES=tiles.stages, PDL=pdl,
                     SC_VEC=4 if vec else 1, WINDOW=window_left >= 0, SOFTCAP=softcap > 0.0,
                     STORE_LSE=store_lse or num_splits > 1, HAS_KEY_START=key_start is not None, num_warps=warps)
        kernel = launch_cached(_decode_fp8_kernel)
        self._launch = kernel.bind(grid, **fixed) if bound else functools.partial(kernel[grid], **fixed)

    def __call__(self, q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table, out, lse, out_strides,
                 lse_strides, key_start=None) -> None:
        strides = k_cache.stride(), v_cache.stride(), k_scale.stride(), v_scale.stride()
        if strides != self._strides:  # heads per program and scale copies were chosen for the given strides
            qk_scale_log2, num_splits, page_size, pdl, options = self._settings
            FP8Decoder(q, k_cache, v_cache, k_scale, v_scale, block_table, qk_scale_log2, num_splits, page_size, pdl,
                       key_start=key_start, **options)(q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table,
                                                       out, lse, out_strides, lse_strides, key_start)
            return
        ks, vs, kss, vss = strides
        paged = self._paged
        self._launch(
            q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table if paged else seqlens, out, lse,
            seqlens if key_start is None else key_start,
            *q.stride()[:3], *ks[:3], *vs[:3], *kss, *vss, block_table.stride(0) if paged else 0, *out_strides,
            *lse_strides, *self._constants, k_cache.shape[0],
            block_table.shape[1] * self._page_size if paged else k_cache.shape[1], *self._tail)


def launch(q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table, out, lse, out_strides, lse_strides,
           qk_scale_log2: float, num_splits: int, page_size: int | None, pdl: bool = False, *,
           window_left: int = -1, softcap: float = 0.0, store_lse: bool = True, seqlen_offset: int = 0,
           key_start: torch.Tensor | None = None) -> None:
    """Run the kernel into ``out`` / ``lse`` (the final tensors, or the split workspace with its leading split
    strides in ``out_strides`` / ``lse_strides``, see ``kernels.triton.decode.split_buffers``); arguments as
    ``kernels.triton.decode.paged_decode``'s, ``page_size`` None for a dense cache, the shape one that
    ``takes_shape`` accepts; ``pdl``: a split reduce follows by programmatic dependent launch; ``window_left``
    (-1 = unbounded) and ``softcap`` (0 = off) as ``paged_decode``'s, ``qk_scale_log2`` the softmax scale times
    log2(e) either way; ``store_lse`` False: the one-split decoder writes no LSE (``lse`` is then a placeholder,
    see ``split_buffers``); ``seqlen_offset``: an int added to every length on the device; ``key_start``: int32
    (B,) contiguous on q's device (FlashAttention's ``cache_leftpad``; None: 0), as ``paged_decode``'s (keys below
    it invisible, clamped to [0, length]), not checked here (the op path validates it).

    Example
    -------
    >>> launch(q, k8, v8, k_scale, v_scale, lengths, table, out, lse, (0, *out.stride()[:3]), (0, *lse.stride()),
    ...        128 ** -0.5 * 1.4426950408889634, 1, 64)  # doctest: +SKIP
    """
    FP8Decoder(q, k_cache, v_cache, k_scale, v_scale, block_table, qk_scale_log2, num_splits, page_size, pdl,
               window_left=window_left, softcap=softcap, store_lse=store_lse, seqlen_offset=seqlen_offset,
               key_start=key_start)(q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table, out, lse, out_strides,
                                    lse_strides, key_start)
