"""cuDNN's fp8 attention forward through ``nvidia-cudnn-frontend`` (``pip install 'fmha-ops[cudnn]'``).

One cuDNN graph (``sdpa_fp8``) per call signature, built on the first call and cached with its workspace
(``cudnn_graphs.GraphCache``).

Contract: fp8 e4m3 q/k/v with per-tensor float32 descales; out = attention(q*q_descale, k*k_descale,
v*v_descale) in bfloat16 / float16 / float32 (default bfloat16), or with ``output_dtype=float8_e4m3fn`` in fp8
in v's units (attention = out * v_descale). On Hopper cuDNN writes the output in fp8 only, so the graph attends
to v in its fp8 units (descale 1) with output scale 1: since attention is a convex combination of value rows,
|o| <= max|v_fp8| <= 448 and the fp8 output cannot saturate, with no reduction over v per call. The fp8 output
is returned as it is; for a float output one fused kernel (``kernels.triton.dequantize``) writes
o_fp8 * v_descale in the output dtype.

Declined, with reasons: per-(batch, head), per-block or per-channel descales (cuDNN takes one scalar per
tensor), varlen / padded / paged masks, one query token (no plan), bottom-right causal with Mq != Mk on
Hopper (cuDNN has it for fp8 on Blackwell only), head dims other than 16..256 in steps of 16 (128 at most on
Blackwell), K != Kv, dropout, local windows, softcap.
The fp8 backward (``sdpa_fp8_backward``) is not offered as an op, because it loses to fa4B on the H200 (cuDNN 9.19,
bench/diagnostics/cudnn_fp8_probe.py, 4x32x4096 D128): cuDNN builds no plan with bf16 gradients, only fp8 ones
(with per-tensor scales that need the gradients' amax in advance); its kernel reaches 667 TFLOP/s against fa4B's
617, but with the per-tensor quantization of o and dO it needs, 480; and its fp8 dQ has cosine 0.986 to the
float32 reference. fp8 forwards are differentiated at the dequantized values by the selected bf16 backward op.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from .. import attn_bias as ab
from ..dispatch import register
from ..inputs import Inputs
from ..problem import Problem
from .base import AttentionFwOp
from .common import OptionalPackage
from .cost import attention_time, head_dim_rate
from .cudnn_graphs import (GraphCache, backend_reason, bhsd, build_plans, cudnn_package_reason, empty_reason,
                           execute, rows_of)

#: the oldest cuDNN backend with an fp8 forward on Hopper, and the one release of it that is known-broken
MIN_BACKEND, BROKEN_BACKEND = 90100, 91000
FP8_MAX = 448.0  # largest e4m3 value
MIN_SEQLEN_Q = 2  # cuDNN 9.19 finds no sdpa_fp8 engine for one query token (measured on the H200)
_FP8 = torch.float8_e4m3fn
_BIAS = frozenset({ab.NONE, ab.CAUSAL, ab.CAUSAL_BR})


def cudnn_unavailable_reason() -> str | None:
    """None when the frontend imports and its cuDNN backend has the fp8 forward, else why not."""
    return backend_reason(MIN_BACKEND, "fp8 attention forward", broken=(BROKEN_BACKEND,))


def graph_key(inp: Inputs, needs_lse: bool) -> tuple:
    """Everything a built graph depends on: shapes, strides, mask, scale, LSE, device."""
    q, k, v = inp.query, inp.key, inp.value
    return (q.device, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), _causal(inp),
            inp.softmax_scale, needs_lse)


def _causal(inp: Inputs) -> bool:
    return inp.bias_kind in (ab.CAUSAL, ab.CAUSAL_BR)


class _Constants:
    """float32 scalars a graph reads, on its device: 1, the softmax-probability scale 448 and its inverse."""

    def __init__(self, device: torch.device) -> None:
        def scalar(x: float) -> torch.Tensor:
            return torch.full((1, 1, 1, 1), x, dtype=torch.float32, device=device)

        self.one, self.scale_s, self.descale_s = scalar(1.0), scalar(FP8_MAX), scalar(1.0 / FP8_MAX)


class Fp8Graph:
    """One built ``sdpa_fp8`` graph for one call signature, with its workspace, tensor handles and constants."""

    def __init__(self, cudnn: Any, handle: Any, inp: Inputs, needs_lse: bool) -> None:
        q, k, v = inp.query, inp.key, inp.value
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        self.q, self.k, self.v = (g.tensor(name=n, dim=d, stride=s, data_type=e4m3)
                                  for n, (d, s) in (("q", bhsd(q)), ("k", bhsd(k)), ("v", bhsd(v))))
        scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
        self.scalars = [g.tensor(name=n, **scalar)
                        for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
        o, stats, amax_s, amax_o = g.sdpa_fp8(
            self.q, self.k, self.v, *self.scalars, is_inference=not needs_lse, attn_scale=inp.softmax_scale,
            use_causal_mask=_causal(inp), name="sdpa_fp8")
        b, mq, hq, _ = q.shape
        self.out_shape = (b, mq, hq, v.shape[3])
        o_dims, o_strides = bhsd(torch.empty(self.out_shape, device="meta"))
        o.set_output(True).set_dim(o_dims).set_stride(o_strides).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(False).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        self.o, self.stats = o, None
        if needs_lse:
            dims, strides = rows_of(b, hq, mq)
            stats.set_output(True).set_dim(dims).set_stride(strides).set_data_type(f32)
            self.stats = stats
        self.workspace = build_plans(g, cudnn, q.device)
        self.graph, self.handle, self.consts = g, handle, _Constants(q.device)

    def run(self, inp: Inputs, cudnn: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """o_fp8 (B, Mq, Hq, Kv) in v's fp8 units (times v_descale is the output) and the LSE or None."""
        q, k, v, consts = inp.query, inp.key, inp.value, self.consts
        o8 = torch.empty(self.out_shape, dtype=_FP8, device=q.device)
        pack = {self.q: q, self.k: k, self.v: v, self.o: o8}
        for t, value in zip(self.scalars, (inp.q_descale, inp.k_descale, consts.one, consts.descale_s,
                                           consts.scale_s, consts.one)):
            pack[t] = value
        lse = None
        if self.stats is not None:
            b, mq, hq, _ = self.out_shape
            lse = torch.empty((b, hq, mq), dtype=torch.float32, device=q.device)
            pack[self.stats] = lse
        execute(self.graph, self.handle, pack, self.workspace, cudnn)
        return o8, lse


