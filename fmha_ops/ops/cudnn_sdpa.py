"""cuDNN's bf16/fp16 attention forward and backward through ``nvidia-cudnn-frontend`` (``pip install
'fmha-ops[cudnn]'``): the ops that take attention sinks and a value head dim of its own on cuDNN's kernels.

torch's SDPA runs cuDNN's fused attention (``sdpa_cudnnF``) without sinks and with Kv == K only. These ops build the
frontend's ``sdpa`` / ``sdpa_backward`` graphs themselves (one per call signature, cached with its workspace:
``cudnn_graphs.GraphCache``), so that calls with sinks (GPT-OSS) and with K=192 / Kv=128 (DeepSeek-V3) run on cuDNN's
kernels too, with:

* sinks as cuDNN's ``sink_token`` (float32 (1, Hq, 1, 1)); the forward's Stats then include the sink, as our LSE does
  (``fmha_ops.sinks``), and the backward returns the sinks' gradient as ``dSink_token`` (``apply_bw_sinks``);
* K != Kv where cuDNN has kernels for it: Kv < K <= 128, or K=192 with Kv=128;
* masks as cuDNN's diagonal band (``band``): causal top-left or bottom-right, and local windows on either, or
  without causality (bottom-right aligned, as our non-causal kinds are), with Mq <= Mk;
* GQA / MQA, the natural-log LSE (B, Hq, Mq) for partial attention and any forward's backward.

Declined, with reasons: varlen, padded and paged masks (cuDNN takes those as ragged offsets and sequence lengths,
not wired here), tensor biases, dropout, softcap, fp8 / fp32 inputs (``cudnn_fp8F`` serves fp8), Kv > K (the
frontend's own tests draw Kv <= K only), empty sequences, one query token with sinks (cuDNN's decode mode has no
sink), bottom-right causal or windows with Mq > Mk (the frontend refuses them), cuDNN backends before 9.13 (the first
with ``sink_token``).
"""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch

from .. import attn_bias as ab
from ..dispatch import register
from ..inputs import Inputs
from ..problem import Problem
from .base import AttentionBwOp, AttentionFwOp
from .common import OptionalPackage, half_backward_operands, window_fields
from .cost import attention_time, backward_time, head_dim_rate
from .cudnn_graphs import (GraphCache, backend_reason, bhsd, build_plans, cudnn_package_reason, empty_reason,
                           execute, rows_of)

#: the first cuDNN backend with ``sink_token`` (forward and backward), which also has head dims up to 256 forward
#: and backward on Hopper (the large-head-dim backward bug of 9.11 / 9.12 is fixed there)
MIN_BACKEND = 91300
_HALF = frozenset({(torch.bfloat16,) * 3, (torch.float16,) * 3})
_BIAS = frozenset({ab.NONE, ab.CAUSAL, ab.CAUSAL_BR})
_HEAD_DIMS = range(8, 257, 8)
#: head dims cuDNN takes with K != Kv: both up to this, or exactly ``_WIDE_PAIR``
_UNEQUAL_MAX = 128
_WIDE_PAIR = (192, 128)
_IO_TYPES = {torch.bfloat16: "BFLOAT16", torch.float16: "HALF"}
#: What cuDNN's kernels skip, measured (H100, bf16, GPT-OSS heads: 64 / 8 of D64, 1x8192, causal at Mq == Mk, CUDA
#: events, ms; ``bench/diagnostics/cudnn_band_cost.py``): the forward skips a 128-key window's tiles under either
#: alignment (0.135 ``TOP_LEFT`` / 0.153 ``BOTTOM_RIGHT`` against 1.22 without the window); forward + backward under
#: ``TOP_LEFT`` skip both the causal and the window's tiles (4.57 causal, 0.72 windowed; torch's cuDNN path 4.59, the
#: Triton pair 6.07 / 0.74), under ``BOTTOM_RIGHT`` the backward does the whole score matrix (7.63 causal, 7.28
#: windowed). ``band`` passes ``TOP_LEFT`` at Mq == Mk, so only Mq != Mk calls are rated at the square.
#: Sinks (``sink_token`` / ``dSink_token``) add about the same time with and without the window (5.36 against 4.57,
#: 1.53 against 0.72): ``SINKS_BACKWARD_SHARE`` of the forward over the causal keys without the window
SINKS_BACKWARD_SHARE = 0.65


