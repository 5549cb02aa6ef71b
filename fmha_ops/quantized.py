"""Quantize-inside attention for training and convenience: bf16/fp16 in, bf16/fp16 out, autograd.

``fp8_attention``: fp8 q/k per block of 128 tokens and head, fp8 v per channel; ``i8fp8_attention``:
the same with int8 q/k (SageAttention-like). Both smooth K first (subtract its mean over the sequence,
a per-query-row constant in the logits, so softmax is unchanged and K's shared component does not eat
the quantization range) and fold the softmax scale into q. On CUDA the quantization is two fused Triton
launches for all three tensors (kernels/triton/quantize.py); elsewhere torch ops (``fmha_ops.quant.quantize_blocks``),
the kernel's tested reference.

Gradients (straight-through): a bf16/fp16 backward kernel on the *dequantized* q, k and v (the values
the quantized forward attended to, written by the same quantization pass), with the forward's output and
LSE, so gradients flow to the bf16 tensors (the practical training path). The backward must see the
forward's logits: it recomputes P = exp(q k^T - lse) with the forward's LSE, so keys or queries that differ
from the forward's by the fp8 rounding (2^-4 relative per element) make rows of P that do not sum to 1
(off by exp of the logit error), and that bias trains a model far worse than bf16 (a recompute from freshly
rounded inputs reached 1.83x bf16's validation loss). The keys are the smoothed ones: dS does not sum to
exactly 0 over keys against a quantized forward, and dQ = dS k would multiply that residue by K's mean.
dK is unchanged by the shift (d(k - mean(k))/dk only removes a component dK does not have).
The forward op is selected by dtype (triton_fp8F / triton_i8fp8F where available, else the reference).
"""
from __future__ import annotations

import ast
import contextvars
import functools
from typing import Any

import torch

from registry import current_arch, fp8_dtype

from . import attn_bias as ab
from . import arguments, compiled
from .call import run_forward
from .dispatch import SELECTOR
from .inputs import Inputs, make_inputs
from .plan import Plan
from .plans import PLANS, call_key, plan_finder
from .quant import (
    K_SCALE_BLOCK,
    Q_SCALE_BLOCK,
    dequantize_blocks,
    fp8_channel_descale,
    quantize_blocks,
    quantize_fp8_channels,
)
from .timing import autotune_seconds
from .validation import make_problem, validate_sinks

__all__ = ["fp8_attention", "i8fp8_attention"]


def quantize_smooth(q, k, v, scale: float, qk_dtype: torch.dtype):
    """q (B, Mq, Hq, D), k (B, Mk, Hkv, D), v (B, Mk, Hkv, Dv) -> ((q8, k8, v8), descales, (qh, kh, vh)).

    q8 = quantize(q * scale), k8 = quantize(k - mean_seq(k)) per block (``qk_dtype`` int8 or fp8), v8 fp8
    per channel; descales as the attention ops take them ("block", "block", "channel"); qh, kh, vh are the
    dequantized values in the inputs' dtype and units (qh ~ q (0 if scale is 0), kh ~ k - mean_seq(k), vh ~ v).
    On CUDA two fused launches (``kernels.triton.quantize.quantize_qkv``; v8 keys-contiguous, the layout the
    fp8 PV product reads), elsewhere torch ops (v8 in v's layout).
    """
    v_dtype = fp8_dtype(current_arch(q.device))
    if q.is_cuda:
        from .kernels.triton.quantize import quantize_qkv

        (q8, k8, v8), (qd, kd, vd), (qh, kh, vh) = quantize_qkv(
            q, k, v, qk_dtype, v_dtype, scale=scale, q_block=Q_SCALE_BLOCK, k_block=K_SCALE_BLOCK)
    else:
        B, Mk, Hkv, D = k.shape
        k_mean = (torch.mean(k, dim=1, dtype=torch.float32) if Mk
                  else torch.zeros((B, Hkv, D), dtype=torch.float32, device=k.device))
        vd = fp8_channel_descale(v, v_dtype)
        q8, qd = quantize_blocks(q.float() * scale, Q_SCALE_BLOCK, qk_dtype)
        k8, kd = quantize_blocks(k.float() - k_mean[:, None], K_SCALE_BLOCK, qk_dtype)
        v8 = quantize_fp8_channels(v, vd, v_dtype)
        qh = (dequantize_blocks(q8, qd, Q_SCALE_BLOCK) * (1.0 / scale if scale else 0.0)).to(q.dtype)
        kh = dequantize_blocks(k8, kd, K_SCALE_BLOCK).to(k.dtype)
        vh = (v8.float() * vd[:, None]).to(v.dtype)
    return (q8, k8, v8), {"q_descale": qd, "k_descale": kd, "v_descale": vd}, (qh, kh, vh)


