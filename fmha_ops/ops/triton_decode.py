"""Triton paged decode: a single-pass decoder and a split-K decoder (+ reduce), bf16/fp16 or fp8 KV.

Reached through the decode masks (``BlockDiagonal[CausalWithOffset]PaddedKeysMask``, the
``Paged*`` masks), through plain BMHK calls with few queries (no mask, or bottom-right causal),
and through ``flash_attn_with_kvcache``. Queries of the Hq // Hkv heads sharing a KV head are
packed into one program, so each KV byte is read once. fp8 KV carries per-token scales
(``k_descale``/``v_descale`` shaped like the cache without its last dim); with
``quantize_kv_to_fp8=True`` a bf16/fp16 KV is quantized per token for this call first. On sm90 the fp8-KV
shapes the Gluon decoder takes go to ``gluon_fp8_decodeF`` (``ops/gluon_decode.py``), which ranks first there.
Local windows (the masks' ``window_left``; key tiles left of the window are not read), softcap and per-sequence key
starts (the paged masks' ``key_start``, ``flash_attn_with_kvcache``'s ``cache_leftpad``).
"""
from __future__ import annotations

import functools
from typing import ClassVar

import torch

from registry.arch import current_arch, sm_count

from ..dispatch import register
from ..dtypes import FP8_DTYPES
from ..problem import Problem
from .base import AttentionFwOp
from .common import (DECODE_MASKS, TRITON_ARCHS, decode_key_start, decode_keys, decode_outputs, decode_reasons,
                     decode_views, decode_window, interpreter_reasons, sink_arg)
from .cost import attention_bytes

_HALF = (torch.float16, torch.bfloat16)
_FP8_KV_DESCALES = frozenset({"token", "tensor", "head"})


