"""``Problem``: everything that decides which op can run a call and how fast it runs.

Built once per call signature from an ``Inputs`` (``Inputs.problem``); hashable; what op declarations
(``ops/base.py``), cost models and tuning-table buckets read. Sizes follow the mask's view of the call
(``attn_bias.MaskDims``): for varlen and decode masks ``batch`` is the number of sequences.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from registry import Arch

from . import attn_bias as ab
from .dtypes import FP8_DTYPES, dtype_name


@dataclass(frozen=True)
class Problem:
    """One call's op-relevant description; hashable.

    Example
    -------
    >>> p = fmha_ops.make_inputs(q, k, v, fmha_ops.LowerTriangularMask()).problem()
    >>> p.causal, p.gqa_ratio, p.bucket()
    """

    arch: Arch
    q_dtype: torch.dtype
    k_dtype: torch.dtype
    v_dtype: torch.dtype
    out_dtype: torch.dtype
    batch: int  # sequences (varlen/decode: number of sequences)
    seqlen_q: int  # longest query sequence
    seqlen_k: int  # longest key sequence (decode: cache capacity per sequence)
    total_q: int  # query tokens in the call
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    bias: str  # attn_bias kind (attn_bias.*)
    q_uniform: bool  # every sequence has seqlen_q queries
    page_size: int  # 0 unless paged
    descales: tuple[str, str, str]  # (q, k, v) descale kinds
    quantize_kv: bool
    dropout: bool
    needs_lse: bool
    needs_grad: bool
    deterministic: bool
    graph_capture: bool
    fp8_backward: bool = False  # set_fp8_dequantized_backward is on
    v_keys_contiguous: bool = False  # value is keys-contiguous (see fmha_ops.inputs)
    #: inputs that break the 16-byte rule of TMA descriptors and vector loads, each with its value
    #: (validation.misaligned_operands): ops that declare ALIGNMENT refuse them
    misaligned: tuple[str, ...] = ()
    #: local attention window (the mask's ``window_left`` / ``window_right``; -1 = unbounded): key j is
    #: visible from query i iff the mask kind allows it and i_al - window_left <= j <= i_al + window_right,
    #: i_al = i for top-left kinds, i + Mk - Mq (per sequence) for bottom-right and non-causal kinds
    window_left: int = -1
    window_right: int = -1
    softcap: bool = False  # scores are capped: s * tanh(score / s) before the softmax (``Inputs.softcap``)
    negative_scale: bool = False  # the softmax scale is below 0 (``AttentionOp.NEGATIVE_SCALE``)
    bias_grad: bool = False  # autograd differentiates a tensor attn_bias
    sinks: bool = False  # attention sinks join the softmax denominators (fmha_ops.sinks)
    key_start: bool = False  # keys before a per-sequence start are masked out (cache_leftpad; the mask's key_start)

    @property
    def causal(self) -> bool:
        return self.bias in ab.CAUSAL_KINDS

    @property
    def windowed(self) -> bool:
        """A local attention window bounds the visible keys on at least one side."""
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def kv_fp8(self) -> bool:
        """The KV is (or becomes, with quantize_kv) fp8 while the query is not."""
        return self.quantize_kv or (self.k_dtype in FP8_DTYPES and self.q_dtype not in FP8_DTYPES + (torch.int8,))

    def bucket(self) -> str:
        """Tuning-table key: exact dtypes, head dims, mask, GQA, page size; sizes rounded to powers of 2;
        window sizes (rounded likewise) and softcap appended only when present."""
        return "|".join([
            "/".join(dtype_name(d) for d in (self.q_dtype, self.k_dtype, self.v_dtype)),
            f"d{self.head_dim}/{self.head_dim_v}", self.bias, f"g{self.gqa_ratio}", f"p{self.page_size}",
            f"qkv{int(self.quantize_kv)}", f"bh{_p2(self.batch * self.heads_kv)}", f"q{_p2(self.seqlen_q)}",
            f"k{_p2(self.seqlen_k)}", f"grad{int(self.needs_grad)}",
        ] + ([f"w{_p2(self.window_left + 1)}/{_p2(self.window_right + 1)}"] if self.windowed else [])
          + (["softcap"] if self.softcap else []) + (["sinks"] if self.sinks else [])
          + (["key_start"] if self.key_start else []))

    def size_point(self) -> tuple[float, float, float, float]:
        """log2 of the call's sizes, unrounded: batch x query heads (the work's head count), query length, key
        length, GQA ratio. Where the problem sits between the tuning table's buckets; the GQA ratio is a size
        (a ratio the grid does not hold sits between the ratios it does)."""
        return (math.log2(max(1, self.batch * self.heads_q)), math.log2(max(1, self.seqlen_q)),
                math.log2(max(1, self.seqlen_k)), math.log2(max(1, self.gqa_ratio)))

    def at_bucket(self, bucket: str) -> "Problem | None":
        """This problem at the sizes of ``bucket`` (a ``bucket()`` string: batch x KV heads, lengths, GQA ratio),
        or None when the bucket differs in anything else (dtypes, head dims, mask, paging...). Batch x KV heads go
        to the batch when they divide by the KV heads, else to the heads (batch 1).

        Example
        -------
        >>> p.at_bucket(p.bucket()).size_point() == p.size_point()  # p on its bucket's sizes
        """
        mine, theirs = self.bucket().split("|"), bucket.split("|")
        if len(mine) != len(theirs) or any(a != b for i, (a, b) in enumerate(zip(mine, theirs))
                                           if i not in _BUCKET_SIZES):
            return None
        ratio, bh, q, k = (int(theirs[i].lstrip("gbhqk")) for i in (_BUCKET_G, _BUCKET_BH, _BUCKET_Q, _BUCKET_K))
        batch, heads_kv = (bh // self.heads_kv, self.heads_kv) if bh % self.heads_kv == 0 else (1, bh)
        return dataclasses.replace(self, batch=batch, heads_kv=heads_kv, heads_q=heads_kv * ratio,
                                   seqlen_q=q, seqlen_k=k, total_q=batch * q)

    def __str__(self) -> str:
        dts = "/".join(dtype_name(d) for d in (self.q_dtype, self.k_dtype, self.v_dtype))
        extra = [f"page={self.page_size}"] if self.page_size else []
        extra += [f"descale={'/'.join(self.descales)}"] if self.descales != ("none",) * 3 else []
        extra += ["quantize_kv"] if self.quantize_kv else []
        extra += ["lse"] if self.needs_lse else []
        extra += ["grad"] if self.needs_grad else []
        extra += ["dropout"] if self.dropout else []
        extra += ["graph"] if self.graph_capture else []
        extra += [f"window=({self.window_left}, {self.window_right})"] if self.windowed else []
        extra += ["softcap"] if self.softcap else []
        extra += ["bias_grad"] if self.bias_grad else []
        extra += ["sinks"] if self.sinks else []
        extra += ["key_start"] if self.key_start else []
        extra += ["deterministic"] if self.deterministic else []
        extra += ["v_keys_contiguous"] if self.v_keys_contiguous else []
        return (f"{dts}->{dtype_name(self.out_dtype)} B={self.batch} Mq={self.seqlen_q} Mk={self.seqlen_k} "
                f"Hq={self.heads_q} Hkv={self.heads_kv} K={self.head_dim} Kv={self.head_dim_v} "
                f"bias={self.bias} " + " ".join(extra + [f"on {self.arch}"]))


#: positions of the size fields (GQA ratio, batch x KV heads, query and key lengths) in ``Problem.bucket()``'s
#: "|"-separated key
_BUCKET_G, _BUCKET_BH, _BUCKET_Q, _BUCKET_K = 3, 6, 7, 8
_BUCKET_SIZES = frozenset({_BUCKET_G, _BUCKET_BH, _BUCKET_Q, _BUCKET_K})


def _p2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))