def quantized_forward(qk_dtype: torch.dtype, bias, scale: float | None, op, query, key, value, sinks=None):
    """``quantize_smooth`` then the selected quantized forward op: (out in query's dtype, lse float32
    (B, Hq, Mq), the sinks included, (qh, kh, vh) the dequantized inputs the backward differentiates at)."""
    kernel_scale = query.shape[-1] ** -0.5 if scale is None else scale
    (q8, k8, v8), descales, dequantized = quantize_smooth(query, key, value, kernel_scale, qk_dtype)
    qd, kd, vd = descales["q_descale"], descales["k_descale"], descales["v_descale"]
    key = call_key(quantized_forward, (q8, k8, v8, bias, op, query.dtype, qd, kd, vd, sinks))
    plan = PLANS.get(key)
    if plan is not None:
        out, lse = plan.run(q8, k8, v8, bias, qd, kd, vd, sinks)
    else:
        inp = make_inputs(q8, k8, v8, bias, scale=1.0, output_dtype=query.dtype, is_partial=True, sinks=sinks,
                          **descales)
        out, lse = run_forward(inp, op, True, key)
    return out, lse, dequantized


def quantized_backward(bias, scale: float | None, qh, kh, vh, out, lse, grad_out, sinks=None, sinks_grad=False):
    """(dq, dk, dv, dsinks) by the selected bf16/fp16 backward op at the dequantized inputs (straight-through); with
    ``sinks`` a backward op that takes the sink-inclusive LSE, and with ``sinks_grad`` also the sinks' gradient
    (``AttentionBwOp.apply_bw_sinks``; dsinks None without it). Under autotune the first backward of a problem times
    the backward ops on these tensors."""
    key = call_key(quantized_backward, (qh, kh, vh, bias, scale, sinks))
    plan = PLANS.get(key)
    if plan is not None:  # these tensors come from the forward's quantization: validated when first selected
        return plan.run(qh, kh, vh, out, lse, grad_out, sinks, sinks_grad)
    inp = make_inputs(qh, kh, vh, bias, scale=scale, is_partial=True, sinks=sinks)
    grad_out = grad_out.contiguous()
    bw = SELECTOR.select(("quantized backward", inp.signature(True)), lambda: make_problem(inp, True), "bw", None,
                         lambda ops: autotune_seconds(ops, lambda o: functools.partial(o.apply_bw, inp, out, lse,
                                                                                       grad_out), qh.device.type))
    plan = PLANS.put(key, Plan(_backward_plan(bw, bias, scale), (bw,)))
    return plan.run(qh, kh, vh, out, lse, grad_out, sinks, sinks_grad)


def _backward_plan(bw, bias, scale: float | None):
    """``run(qh, kh, vh, out, lse, grad_out, sinks, sinks_grad) -> (dq, dk, dv, dsinks)``: ``bw`` at dequantized
    inputs of one layout (the sinks, when given, of the layout the key holds; dsinks None unless ``sinks_grad``)."""
    def run(qh, kh, vh, out, lse, grad_out, sinks, sinks_grad):
        inp = Inputs(qh, kh, vh, bias, 0.0, scale, None, True, sinks=sinks)
        if sinks_grad:
            return bw.apply_bw_sinks(inp, out, lse, grad_out.contiguous())
        return (*bw.apply_bw(inp, out, lse, grad_out.contiguous()), None)
    return run


