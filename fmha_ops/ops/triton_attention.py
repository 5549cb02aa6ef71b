"""Triton prefill/training attention: fp8, i8fp8 and bf16/fp16 forward ops, and the backward op.

One kernel (``kernels/triton/attention_fwd.py``) serves the three forward ops through dtype
switches; the selector routes by dtype (fp8 q/k/v -> triton_fp8F, int8 q/k + fp8 v ->
triton_i8fp8F). The backward op runs on bf16/fp16 values; for fp8/int8 forward inputs it runs on
the dequantized values when ``set_fp8_dequantized_backward(True)`` is on.
On a CPU the ops are available only under ``TRITON_INTERPRET=1`` (tests), with an estimate that
keeps the selector away from them.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .. import attn_bias as ab
from ..dispatch import register
from ..dtypes import FP8_DTYPES
from ..inputs import Inputs
from ..problem import Problem
from ..sinks import sink_grad_from_delta
from .base import AttentionBwOp, AttentionFwOp
from .common import TRITON_ARCHS, dequantized_qkv, interpreter_reasons, sink_arg
from .cost import attention_time, backward_time, head_dim_rate

_HEAD_DIMS = range(16, 257, 16)
_BIAS = frozenset({ab.NONE, ab.CAUSAL, ab.CAUSAL_BR, ab.BLOCK_DIAGONAL, ab.BLOCK_DIAGONAL_CAUSAL,
                   ab.BLOCK_DIAGONAL_CAUSAL_BR})
_TOP_LEFT = frozenset({ab.CAUSAL, ab.BLOCK_DIAGONAL_CAUSAL})
_OUT = frozenset({torch.bfloat16, torch.float16, torch.float32})


def mask_args(inp: Inputs) -> dict:
    """The kernels' causal / window / softcap / varlen keyword arguments for the call's attn_bias and softcap
    (a mask's ``window_left`` / ``window_right``, -1 = unbounded; ``Inputs.softcap``, 0 = off)."""
    kind = inp.bias_kind
    b = inp.attn_bias
    args = {"causal": kind in ab.CAUSAL_KINDS, "causal_bottom_right": kind not in _TOP_LEFT,
            "window_left": getattr(b, "window_left", -1), "window_right": getattr(b, "window_right", -1),
            "softcap": getattr(inp, "softcap", 0.0)}
    if kind in ab.VARLEN_KINDS:
        args.update(cu_seqlens_q=b.q_seqinfo.seqstart, cu_seqlens_k=b.k_seqinfo.seqstart,
                    max_seqlen_q=b.q_seqinfo.max_seqlen, max_seqlen_k=b.k_seqinfo.max_seqlen)
    return args


#: descales of the quantized (fp8, i8fp8) ops: FA3's per tensor / (batch, kv head), the training path's per block
_QUANTIZED_DESCALES = {"q": frozenset({"tensor", "head", "block"}), "k": frozenset({"tensor", "head", "block"}),
                       "v": frozenset({"tensor", "head", "channel"})}


class _TritonFwOp(AttentionFwOp):
    ARCHS = TRITON_ARCHS
    REQUIRES = ("triton",)
    OUT_DTYPES = _OUT
    HEAD_DIMS = _HEAD_DIMS
    HEAD_DIMS_V = _HEAD_DIMS
    BIAS_KINDS = _BIAS
    GQA = True
    PARTIAL = True
    V_KEYS_CONTIGUOUS = True
    ALIGNMENT = "TMA descriptors"
    WINDOW = True
    SOFTCAP = True
    SINKS = True
    #: achieved TFLOP/s on the H200 (non-causal, d128), for the cost model; HEAD_DIM_TFLOPS, where set, by head dim
    TFLOPS: ClassVar[float]
    HEAD_DIM_TFLOPS: ClassVar[dict[int, float] | None] = None
    #: one kernel launch with four host descriptors and the output's allocation (bench/host_time.py, direct column)
    HOST_US = 75.0

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        r = interpreter_reasons(p)
        if p.bias in ab.VARLEN_KINDS and "block" in p.descales:
            r.append("per-block descales with a varlen (BlockDiagonal) mask not supported")
        if p.bias in ab.VARLEN_KINDS and p.v_keys_contiguous:
            r.append("a keys-contiguous value with a varlen (BlockDiagonal) mask not supported")
        return r

    @classmethod
    def apply(cls, inp, needs_lse):
        from ..kernels.triton.attention_fwd import attention_forward

        return attention_forward(inp.query, inp.key, inp.value, scale=inp.softmax_scale, q_descale=inp.q_descale,
                                 k_descale=inp.k_descale, v_descale=inp.v_descale, out_dtype=inp.out_dtype,
                                 return_lse=needs_lse, sinks=sink_arg(inp), **mask_args(inp))

    @classmethod
    def estimate(cls, p: Problem) -> float:
        if p.arch.kind == "cpu":  # the interpreter: correct, never fast
            return attention_time(p, 1e-6, 1e-6, 1e5)
        rate = cls.TFLOPS if cls.HEAD_DIM_TFLOPS is None else head_dim_rate(cls.HEAD_DIM_TFLOPS, p.head_dim)
        return attention_time(p, rate, 3.0, 6.0)


@register
class TritonFp8FwOp(_TritonFwOp):
    """fp8 e4m3 q/k/v with float32 descales (FA3 convention, or per-block q/k and per-channel v as the
    training path quantizes), bf16 out; P quantized to fp8 for PV."""

    NAME = "triton_fp8F"
    DTYPES = frozenset((f, f, f) for f in FP8_DTYPES)
    DESCALES = _QUANTIZED_DESCALES
    TFLOPS = 900.0
    #: the tuning table's long-sequence rates on the H200 (non-causal, 8k tokens): 547 / 812 / 980 at D64 / 128 / 256
    HEAD_DIM_TFLOPS = {64: 550.0, 128: 810.0, 256: 980.0}
    HOST_US = 90.0  # and the launch that transposes V


@register
class TritonI8Fp8FwOp(_TritonFwOp):
    """i8fp8 (SageAttention-like): int8 q/k (int32 QK^T), fp8 v, bf16 out; per-block q/k descales."""

    NAME = "triton_i8fp8F"
    DTYPES = frozenset((torch.int8, torch.int8, f) for f in FP8_DTYPES)
    DESCALES = _QUANTIZED_DESCALES
    TFLOPS = 850.0
    HOST_US = 90.0  # and the launch that transposes V


@register
class TritonFwOp(_TritonFwOp):
    """bf16/fp16 flash attention in Triton (TMA descriptors on Hopper)."""

    NAME = "triton_attnF"
    DTYPES = frozenset({(torch.bfloat16,) * 3, (torch.float16,) * 3})
    OUT_DTYPES = frozenset({torch.bfloat16, torch.float16})
    TFLOPS = 450.0

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        r = super().extra_reasons(p)
        if p.out_dtype != p.q_dtype:
            r.append(f"output dtype must equal the input dtype {p.q_dtype}")
        return r


@register
class TritonBwOp(AttentionBwOp):
    """Backward on bf16/fp16 values (FA2-style: dK/dV and dQ kernels, deterministic). For fp8/int8
    forward inputs it differentiates w.r.t. the dequantized values, when
    ``set_fp8_dequantized_backward(True)`` is on; gradients come back in the inputs' dtypes."""

    NAME = "triton_attnB"
    ARCHS = TRITON_ARCHS
    REQUIRES = ("triton",)
    DTYPES = TritonFwOp.DTYPES | TritonFp8FwOp.DTYPES | TritonI8Fp8FwOp.DTYPES
    OUT_DTYPES = _OUT
    HEAD_DIMS = _HEAD_DIMS
    HEAD_DIMS_V = _HEAD_DIMS
    BIAS_KINDS = _BIAS
    GQA = True
    PARTIAL = True
    WINDOW = True
    SOFTCAP = True
    SINKS = True  # dq / dk / dv from the sink-inclusive LSE, the sinks' gradient from the kernels' row sums
    DESCALES = {r: kinds | {"none"} for r, kinds in TritonI8Fp8FwOp.DESCALES.items()}
    HOST_US = 100.0  # three launches
    #: achieved TFLOP/s of the backward's work by head dim on the H200 (346 at D64, 408-427 at D128, 237 at D256 on
    #: 4k-16k tokens; 297 at 8x1000 D128: a fixed ~100 us beside the rate)
    BW_RATES: ClassVar[dict[int, float]] = {64: 350.0, 128: 420.0, 256: 240.0}
    BW_OVERHEAD_US = 100.0

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        return interpreter_reasons(p)

    @classmethod
    def apply_bw(cls, inp, out, lse, grad_out):
        return cls._backward(inp, out, lse, grad_out, None)

    @classmethod
    def apply_bw_sinks(cls, inp, out, lse, grad_out):
        """The sinks' gradient from the row sums delta = rowsum(dO * O) the kernels' preprocess writes: a (B, Hq, Mq)
        float32 pass instead of ``sink_grad``'s float32 copies of out and dO (0.9 GB at 1x8192, Hq 64, D64; there
        0.04 ms against 0.41 on the H100, bench/diagnostics/sinks_backward_cost.py)."""
        delta = torch.empty(lse.shape, device=lse.device, dtype=torch.float32)
        dq, dk, dv = cls._backward(inp, out, lse, grad_out, delta)
        return dq, dk, dv, sink_grad_from_delta(delta, lse, inp.sinks)

    @classmethod
    def _backward(cls, inp, out, lse, grad_out, delta):
        """(dq, dk, dv) by the kernels; ``delta``: None, or the float32 (like lse) output of their row sums."""
        from ..kernels.triton.attention_bwd import attention_backward

        q, k, v = inp.query, inp.key, inp.value
        if q.dtype not in (torch.bfloat16, torch.float16):
            q, k, v = (t.to(torch.bfloat16) for t in dequantized_qkv(inp))
            out, grad_out = out.to(q.dtype), grad_out.to(q.dtype)
        return attention_backward(grad_out, q, k, v, out, lse, scale=inp.softmax_scale, delta=delta,
                                  **mask_args(inp))

    @classmethod
    def estimate(cls, p: Problem) -> float:
        if p.arch.kind == "cpu":
            return attention_time(p, 1e-6, 1e-6, 1e5)
        return backward_time(p, cls.BW_RATES, 2.0, cls.BW_OVERHEAD_US)
