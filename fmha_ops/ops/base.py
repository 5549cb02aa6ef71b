"""Attention op base classes: what an op declares, and the one check that reads the declaration.

Declarations (class attributes; every check below reads only these):
  DTYPES         allowed (q, k, v) dtype triples
  OUT_DTYPES     allowed output dtypes
  HEAD_DIMS      allowed K (a container: range or tuple); HEAD_DIMS_V likewise for Kv (None: Kv == K)
  BIAS_KINDS     allowed attn_bias kinds (fmha_ops.attn_bias constants)
  GQA            Hq != Hkv allowed
  PAGE_SIZES     allowed page sizes for paged masks (a container)
  DESCALES       allowed descale kinds per role: dict role -> set, roles "q", "k", "v"
  QUANTIZE_KV    accepts quantize_kv_to_fp8=True
  MAX_SEQLEN_Q   longest query sequence (decode ops: 16); None: any
  RAGGED_Q       query sequences of different lengths in one call (decode masks)
  PARTIAL        can return the LSE (memory_efficient_attention_partial, merge_attentions)
  AUTOGRAD       forward is differentiable by torch autograd itself (no bw op needed)
  BACKWARD_RATES (AUTOGRAD ops) their own backward's achieved TFLOP/s by head dim, with BACKWARD_OVERHEAD_US:
                 what the selector adds to a forward's estimate when the call needs gradients (without them:
                 BACKWARD_WORK x the forward's estimate)
  DROPOUT        p > 0
  DETERMINISTIC  bitwise reproducible (checked when torch.use_deterministic_algorithms is on)
  CUDA_GRAPH     capturable in a CUDA graph
  V_KEYS_CONTIGUOUS  accepts a keys-contiguous value (stride 1 along the sequence; fmha_ops.inputs)
  ALIGNMENT      what in the op's kernels needs q/k/v at 16-byte aligned start addresses with every stride but the
                 unit one a multiple of 16 bytes ("TMA descriptors", "16-byte vector loads"); None: any layout
                 (``alignment(problem)`` may answer per architecture)
  TRACEABLE      ``apply`` is plain torch that torch.compile traces into the graph (else it runs behind the
                 custom op ``fmha_ops::attention_forward``, see fmha_ops.compiled); implies AUTOGRAD
  WINDOW         local attention windows (Problem.window_left / window_right, with each allowed mask kind)
  SOFTCAP        score capping (Problem.softcap: s * tanh(score / s) before the softmax)
  NEGATIVE_SCALE a softmax scale below 0 (Problem.negative_scale)
  SINKS          attention sinks (Problem.sinks: a float32 logit per query head in every softmax denominator,
                 fmha_ops.sinks); a backward op declaring it takes the sink-inclusive LSE, and gives the sinks'
                 own gradient with dq / dk / dv (``apply_bw_sinks``)
  KEY_START      per-sequence key starts on the device (Problem.key_start: the paged masks' ``key_start``,
                 ``flash_attn_with_kvcache``'s ``cache_leftpad``): keys before a sequence's start are masked out
  HOST_US        host time of one eager call on the H200's host, microseconds (the selector ranks a GPU op by
                 max(estimate, host time); not counted during a CUDA graph capture, whose replays skip the host)
Ops add op-specific reasons in ``extra_reasons``.
"""
from __future__ import annotations

from typing import ClassVar, Collection

import torch

from registry import Op

from .. import attn_bias as ab
from ..dtypes import FLOAT_DTYPES, dtype_name
from ..inputs import Inputs
from ..plan import on_packed
from ..problem import Problem
from ..sinks import sink_grad
from ..validation import TMA_ALIGNMENT
from .cost import BACKWARD_WORK, backward_time

NO_DESCALES = {"q": frozenset({"none"}), "k": frozenset({"none"}), "v": frozenset({"none"})}


