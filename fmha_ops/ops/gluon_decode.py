"""Gluon fp8-KV paged decode for Hopper (``kernels/gluon/decode.py``): the op ``gluon_fp8_decodeF``.

A bf16/fp16 query against an fp8 e4m3fn KV cache with per-token scales (or a bf16/fp16 KV quantized per token
for the call with ``quantize_kv_to_fp8=True``), through the decode masks, plain BMHK calls with few queries
and ``flash_attn_with_kvcache``; one-warp programs (two at D256) whose fp8 K and V reach mma.sync operands by
16-byte shared loads. Split-K with the Triton reduce kernel when the wave model asks for splits. sm90 only
(measured and tuned there); Gluon kernels do not run in the Triton interpreter, so the op never runs on a CPU.
Local windows (the masks' ``window_left``; key tiles left of the window are not read), softcap, per-sequence key
starts (the paged masks' ``key_start``, ``flash_attn_with_kvcache``'s ``cache_leftpad``; key tiles wholly below the
start are not read), and attention sinks, which the reduce adds (``MIN_SINK_SPLITS``: a call with sinks always
takes the split path).
"""
from __future__ import annotations

import functools

import torch

from registry.arch import current_arch, sm_count

from ..dispatch import register
from ..problem import Problem
from .base import AttentionFwOp
from .common import (DECODE_MASKS, decode_key_start, decode_keys, decode_outputs, decode_reasons, decode_views,
                     decode_window, sink_arg)
from .cost import attention_bytes

_HALF = (torch.float16, torch.bfloat16)
_E4M3 = torch.float8_e4m3fn
_KV_DESCALES = frozenset({"none", "token", "tensor", "head"})
#: fp8-KV bytes weight of the cost model (1.7-1.9x its bf16 decode on the H200); the Triton decode ops weigh
#: their fp8 kernel at 0.72, so this op ranks first wherever both take a call
FP8_KV_BYTES = 0.55
#: splits of a call with sinks: the Gluon kernel's epilogue has no sink, the split reduce adds it once
MIN_SINK_SPLITS = 2