GRAPHS = GraphCache("fp8 attention", graph_key, Fp8Graph)


@register
class CudnnFp8FwOp(OptionalPackage, AttentionFwOp):
    """cuDNN fp8 attention forward (``sdpa_fp8``): fp8 e4m3 q/k/v, per-tensor descales, bf16/fp16/fp32 out, or
    fp8 out in v's units."""

    NAME = "cudnn_fp8F"
    ARCHS = ("cuda>=9.0",)
    REQUIRES = ("triton",)
    DTYPES = frozenset({(_FP8,) * 3})
    OUT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32, _FP8})
    HEAD_DIMS = range(16, 257, 16)
    BIAS_KINDS = _BIAS
    GQA = True
    DESCALES = {r: frozenset({"tensor"}) for r in "qkv"}
    PARTIAL = True
    #: the graph's fp8 kernels read q / k / v through TMA (cuDNN's fused attention on Hopper and Blackwell)
    ALIGNMENT = "cuDNN fp8 kernels' TMA loads"
    #: achieved TFLOP/s by head dim on the H200 (the tuning table's long-sequence rates, non-causal, 8k tokens:
    #: 570 / 989 / 967 at D64 / 128 / 256), TB/s, device overhead us (the dequantization launch)
    HEAD_DIM_TFLOPS: ClassVar[dict[int, float]] = {64: 570.0, 128: 990.0, 256: 970.0}
    TBPS, OVERHEAD_US = 3.0, 8.0
    HOST_US = 40.0  # binding the cached graph's tensors and executing it, plus the dequantization launch
    package_reason = staticmethod(cudnn_package_reason)
    import_reason = staticmethod(cudnn_unavailable_reason)

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        r = []
        blackwell = p.arch.kind == "cuda" and p.arch.capability[0] >= 10
        if p.bias == ab.CAUSAL_BR and p.seqlen_q != p.seqlen_k and not blackwell:
            r.append(f"bottom-right causal with Mq={p.seqlen_q} != Mk={p.seqlen_k} not supported on Hopper "
                     f"(cuDNN's fp8 forward has it on Blackwell only)")
        if blackwell and p.head_dim > 128:
            r.append(f"head dim K={p.head_dim} not supported on Blackwell; supported: multiples of 16 from 16 to 128")
        if p.out_dtype == _FP8 and p.needs_grad:
            r.append("gradients through an fp8 output (output_dtype=float8_e4m3fn) not supported")
        if (empty := empty_reason(p)) is not None:
            r.append(empty)
        elif p.seqlen_q < MIN_SEQLEN_Q:
            r.append(f"query length {p.seqlen_q} < {MIN_SEQLEN_Q} not supported (cuDNN builds no fp8 plan for it on "
                     f"the H200; the decode ops serve single-token queries)")
        return r

    @classmethod
    def apply(cls, inp: Inputs, needs_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        from ..kernels.triton.dequantize import dequantize

        graph, cudnn = GRAPHS.get(inp, needs_lse)
        o8, lse = graph.run(inp, cudnn)
        if inp.out_dtype == _FP8:
            return o8, lse
        return dequantize(o8, inp.v_descale, inp.out_dtype), lse

    @classmethod
    def estimate(cls, p: Problem) -> float:
        return attention_time(p, head_dim_rate(cls.HEAD_DIM_TFLOPS, p.head_dim), cls.TBPS, cls.OVERHEAD_US)