class Band(NamedTuple):
    """cuDNN's diagonal band for one call: key j is visible from query i iff
    i_al - left < j <= i_al + right, i_al = i (``TOP_LEFT``) or i + Mk - Mq (``BOTTOM_RIGHT``); None: unbounded.
    ``alignment`` None: no band (no mask)."""

    alignment: str | None
    left: int | None
    right: int | None

    def kwargs(self, cudnn: Any) -> dict:
        """The frontend's ``sdpa`` / ``sdpa_backward`` keywords for this band."""
        if self.alignment is None:
            return {}
        kw = dict(diagonal_alignment=getattr(cudnn.diagonal_alignment, self.alignment),
                  diagonal_band_right_bound=self.right)
        if self.left is not None:
            kw["diagonal_band_left_bound"] = self.left
        return kw


def band(kind: str, mq: int, mk: int, window_left: int, window_right: int) -> Band:
    """The band of our mask kind and window (``attn_bias``: key j visible iff i_al - window_left <= j <=
    i_al + window_right, -1 unbounded, and causal kinds add j <= i_al). cuDNN's left bound counts the query's own
    key (left = window_left + 1); it takes a left bound only with a right bound, so a window unbounded on the right
    gets one past the last key (Mk: with Mq <= Mk, i_al >= 0). With Mq == Mk the two alignments coincide and the
    band is ``TOP_LEFT``, the alignment of torch's cuDNN path (``set_causal_mask``): under ``BOTTOM_RIGHT`` cuDNN's
    backward is rated at the whole score matrix's work (``CudnnSdpaBwOp``).

    >>> band("causal_bottom_right", 1024, 4096, 127, -1)
    Band(alignment='BOTTOM_RIGHT', left=128, right=0)
    >>> band("causal_bottom_right", 4096, 4096, 127, -1)
    Band(alignment='TOP_LEFT', left=128, right=0)
    >>> band("none", 4096, 4096, -1, -1)
    Band(alignment=None, left=None, right=None)
    """
    left = window_left + 1 if window_left >= 0 else None
    alignment = "TOP_LEFT" if kind == ab.CAUSAL or mq == mk else "BOTTOM_RIGHT"
    if kind in ab.CAUSAL_KINDS:
        return Band(alignment, left, 0)
    if left is None and window_right < 0:
        return Band(None, None, None)
    return Band(alignment, left, window_right if window_right >= 0 else mk)


def bottom_right_band(p: Problem) -> bool:
    """Whether cuDNN gets the problem's mask as a ``BOTTOM_RIGHT`` band (``band``): bottom-right causal or a window
    with Mq != Mk."""
    return p.seqlen_q != p.seqlen_k and (p.bias == ab.CAUSAL_BR or (p.bias == ab.NONE and p.windowed))


def call_band(inp: Inputs) -> Band:
    """``band`` of the call's mask kind, lengths and window."""
    return band(inp.bias_kind, inp.query.shape[1], inp.key.shape[1], *window_fields(inp))


def cudnn_sdpa_unavailable_reason() -> str | None:
    """None when the frontend imports and its cuDNN backend has ``sink_token``, else why not."""
    return backend_reason(MIN_BACKEND, "attention with sink_token")


def forward_key(inp: Inputs, needs_lse: bool) -> tuple:
    """Everything a built forward graph depends on: dtype, shapes, strides, band, scale, sinks, LSE, device."""
    q, k, v = inp.query, inp.key, inp.value
    return (q.device, q.dtype, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), call_band(inp),
            inp.softmax_scale, inp.sinks is not None, needs_lse)


def backward_key(inp: Inputs) -> tuple:
    """Everything a built backward graph depends on (out, dO and the LSE are passed contiguous)."""
    return forward_key(inp, True)


