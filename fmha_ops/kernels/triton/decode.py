"""Paged-attention decode: a split-K decoder and its reduce kernel.

One program handles one (sequence, KV head, key split, row block). Its rows are the
``Hq // Hkv`` query heads sharing the KV head times the ``Mq`` new tokens, so every K/V
byte of a split is read once per row block. K/V are bf16/fp16 like ``q``, or fp8 e4m3 with
a float32 scale per token and KV head: the K scale multiplies the columns of ``q @ k^T``
and the V scale the columns of ``P`` before ``P @ v``, so dequantization costs no extra pass.
On NVIDIA sm89+ the fp8 V tile is converted to fp16 in its load layout (see ``_e4m3_to_f16``).

Local attention (``window_left`` >= 0): query i, at position p_i = seqlen - Mq + i, sees keys
[p_i - window_left, p_i]; the splits cut only the keys some query of the sequence can see, so key tiles wholly
left of the window are never read. Key starts (``key_start``, FlashAttention's ``cache_leftpad``): sequence b's
keys below key_start[b] are masked out like keys past its length, and tiles wholly below it are not read. Softcap
c > 0: scores s become c * tanh(s / c) before the softmax.

With ``num_splits == 1`` the decoder writes the final output and LSE. Otherwise each
split writes a float32 partial output (normalized) and its LSE into a workspace whose size
depends on static shapes only, and the reduce kernel combines them with log-sum-exp
weights (``reduce_splits``, also the reduce of the Gluon fp8 decoder). Each sequence's keys are cut into
``num_splits`` equal chunks of its own length; ``kernels/decode_splits.py`` chooses the count.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fmha_ops.kernels.softmax import LN2, LOG2E, add_sink, tanh
from fmha_ops.kernels.triton.launch import cdiv, launch, next_pow2, pow2_width

SCAN = tl.constexpr(512)  # block-table entries checked per step of a program's prologue (``valid_end``)


@triton.jit
def _e4m3_to_f16(x, ASM: tl.constexpr):
    """fp8 e4m3 -> fp16, exact. ``ASM``: the packed ``cvt.rn.f16x2.e4m3x2`` as impure inline asm, which Triton
    cannot hoist past the layout change into the mma operand: the tile is then converted in its load layout
    (16-byte shared loads) and reaches the operand through ldmatrix, instead of being gathered one byte per
    shared load in the operand layout (V's reduction dim, the keys, is not contiguous). For K (reduction dim
    D contiguous) the hoisted plain conversion is faster."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 a<2>; mov.b32 {a0, a1}, $2; cvt.rn.f16x2.e4m3x2 $0, a0; cvt.rn.f16x2.e4m3x2 $1, a1; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return x.to(tl.float16)


