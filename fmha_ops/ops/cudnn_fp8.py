"""cuDNN's fp8 attention forward through ``nvidia-cudnn-frontend`` (``pip install 'fmha-ops[cudnn]'``).

One cuDNN graph (``sdpa_fp8``) per call signature, built on the first call and cached with its workspace;
a repeated call binds its tensors to the cached graph and executes it (no graph building per call).

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

import atexit
import functools
import threading
from typing import Any, ClassVar

import torch

from .. import attn_bias as ab
from ..dispatch import register
from ..inputs import Inputs
from ..problem import Problem
from .base import AttentionFwOp
from .common import OptionalPackage, import_failure, installed_version
from .cost import attention_time, head_dim_rate

#: the oldest frontend release whose ``sdpa_fp8`` graph this op builds
MIN_FRONTEND = (1, 16)
#: the oldest cuDNN backend with an fp8 forward on Hopper that is not known-broken (9.10.0 is)
MIN_BACKEND = 90100
FP8_MAX = 448.0  # largest e4m3 value
MIN_SEQLEN_Q = 2  # cuDNN 9.19 finds no sdpa_fp8 engine for one query token (measured on the H200)
_FP8 = torch.float8_e4m3fn
_BIAS = frozenset({ab.NONE, ab.CAUSAL, ab.CAUSAL_BR})


@functools.lru_cache(maxsize=None)
def cudnn_package_reason() -> str | None:
    """None when a recent enough nvidia-cudnn-frontend is installed, else why not (no import, no GPU needed)."""
    version, missing = installed_version("nvidia-cudnn-frontend", "cudnn")
    if missing:
        return missing
    if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < MIN_FRONTEND:
        return f"nvidia-cudnn-frontend {version} is older than {'.'.join(map(str, MIN_FRONTEND))}"
    return None


def cudnn_unavailable_reason() -> str | None:
    """None when the frontend imports and its cuDNN backend has the fp8 forward, else why not."""
    failed = import_failure("cudnn")
    if failed:
        return failed
    import cudnn

    backend = cudnn.backend_version()
    if backend < MIN_BACKEND or backend == 91000:
        return f"cuDNN backend {backend} has no usable fp8 attention forward (needs >= 9.1, not 9.10.0)"
    return None


def graph_key(inp: Inputs, needs_lse: bool) -> tuple:
    """Everything a built graph depends on: shapes, strides, mask, scale, LSE, device."""
    q, k, v = inp.query, inp.key, inp.value
    return (q.device, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), _causal(inp),
            inp.softmax_scale, needs_lse)


def _causal(inp: Inputs) -> bool:
    return inp.bias_kind in (ab.CAUSAL, ab.CAUSAL_BR)


def _bhsd(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """cuDNN's (B, H, S, D) dims and strides of a BMHK tensor."""
    view = t.transpose(1, 2)
    return list(view.shape), list(view.stride())


class _Constants:
    """Per-device float32 scalars the graphs read: 1, the softmax-probability scale 448 and its inverse."""

    def __init__(self, device: torch.device) -> None:
        def scalar(x: float) -> torch.Tensor:
            return torch.full((1, 1, 1, 1), x, dtype=torch.float32, device=device)

        self.one, self.scale_s, self.descale_s = scalar(1.0), scalar(FP8_MAX), scalar(1.0 / FP8_MAX)