class _Graph:
    """What both graphs declare: q / k / v in cuDNN's (B, H, S, D) order, the sinks (1, Hq, 1, 1), and the shapes
    of the output (B, Mq, Hq, Kv) and the LSE (B, Hq, Mq)."""

    def __init__(self, cudnn: Any, handle: Any, inp: Inputs) -> None:
        q, v = inp.query, inp.value
        self.io, self.f32 = getattr(cudnn.data_type, _IO_TYPES[q.dtype]), cudnn.data_type.FLOAT
        self.g = cudnn.pygraph(io_data_type=self.io, intermediate_data_type=self.f32, compute_data_type=self.f32,
                               handle=handle)
        self.handle = handle
        self.q, self.k, self.v = (self.bmhk(name, t) for name, t in (("q", q), ("k", inp.key), ("v", v)))
        b, mq, hq, _ = q.shape
        self.out_shape, self.lse_shape = (b, mq, hq, v.shape[3]), (b, hq, mq)
        self.sinks = None if inp.sinks is None else self.per_head("sink")

    def bmhk(self, name: str, t: torch.Tensor) -> Any:
        """A q / k / v-like tensor of the graph, laid out as ``t`` (a BMHK tensor) is."""
        dims, strides = bhsd(t)
        return self.g.tensor(name=name, dim=dims, stride=strides, data_type=self.io)

    def per_head(self, name: str) -> Any:
        """A float32 (1, Hq, 1, 1) tensor of the graph: the sinks, their gradient."""
        hq = self.lse_shape[1]
        return self.g.tensor(name=name, dim=[1, hq, 1, 1], stride=[hq, 1, 1, 1], data_type=self.f32)

    def output(self, t: Any, shape: tuple[int, ...]) -> None:
        """Mark ``t`` an output of the graph, laid out as a contiguous BMHK tensor of ``shape``."""
        dims, strides = bhsd(torch.empty(shape, device="meta"))
        t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(self.io)

    def pack(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor | None) -> dict:
        pack = {self.q: query, self.k: key, self.v: value}
        if self.sinks is not None:
            pack[self.sinks] = sinks.detach().contiguous()
        return pack


class ForwardGraph(_Graph):
    """One built ``sdpa`` graph for one call signature, with its workspace."""

    def __init__(self, cudnn: Any, handle: Any, inp: Inputs, needs_lse: bool) -> None:
        super().__init__(cudnn, handle, inp)
        sinks = {} if self.sinks is None else {"sink_token": self.sinks}
        o, stats = self.g.sdpa(q=self.q, k=self.k, v=self.v, attn_scale=inp.softmax_scale, generate_stats=needs_lse,
                               name="sdpa", **call_band(inp).kwargs(cudnn), **sinks)
        self.output(o, self.out_shape)
        self.o, self.stats = o, None
        if needs_lse:
            dims, strides = rows_of(*self.lse_shape)
            stats.set_output(True).set_dim(dims).set_stride(strides).set_data_type(self.f32)
            self.stats = stats
        self.workspace = build_plans(self.g, cudnn, inp.query.device)

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor | None,
            cudnn: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out (B, Mq, Hq, Kv) in q's dtype and the LSE float32 (B, Hq, Mq) (the sink included) or None, for tensors
        laid out as the graph's call's were (sinks float32 (Hq,) where it had them)."""
        q = query
        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device)
        pack = self.pack(query, key, value, sinks)
        pack[self.o] = out
        lse = None
        if self.stats is not None:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
            pack[self.stats] = lse
        execute(self.g, self.handle, pack, self.workspace, cudnn)
        return out, lse


class BackwardGraph(_Graph):
    """One built ``sdpa_backward`` graph for one call signature, with its workspace; with sinks it also gives
    their gradient (``dSink_token``)."""

    def __init__(self, cudnn: Any, handle: Any, inp: Inputs) -> None:
        super().__init__(cudnn, handle, inp)
        out = torch.empty(self.out_shape, device="meta")
        self.o, self.do = self.bmhk("o", out), self.bmhk("dO", out)
        dims, strides = rows_of(*self.lse_shape)
        self.stats = self.g.tensor(name="stats", dim=dims, stride=strides, data_type=self.f32)
        sinks, self.dsinks = {}, None
        if self.sinks is not None:
            self.dsinks = self.per_head("dsink")
            sinks = {"sink_token": self.sinks, "dSink_token": self.dsinks}
        self.dq, self.dk, self.dv = self.g.sdpa_backward(
            q=self.q, k=self.k, v=self.v, o=self.o, dO=self.do, stats=self.stats, attn_scale=inp.softmax_scale,
            name="sdpa_backward", **call_band(inp).kwargs(cudnn), **sinks)
        for grad, t in ((self.dq, inp.query), (self.dk, inp.key), (self.dv, inp.value)):
            self.output(grad, tuple(t.shape))
        self.workspace = build_plans(self.g, cudnn, inp.query.device)

    def run(self, inp: Inputs, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, cudnn: Any
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(dq, dk, dv) contiguous BMHK in q's dtype, and the sinks' gradient float32 (Hq,) or None. out and
        grad_out contiguous (B, Mq, Hq, Kv) in q's dtype, lse contiguous float32 (B, Hq, Mq), the sink included."""
        q = inp.query
        dq, dk, dv = (torch.empty(t.shape, dtype=q.dtype, device=q.device) for t in (q, inp.key, inp.value))
        pack = self.pack(q, inp.key, inp.value, inp.sinks)
        pack.update({self.o: out, self.do: grad_out, self.stats: lse, self.dq: dq, self.dk: dk, self.dv: dv})
        dsinks = None
        if self.dsinks is not None:
            dsinks = torch.zeros(self.lse_shape[1], dtype=torch.float32, device=q.device)
            pack[self.dsinks] = dsinks
        execute(self.g, self.handle, pack, self.workspace, cudnn)
        return dq, dk, dv, dsinks