class AttentionOp(Op):
    DTYPES: ClassVar[frozenset[tuple[torch.dtype, torch.dtype, torch.dtype]]] = frozenset()
    OUT_DTYPES: ClassVar[frozenset[torch.dtype]] = frozenset()
    HEAD_DIMS: ClassVar[Collection[int]] = ()
    HEAD_DIMS_V: ClassVar[Collection[int] | None] = None
    BIAS_KINDS: ClassVar[frozenset[str]] = frozenset({ab.NONE})
    GQA: ClassVar[bool] = False
    PAGE_SIZES: ClassVar[Collection[int]] = ()
    DESCALES: ClassVar[dict[str, frozenset[str]]] = NO_DESCALES
    QUANTIZE_KV: ClassVar[bool] = False
    MAX_SEQLEN_Q: ClassVar[int | None] = None
    RAGGED_Q: ClassVar[bool] = True
    PARTIAL: ClassVar[bool] = False
    AUTOGRAD: ClassVar[bool] = False
    DROPOUT: ClassVar[bool] = False
    DETERMINISTIC: ClassVar[bool] = True
    CUDA_GRAPH: ClassVar[bool] = True
    V_KEYS_CONTIGUOUS: ClassVar[bool] = False
    ALIGNMENT: ClassVar[str | None] = None
    TRACEABLE: ClassVar[bool] = False
    WINDOW: ClassVar[bool] = False
    SOFTCAP: ClassVar[bool] = False
    #: takes a softmax scale below 0 (kernels that keep the row maximum of scaled scores as the scale times the
    #: maximum score need scale >= 0; a zero scale, or a zero descale, they take)
    NEGATIVE_SCALE: ClassVar[bool] = False
    SINKS: ClassVar[bool] = False
    KEY_START: ClassVar[bool] = False
    BACKWARD_RATES: ClassVar[dict[int, float] | None] = None
    BACKWARD_OVERHEAD_US: ClassVar[float] = 0.0

    @classmethod
    def backward_estimate(cls, p: Problem) -> float | None:
        """An AUTOGRAD forward's own backward (a float forward: fp8 inputs take a bw op); None otherwise."""
        if not cls.AUTOGRAD or p.q_dtype not in FLOAT_DTYPES:
            return None
        if cls.BACKWARD_RATES is not None and p.arch.kind != "cpu":
            return backward_time(p, cls.BACKWARD_RATES, 2.5, cls.BACKWARD_OVERHEAD_US)
        forward = cls.estimate(p)
        return None if forward is None else BACKWARD_WORK * forward

    @classmethod
    def not_supported_reasons(cls, p: Problem) -> list[str]:
        r: list[str] = []
        dts = (p.q_dtype, p.k_dtype, p.v_dtype)
        if dts not in cls.DTYPES:
            r.append(f"dtypes (q, k, v) {'/'.join(map(dtype_name, dts))} not supported; supported: "
                     + ", ".join(sorted("/".join(map(dtype_name, t)) for t in cls.DTYPES)))
        if p.out_dtype not in cls.OUT_DTYPES:
            r.append(f"output dtype {dtype_name(p.out_dtype)} not supported; supported: "
                     + ", ".join(sorted(map(dtype_name, cls.OUT_DTYPES))))
        if p.head_dim not in cls.HEAD_DIMS:
            r.append(f"head dim K={p.head_dim} not supported; supported: {_fmt(cls.HEAD_DIMS)}")
        if cls.HEAD_DIMS_V is None:
            if p.head_dim_v != p.head_dim:
                r.append(f"value head dim Kv={p.head_dim_v} must equal K={p.head_dim}")
        elif p.head_dim_v not in cls.HEAD_DIMS_V:
            r.append(f"value head dim Kv={p.head_dim_v} not supported; supported: {_fmt(cls.HEAD_DIMS_V)}")
        if p.bias not in cls.BIAS_KINDS:
            r.append(f"attn_bias {p.bias} not supported; supported: {', '.join(sorted(cls.BIAS_KINDS))}")
        if p.heads_q != p.heads_kv and not cls.GQA:
            r.append(f"GQA/MQA (Hq={p.heads_q}, Hkv={p.heads_kv}) not supported")
        if p.page_size and p.page_size not in cls.PAGE_SIZES:
            r.append(f"page_size={p.page_size} not supported; supported: {_fmt(cls.PAGE_SIZES)}")
        for role, kind in zip("qkv", p.descales if dts in cls.DTYPES else ()):
            if kind not in cls.DESCALES[role]:
                r.append(f"{role}_descale kind {kind!r} not supported; supported: {', '.join(sorted(cls.DESCALES[role]))}")
        if p.quantize_kv and not cls.QUANTIZE_KV:
            r.append("quantize_kv_to_fp8=True not supported")
        if cls.MAX_SEQLEN_Q is not None and p.seqlen_q > cls.MAX_SEQLEN_Q:
            r.append(f"query length {p.seqlen_q} per sequence > {cls.MAX_SEQLEN_Q}")
        if not p.q_uniform and not cls.RAGGED_Q:
            r.append("query sequences of different lengths not supported")
        if p.needs_lse and not cls.PARTIAL:
            r.append("cannot return the LSE (partial attention)")
        if p.dropout and not cls.DROPOUT:
            r.append("dropout (p > 0) not supported")
        if p.deterministic and not cls.DETERMINISTIC:
            r.append("not deterministic (torch.use_deterministic_algorithms is on)")
        if p.graph_capture and not cls.CUDA_GRAPH:
            r.append("not CUDA-graph capturable (a capture is in progress)")
        if p.v_keys_contiguous and not cls.V_KEYS_CONTIGUOUS:
            r.append("a keys-contiguous value (stride 1 along the sequence) not supported; pass value.contiguous()")
        need = cls.alignment(p) if p.misaligned else None
        if need is not None:
            r.append(f"{'; '.join(p.misaligned)}: not a multiple of {TMA_ALIGNMENT} bytes, which this op's {need} "
                     f"need for start addresses and strides; pass .contiguous() copies (rows of 16-byte multiples)")
        if p.windowed and not cls.WINDOW:
            r.append(f"local attention window (window_left={p.window_left}, window_right={p.window_right}) not "
                     f"supported; only unbounded windows (-1)")
        if p.softcap and not cls.SOFTCAP:
            r.append("softcap > 0 not supported; only softcap=0")
        if p.sinks and not cls.SINKS:
            r.append("attention sinks (sinks=) not supported; only sinks=None")
        if p.key_start and not cls.KEY_START:
            r.append("per-sequence key starts (cache_leftpad, a mask's key_start) not supported; only None")
        if p.negative_scale and not cls.NEGATIVE_SCALE:
            r.append("a softmax scale below 0 not supported; scale >= 0 (SDPA and the reference ops take any finite "
                     "scale)")
        r.extend(cls.extra_reasons(p))
        return r

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        return []

    @classmethod
    def alignment(cls, p: Problem) -> str | None:
        """What needs 16-byte aligned q/k/v for calls like ``p`` (``ALIGNMENT``), or None."""
        return cls.ALIGNMENT

    @classmethod
    def host_time(cls, p: Problem) -> float:
        return 0.0 if p.graph_capture else cls.HOST_US * 1e-6