class _QuantizedAttention(torch.autograd.Function):
    """The backward selects its op in the forward's context (``use_ops``, ``set_fp8_dequantized_backward`` are
    context-local, and autograd runs CUDA backwards on its own thread)."""

    @staticmethod
    def forward(ctx, qk_dtype, bias, scale, op, query, key, value, sinks=None):
        out, lse, dequantized = quantized_forward(qk_dtype, bias, scale, op, query, key, value, sinks)
        ctx.save_for_backward(*dequantized, out, lse)
        ctx.bias, ctx.scale, ctx.sinks, ctx.context = bias, scale, sinks, contextvars.copy_context()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qh, kh, vh, out, lse = ctx.saved_tensors
        dq, dk, dv, dsinks = ctx.context.run(quantized_backward, ctx.bias, ctx.scale, qh, kh, vh, out, lse, grad_out,
                                             ctx.sinks, ctx.needs_input_grad[7])
        return None, None, None, None, dq, dk, dv, dsinks


#: the dtypes the quantize-inside functions take (and return): the ones their backward kernels run in
_QUANTIZED_FROM = (torch.float16, torch.bfloat16)


def _check_call(q, k, v, causal, softmax_scale) -> None:
    """Raise on bad arguments (once per call signature: a repeated call runs its plan)."""
    arguments.bmhk_qkv(q, k, v, dtypes=_QUANTIZED_FROM)
    arguments.flag("causal", causal)
    if softmax_scale is not None:
        arguments.finite_float("softmax_scale", softmax_scale)


#: FA3's causal mask (stateless: one instance serves every call, its signature computed once)
_BOTTOM_RIGHT_CAUSAL = ab.LowerTriangularFromBottomRightMask()


def _causal(causal: bool):
    return _BOTTOM_RIGHT_CAUSAL if causal else None


def _quantized_attention(key, qk_kind: str, causal: bool, scale: float | None, op, q, k, v,
                         sinks=None) -> torch.Tensor:
    """The full path of ``fp8_attention`` / ``i8fp8_attention`` (``qk_kind`` "fp8" / "int8"): validate, then run the
    plan it stores under the call's plan ``key``."""
    _check_call(q, k, v, causal, scale)
    if sinks is not None:
        validate_sinks(sinks, q.shape[2], q.device)
    if torch.compiler.is_compiling():
        if sinks is not None:
            raise NotImplementedError("sinks are not implemented for fp8_attention / i8fp8_attention under "
                                      "torch.compile (eager calls take them)")
        return _traced_quantized_attention(qk_kind, causal, scale, op, q, k, v)
    qk_dtype = torch.int8 if qk_kind == "int8" else fp8_dtype(current_arch(q.device))
    bias = _causal(causal)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or (sinks is not None and sinks.requires_grad))):
        def run(q, k, v, sinks):  # no autograd node to record
            return quantized_forward(qk_dtype, bias, scale, op, q, k, v, sinks)[0]
    else:
        def run(q, k, v, sinks):
            return _QuantizedAttention.apply(qk_dtype, bias, scale, op, q, k, v, sinks)
    return PLANS.put(key, Plan(run, skips=("validation",))).run(q, k, v, sinks)


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  softmax_scale: float | None = None, *, op=None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention through fp8: q/k per block of 128 tokens and head, v per channel (``quantize_smooth``).

    q (B, Mq, Hq, D), k / v (B, Mk, Hkv, D) bfloat16 / float16 -> out (B, Mq, Hq, D) in q's dtype;
    differentiable (straight-through: a bf16 backward at the dequantized values). ``causal`` is
    bottom-right aligned; ``op`` forces the forward op. ``sinks``: float32 (Hq,) attention sinks
    (``fmha_ops.sinks``), differentiable; eager calls only (torch.compile raises).

    Example
    -------
    >>> out = fp8_attention(q, k, v, causal=True)
    >>> out.float().sum().backward()
    """
    plan, key = _FIND_FP8(q, k, v, causal, softmax_scale, op, sinks)
    if plan is not None:
        return plan.run(q, k, v, sinks)
    return _quantized_attention(key, "fp8", causal, softmax_scale, op, q, k, v, sinks)


def i8fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: float | None = None, *, op=None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Like ``fp8_attention`` with int8 q/k (per-block scales, smooth-K) and fp8 v (per channel).

    Example
    -------
    >>> out = i8fp8_attention(q, k, v, causal=True)
    """
    plan, key = _FIND_I8FP8(q, k, v, causal, softmax_scale, op, sinks)
    if plan is not None:
        return plan.run(q, k, v, sinks)
    return _quantized_attention(key, "int8", causal, softmax_scale, op, q, k, v, sinks)


