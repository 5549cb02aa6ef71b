"""Quantize-inside attention for training and convenience: bf16/fp16 in, bf16/fp16 out, autograd.

``fp8_attention``: q/k/v quantized to fp8 per (batch, kv head) (FA3 convention), fp8 forward;
``i8fp8_attention``: int8 q/k per block with smooth-K, fp8 v per channel (SageAttention-like).
Both differentiate with a bf16/fp16 backward kernel on the original q/k/v, using the quantized
forward's output and LSE, so gradients flow to the bf16 tensors (the practical training path).
The forward op is selected by dtype (triton_fp8F / triton_i8fp8F where available, else the reference).
"""
from __future__ import annotations

from typing import Callable

import torch

from registry import current_arch, fp8_dtype

from . import attn_bias as ab
from .api import _forward, _inputs
from .dispatch import SELECTOR
from .quant import quantize_i8fp8, quantize_qkv_fp8

__all__ = ["fp8_attention", "i8fp8_attention"]


def _fp8(q, k, v, scale):
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v, dtype=fp8_dtype(current_arch(q.device)))
    return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd), scale


def _i8fp8(q, k, v, scale):
    r = quantize_i8fp8(q, k, v, scale=scale, fp8_dtype=fp8_dtype(current_arch(q.device)))
    return (r.q, r.k, r.v), dict(q_descale=r.q_descale, k_descale=r.k_descale, v_descale=r.v_descale), r.softmax_scale


class _QuantizedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, quantize: Callable, bias, scale, op, query, key, value):
        qkv, descales, kernel_scale = quantize(query, key, value, scale)
        inp, _ = _inputs(*qkv, bias, 0.0, kernel_scale, query.dtype, True, descales["q_descale"],
                         descales["k_descale"], descales["v_descale"], False)
        out, lse = _forward(inp, op, True)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.bias, ctx.scale = bias, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        inp, _ = _inputs(query, key, value, ctx.bias, 0.0, ctx.scale, None, True, None, None, None, False)
        bw = SELECTOR.select(("qbw",) + inp.signature(), lambda: _problem(inp), "bw")
        dq, dk, dv = bw.apply_bw(inp, out, lse, grad_out.contiguous())
        return None, None, None, None, dq, dk, dv


def _problem(inp):
    inp.validate()
    return inp.problem(needs_lse=True)


def _causal(causal: bool):
    return ab.LowerTriangularFromBottomRightMask() if causal else None


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  softmax_scale: float | None = None, *, op=None) -> torch.Tensor:
    """q (B, Mq, Hq, D), k/v (B, Mk, Hkv, D) bf16/fp16 -> out (B, Mq, Hq, D) in q's dtype, via fp8.
    ``causal`` is bottom-right aligned; ``op`` forces the forward op."""
    return _QuantizedAttention.apply(_fp8, _causal(causal), softmax_scale, op, q, k, v)


def i8fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: float | None = None, *, op=None) -> torch.Tensor:
    """Like ``fp8_attention`` with int8 q/k (per-block scales, smooth-K) and fp8 v (per channel)."""
    return _QuantizedAttention.apply(_i8fp8, _causal(causal), softmax_scale, op, q, k, v)