class AttentionFwOp(AttentionOp):
    KIND = "fw"

    @classmethod
    def not_supported_reasons(cls, p: Problem) -> list[str]:
        r = super().not_supported_reasons(p)
        if p.needs_grad and p.q_dtype not in (torch.float16, torch.bfloat16, torch.float32) and not p.fp8_backward:
            r.append(f"gradients through {dtype_name(p.q_dtype)} inputs need set_fp8_dequantized_backward(True)")
        if p.bias_grad and not cls.AUTOGRAD:
            r.append("the tensor attn_bias requires grad, and only ops differentiated by torch autograd give its "
                     "gradient")
        if p.needs_grad and not (cls.AUTOGRAD or cls.PARTIAL):
            r.append("gradients are needed, and this forward neither supports autograd nor returns the "
                     "LSE a backward op needs")
        return r

    @classmethod
    def apply(cls, inp: Inputs, needs_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out (B, Mq, Hq, Kv) and, when ``needs_lse``, lse float32 (B, Hq, Mq) in natural log."""
        raise NotImplementedError

    @classmethod
    def launcher(cls, inp: Inputs, needs_lse: bool):
        """The launch plan of calls laid out like ``inp`` (validated, BMHK, this op selected for it):
        ``run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks=None)`` -> what ``apply`` returns,
        for new tensors (sinks too) of the same shapes, dtypes, devices and strides and a mask of the same signature. It keeps
        only ``inp``'s scalars, never its tensors. This default rebuilds the ``Inputs`` and calls ``apply``; ops
        whose launch has per-layout work to skip override it.

        Example
        -------
        >>> run = SdpaFlashFwOp.launcher(make_inputs(q, k, v, LowerTriangularMask()), False)
        >>> out, _ = run(q2, k2, v2, LowerTriangularMask(), None, None, None)
        """
        fields = (inp.p, inp.scale, inp.output_dtype, inp.is_partial)
        quantize_kv, layout, softcap, apply = inp.quantize_kv_to_fp8, inp.layout, inp.softcap, cls.apply

        def run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks=None):
            return apply(Inputs(query, key, value, attn_bias, *fields, q_descale, k_descale, v_descale, quantize_kv,
                                layout, softcap, sinks), needs_lse)
        return run


    @classmethod
    def varlen_launcher(cls, inp: Inputs, needs_lse: bool):
        """The launch plan of packed varlen calls laid out like ``inp`` (validated, batch 1 under a ``BlockDiagonal*``
        mask, this op selected for it, no autograd pair): ``run(query, key, value, attn_bias, q_descale, k_descale,
        v_descale, sinks=None)`` on the packed tensors (total, H, D) -> out (total, Hq, Kv) and, when
        ``needs_lse``, lse float32 (Hq, total_q), else None (``flash_attn_varlen_func``'s repeated calls). This
        default runs ``launcher`` on batch-1 views; ops whose kernels take packed tensors override it.

        Example
        -------
        >>> run = FA3FwOp.varlen_launcher(make_inputs(q[None], k[None], v[None], mask), False)  # doctest: +SKIP
        >>> out, _ = run(q, k, v, mask, None, None, None)  # doctest: +SKIP
        """
        return on_packed(cls.launcher(inp, needs_lse))


class AttentionBwOp(AttentionOp):
    KIND = "bw"

    @classmethod
    def not_supported_reasons(cls, p: Problem) -> list[str]:
        r = super().not_supported_reasons(p)
        if p.q_dtype not in (torch.float16, torch.bfloat16, torch.float32) and not p.fp8_backward:
            r.append(f"backward through {dtype_name(p.q_dtype)} inputs needs set_fp8_dequantized_backward(True)")
        return r

    @classmethod
    def apply_bw(cls, inp: Inputs, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients (dq, dk, dv) of the attention output w.r.t. the dequantized query, key, value."""
        raise NotImplementedError

    @classmethod
    def apply_bw_sinks(cls, inp: Inputs, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``apply_bw``'s (dq, dk, dv) and the gradient of ``inp.sinks``, float32 (Hq,), for a call with sinks.

        This default computes the sinks' gradient apart (``sinks.sink_grad``: float32 copies of out and grad_out);
        a backward op whose kernels compute the row sums rowsum(dO * O) anyway overrides it with
        ``sinks.sink_grad_from_delta`` of those (``TritonBwOp``).

        Example
        -------
        >>> dq, dk, dv, dsinks = TritonBwOp.apply_bw_sinks(inp, out, lse, grad_out)  # doctest: +SKIP
        """
        dq, dk, dv = cls.apply_bw(inp, out, lse, grad_out)
        return dq, dk, dv, sink_grad(out, grad_out, lse, inp.sinks)


def _fmt(c: Collection[int]) -> str:
    if isinstance(c, range):
        return f"{c.start}..{c.stop - 1}" + (f" step {c.step}" if c.step != 1 else "")
    return ", ".join(map(str, sorted(c)))
