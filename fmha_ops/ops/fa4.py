"""FlashAttention-4 (``flash-attn-4``, CuTe DSL) forward and backward ops, used when the package is installed
(``pip install 'fmha-ops[fa4]'``).

What FA4 4.0.0b36 takes, per architecture (its ``flash_attn.cute.interface`` checks the same):

==============  ==========================================  ==========================================
                sm90 (Hopper)                               sm100 / sm110 (Blackwell)
==============  ==========================================  ==========================================
dtypes          bf16, fp16 (q = k = v)                      bf16, fp16; fp8 e4m3 forward with (B, Hkv)
                                                            descales (per-tensor ones are broadcast),
                                                            no gradients through fp8
head dims       K = Kv, 8..256, multiple of 8               K = Kv, 8..128 multiple of 8, or 256
masks           none; causal bottom-right (FA's causal); top-left causal where it equals bottom-right
                (Mq == Mk); varlen BlockDiagonal, non-causal or bottom-right causal; local windows
                (``window_size``, aligned bottom-right like FA's causal mask); softcap (both; not in the
                sm100 backward at head dim 256)
GQA / MQA       yes                                         yes
LSE (partial)   yes (natural log, (B, Hq, Mq); varlen (1, Hq, total))
autograd        yes (FA4's own autograd function); the backward op below serves other forwards
==============  ==========================================  ==========================================

FA4 writes q's dtype (bf16 for fp8); other output dtypes (float32 for the partial API) are cast from it.
Not taken: dropout, padded-key and paged masks (the decode ops serve those), top-left causal with
Mq != Mk (including ``BlockDiagonalCausalMask``, whose per-sequence lengths the selector does not see),
keys-contiguous values, Kv != K. The first call of each configuration JIT-compiles (about 2 s).
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable, ClassVar, TypeVar

import torch

from .. import attn_bias as ab
from ..dispatch import register
from ..inputs import Inputs
from ..problem import Problem
from .base import AttentionBwOp, AttentionFwOp
from .common import (OptionalPackage, half_backward_operands, import_failure, installed_version, kv_head_descales,
                     varlen_args, window_fields, window_size)
from .cost import attention_time, backward_time

#: the release whose interface this adapter calls (its backward entry point is module-level, not public)
FA4_VERSION = "4.0.0b36"
_HALF = frozenset({(torch.bfloat16,) * 3, (torch.float16,) * 3})
_FP8 = frozenset({(torch.float8_e4m3fn,) * 3})
_BIAS = frozenset({ab.NONE, ab.CAUSAL, ab.CAUSAL_BR, ab.BLOCK_DIAGONAL, ab.BLOCK_DIAGONAL_CAUSAL_BR})
_TOP_LEFT = frozenset({ab.CAUSAL, ab.BLOCK_DIAGONAL_CAUSAL})
#: head dims beyond the range sm100 takes with K = Kv
_SM100_EXTRA_HEAD_DIMS = (256,)
_ARCHS = ("cuda>=9.0,<10.0", "cuda>=10.0,<12.0")
T = TypeVar("T")


@functools.lru_cache(maxsize=None)
def fa4_package_reason() -> str | None:
    """None when the supported flash-attn-4 release is installed, else why not (no import, no GPU needed)."""
    installed, missing = installed_version("flash-attn-4", "fa4")
    if missing or installed == FA4_VERSION:
        return missing
    return f"flash-attn-4 {installed} is installed; this adapter is written against {FA4_VERSION}"


def fa4_unavailable_reason() -> str | None:
    """None when ``flash_attn.cute`` imports (the CuTe DSL loads its CUDA libraries then), else why not."""
    return import_failure("flash_attn.cute.interface")


def arch_reasons(p: Problem) -> list[str]:
    """What FA4 does not take on ``p.arch`` (dtypes and head dims per architecture, see the module docstring)."""
    if p.arch.kind != "cuda":
        return []
    major = p.arch.capability[0]
    r = []
    fp8 = (p.q_dtype, p.k_dtype, p.v_dtype) in _FP8
    if major == 9:
        if fp8:
            r.append("fp8 inputs run on FA4's sm100 path only (this is sm90)")
    elif major in (10, 11):
        if not (p.head_dim <= 128 or p.head_dim in _SM100_EXTRA_HEAD_DIMS):
            r.append(f"head dim K={p.head_dim} not supported on sm100; supported: multiples of 8 up to 128, and 256")
        if fp8 and p.head_dim > 128:
            r.append(f"fp8 with head dim K={p.head_dim} not supported on sm100; supported: multiples of 8 up to 128")
    return r


def mask_reasons(p: Problem) -> list[str]:
    """Masks FA4 cannot express: top-left causal differs from its bottom-right causal unless Mq == Mk."""
    if p.bias == ab.CAUSAL and p.seqlen_q != p.seqlen_k:
        return [f"top-left causal with Mq={p.seqlen_q} != Mk={p.seqlen_k} not supported "
                f"(FA4's causal mask is bottom-right aligned)"]
    return []


def backward_reasons(p: Problem) -> list[str]:
    """What FA4's backward does not take beyond its forward: softcap at head dim 256 on sm100."""
    if getattr(p, "softcap", False) and p.arch.kind == "cuda" and p.arch.capability[0] >= 10 and p.head_dim == 256:
        return ["softcap with head dim 256 not supported by FA4's sm100 backward"]
    return []


