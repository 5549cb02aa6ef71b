"""FlyDSL paged decode on AMD gfx942 (MI300) / gfx950 (MI350): a single-pass decoder, a split-K decoder
(+ reduce), and fixed-split variants; the replacements of xformers' CK decoder ops.

Reached like the Triton decode ops (decode masks, plain BMHK calls with few queries, quantize_kv_to_fp8)
and through xformers' and MSLK's CK / FlyDSL decoder names (``ck_decoderF``, ``ck_splitK{N}``,
``flydsl_splitK{N}``, ``MemoryEfficientAttentionCkDecoderOp``; see :mod:`fmha_ops.ops.aliases`).

What the kernels (:mod:`fmha_ops.kernels.flydsl`) do, and so what is declared here: f16/bf16 queries;
KV in the query's dtype or in the arch's native fp8 (e4m3fnuz on gfx942, e4m3fn on gfx950) with
symmetric per-token scales; head dim 128 or 256 (K == Kv); GQA/MQA; any page size; output in the
query's dtype plus the LSE. Every query row attends to all ``seqlen[b]`` keys of its sequence: the
kernels are not causal among the new tokens, so causal masks are accepted only with one query per
sequence. A dense cache (padded-keys mask or a BMHK call) is handed over without a copy as a paged
cache of one page per sequence: page size = its padded length, block table ``arange(B)[:, None]``.
FlyDSL is imported on the first launch only (its LLVM conflicts with Triton's in one process).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from ..dispatch import register
from ..dtypes import FP8_DTYPES
from ..inputs import Inputs
from ..problem import Problem
from .base import AttentionFwOp
from .common import DECODE_MASKS, decode_outputs, decode_views
from .cost import attention_bytes

_HALF = (torch.float16, torch.bfloat16)
_KV_DESCALES = frozenset({"none", "token"})
_INT32_MAX = (1 << 31) - 1
# Achieved HBM bandwidth (bytes/s) assumed by the cost model: ~75% of MI300X (5.3 TB/s) and
# MI355X (8 TB/s) peaks. Not calibrated on hardware (no AMD GPU here).
_BANDWIDTH = {"gfx942": 4.0e12, "gfx950": 6.0e12}
FIXED_SPLITS = (1, 2, 4, 8, 16, 32, 64)


def flydsl_views(inp: Inputs):
    """``(q, k_cache, v_cache, block_table, seqlens, k_scale, v_scale)`` in the kernels' layout
    (:mod:`fmha_ops.kernels.flydsl.host`), views of the caller's tensors wherever possible.

    q ``(B, Mq, Hq, D)``; caches ``(pages, page_size, Hkv, D)`` (a dense ``(B, L, Hkv, D)`` cache
    is ``B`` pages of ``L`` rows with block table ``arange(B)[:, None]``); fp8 scales shaped like
    the caches without ``D``, float32, sharing one stride set (copied only if K's and V's differ).
    """
    q, k, v, seqlens, table, ks, vs = decode_views(inp)
    if table is None:
        table = torch.arange(k.shape[0], dtype=torch.int32, device=q.device)[:, None]  # sequence b is page b
    elif table.stride(-1) != 1:
        table = table.contiguous()
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    if ks is not None and ks.stride() != vs.stride():
        ks, vs = ks.contiguous(), vs.contiguous()
    return q, k, v, table, seqlens, ks, vs


class _FlyDSLDecodeOp(AttentionFwOp):
    ARCHS = ("rocm:gfx942,gfx950",)
    REQUIRES = ("flydsl",)
    DTYPES = frozenset([(h, h, h) for h in _HALF] + [(h, f, f) for h in _HALF for f in FP8_DTYPES])
    OUT_DTYPES = frozenset(_HALF)
    HEAD_DIMS = (128, 256)  # fmha_ops.kernels.flydsl.host.HEAD_DIMS
    BIAS_KINDS = DECODE_MASKS
    GQA = True
    PAGE_SIZES = range(1, 1 << 24)  # any; a dense cache runs as one page of its padded length
    DESCALES = {"q": frozenset({"none"}), "k": _KV_DESCALES, "v": _KV_DESCALES}
    QUANTIZE_KV = True
    MAX_SEQLEN_Q = 16
    RAGGED_Q = False
    PARTIAL = True
    CUDA_GRAPH = True
    #: None: split count from the kernels' heuristic; an int: always that many splits
    NUM_SPLITS: ClassVar[int | None] = 1

    @classmethod
    def unavailable_reason(cls) -> str | None:
        from ..kernels.flydsl.host import available

        return available()

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        r = []
        if p.out_dtype != p.q_dtype:
            r.append(f"output dtype must be the query's ({p.q_dtype})")
        if p.causal and p.seqlen_q > 1:
            r.append(f"causal decode with {p.seqlen_q} queries per sequence not supported (the kernels are not "
                     "causal among new tokens; only 1 query per sequence)")
        if p.k_dtype in FP8_DTYPES and p.arch.kind == "rocm" and p.arch.gfx in _BANDWIDTH:
            from ..kernels.flydsl.host import fp8_dtype

            want = fp8_dtype(p.arch.gfx)
            if p.k_dtype != want:
                r.append(f"fp8 KV {p.k_dtype} is not the native format of {p.arch.gfx} (use {want})")
        if not p.page_size and p.seqlen_k == 0:
            r.append("no keys (key length 0)")
        rows = p.page_size or p.seqlen_k
        if rows * p.heads_kv * p.head_dim > _INT32_MAX:
            r.append(f"a cache page of {rows} rows x {p.heads_kv} heads x {p.head_dim} exceeds the kernels' int32 "
                     "strides")
        return r

    @classmethod
    def num_splits(cls, batch: int, hkv: int, rows: int, max_len: int, device: torch.device) -> int:
        if cls.NUM_SPLITS is not None:
            return cls.NUM_SPLITS
        from ..kernels.flydsl.host import choose_num_splits, device_arch

        return choose_num_splits(batch, hkv, rows, max_len, device_arch(device) or "gfx942")

    @classmethod
    def apply(cls, inp, needs_lse):
        from ..kernels.flydsl.launcher import paged_decode

        q, k, v, table, seqlens, ks, vs = flydsl_views(inp)
        splits = cls.num_splits(q.shape[0], k.shape[2], q.shape[1] * (q.shape[2] // k.shape[2]),
                                table.shape[1] * k.shape[1], q.device)
        out, lse = paged_decode(q, k, v, table, seqlens, k_scale=ks, v_scale=vs, scale=inp.softmax_scale,
                                num_splits=splits)
        return decode_outputs(inp, q, out, lse, needs_lse)

    @classmethod
    def _splits_for(cls, p: Problem) -> int:
        if cls.NUM_SPLITS is not None:
            return cls.NUM_SPLITS
        from ..kernels.flydsl.host import choose_num_splits

        return choose_num_splits(p.batch, p.heads_kv, p.gqa_ratio * p.seqlen_q, p.seqlen_k, p.arch.gfx)

    @classmethod
    def estimate(cls, p: Problem) -> float:
        """Bandwidth-bound: KV bytes over the achieved bandwidth, scaled down when too few workgroups
        (one per sequence, KV head, 16 query rows and split) fill the CUs; plus launch overheads."""
        from ..kernels.flydsl.host import BLOCK_KEYS, NUM_CUS

        if p.arch.kind != "rocm" or p.arch.gfx not in _BANDWIDTH:
            return 1e3
        splits = cls._splits_for(p)
        tiles = p.batch * p.heads_kv * -(-p.gqa_ratio * p.seqlen_q // BLOCK_KEYS)
        fill = min(1.0, tiles * splits / (2.0 * NUM_CUS[p.arch.gfx]))
        bw = _BANDWIDTH[p.arch.gfx]
        kv_bytes = attention_bytes(p) * (0.55 if p.kv_fp8 and not p.quantize_kv else 1.0)
        extra = 3.0 * attention_bytes(p) if p.quantize_kv else 0.0
        return kv_bytes / (bw * max(fill, 0.02)) + extra / bw + (9e-6 if splits > 1 else 5e-6)


@register
class FlyDSLDecoderFwOp(_FlyDSLDecodeOp):
    """Single-pass FlyDSL paged decoder: one wave per (sequence, KV head, 16 query rows)."""

    NAME = "flydsl_decoderF"
    NUM_SPLITS = 1


@register
class FlyDSLSplitKFwOp(_FlyDSLDecodeOp):
    """Split-K FlyDSL paged decoder: keys cut into splits (about two workgroups per CU, >= 256 keys
    each), float32 partials merged by a reduce kernel."""

    NAME = "flydsl_splitKF"
    NUM_SPLITS = None


def _fixed_split_op(n: int) -> type[FlyDSLSplitKFwOp]:
    """``flydsl_splitK{n}F``: the split-K decoder with exactly ``n`` splits.
    For benchmarks and forced use: no estimate, so the selector ranks it after every op with one."""
    return register(type(f"FlyDSLSplitK{n}FwOp", (FlyDSLSplitKFwOp,), {
        "NAME": f"flydsl_splitK{n}F", "NUM_SPLITS": n, "PRIORITY": -1,
        "estimate": classmethod(lambda cls, p: None), "__module__": __name__,
        "__doc__": f"FlyDSL split-K paged decoder with a fixed {n} splits.",
    }))


FIXED_SPLIT_OPS = {n: _fixed_split_op(n) for n in FIXED_SPLITS}