class Fp8Graph:
    """One built ``sdpa_fp8`` graph for one call signature, with its workspace and tensor handles."""

    def __init__(self, cudnn: Any, handle: Any, inp: Inputs, needs_lse: bool) -> None:
        q, k, v = inp.query, inp.key, inp.value
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        self.q, self.k, self.v = (g.tensor(name=n, dim=d, stride=s, data_type=e4m3)
                                  for n, (d, s) in (("q", _bhsd(q)), ("k", _bhsd(k)), ("v", _bhsd(v))))
        scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
        self.scalars = [g.tensor(name=n, **scalar)
                        for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
        o, stats, amax_s, amax_o = g.sdpa_fp8(
            self.q, self.k, self.v, *self.scalars, is_inference=not needs_lse, attn_scale=inp.softmax_scale,
            use_causal_mask=_causal(inp), name="sdpa_fp8")
        b, mq, hq, _ = q.shape
        self.out_shape = (b, mq, hq, v.shape[3])
        o_dims, o_strides = _bhsd(torch.empty(self.out_shape, device="meta"))
        o.set_output(True).set_dim(o_dims).set_stride(o_strides).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(False).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        self.o, self.stats = o, None
        if needs_lse:
            stats.set_output(True).set_dim([b, hq, mq, 1]).set_stride([hq * mq, mq, 1, 1]).set_data_type(f32)
            self.stats = stats
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph, self.handle = g, handle
        self.workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=q.device)

    def run(self, inp: Inputs, consts: _Constants, cudnn: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """o_fp8 (B, Mq, Hq, Kv) in v's fp8 units (times v_descale is the output) and the LSE or None."""
        q, k, v = inp.query, inp.key, inp.value
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
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        self.graph.execute(pack, self.workspace, handle=self.handle)
        return o8, lse


class GraphCache:
    """Built graphs by ``graph_key``, one cuDNN handle and one set of constants per device."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, Fp8Graph] = {}
        self._handles: dict[torch.device, tuple[Any, _Constants]] = {}
        self._lock = threading.Lock()

    def get(self, inp: Inputs, needs_lse: bool) -> tuple[Fp8Graph, _Constants, Any]:
        import cudnn

        key = graph_key(inp, needs_lse)
        graph = self._graphs.get(key)
        device = inp.query.device
        if graph is None:
            with self._lock:
                if device not in self._handles:
                    if not self._handles:
                        atexit.register(self.release)
                    with torch.cuda.device(device):
                        self._handles[device] = (cudnn.create_handle(), _Constants(device))
                graph = self._graphs.get(key)
                if graph is None:
                    with torch.cuda.device(device):
                        try:
                            graph = Fp8Graph(cudnn, self._handles[device][0], inp, needs_lse)
                        except cudnn.cudnnGraphNotSupportedError as e:
                            raise NotImplementedError(
                                f"cuDNN has no fp8 attention plan for q {tuple(inp.query.shape)}, k "
                                f"{tuple(inp.key.shape)}, causal={_causal(inp)}: {str(e).splitlines()[0]}") from e
                    self._graphs[key] = graph
        return graph, self._handles[device][1], cudnn

    def __len__(self) -> int:
        return len(self._graphs)

    def release(self) -> None:
        """Drop every built graph and destroy the cuDNN handles. Run at exit: graphs still alive when the interpreter
        shuts down make the frontend's nanobind bindings print "leaked" lines into the user's stderr."""
        import cudnn

        with self._lock:
            self._graphs.clear()
            for handle, _ in self._handles.values():
                cudnn.destroy_handle(handle)
            self._handles.clear()


GRAPHS = GraphCache()


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
        if p.seqlen_k == 0 or p.seqlen_q == 0:
            r.append(f"empty sequences (Mq={p.seqlen_q}, Mk={p.seqlen_k}) not supported")
        elif p.seqlen_q < MIN_SEQLEN_Q:
            r.append(f"query length {p.seqlen_q} < {MIN_SEQLEN_Q} not supported (cuDNN builds no fp8 plan for it on "
                     f"the H200; the decode ops serve single-token queries)")
        return r

    @classmethod
    def apply(cls, inp: Inputs, needs_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        from ..kernels.triton.dequantize import dequantize

        graph, consts, cudnn = GRAPHS.get(inp, needs_lse)
        o8, lse = graph.run(inp, consts, cudnn)
        if inp.out_dtype == _FP8:
            return o8, lse
        return dequantize(o8, inp.v_descale, inp.out_dtype), lse

    @classmethod
    def estimate(cls, p: Problem) -> float:
        return attention_time(p, head_dim_rate(cls.HEAD_DIM_TFLOPS, p.head_dim), cls.TBPS, cls.OVERHEAD_US)