#: the one warning FA4 4.0.0b36's CuTe DSL compile prints for each new configuration: FA4 passes its own ``AuxData``
#: (score-mod tensors, None here) to ``cute.compile``, which warns and then runs it as a Python object, as FA4 intends
COMPILE_WARNING = r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument"


def quiet(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` (an FA4 call) with ``COMPILE_WARNING`` silenced for that call only: nothing a caller
    passes changes the warning, so our callers should not see it, while a warning of FA4 called directly, or any other
    warning, still shows. ``warnings.catch_warnings`` costs ~2 us per call (FA4's interface ~95 us) and, like every
    use of it, is not thread-safe: a warning another thread issues during the call may go unfiltered or be lost."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, message=COMPILE_WARNING)
        return fn(*args, **kwargs)


class _FA4Op(OptionalPackage):
    """Declarations shared by the forward and backward ops."""

    ARCHS = _ARCHS
    HEAD_DIMS = range(8, 257, 8)
    BIAS_KINDS = _BIAS
    GQA = True
    PARTIAL = True
    WINDOW = True
    SOFTCAP = True
    DETERMINISTIC = True  # passes deterministic=True to FA4 when torch.use_deterministic_algorithms is on
    CUDA_GRAPH = True
    #: FA4's CuTe DSL kernels take q / k / v (and the gradients) through TMA, their tensors marked 16-byte aligned
    ALIGNMENT = "TMA descriptors (CuTe DSL)"
    package_reason = staticmethod(fa4_package_reason)
    import_reason = staticmethod(fa4_unavailable_reason)


#: FA4's backward on the H200, achieved TFLOP/s of the backward's work by head dim (bench/results/backends.md:
#: 545 at D64, 584 at D128, 371 at D256 on long sequences, 460 at 8x1000 D128) and a fixed ~80 us (its
#: preprocess / dQ postprocess launches and the tail of short sequences): fa4B, and fa4F's own autograd
BACKWARD_RATES = {64: 582.0, 128: 600.0, 256: 375.0}
BACKWARD_OVERHEAD_US = 80.0


@register
class FA4FwOp(_FA4Op, AttentionFwOp):
    """FlashAttention-4 forward (bf16/fp16; fp8 on sm100), differentiable through FA4's own backward."""

    NAME = "fa4F"
    DTYPES = _HALF | _FP8
    OUT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})  # FA4 writes q's dtype (fp8: bf16); cast
    DESCALES = {r: frozenset({"none", "tensor", "head"}) for r in "qkv"}
    AUTOGRAD = True
    #: achieved (TFLOP/s, TB/s, device overhead us) on the H200 for the cost model (D128, 4096 tokens)
    RATES: ClassVar[tuple[float, float, float]] = (700.0, 3.5, 8.0)
    BACKWARD_RATES = BACKWARD_RATES  # its autograd runs the same backward as fa4B
    BACKWARD_OVERHEAD_US = BACKWARD_OVERHEAD_US
    #: FA4's Python interface per call: back to back, its calls at B8 N768 H16 D128 (39 GFLOP) take 1.23x cuDNN's and
    #: at 8x1000 (66 GFLOP) 0.97x: the time barely falls with the work below ~100 us
    HOST_US = 95.0
    #: FA4's ``learnable_sink`` (bfloat16 (Hq,): our float32 sinks are rounded to it); its autograd gives no sink
    #: gradient here, so calls whose sinks need one pair another forward with fa4B
    SINKS = True

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        r = arch_reasons(p) + mask_reasons(p) + (backward_reasons(p) if p.needs_grad else [])
        if p.sinks and p.needs_grad:
            r.append("sinks with gradients not supported (FA4's autograd gives no sink gradient); fa4B takes them")
        if p.sinks and p.q_dtype not in (torch.bfloat16, torch.float16):
            r.append("sinks with fp8 inputs not supported")
        return r

    @classmethod
    def apply(cls, inp: Inputs, needs_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        causal, window = window_size(inp.bias_kind, *window_fields(inp))
        varlen = inp.bias_kind in ab.VARLEN_KINDS
        q, k, v = (t[0] for t in (inp.query, inp.key, inp.value)) if varlen else (inp.query, inp.key, inp.value)
        seqlens = varlen_args(inp) if varlen else {}
        if inp.q_descale is not None:  # fp8 (sm100): the module-level forward takes descales, no autograd
            from flash_attn.cute.interface import _flash_attn_fwd

            out, lse = quiet(_flash_attn_fwd, q, k, v, softmax_scale=inp.softmax_scale, causal=causal,
                             softcap=inp.softcap, window_size_left=window[0], window_size_right=window[1],
                             return_lse=needs_lse, **seqlens, **kv_head_descales(inp))[:2]
        else:
            from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

            fn = flash_attn_varlen_func if varlen else flash_attn_func
            sinks = {} if inp.sinks is None else {"learnable_sink": inp.sinks.detach().to(torch.bfloat16)}
            out, lse = quiet(fn, q, k, v, softmax_scale=inp.softmax_scale, causal=causal, window_size=window,
                             softcap=inp.softcap, deterministic=torch.are_deterministic_algorithms_enabled(),
                             return_lse=needs_lse, **seqlens, **sinks)
        if not needs_lse:
            lse = None
        if out.dtype != inp.out_dtype:
            out = out.to(inp.out_dtype)
        if varlen:
            return out[None], (None if lse is None else lse[None])
        return out, lse

    @classmethod
    def estimate(cls, p: Problem) -> float:
        return attention_time(p, *cls.RATES)


@register
class FA4BwOp(_FA4Op, AttentionBwOp):
    """FlashAttention-4 backward on bf16/fp16 values, given any forward's output and natural-log LSE
    (B, Hq, Mq). For fp8 forward inputs it differentiates w.r.t. the dequantized values (cast to bf16) when
    ``set_fp8_dequantized_backward(True)`` is on."""

    NAME = "fa4B"
    DTYPES = _HALF | _FP8
    OUT_DTYPES = FA4FwOp.OUT_DTYPES
    DESCALES = {r: frozenset({"none", "tensor", "head"}) for r in "qkv"}
    RATES: ClassVar[dict[int, float]] = BACKWARD_RATES
    TBPS = 2.5
    OVERHEAD_US = BACKWARD_OVERHEAD_US
    HOST_US = 60.0  # FA4's Python interface per call
    SINKS = True  # P recomputed from the given, sink-inclusive LSE (the sinks' gradient: fmha_ops.sinks.sink_grad)

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        return [r for r in arch_reasons(p) if not r.startswith("fp8")] + mask_reasons(p) + backward_reasons(p)

    @classmethod
    def apply_bw(cls, inp: Inputs, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from flash_attn.cute.interface import _flash_attn_bwd

        q, k, v, out, grad_out = half_backward_operands(inp, out, grad_out)
        causal, (left, right) = window_size(inp.bias_kind, *window_fields(inp))
        kwargs = dict(softmax_scale=inp.softmax_scale, causal=causal, softcap=inp.softcap, window_size_left=left,
                      window_size_right=right, deterministic=torch.are_deterministic_algorithms_enabled())
        if inp.bias_kind in ab.VARLEN_KINDS:
            dq, dk, dv = quiet(_flash_attn_bwd, q[0], k[0], v[0], out[0], grad_out[0], lse[0], **varlen_args(inp),
                               **kwargs)
            return dq[None], dk[None], dv[None]
        return quiet(_flash_attn_bwd, q, k, v, out, grad_out, lse, **kwargs)[:3]

    @classmethod
    def estimate(cls, p: Problem) -> float:
        return backward_time(p, cls.RATES, cls.TBPS, cls.OVERHEAD_US)