FORWARD_GRAPHS = GraphCache("bf16/fp16 attention", forward_key, ForwardGraph)
BACKWARD_GRAPHS = GraphCache("bf16/fp16 attention backward", backward_key, BackwardGraph)


class _CudnnSdpaOp(OptionalPackage):
    """Declarations shared by the forward and backward ops."""

    ARCHS = ("cuda>=9.0",)
    DTYPES = _HALF
    OUT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})  # cuDNN writes q's dtype; others cast
    HEAD_DIMS = _HEAD_DIMS
    HEAD_DIMS_V = _HEAD_DIMS
    BIAS_KINDS = _BIAS
    GQA = True
    PARTIAL = True
    WINDOW = True
    SINKS = True
    #: cuDNN's fused kernels read q / k / v (and write the gradients) through TMA
    ALIGNMENT = "cuDNN fused kernels' TMA loads"
    #: on ties with torch's cuDNN path (``sdpa_cudnnF``: the same kernels, less host time) that op wins
    PRIORITY = -1
    package_reason = staticmethod(cudnn_package_reason)
    import_reason = staticmethod(cudnn_sdpa_unavailable_reason)

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        r = []
        k, kv = p.head_dim, p.head_dim_v
        if k != kv and (k, kv) != _WIDE_PAIR and (kv > k or max(k, kv) > _UNEQUAL_MAX):
            r.append(f"head dims K={k} != Kv={kv} not supported; cuDNN takes Kv <= K <= {_UNEQUAL_MAX}, or "
                     f"K={_WIDE_PAIR[0]} with Kv={_WIDE_PAIR[1]}")
        if (empty := empty_reason(p)) is not None:
            return r + [empty]
        if p.sinks and p.seqlen_q == 1:
            r.append("sinks with one query token not supported (cuDNN's decode mode takes no sink_token); the decode "
                     "ops serve it")
        if p.seqlen_q > p.seqlen_k and (p.bias == ab.CAUSAL_BR or p.windowed):
            r.append(f"{'a local window' if p.windowed else 'bottom-right causal'} with Mq={p.seqlen_q} > "
                     f"Mk={p.seqlen_k} not supported (cuDNN takes bottom-right bands and windows with Mq <= Mk only)")
        return r