_FIND_FP8 = plan_finder(fp8_attention)
_FIND_I8FP8 = plan_finder(i8fp8_attention)


# ---- under torch.compile: one custom op ----------------------------------------------------------------

def _traced_quantized_attention(qk_kind: str, causal: bool, scale: float | None, op: Any, q, k, v) -> torch.Tensor:
    """The traced twin of ``fp8_attention`` / ``i8fp8_attention`` (``qk_kind`` "fp8" / "int8"). The quantized
    problem exists only after the quantization, so its ops are selected inside the custom op (memoized)."""
    text = repr((qk_kind, causal, scale, _op_names(op)))
    return torch.ops.fmha_ops.quantized_attention(q, k, v, text)[0]


def _op_names(op: Any) -> Any:
    """An ``op=`` value as constants: names for op classes (tuples element-wise)."""
    if isinstance(op, tuple):
        return tuple(_op_names(o) for o in op)
    return op.NAME if isinstance(op, type) else op


def _quantized_args(spec: str):
    qk_kind, causal, scale, op = ast.literal_eval(spec)
    bias = ab.LowerTriangularFromBottomRightMask() if causal else None
    return qk_kind, bias, scale, op


@torch.library.custom_op("fmha_ops::quantized_attention", mutates_args=())
def quantized_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           spec: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantized.quantized_forward``: (out, lse, qh, kh, vh), contiguous."""
    qk_kind, bias, scale, op = _quantized_args(spec)
    qk_dtype = torch.int8 if qk_kind == "int8" else fp8_dtype(current_arch(query.device))
    out, lse, dequantized = quantized_forward(qk_dtype, bias, scale, op, query, key, value)
    return tuple(t.contiguous() for t in (out, lse, *dequantized))


@quantized_attention_op.register_fake
def _quantized_attention_fake(query, key, value, spec):
    b, mq, hq, _ = query.shape
    return (query.new_empty((b, mq, hq, value.shape[-1])), query.new_empty((b, hq, mq), dtype=torch.float32),
            query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape))


@torch.library.custom_op("fmha_ops::quantized_attention_backward", mutates_args=())
def quantized_attention_backward_op(grad_out: torch.Tensor, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                                    out: torch.Tensor, lse: torch.Tensor,
                                    spec: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantized.quantized_backward``: (dq, dk, dv), contiguous."""
    _, bias, scale, _ = _quantized_args(spec)
    with compiled.autograd_dispatch():
        grads = quantized_backward(bias, scale, qh, kh, vh, out, lse, grad_out)[:3]
    return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, (qh, kh, vh)))


@quantized_attention_backward_op.register_fake
def _quantized_attention_backward_fake(grad_out, qh, kh, vh, out, lse, spec):
    return tuple(t.new_empty(t.shape) for t in (qh, kh, vh))


def _quantized_setup(ctx, inputs, output):
    ctx.spec = inputs[3]
    out, lse, qh, kh, vh = output
    ctx.save_for_backward(qh, kh, vh, out, lse)


def _quantized_backward(ctx, grad_out, *_unused):
    qh, kh, vh, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fmha_ops.quantized_attention_backward(grad_out, qh, kh, vh, out, lse, ctx.spec)
    return dq, dk, dv, None


quantized_attention_op.register_autograd(_quantized_backward, setup_context=_quantized_setup)