@register
class GluonFp8DecodeFwOp(AttentionFwOp):
    """fp8-KV decoder in Gluon: one (sequence, KV head [pair], key split) per program, <= 16 query rows per KV
    head; splits chosen by the wave model of ``kernels/decode_splits.py``, merged by the Triton reduce."""

    NAME = "gluon_fp8_decodeF"
    ARCHS = ("cuda>=9.0,<10.0",)
    REQUIRES = ("triton.experimental.gluon",)
    PRIORITY = 1
    DTYPES = frozenset([(h, _E4M3, _E4M3) for h in _HALF] + [(h, h, h) for h in _HALF])
    OUT_DTYPES = frozenset(_HALF + (torch.float32,))
    HEAD_DIMS = (64, 128, 256)
    BIAS_KINDS = DECODE_MASKS
    GQA = True
    PAGE_SIZES = range(1, 1 << 24)  # the tiles cover pages that divide 32 keys or are a multiple of 16 (below)
    DESCALES = {"q": frozenset({"none"}), "k": _KV_DESCALES, "v": _KV_DESCALES}
    QUANTIZE_KV = True
    MAX_SEQLEN_Q = 16
    RAGGED_Q = False
    PARTIAL = True
    WINDOW = True
    SOFTCAP = True
    SINKS = True  # through the split reduce (MIN_SINK_SPLITS)
    KEY_START = True  # keys below the start masked like keys past the length

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        from ..kernels.gluon.decode import ROWS, tile_config

        r = []
        if p.arch.kind == "cuda" and p.arch.capability != (9, 0):
            r.append(f"measured and tuned on sm90 only; this is sm{p.arch.capability[0]}{p.arch.capability[1]}")
        if not p.kv_fp8:
            r.append("needs an fp8 KV cache (float8_e4m3fn key/value with per-token descales) or "
                     "quantize_kv_to_fp8=True")
        if p.gqa_ratio * p.seqlen_q > ROWS.value:
            r.append(f"{p.gqa_ratio * p.seqlen_q} query rows per KV head (Hq/Hkv x Mq) > {ROWS.value}")
        if p.page_size and tile_config(p.page_size, p.head_dim) is None:
            r.append(f"page_size={p.page_size} not supported; pages must divide 32 keys or be a multiple of 16")
        return r + decode_reasons(p)

    @classmethod
    def num_splits(cls, batch: int, hkv: int, max_len: int, rows: int, head_dim: int, page_size: int | None,
                   arch, heads_adjacent: bool = True) -> int:
        """Key splits for ``batch`` sequences of up to ``max_len`` keys, ``hkv`` KV heads with ``rows`` query rows
        each, pages of ``page_size`` keys (None: dense cache)."""
        return _split_count(batch, hkv, max_len, rows, head_dim, page_size, heads_adjacent,
                            sm_count(arch) if arch.kind != "cpu" else 132)

    @classmethod
    def apply(cls, inp, needs_lse):
        from ..kernels.gluon import decode as gluon
        from ..kernels.softmax import LOG2E
        from ..kernels.triton.decode import programmatic_launch, reduce_splits, split_buffers

        q, k, v, seqlens, table, ks, vs = decode_views(inp)
        B, MQ, HQ, D = q.shape
        page_size = k.shape[1] if table is not None else None
        window = decode_window(inp)
        max_len = decode_keys(k.shape[1] * (table.shape[1] if table is not None else 1), window, MQ)
        splits = cls.num_splits(B, k.shape[2], max_len, HQ // k.shape[2] * MQ, D, page_size, current_arch(q.device),
                                gluon.heads_adjacent(k, v))
        if inp.sinks is not None:
            splits = max(splits, MIN_SINK_SPLITS)
        out = torch.empty(q.shape, dtype=inp.out_dtype, device=q.device)
        lse = torch.empty((B, HQ, MQ), dtype=torch.float32, device=q.device) if needs_lse else None
        o_buf, l_buf, o_strides, l_strides = split_buffers(q, splits, out, lse)
        pdl = splits > 1 and programmatic_launch(q.device)
        gluon.launch(q, k, v, ks, vs, seqlens, table, o_buf, l_buf, o_strides, l_strides,
                     inp.softmax_scale * LOG2E.value, splits, page_size, pdl, window_left=window, softcap=inp.softcap,
                     store_lse=needs_lse, key_start=decode_key_start(inp))
        if splits > 1:
            reduce_splits(o_buf, l_buf, out, lse, pdl, sink_arg(inp))
        return decode_outputs(inp, q, out, lse, needs_lse)

    @classmethod
    def decode_launcher(cls, inp, needs_lse, own_workspace: bool = True):
        """``launch(q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table, out, lse, seqlen_offset=0,
        sinks=None, key_start=None)`` for calls like ``inp`` (same shapes, strides, mask kind and window; a plan for
        calls with sinks takes the split path): tensors as ``decode_views`` lays them out, written into ``out`` /
        ``lse`` (None: no LSE written), lengths ``seqlens + seqlen_offset``, keys from ``key_start`` (int32 (B,);
        None: 0); the split count (and, with ``own_workspace``, one split workspace for every launch: one stream at a
        time) fixed here (``fmha_ops.decode_plan``, the ``flash_attn_with_kvcache`` fast path). Each kind of call
        (LSE or not, offset, sinks or not, key starts or not) gets a bound decoder and reduce at its first launch: a
        repeated call checks its launch keys instead of rebuilding them (``BoundLaunch``)."""
        from ..kernels.gluon import decode as gluon
        from ..kernels.softmax import LOG2E
        from ..kernels.triton.decode import SplitReduce, programmatic_launch, split_buffers

        q, k, v, _, table, _, _ = decode_views(inp)
        B, MQ, HQ, D = q.shape
        page_size = k.shape[1] if table is not None else None
        window, softcap, scale_log2 = decode_window(inp), inp.softcap, inp.softmax_scale * LOG2E.value
        max_len = decode_keys(k.shape[1] * (table.shape[1] if table is not None else 1), window, MQ)
        splits = cls.num_splits(B, k.shape[2], max_len, HQ // k.shape[2] * MQ, D, page_size, current_arch(q.device),
                                gluon.heads_adjacent(k, v))
        if inp.sinks is not None:
            splits = max(splits, MIN_SINK_SPLITS)
        workspace = split_buffers(q, splits, None, None)[:2] if splits > 1 and own_workspace else None
        pdl = splits > 1 and programmatic_launch(q.device)
        planned: dict = {}  # by (LSE, offset, sinks, key starts): a few kinds per plan at most

        def launch(q, k_cache, v_cache, k_scale, v_scale, seqlens, table, out, lse, seqlen_offset=0, sinks=None,
                   key_start=None):
            o_buf, l_buf, o_strides, l_strides = split_buffers(q, splits, out, lse, workspace)
            kind = (lse is None, seqlen_offset, sinks is None, key_start is None)
            bound = planned.get(kind)
            if bound is None:
                bound = planned[kind] = (
                    gluon.FP8Decoder(q, k_cache, v_cache, k_scale, v_scale, table, scale_log2, splits, page_size,
                                     pdl, window_left=window, softcap=softcap, store_lse=lse is not None,
                                     seqlen_offset=seqlen_offset, key_start=key_start, bound=True),
                    SplitReduce(tuple(o_buf.shape), lse is not None, sinks is not None, pdl, bound=True)
                    if splits > 1 else None)
            decoder, reduce = bound
            decoder(q, k_cache, v_cache, k_scale, v_scale, seqlens, table, o_buf, l_buf, o_strides, l_strides,
                    key_start)
            if reduce is not None:
                reduce(o_buf, l_buf, out, lse, sinks)
        return launch

    @classmethod
    def estimate(cls, p: Problem) -> float:
        rows = p.gqa_ratio * p.seqlen_q
        keys = decode_keys(p.seqlen_k, p.window_left, p.seqlen_q)
        splits = cls.num_splits(p.batch, p.heads_kv, keys, rows, p.head_dim, p.page_size or None, p.arch)
        fill = min(1.0, p.batch * p.heads_kv * splits / (1.5 * sm_count(p.arch)))
        kv_bytes = attention_bytes(p) * keys / max(p.seqlen_k, 1) * (1.0 if p.quantize_kv else FP8_KV_BYTES)
        extra = 3.0 * attention_bytes(p) if p.quantize_kv else 0.0
        return kv_bytes / (3.9e12 * max(fill, 0.02)) + extra / 3.0e12 + (7e-6 if splits > 1 else 4e-6)


@functools.lru_cache(maxsize=1024)  # on every decode call; the wave model costs ~10 us at 64 candidates
def _split_count(batch: int, hkv: int, max_len: int, rows: int, head_dim: int, page_size: int | None,
                 heads_adjacent: bool, sms: int) -> int:
    from ..kernels.decode_splits import choose_num_splits
    from ..kernels.gluon.decode import heads_per_program, programs_per_split, resident_programs

    heads = heads_per_program(head_dim, hkv, rows, heads_adjacent)
    return choose_num_splits(programs_per_split(batch, hkv, heads), max_len, sms, resident_programs(page_size, head_dim))

