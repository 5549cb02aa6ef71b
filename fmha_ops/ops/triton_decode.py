"""Triton paged decode: a single-pass decoder and a split-K decoder (+ reduce), bf16/fp16 or fp8 KV.

Reached through the decode masks (``BlockDiagonal[CausalWithOffset]PaddedKeysMask``, the
``Paged*`` masks), through plain BMHK calls with few queries (no mask, or bottom-right causal),
and through ``flash_attn_with_kvcache``. Queries of the Hq // Hkv heads sharing a KV head are
packed into one program, so each KV byte is read once. fp8 KV carries per-token scales
(``k_descale``/``v_descale`` shaped like the cache without its last dim); with
``quantize_kv_to_fp8=True`` a bf16/fp16 KV is quantized per token for this call first.
"""
from __future__ import annotations

import functools
from typing import ClassVar

import torch

from registry.arch import sm_count

from .. import attn_bias as ab
from ..dispatch import register
from ..dtypes import FP8_DTYPES
from ..problem import Problem
from .base import AttentionFwOp
from .common import DECODE_MASKS, TRITON_ARCHS, decode_outputs, decode_views, interpreter_reasons
from .cost import attention_bytes

_HALF = (torch.float16, torch.bfloat16)
_FP8_KV_DESCALES = frozenset({"token", "tensor", "head"})


class _DecodeOp(AttentionFwOp):
    ARCHS = TRITON_ARCHS
    REQUIRES = ("triton",)
    DTYPES = frozenset([(h, h, h) for h in _HALF] + [(h, f, f) for h in _HALF for f in FP8_DTYPES])
    OUT_DTYPES = frozenset(_HALF + (torch.float32,))
    HEAD_DIMS = (16, 32, 64, 128, 256)
    BIAS_KINDS = DECODE_MASKS
    GQA = True
    PAGE_SIZES = range(1, 1 << 24)  # a dense cache runs as one page of its full length
    DESCALES = {"q": frozenset({"none"}), "k": frozenset({"none"}) | _FP8_KV_DESCALES,
                "v": frozenset({"none"}) | _FP8_KV_DESCALES}
    QUANTIZE_KV = True
    MAX_SEQLEN_Q = 16
    RAGGED_Q = False
    PARTIAL = True
    SPLIT_K: ClassVar[bool]

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        r = interpreter_reasons(p)
        if p.out_dtype not in (p.q_dtype, torch.float32):
            r.append(f"output dtype must be the query's ({p.q_dtype}) or float32")
        if p.bias in (ab.NONE, ab.PADDED_KEYS, ab.PAGED) and p.seqlen_q > 1:
            r.append("non-causal decode with more than one query per sequence not supported")
        if p.page_size and "head" in p.descales[1:]:
            r.append("per-(batch, head) KV descales with a paged cache not supported (use per-token scales)")
        return r

    @classmethod
    def num_splits(cls, p_batch: int, hkv: int, max_len: int, rows: int, head_dim: int, kv_fp8: bool,
                   page_size: int | None, arch) -> int:
        if not cls.SPLIT_K:
            return 1
        from ..kernels.triton.decode import default_num_splits

        return default_num_splits(p_batch, hkv, max_len, rows, head_dim, kv_fp8, page_size, arch.capability,
                                  sm_count(arch) if arch.kind != "cpu" else 132)

    @classmethod
    def apply(cls, inp, needs_lse):
        from ..kernels.triton.decode import paged_decode

        q, k, v, seqlens, table, ks, vs = decode_views(inp)
        max_len = k.shape[1] * (table.shape[1] if table is not None else 1)
        splits = cls.num_splits(q.shape[0], k.shape[2], max_len, q.shape[2] // k.shape[2] * q.shape[1], q.shape[3],
                                k.dtype != q.dtype, k.shape[1] if table is not None else None, _arch(q.device))
        out = torch.empty(q.shape, dtype=inp.out_dtype, device=q.device)
        out, lse = paged_decode(q, k, v, seqlens, block_table=table, scale=inp.softmax_scale, k_scale=ks,
                                v_scale=vs, num_splits=splits, out=out)
        return decode_outputs(inp, q, out, lse, needs_lse)

    @classmethod
    def estimate(cls, p: Problem) -> float:
        if p.arch.kind == "cpu":
            return 1e3
        rows = p.gqa_ratio * p.seqlen_q
        programs = p.batch * p.heads_kv * max(1, -(-rows // 64))
        splits = 1
        if cls.SPLIT_K:
            splits = cls.num_splits(p.batch, p.heads_kv, p.seqlen_k, rows, p.head_dim, p.kv_fp8, p.page_size or None,
                                    p.arch)
        fill = min(1.0, programs * splits / (1.5 * sm_count(p.arch)))
        kv_bytes = attention_bytes(p) * (0.55 if p.kv_fp8 and not p.quantize_kv else 1.0)
        extra = 3.0 * attention_bytes(p) if p.quantize_kv else 0.0
        return (kv_bytes / (3.9e12 * max(fill, 0.02)) + extra / 3.0e12 + (7e-6 if splits > 1 else 4e-6))


@functools.lru_cache(maxsize=None)
def _arch(device: torch.device):
    from registry import current_arch

    return current_arch(device)


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