@register
class CudnnSdpaFwOp(_CudnnSdpaOp, AttentionFwOp):
    """cuDNN attention forward (frontend ``sdpa`` graph): bf16/fp16, sinks, K != Kv, windows, GQA, LSE."""

    NAME = "cudnnF"
    #: achieved TFLOP/s by head dim on the H200 (torch's cuDNN path, the same kernels: 477 / 677 / 728 at D64 / 128 /
    #: 256, 4096 tokens, bench/results/backends.md; held at ``sdpa_cudnnF``'s 600 beyond D64), TB/s, overhead us
    HEAD_DIM_TFLOPS: ClassVar[dict[int, float]] = {64: 480.0, 128: 600.0, 256: 600.0}
    TBPS, OVERHEAD_US = 3.9, 8.0
    HOST_US = 30.0  # the graph-cache lookup, binding the tensors and executing the graph
    CALIBRATED_AS = "sdpa_cudnnF"  # the same kernels: where a table has no factor of this op, torch's route's

    @classmethod
    def apply(cls, inp: Inputs, needs_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return cls.launcher(inp, needs_lse)(inp.query, inp.key, inp.value, inp.attn_bias, None, None, None, inp.sinks)

    @classmethod
    def launcher(cls, inp: Inputs, needs_lse: bool):
        """The call's built graph, looked up once: a repeated call binds its tensors to it and executes it."""
        graph, cudnn = FORWARD_GRAPHS.get(inp, needs_lse)
        out_dtype = inp.out_dtype

        def run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks=None):
            out, lse = graph.run(query, key, value, sinks, cudnn)
            return (out if out.dtype == out_dtype else out.to(out_dtype)), lse
        return run

    @classmethod
    def estimate(cls, p: Problem) -> float:
        return attention_time(p, head_dim_rate(cls.HEAD_DIM_TFLOPS, p.head_dim), cls.TBPS, cls.OVERHEAD_US)


@register
class CudnnSdpaBwOp(_CudnnSdpaOp, AttentionBwOp):
    """cuDNN attention backward (frontend ``sdpa_backward`` graph) given any forward's output and sink-inclusive
    natural-log LSE (B, Hq, Mq); with sinks it gives their gradient too (``dSink_token``). Declined under
    torch.use_deterministic_algorithms: with cuDNN's deterministic algorithm asked for, two backward calls of a
    GPT-OSS layer (sinks, 128-token window, 1000 tokens) still gave gradients that differ bitwise (H100)."""

    NAME = "cudnnB"
    DETERMINISTIC = False
    #: cuDNN's backward on the H200 (``sdpa_cudnnF``'s own: 446 / 551 / 411 TFLOP/s of the backward's work at D64 /
    #: 128 / 256 on long sequences), TB/s, and its fixed ~110 us
    RATES: ClassVar[dict[int, float]] = {64: 480.0, 128: 560.0, 256: 415.0}
    TBPS, OVERHEAD_US = 2.5, 110.0
    HOST_US = 40.0

    @classmethod
    def apply_bw(cls, inp: Inputs, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return cls._backward(inp, out, lse, grad_out)[:3]

    @classmethod
    def apply_bw_sinks(cls, inp: Inputs, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) and the sinks' gradient as cuDNN's ``dSink_token`` of the same graph (no pass of its own)."""
        return cls._backward(inp, out, lse, grad_out)

    @classmethod
    def _backward(cls, inp, out, lse, grad_out):
        _, _, _, out, grad_out = half_backward_operands(inp, out, grad_out)
        graph, cudnn = BACKWARD_GRAPHS.get(inp)
        return graph.run(inp, out.contiguous(), lse.contiguous(), grad_out.contiguous(), cudnn)

    @classmethod
    def estimate(cls, p: Problem) -> float:
        """The backward of torch's cuDNN path (the same kernels) over the work it was measured to do: under a
        ``BOTTOM_RIGHT`` band (``band``) the whole score matrix, else the causal mask's and the window's keys; with
        sinks ``SINKS_BACKWARD_SHARE`` of a forward over the causal keys on top."""
        skips = not bottom_right_band(p)
        seconds = backward_time(p, cls.RATES, cls.TBPS, cls.OVERHEAD_US, window=skips, causal=skips)
        if p.sinks:
            rate = head_dim_rate(CudnnSdpaFwOp.HEAD_DIM_TFLOPS, p.head_dim)
            seconds += SINKS_BACKWARD_SHARE * attention_time(p, rate, cls.TBPS, 0.0, window=False)
        return seconds