@triton.jit
def valid_end(bt_row, start, end, num_pages, PAGE_SIZE: tl.constexpr):
    """``end``, or the first key of [start, end) whose block-table entry is not a page of the pool (entries are
    int32 in [0, num_pages)): a program's keys stop there, so no load leaves the pool. Checked once per program,
    SCAN entries per step, so the key loop carries no guard."""
    last = tl.cdiv(end, PAGE_SIZE)
    cut = last
    for p0 in range(start // PAGE_SIZE, last, SCAN):
        idx = p0 + tl.arange(0, SCAN)
        inside = idx < last
        page = tl.load(bt_row + idx, mask=inside, other=0)
        bad = inside & (page.to(tl.uint32, bitcast=True) >= num_pages.to(tl.uint32, bitcast=True))
        cut = tl.minimum(cut, tl.min(tl.where(bad, idx, last), 0))
    return tl.minimum(end, tl.maximum(cut * PAGE_SIZE, start))


@triton.jit(do_not_specialize=["NUM_PAGES", "CAPACITY", "WINDOW_LEFT", "SEQ_OFFSET"])
def _decode_kernel(
    Q, K, V, KS, VS, SEQ, BT, OUT, LSE, SINKS, KEY_START,
    stride_qb, stride_qm, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ksp, stride_kss, stride_ksh,
    stride_vsp, stride_vss, stride_vsh,
    stride_btb,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lh, stride_lm,
    qk_scale, softcap_log2,
    NUM_KV_HEADS, NUM_SPLITS, NUM_PAGES, CAPACITY, WINDOW_LEFT, SEQ_OFFSET,
    G: tl.constexpr, MQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, FP8: tl.constexpr, PARTIAL: tl.constexpr,
    ASM_CVT: tl.constexpr, PDL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    STORE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_KEY_START: tl.constexpr,
):
    """One program: the rows (query heads x new tokens) of one KV head over one key split. D / DV: the q/k and the
    value head dims, each padded to a power of two in registers (loads past it read 0, stores stop at it).
    HAS_SINKS (one split only, not PARTIAL): the head's sink logit ``SINKS[qh]`` joins each row's denominator
    after the last tile; with splits the reduce adds it, once. HAS_KEY_START: keys below ``KEY_START[b]`` (clamped
    to [0, seqlen]) are invisible and the splits cut only the keys from its tile on."""
    BLOCK_D: tl.constexpr = pow2_width(D)
    BLOCK_DV: tl.constexpr = pow2_width(DV)
    if PDL:  # the split reduce may launch now and wait for this grid on the device (programmatic dependent launch)
        gdc_launch_dependents()
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    hkv = pid_bh % NUM_KV_HEADS

    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * MQ
    qi = rows // G
    qh = hkv * G + rows % G
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV

    # lengths (SEQ[b] + SEQ_OFFSET) outside [0, CAPACITY] are clamped: the block-table reads below stay inside
    # its rows
    seqlen = tl.minimum(tl.maximum(tl.load(SEQ + b) + SEQ_OFFSET, 0), CAPACITY)
    if HAS_KEY_START:  # the sequence's first key; clamped, so the block-table reads below stay inside its row
        key_start = tl.minimum(tl.maximum(tl.load(KEY_START + b), 0), seqlen)
    else:
        key_start = 0
    if WINDOW:  # the first tile holding a key that the sequence's first query sees
        first = tl.maximum(tl.maximum(seqlen - MQ - WINDOW_LEFT, 0), key_start) // BLOCK_N * BLOCK_N
    else:
        first = key_start // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(seqlen - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    end = tl.minimum(start + chunk, seqlen)
    bt_row = BT + b * stride_btb
    if PAGED:
        end = valid_end(bt_row, start, end, NUM_PAGES, PAGE_SIZE)
    # query row i sits at position seqlen - MQ + i and sees keys j <= that position (and, with a window, j >=
    # that position - WINDOW_LEFT)
    last_key = seqlen - MQ + qi

    q = tl.load(Q + b.to(tl.int64) * stride_qb + qi[:, None] * stride_qm + qh[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8:
        # e4m3 -> fp16 is one packed cvt on sm89+, -> bf16 takes three: run both dots in fp16
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    k_head = K + hkv * stride_kh
    v_head = V + hkv * stride_vh
    # page ids of the next tile are loaded one iteration ahead, off the K/V loads' critical path (a page id
    # loaded in the same iteration keeps Triton's pipeliner from prefetching that tile's K/V)
    if PAGED and PAGE_SIZE % BLOCK_N == 0:
        page_next = tl.load(bt_row + start // PAGE_SIZE, mask=start < end, other=0)
    elif PAGED:
        offs_next = start + tl.arange(0, BLOCK_N)
        pages_next = tl.load(bt_row + offs_next // PAGE_SIZE, mask=offs_next < end, other=0)
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        kv_ok = offs_n < end
        if PAGED:
            if PAGE_SIZE % BLOCK_N == 0:
                page = page_next.to(tl.int64)
                page_next = tl.load(bt_row + (n + BLOCK_N) // PAGE_SIZE, mask=n + BLOCK_N < end, other=0)
            else:
                page = pages_next.to(tl.int64)
                offs_next = offs_n + BLOCK_N
                pages_next = tl.load(bt_row + offs_next // PAGE_SIZE, mask=offs_next < end, other=0)
            slot = offs_n % PAGE_SIZE
        else:
            page = b.to(tl.int64)
            slot = offs_n
        k = tl.load(k_head + (page * stride_kp + slot * stride_ks)[:, None] + offs_d[None, :],
                    mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_head + (page * stride_vp + slot * stride_vs)[:, None] + offs_dv[None, :],
                    mask=kv_ok[:, None] & dv_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if FP8:
            ks = tl.load(KS + page * stride_ksp + slot * stride_kss + hkv * stride_ksh, mask=kv_ok, other=0.0)
            s = s * (ks * qk_scale)[None, :]
        else:
            s = s * qk_scale
        if SOFTCAP:  # qk_scale is then the natural scale / c: c * tanh(scale * q.k / c) in log2 units
            s = tanh(s) * softcap_log2
        visible = (offs_n[None, :] <= last_key[:, None]) & kv_ok[None, :]
        if HAS_KEY_START:
            visible = visible & (offs_n[None, :] >= key_start)
        if WINDOW:
            visible = visible & (offs_n[None, :] >= last_key[:, None] - WINDOW_LEFT)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:
            # V scales enter P's columns relative to the tile's largest, so fp16 P cannot overflow
            vs = tl.load(VS + page * stride_vsp + slot * stride_vss + hkv * stride_vsh, mask=kv_ok, other=0.0)
            v_max = tl.max(vs, 0)
            v_max = tl.where(v_max > 0.0, v_max, 1.0)
            pv = (p * (vs / v_max)[None, :]).to(tl.float16)
            acc = acc * alpha[:, None] + tl.dot(pv, _e4m3_to_f16(v, ASM_CVT)) * v_max
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    if HAS_SINKS:
        m_i, l_i, alpha = add_sink(m_i, l_i, tl.load(SINKS + qh, mask=row_ok, other=0.0) * LOG2E, 0)
        acc = acc * alpha[:, None]
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    o_ptrs = (OUT + split.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob + qi[:, None] * stride_om
              + qh[:, None] * stride_oh + offs_dv[None, :])
    if PARTIAL:
        tl.store(o_ptrs, o, mask=row_ok[:, None] & dv_ok[None, :])
    else:
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    if STORE_LSE:
        tl.store(LSE + split * stride_ls + b * stride_lb + qh * stride_lh + qi * stride_lm, lse, mask=row_ok)


@triton.jit
def _reduce_kernel(
    PO, PL, OUT, LSE, SINKS,
    stride_pos, stride_pls,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_lm,
    HQ, MQ, NUM_SPLITS,
    S_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, STORE_LSE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One output row's dims [chunk * BLOCK_D, ...) (those < D): the splits' partial outputs weighted by
    exp(lse_split - lse); HAS_SINKS: the head's sink logit ``SINKS[h]`` joins the denominator here, once."""
    row = tl.program_id(0)  # (b * MQ + i) * HQ + h, the row order of the contiguous partial output
    chunk = tl.program_id(1)  # head dims [chunk * BLOCK_D, (chunk + 1) * BLOCK_D)
    h = row % HQ
    i = (row // HQ) % MQ
    b = row // (HQ * MQ)
    offs_s = tl.arange(0, S_PAD)
    offs_d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    s_ok = offs_s < NUM_SPLITS
    if PDL:  # launched early (programmatic dependent launch): wait until the decoder's partials are written
        gdc_wait()
    pl = tl.load(PL + offs_s * stride_pls + (b * HQ + h) * MQ + i, mask=s_ok, other=float("-inf"))
    m = tl.max(pl, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(pl - m_safe)
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m_safe)
    po = tl.load(PO + offs_s[:, None] * stride_pos + row.to(tl.int64) * D + offs_d[None, :],
                 mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(po * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    lse = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(OUT + b.to(tl.int64) * stride_ob + i * stride_om + h * stride_oh + offs_d,
             o.to(OUT.dtype.element_ty), mask=d_ok)
    if STORE_LSE:
        if chunk == 0:
            tl.store(LSE + b * stride_lb + h * stride_lh + i * stride_lm, lse)


@functools.cache
def _asm_cvt(device: torch.device) -> bool:
    """Whether ``_e4m3_to_f16`` may use inline asm: compiled (not interpreted) for an NVIDIA GPU of sm89+."""
    return (isinstance(_decode_kernel, triton.runtime.JITFunction) and device.type == "cuda"
            and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9))


@functools.cache
def programmatic_launch(device: torch.device) -> bool:
    """Whether the split reduce goes by programmatic dependent launch (compiled, NVIDIA sm90+): it is launched
    while the decoder runs and waits for it on the device, instead of after it."""
    return _asm_cvt(device) and torch.cuda.get_device_capability(device) >= (9, 0)


def block_m(rows: int) -> int:
    """Query rows per program for ``rows`` rows per KV head (Hq / Hkv x Mq): 16 to 64, a power of two."""
    return min(64, max(16, next_pow2(rows)))


def programs_per_split(batch: int, num_kv_heads: int, q_rows_per_kv_head: int) -> int:
    """Programs the decoder launches per key split: one per (sequence, KV head, row block)."""
    return batch * num_kv_heads * cdiv(q_rows_per_kv_head, block_m(q_rows_per_kv_head))


def resident_programs(head_dim: int, kv_fp8: bool, q_rows_per_kv_head: int) -> int | None:
    """Programs per SM that keep the SM busy with the default fp8-KV config on sm90: its residency (registers
    and shared memory from ``bench/diagnostics/decode_aot.py``), capped at 4 where more resident programs
    measured no faster (D64: 7 resident). The fp8 kernel is latency bound, so its time follows waves of these
    programs. None for bf16/fp16 KV, which is bandwidth bound."""
    if not kv_fp8:
        return None
    bm = block_m(q_rows_per_kv_head)
    if bm > 32:
        return 2
    if head_dim <= 64:
        return 4
    if head_dim <= 128:
        return 4 if bm <= 16 else 3
    return 3 if bm <= 16 else 2


def _reduce_chunks(rows: int, head_dim: int) -> int:
    """Programs per output row of the reduce (each combines the splits for head_dim / chunks dims): enough for
    ~512 programs when there are few rows (B1 x 64 heads: 4 chunks of 32 dims), at least 32 dims each."""
    return max(1, min(head_dim // 32, next_pow2(cdiv(512, rows))))


@dataclass(frozen=True)
class DecodeConfig:
    """Tile config of ``_decode_kernel``: keys per tile, warps and pipeline stages per program."""

    block_n: int
    num_warps: int
    num_stages: int


def default_config(head_dim: int, kv_fp8: bool, page_aligned: bool, rows_per_program: int) -> DecodeConfig:
    """Measured on the H200 at B=64/Hkv=8/L=4096, 4 query rows per KV head (tile options of ``paged_decode``).
    ``page_aligned``: dense, or pages a multiple of 64 keys (one page id per tile). fp8: two-warp programs with
    64-key tiles (4-7 resident per SM) up to 32 rows, four warps beyond. bf16: 128-key tiles at D64, 64-key
    tiles on aligned pages at D128 (32-key, 3 stages, when a tile spans pages), 32-key tiles at D256."""
    if kv_fp8:
        if head_dim <= 128:
            return DecodeConfig(64, 2, 3) if rows_per_program <= 32 else DecodeConfig(64, 4, 3)
        return DecodeConfig(64, 4, 2)
    if head_dim <= 64:
        return DecodeConfig(128, 4, 2)
    if head_dim <= 128:
        return DecodeConfig(64, 4, 2) if page_aligned else DecodeConfig(32, 4, 3)
    return DecodeConfig(32, 4, 2)


def split_buffers(q: torch.Tensor, num_splits: int, out: torch.Tensor, lse: torch.Tensor | None, workspace=None,
                  head_dim_v: int | None = None):
    """(out buffer, lse buffer, out strides, lse strides) a decoder writes: ``out`` / ``lse`` themselves (a
    leading split stride of 0) for one split, else float32 workspaces (num_splits, B, Mq, Hq, Dv) (``head_dim_v``,
    default q's head dim) and
    (num_splits, B, Hq, Mq) whose size depends on static shapes only (``workspace``: such a pair to reuse, from an
    earlier call's ``split_buffers``). ``lse`` None: no LSE is wanted; with one split the lse buffer is then
    ``out`` with strides 0, a placeholder the decoder does not write (``STORE_LSE`` off)."""
    if num_splits == 1:
        if lse is None:
            return out, out, (0, *out.stride()[:3]), (0, 0, 0, 0)
        return out, lse, (0, *out.stride()[:3]), (0, *lse.stride())
    if workspace is not None:
        o_buf, l_buf = workspace
    else:
        B, MQ, HQ, D = q.shape
        o_buf = torch.empty((num_splits, B, MQ, HQ, head_dim_v or D), device=q.device, dtype=torch.float32)
        l_buf = torch.empty((num_splits, B, HQ, MQ), device=q.device, dtype=torch.float32)
    return o_buf, l_buf, o_buf.stride()[:4], l_buf.stride()


class SplitReduce:
    """The split reduce's launch for one layout: grid and constexprs fixed here, ``reduce(o_buf, l_buf, out, lse,
    sinks)`` per call (``reduce_splits``'s arguments, tensors of the shapes given here).

    ``o_shape``: the partial outputs' (S, B, Mq, Hq, Dv); ``store_lse``: an ``lse`` is written; ``has_sinks``: sinks
    are passed; ``pdl``: the decoder was launched by programmatic dependent launch; ``bound``: the launch is a
    ``BoundLaunch`` (repeated calls of a plan) instead of ``CachedKernel``'s keyed one (a single call)."""

    __slots__ = ("_launch",)

    def __init__(self, o_shape: tuple, store_lse: bool, has_sinks: bool, pdl: bool, bound: bool = False) -> None:
        num_splits, B, MQ, HQ, D = o_shape
        chunks = _reduce_chunks(B * MQ * HQ, D)
        fixed = dict(S_PAD=next_pow2(num_splits), D=D, BLOCK_D=next_pow2(cdiv(D, chunks)), PDL=pdl,
                     STORE_LSE=store_lse, HAS_SINKS=has_sinks, num_warps=4, launch_pdl=pdl)
        grid = (B * MQ * HQ, chunks)
        self._launch = _REDUCE.bind(grid, **fixed) if bound else functools.partial(_REDUCE[grid], **fixed)

    def __call__(self, o_buf: torch.Tensor, l_buf: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                 sinks: torch.Tensor | None = None) -> None:
        self._launch(o_buf, l_buf, out, l_buf if lse is None else lse, l_buf if sinks is None else sinks,
                     o_buf.stride(0), l_buf.stride(0), *out.stride()[:3], *((0, 0, 0) if lse is None else lse.stride()),
                     o_buf.shape[3], o_buf.shape[2], o_buf.shape[0])


def reduce_splits(o_buf: torch.Tensor, l_buf: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                  pdl: bool = False, sinks: torch.Tensor | None = None) -> None:
    """Combine the partial outputs ``o_buf`` (S, B, Mq, Hq, Dv) float32 and their LSEs ``l_buf`` (S, B, Hq, Mq)
    into ``out`` (B, Mq, Hq, Dv) and ``lse`` (B, Hq, Mq) (None: not written) with log-sum-exp weights; ``pdl``: the
    decoder was launched with programmatic dependent launch (``programmatic_launch``); ``sinks``: float32 (Hq,)
    sink logits, each joining its head's denominators once (the splits' partials leave them out)."""
    SplitReduce(tuple(o_buf.shape), lse is not None, sinks is not None, pdl)(o_buf, l_buf, out, lse, sinks)


class PagedDecoder:
    """``paged_decode``'s launches for calls of one layout: the checks, the tile config, the grids and the
    constexprs are made once, from the tensors given here (their shapes, dtypes and strides; ``paged_decode``'s
    arguments), and ``decoder(q, k_cache, v_cache, seqlens, block_table, k_scale, v_scale, out, lse, sinks,
    key_start, workspace)`` launches the kernels, each call's pointers, strides and sizes read from its own tensors.
    Calls pass tensors of the shapes and dtypes given here and the same kinds of arguments (``block_table``,
    ``k_scale`` / ``v_scale``, ``sinks``, ``key_start`` given or None as here; ``lse`` given or None as
    ``lse_wanted``): the grids are these shapes'. ``bound``: the launches are ``BoundLaunch``es (a plan's repeated
    calls: the launch key is checked, not rebuilt); otherwise keyed by ``CachedKernel`` (a single call).

    Example
    -------
    >>> decoder = PagedDecoder(q, k_pages, v_pages, block_table=table, scale=128 ** -0.5, num_splits=4,
    ...                        bound=True)  # doctest: +SKIP
    >>> out, lse = decoder(q, k_pages, v_pages, lengths, table, None, None, None, None, None, None,
    ...                    None)  # doctest: +SKIP
    """

    def __init__(self, q, k_cache, v_cache, *, block_table=None, scale: float, k_scale=None, v_scale=None,
                 num_splits: int = 1, lse_wanted: bool = True, seqlen_offset: int = 0, window_left: int = -1,
                 softcap: float = 0.0, block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, sinks=None, key_start=None, bound: bool = False) -> None:
        B, MQ, HQ, D = q.shape
        HKV, DV = k_cache.shape[2], v_cache.shape[3]
        G = HQ // HKV
        fp8 = k_cache.dtype != q.dtype
        if G * HKV != HQ or k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != D:
            raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}: "
                             f"the caches must agree in (pages, slots, heads), k_cache's head dim be q's and q's heads "
                             f"be a multiple of theirs")
        if sinks is not None and (sinks.shape != (HQ,) or sinks.dtype != torch.float32 or sinks.stride(0) != 1):
            raise ValueError(f"sinks must be float32 ({HQ},) contiguous, got {sinks.dtype} {tuple(sinks.shape)}")
        if key_start is not None and (key_start.shape != (B,) or key_start.dtype != torch.int32
                                      or key_start.stride(0) != 1 or key_start.device != q.device):
            raise ValueError(f"key_start must be int32 ({B},) contiguous on {q.device}, got {key_start.dtype} "
                             f"{tuple(key_start.shape)} on {key_start.device}")
        if q.stride(3) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
            raise ValueError("q, k_cache and v_cache must be contiguous in their last dim")
        if fp8 and (k_scale is None or v_scale is None):
            raise ValueError(f"an {k_cache.dtype} cache needs k_scale and v_scale")
        if window_left < -1 or not softcap >= 0.0 or softcap == float("inf"):
            raise ValueError(f"window_left={window_left} must be >= -1 (-1 = unbounded) and softcap={softcap} "
                             f"finite and >= 0 (0 = off)")
        paged = block_table is not None
        self._page_size = k_cache.shape[1] if paged else 1
        self._shape, self._dv, self._fp8, self._paged = (B, MQ, HQ, D), DV, fp8, paged
        self._num_splits, self._lse_wanted = num_splits, lse_wanted
        pdl = num_splits > 1 and programmatic_launch(q.device)
        rows = G * MQ
        bm = block_m(rows)
        cfg = default_config(next_pow2(max(D, DV)), fp8, not paged or self._page_size % 64 == 0, bm)
        qk_scale, softcap_log2 = (scale / softcap, softcap * LOG2E.value) if softcap else (scale * LOG2E.value, 0.0)
        self._constants = (qk_scale, softcap_log2, HKV, num_splits)
        self._window_offset = (max(window_left, 0), seqlen_offset)
        grid = (B * HKV, num_splits, cdiv(rows, bm))
        fixed = dict(G=G, MQ=MQ, D=D, DV=DV, BLOCK_M=bm, BLOCK_N=block_n or cfg.block_n, PAGE_SIZE=self._page_size,
                     PAGED=paged, FP8=fp8, PARTIAL=num_splits > 1, ASM_CVT=fp8 and _asm_cvt(q.device), PDL=pdl,
                     WINDOW=window_left >= 0, SOFTCAP=softcap > 0.0, STORE_LSE=num_splits > 1 or lse_wanted,
                     HAS_SINKS=sinks is not None and num_splits == 1, HAS_KEY_START=key_start is not None,
                     num_warps=num_warps or cfg.num_warps, num_stages=num_stages or cfg.num_stages)
        self._decode = _DECODE.bind(grid, **fixed) if bound else functools.partial(_DECODE[grid], **fixed)
        self._reduce = (SplitReduce((num_splits, B, MQ, HQ, DV), lse_wanted, sinks is not None, pdl, bound)
                        if num_splits > 1 else None)

    def __call__(self, q, k_cache, v_cache, seqlens, block_table, k_scale, v_scale, out, lse, sinks, key_start,
                 workspace):
        """Out (B, Mq, Hq, Dv) in q's dtype and lse float32 (B, Hq, Mq) (None without ``lse_wanted``), written into
        ``out`` / ``lse`` when given (``paged_decode``'s arguments; ``workspace`` as ``split_buffers`` takes it)."""
        if out is None:
            out = q.new_empty((*self._shape[:3], self._dv))
        if lse is None and self._lse_wanted:
            B, MQ, HQ, _ = self._shape
            lse = torch.empty((B, HQ, MQ), device=q.device, dtype=torch.float32)
        o_buf, l_buf, o_strides, l_strides = split_buffers(q, self._num_splits, out, lse, workspace, self._dv)
        fp8, paged = self._fp8, self._paged
        self._decode(
            q, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, seqlens,
            block_table if paged else seqlens, o_buf, l_buf, l_buf if sinks is None else sinks,
            seqlens if key_start is None else key_start,
            *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            *(k_scale.stride() if fp8 else (0, 0, 0)), *(v_scale.stride() if fp8 else (0, 0, 0)),
            block_table.stride(0) if paged else 0, *o_strides, *l_strides, *self._constants, k_cache.shape[0],
            block_table.shape[1] * self._page_size if paged else k_cache.shape[1], *self._window_offset)
        if self._reduce is not None:
            self._reduce(o_buf, l_buf, out, lse, sinks)
        return out, lse


def paged_decode(q, k_cache, v_cache, seqlens, *, block_table=None, scale: float,
                 k_scale=None, v_scale=None, num_splits: int = 1, out=None, lse=None, lse_wanted: bool = True,
                 seqlen_offset: int = 0, window_left: int = -1, softcap: float = 0.0, workspace=None,
                 block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, sinks=None, key_start=None):
    """Attention of ``Mq`` new query tokens per sequence against a (paged) KV cache.

    q: (B, Mq, Hq, D) bf16/fp16, Mq in 1..16, last dim contiguous; D a multiple of 16 up to 256.
    k_cache, v_cache: paged (num_pages, page_size, Hkv, D) and (..., Dv) with ``block_table`` int32
    (B, max_pages_per_seq), or dense (B, Lmax, Hkv, D) / (..., Dv) when ``block_table`` is None (Dv: the value
    head dim, a multiple of 16 up to 256, may differ from D); q's dtype,
    or fp8 e4m3 with ``k_scale``/``v_scale`` float32 shaped like the cache without D.
    Separate K/V tensors with their own strides; last dim contiguous.
    seqlens: int32 (B,) valid keys per sequence, the Mq new ones included, plus ``seqlen_offset`` (an int added
    on the device, e.g. the tokens just appended to lengths counted before the append). Query i of sequence b
    sits at position seqlens[b] - Mq + i and sees keys j <= that position; a row seeing no key
    gets out 0 and lse -inf. Hq must be a multiple of Hkv. With fp8 K/V both dots run in fp16
    (q cast to fp16: |q| must stay below 65504).
    ``window_left`` >= 0: query i also sees only keys j >= seqlens[b] - Mq + i - window_left (local attention;
    -1 = unbounded); key tiles left of every query's window are skipped. ``softcap`` > 0: scores s (scaled
    by ``scale``) become softcap * tanh(s / softcap) before the softmax; 0 = off. ``sinks``: float32 (Hq,)
    attention sinks (GPT-OSS), each query head's logit joining its rows' denominators once (with splits: in the
    reduce); the LSE includes it. ``key_start``: int32 (B,) on q's device (FlashAttention's ``cache_leftpad``), sequence
    b's first key: keys j < key_start[b] are invisible too (a left-padded batch; a start equal to the length leaves
    its rows no key: out 0, lse -inf); None: 0.
    Index guards: lengths are clamped to [0, capacity] (max_pages_per_seq * page_size, or Lmax), starts to
    [0, length], and a program's keys stop at the first block-table entry of its split that is not in
    [0, num_pages); no entry can make the kernel read outside the caches (``fmha_ops.checks`` validates them on
    the host instead).
    Returns (out (B, Mq, Hq, Dv) in q's dtype, lse float32 (B, Hq, Mq) natural log), written into
    ``out``/``lse`` when given; with ``lse_wanted=False`` (and no ``lse``) no LSE is written or allocated and lse
    is None. ``num_splits > 1`` runs the split kernel into a float32 workspace and the reduce kernel
    (``workspace``: the (partial out, partial lse) pair of ``split_buffers`` to reuse); no host sync, so it can be
    captured in a CUDA graph. ``block_n`` / ``num_warps`` / ``num_stages`` override fields
    of ``default_config``.

    Example
    -------
    >>> out, lse = paged_decode(q, k_pages, v_pages, lengths, block_table=table, scale=128 ** -0.5,
    ...                         num_splits=4)  # doctest: +SKIP
    """
    decoder = PagedDecoder(q, k_cache, v_cache, block_table=block_table, scale=scale, k_scale=k_scale,
                           v_scale=v_scale, num_splits=num_splits, lse_wanted=lse_wanted or lse is not None,
                           seqlen_offset=seqlen_offset, window_left=window_left, softcap=softcap, block_n=block_n,
                           num_warps=num_warps, num_stages=num_stages, sinks=sinks, key_start=key_start)
    return decoder(q, k_cache, v_cache, seqlens, block_table, k_scale, v_scale, out, lse, sinks, key_start, workspace)


#: the kernels' launchers (``launch``), held here: looking one up hashes its JITFunction in Python
_DECODE, _REDUCE = launch(_decode_kernel), launch(_reduce_kernel)
