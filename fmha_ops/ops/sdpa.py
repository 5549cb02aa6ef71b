"""torch ``scaled_dot_product_attention``, one op per backend (cuDNN, flash, efficient, math).

Layout bridge: BMHK views are transposed to SDPA's (B, H, M, K) without copies. GQA uses
``enable_gqa``. Masks: none, top-left causal (``is_causal``), and bottom-right causal where it
coincides with those (Mq == Mk, or Mq == 1 which sees every key). No LSE (not partial).
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import attn_bias as ab
from ..dispatch import register
from ..problem import Problem
from .base import AttentionFwOp
from .cost import attention_time

_HALF = frozenset({(torch.float16,) * 3, (torch.bfloat16,) * 3})
_ALL_FLOAT = _HALF | {(torch.float32,) * 3}


class _SdpaOp(AttentionFwOp):
    BACKEND: ClassVar[SDPBackend]
    BIAS_KINDS = frozenset({ab.NONE, ab.CAUSAL, ab.CAUSAL_BR})
    GQA = True
    AUTOGRAD = True
    DROPOUT = True
    #: achieved (TFLOP/s, TB/s, overhead us) on the H200 for the cost model; CPU rates below
    RATES: ClassVar[tuple[float, float, float]]
    CPU_RATES: ClassVar[tuple[float, float, float]] = (0.001, 0.005, 100.0)

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        if p.bias == ab.CAUSAL_BR and p.seqlen_q not in (1, p.seqlen_k):
            return [f"bottom-right causal with Mq={p.seqlen_q} != Mk={p.seqlen_k} not supported"]
        return []

    @classmethod
    def apply(cls, inp, needs_lse):
        q, k, v = (t.transpose(1, 2) for t in (inp.query, inp.key, inp.value))
        causal = inp.bias_kind == ab.CAUSAL or (inp.bias_kind == ab.CAUSAL_BR and q.shape[2] > 1)
        with sdpa_kernel(cls.BACKEND):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=inp.p, is_causal=causal, scale=inp.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).to(inp.out_dtype), None

    @classmethod
    def estimate(cls, p: Problem) -> float:
        rates = cls.CPU_RATES if p.arch.kind == "cpu" else cls.RATES
        return attention_time(p, *rates)


@register
class SdpaCudnnFwOp(_SdpaOp):
    """SDPA through cuDNN's fused attention (Hopper: the fastest bf16 baseline)."""

    NAME = "sdpa_cudnnF"
    ARCHS = ("cuda>=9.0",)
    BACKEND = SDPBackend.CUDNN_ATTENTION
    DTYPES = _HALF
    OUT_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIMS = range(8, 257, 8)
    DETERMINISTIC = False
    RATES = (600.0, 3.9, 8.0)


@register
class SdpaFlashFwOp(_SdpaOp):
    """SDPA through its FlashAttention-2 kernels (CUDA), or the CPU flash kernel."""

    NAME = "sdpa_flashF"
    ARCHS = ("cpu", "cuda>=8.0")
    BACKEND = SDPBackend.FLASH_ATTENTION
    DTYPES = _ALL_FLOAT
    OUT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    HEAD_DIMS = range(8, 257, 8)
    RATES = (340.0, 2.5, 8.0)
    CPU_RATES = (0.01, 0.01, 50.0)

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        r = super().extra_reasons(p)
        if p.arch.kind != "cpu" and p.q_dtype == torch.float32:
            r.append("float32 runs only on the CPU flash kernel")
        return r


@register
class SdpaEfficientFwOp(_SdpaOp):
    """SDPA through its memory-efficient (xformers cutlass) kernels."""

    NAME = "sdpa_efficientF"
    ARCHS = ("cuda>=5.0",)
    BACKEND = SDPBackend.EFFICIENT_ATTENTION
    DTYPES = _ALL_FLOAT
    OUT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    HEAD_DIMS = range(1, 513)
    HEAD_DIMS_V = range(1, 513)
    GQA = False  # enable_gqa is not implemented by this backend (torch 2.11)
    DETERMINISTIC = False
    RATES = (250.0, 2.0, 8.0)


@register
class SdpaMathFwOp(_SdpaOp):
    """SDPA's composite math path (materializes the score matrix); any float dtype, CPU and CUDA."""

    NAME = "sdpa_mathF"
    ARCHS = ("cpu", "cuda>=0.0")
    BACKEND = SDPBackend.MATH
    DTYPES = _ALL_FLOAT
    OUT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    HEAD_DIMS = range(1, 1025)
    HEAD_DIMS_V = range(1, 1025)
    RATES = (60.0, 0.6, 15.0)
    PRIORITY = -10