class _DecodeOp(AttentionFwOp):
    ARCHS = TRITON_ARCHS
    REQUIRES = ("triton",)
    DTYPES = frozenset([(h, h, h) for h in _HALF] + [(h, f, f) for h in _HALF for f in FP8_DTYPES])
    OUT_DTYPES = frozenset(_HALF + (torch.float32,))
    HEAD_DIMS = range(16, 257, 16)  # tiles padded to the next power of two
    HEAD_DIMS_V = range(16, 257, 16)  # a value head dim of its own (DeepSeek-V3: K=192, Kv=128)
    BIAS_KINDS = DECODE_MASKS
    GQA = True
    PAGE_SIZES = range(1, 1 << 24)  # a dense cache runs as one page of its full length
    DESCALES = {"q": frozenset({"none"}), "k": frozenset({"none"}) | _FP8_KV_DESCALES,
                "v": frozenset({"none"}) | _FP8_KV_DESCALES}
    QUANTIZE_KV = True
    MAX_SEQLEN_Q = 16
    RAGGED_Q = False
    PARTIAL = True
    WINDOW = True
    SOFTCAP = True
    SINKS = True  # the single pass adds them in its epilogue, the split reduce once
    KEY_START = True  # keys below the start masked like keys past the length
    SPLIT_K: ClassVar[bool]

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        return interpreter_reasons(p) + decode_reasons(p)

    @classmethod
    def num_splits(cls, batch: int, hkv: int, max_len: int, rows: int, head_dim: int, kv_fp8: bool, arch) -> int:
        """Key splits for ``batch`` sequences of up to ``max_len`` keys, ``hkv`` KV heads with ``rows`` query rows
        each (1 for the single-pass op)."""
        if not cls.SPLIT_K:
            return 1
        return _split_count(batch, hkv, max_len, rows, head_dim, kv_fp8, sm_count(arch) if arch.kind != "cpu" else 132)

    @classmethod
    def apply(cls, inp, needs_lse):
        from ..kernels.triton.decode import paged_decode

        q, k, v, seqlens, table, ks, vs = decode_views(inp)
        window = decode_window(inp)
        max_len = decode_keys(k.shape[1] * (table.shape[1] if table is not None else 1), window, q.shape[1])
        splits = cls.num_splits(q.shape[0], k.shape[2], max_len, q.shape[2] // k.shape[2] * q.shape[1], q.shape[3],
                                k.dtype != q.dtype, current_arch(q.device))
        out = torch.empty((*q.shape[:3], v.shape[3]), dtype=inp.out_dtype, device=q.device)
        out, lse = paged_decode(q, k, v, seqlens, block_table=table, scale=inp.softmax_scale, k_scale=ks,
                                v_scale=vs, num_splits=splits, out=out, lse_wanted=needs_lse, window_left=window,
                                softcap=inp.softcap, sinks=sink_arg(inp), key_start=decode_key_start(inp))
        return decode_outputs(inp, q, out, lse, needs_lse)

    @classmethod
    def decode_launcher(cls, inp, needs_lse, own_workspace: bool = True):
        """``launch(q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table, out, lse, seqlen_offset=0,
        sinks=None, key_start=None)`` for calls like ``inp`` (same shapes, strides, mask kind and window): tensors as
        ``decode_views`` lays them out, written into ``out`` / ``lse`` (None: no LSE written), lengths ``seqlens +
        seqlen_offset``; the split count (and, with ``own_workspace``, one split workspace for every launch: one
        stream at a time) fixed here (``fmha_ops.decode_plan``, the ``flash_attn_with_kvcache`` fast path). Each
        kind of call (LSE or not, offset, sinks or not, key starts or not) gets a bound ``PagedDecoder`` at its
        first launch: a repeated call checks its launch key instead of rebuilding it (``BoundLaunch``)."""
        from ..kernels.triton.decode import PagedDecoder, split_buffers

        q, k, v, _, table, _, _ = decode_views(inp)
        window, scale, softcap = decode_window(inp), inp.softmax_scale, inp.softcap
        max_len = decode_keys(k.shape[1] * (table.shape[1] if table is not None else 1), window, q.shape[1])
        splits = cls.num_splits(q.shape[0], k.shape[2], max_len, q.shape[2] // k.shape[2] * q.shape[1], q.shape[3],
                                k.dtype != q.dtype, current_arch(q.device))
        workspace = (split_buffers(q, splits, None, None, head_dim_v=v.shape[3])[:2] if splits > 1 and own_workspace
                     else None)
        decoders: dict = {}  # by (LSE, offset, sinks, key starts): a few kinds per plan at most

        def launch(q, k_cache, v_cache, k_scale, v_scale, seqlens, table, out, lse, seqlen_offset=0, sinks=None,
                   key_start=None):
            kind = (lse is None, seqlen_offset, sinks is None, key_start is None)
            decoder = decoders.get(kind)
            if decoder is None:
                decoder = decoders[kind] = PagedDecoder(
                    q, k_cache, v_cache, block_table=table, scale=scale, k_scale=k_scale, v_scale=v_scale,
                    num_splits=splits, lse_wanted=lse is not None, seqlen_offset=seqlen_offset, window_left=window,
                    softcap=softcap, sinks=sinks, key_start=key_start, bound=True)
            decoder(q, k_cache, v_cache, seqlens, table, k_scale, v_scale, out, lse, sinks, key_start, workspace)
        return launch

    @classmethod
    def estimate(cls, p: Problem) -> float:
        if p.arch.kind == "cpu":
            return 1e3
        rows = p.gqa_ratio * p.seqlen_q
        programs = p.batch * p.heads_kv * max(1, -(-rows // 64))
        keys = decode_keys(p.seqlen_k, p.window_left, p.seqlen_q)
        splits = cls.num_splits(p.batch, p.heads_kv, keys, rows, p.head_dim, p.kv_fp8, p.arch)
        fill = min(1.0, programs * splits / (1.5 * sm_count(p.arch)))
        kv_bytes = attention_bytes(p) * keys / max(p.seqlen_k, 1)  # a window reads its keys only
        if p.kv_fp8:
            kv_bytes *= (1.0 if p.quantize_kv else FP8_KV_BYTES) * FP8_KERNEL_SLOWDOWN
        extra = 3.0 * attention_bytes(p) if p.quantize_kv else 0.0
        return (kv_bytes / (3.9e12 * max(fill, 0.02)) + extra / 3.0e12 + (7e-6 if splits > 1 else 4e-6))


#: cost-model weight of an fp8 cache's bytes (the one the Gluon decoder's model uses, ``ops/gluon_decode.py``)
FP8_KV_BYTES = 0.55
#: the Triton fp8-KV kernel measured 1.33-1.45x its bf16 decode at D128 on the H200, the Gluon one 1.7-1.9x
FP8_KERNEL_SLOWDOWN = 1.3


@functools.lru_cache(maxsize=1024)  # on every decode call; the wave model costs ~10 us at 64 candidates
def _split_count(batch: int, hkv: int, max_len: int, rows: int, head_dim: int, kv_fp8: bool, sms: int) -> int:
    from ..kernels.decode_splits import choose_num_splits
    from ..kernels.triton.decode import programs_per_split, resident_programs

    return choose_num_splits(programs_per_split(batch, hkv, rows), max_len, sms,
                             resident_programs(head_dim, kv_fp8, rows))



@register
class TritonDecoderFwOp(_DecodeOp):
    """Single-pass paged decoder: one program per (sequence, KV head, row block)."""

    NAME = "triton_decoderF"
    SPLIT_K = False


@register
class TritonSplitKFwOp(_DecodeOp):
    """Split-K paged decoder: keys cut into splits chosen from batch, heads, length and SM count, then
    a reduce kernel merges the partial outputs by their LSE."""

    NAME = "triton_splitKF"
    SPLIT_K = True
