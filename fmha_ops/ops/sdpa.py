"""torch ``scaled_dot_product_attention``, one op per backend (cuDNN, flash, efficient, math).

Each op calls its backend's own aten function (``torch._scaled_dot_product_cudnn_attention``, ...), the
functions ``scaled_dot_product_attention`` dispatches to, with the same arguments; entering
``sdpa_kernel(backend)`` per call instead costs more host time than the tiny-shape call itself. Autograd comes
with the aten functions. Layout bridge: BMHK views are transposed to SDPA's (B, H, M, K) without copies (the CUDA
flash op calls the BMHK function behind SDPA's flash path instead); GQA is native in the flash and cuDNN kernels
and ``enable_gqa`` in the math path. Repeated calls run the op's launch plan (``launcher``, see
``fmha_ops.call``): the aten function with the call's constants bound, four tensor views around it (none for
CUDA flash) and nothing else. Masks: none, top-left causal
(``is_causal``), and bottom-right causal where it coincides with those (Mq == Mk, or Mq == 1 which sees every
key). The backends that take an ``attn_mask`` (efficient, math; ``ATTN_MASK``) also run local windows, any
bottom-right causal and tensor biases: through SDPA's front end (``sdpa_kernel``) with a mask materialized per
call (an (Mq, Mk) boolean, or the bias with -inf where the window hides a key; the bias gradient flows through
it). Under torch.compile the ops trace SDPA's front end (``scaled_dot_product_attention``), whose kernel the
compiler picks. Query rows that see no key give 0 (SDPA would give NaN): they attend to every key inside SDPA and are
zeroed after. No LSE (not partial).
"""
from __future__ import annotations

import functools
from typing import Callable, ClassVar, NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import attn_bias as ab
from ..dispatch import register
from ..problem import Problem
from .base import AttentionFwOp
from .cost import attention_time

_is_compiling = torch.compiler.is_compiling
#: cuDNN SDPA's largest batch / head count (torch's check_cudnn_tensor_shapes)
_CUDNN_MAX_DIM = 65535
#: cuDNN versions (torch.backends.cudnn.version()) from which torch's own SDPA dispatch lets cuDNN take head dim 256
#: on sm90/sm100 (above 9.22), and head dims 192 (q/k) with 128 (v) (9.11 and later)
_CUDNN_D256_AFTER, _CUDNN_D192_FROM = 92200, 91100
#: cuDNN from which its fused attention takes head dims up to 256 forward and backward on Hopper (its support
#: matrix; the Hopper backward bug with large head dims of 9.11 / 9.12 is fixed in 9.13). The aten functions these
#: ops call run such shapes; only torch's dispatch heuristic (``can_use_cudnn_attention``) waits for 9.22.
_CUDNN_HOPPER_D256_FROM = 91300
_HOPPER = 9


def _cudnn_head_dim_limit(k: int, kv: int, capability: tuple[int, int]) -> int:
    version = torch.backends.cudnn.version() or 0
    if version > _CUDNN_D256_AFTER or (capability[0] == _HOPPER and version >= _CUDNN_HOPPER_D256_FROM):
        return 256
    if version >= _CUDNN_D192_FROM and (k, kv) == (192, 128):
        return 192
    return 128


_HALF = frozenset({(torch.float16,) * 3, (torch.bfloat16,) * 3})
_ALL_FLOAT = _HALF | {(torch.float32,) * 3}


class _SdpaOp(AttentionFwOp):
    BIAS_KINDS = frozenset({ab.NONE, ab.CAUSAL, ab.CAUSAL_BR})
    GQA = True
    AUTOGRAD = True
    DROPOUT = True
    TRACEABLE = True
    NEGATIVE_SCALE = True
    #: achieved (TFLOP/s, TB/s, overhead us) on the H200 for the cost model; CPU rates below
    RATES: ClassVar[tuple[float, float, float]]
    CPU_RATES: ClassVar[tuple[float, float, float]] = (0.001, 0.005, 100.0)

    #: takes ``attn_mask``: windows, any bottom-right causal and tensor biases run through a dense mask, on
    #: this SDPA backend
    ATTN_MASK: ClassVar[bool] = False
    MASK_BACKEND: ClassVar[SDPBackend]

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        if p.bias == ab.CAUSAL_BR and p.seqlen_q not in (1, p.seqlen_k) and not cls.ATTN_MASK:
            return [f"bottom-right causal with Mq={p.seqlen_q} != Mk={p.seqlen_k} not supported"]
        return []

    @classmethod
    def apply(cls, inp, needs_lse):
        run = cls._kernel_plan(inp)
        if run is not None:
            return run(inp.query, inp.key, inp.value)
        q, k, v = inp.query.transpose(1, 2), inp.key.transpose(1, 2), inp.value.transpose(1, 2)
        causal, scale = _causal(inp), inp.softmax_scale
        if causal and scale <= 0.0:  # the fused kernels mask with -inf before scaling: -inf * 0 is NaN
            q, scale = q * scale, 1.0
        if cls.ATTN_MASK and _needs_dense_mask(inp):
            mask, empty_rows = _dense_mask(inp)
            with sdpa_kernel(cls.MASK_BACKEND):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=inp.p, scale=scale,
                    enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)
            out = out.masked_fill(empty_rows[None, :, None, None], 0.0)
        elif q.numel() and k.numel() and not _is_compiling():
            fn, args, kwargs, bmhk = cls.kernel(inp, causal, scale)
            out = fn(q.transpose(1, 2), inp.key, inp.value, *args, **kwargs)[0] if bmhk else \
                fn(q, k, v, *args, **kwargs)[0].transpose(1, 2)
        elif _is_compiling():  # traced calls take SDPA's front end, the function torch.compile knows best (it
            # picks the kernel then)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=inp.p, is_causal=causal, scale=scale,
                enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)
        else:  # empty inputs: the fused functions fault on them and SDPA's front end returned None for batch 0 on
            # CUDA (torch 2.11); the math composite gives the empty output, or zeros where no key exists, built from
            # q / k / v so that autograd flows through it
            out = torch._scaled_dot_product_attention_math(
                q, k, v, None, inp.p, causal, None, scale=scale, enable_gqa=q.shape[1] != k.shape[1])[0].transpose(1, 2)
        return (out if out.dtype == inp.out_dtype else out.to(inp.out_dtype)), None

    @classmethod
    def launcher(cls, inp, needs_lse):
        """The backend's function with the call's constants bound, when the call is a plain one (no dense mask,
        inputs not empty, output in the input dtype); else the generic plan."""
        return cls._kernel_plan(inp) or super().launcher(inp, needs_lse)

    @classmethod
    def _kernel_plan(cls, inp):
        """run(query, key, value, *ignored) -> (out, None): the backend's function on views of BMHK tensors laid
        out like ``inp``'s, or None where ``apply`` has more to do than call it."""
        causal, scale = _causal(inp), inp.softmax_scale
        if ((cls.ATTN_MASK and _needs_dense_mask(inp)) or not (inp.query.numel() and inp.key.numel())
                or (causal and scale <= 0.0) or inp.query.dtype != inp.out_dtype or _is_compiling()):
            return None
        fn, args, kwargs, bmhk = cls.kernel(inp, causal, None if inp.scale is None else scale)
        if kwargs:  # bound once: an empty ``**kwargs`` at the call alone costs ~0.2 us of the tiny call's host time
            fn = functools.partial(fn, **kwargs)
        if bmhk:
            def run(query, key, value, *_):
                return fn(query, key, value, *args)[0], None
        elif inp.needs_grad():
            def run(query, key, value, *_):
                out = fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), *args)[0]
                return out.transpose(1, 2), None
        else:  # no autograd node holds the output: its two dims swap in place (no second view object)
            def run(query, key, value, *_):
                return fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), *args)[0].transpose_(
                    1, 2), None
        return run

    @classmethod
    def kernel(cls, inp, causal: bool, scale: float | None) -> "SdpaKernel":
        """The backend's aten function for calls like ``inp`` and its arguments after query, key and value:
        ``fn(q, k, v, *args, **kwargs)[0]`` is the output, (B, Hq, Mq, Kv) for BHMK views q (B, Hq, Mq, K) and
        k / v (B, Hkv, Mk, K / Kv), or (B, Mq, Hq, Kv) for the BMHK tensors themselves when ``bmhk``.
        ``scale`` None: the backend's default 1/sqrt(K) (the same float)."""
        raise NotImplementedError

    @classmethod
    def estimate(cls, p: Problem) -> float:
        """The roofline at the backend's rates; a local window runs as a dense mask: every score is computed."""
        rates = cls.CPU_RATES if p.arch.kind == "cpu" else cls.RATES
        return attention_time(p, *rates, window=False)


def _needs_dense_mask(inp) -> bool:
    bias = inp.attn_bias
    return bias is not None and (bias.window_left >= 0 or bias.window_right >= 0 or bias.tensor_bias is not None
                                 or (inp.bias_kind == ab.CAUSAL_BR and inp.query.shape[1] not in (1, inp.key.shape[1])))


def _dense_mask(inp) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's ``attn_mask`` for a dense mask kind with its window / tensor bias: bool (Mq, Mk), or the bias
    (B, Hq, Mq, Mk) in the query's dtype with -inf where hidden; and the (Mq,) bool query rows that see no key
    (shown every key here, zeroed by the caller: no data-dependent branch, so torch.compile traces it)."""
    q, k = inp.query, inp.key
    mq, mk = q.shape[1], k.shape[1]
    (seg,) = inp.attn_bias.segments(mq, mk)
    visible = seg.visible(mq, mk, q.device)
    empty = ~visible.any(dim=-1)
    visible = visible | empty[:, None]
    tensor = inp.attn_bias.tensor_bias
    if tensor is None:
        return visible, empty
    return tensor.to(q.dtype).expand(q.shape[0], q.shape[2], mq, mk).masked_fill(~visible, float("-inf")), empty


@register
class SdpaCudnnFwOp(_SdpaOp):
    """SDPA through cuDNN's fused attention (Hopper: the fastest bf16 baseline)."""

    NAME = "sdpa_cudnnF"
    ARCHS = ("cuda>=9.0",)
    DTYPES = _HALF
    OUT_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIMS = range(8, 257, 8)
    DROPOUT = False  # torch takes cuDNN dropout only in steps of 1/16 (and not with one query)
    DETERMINISTIC = False
    RATES = (600.0, 3.9, 8.0)
    #: cuDNN's backward on the H200 (bench/results/backends.md, TFLOP/s of the backward's work): 446 at D64, 551
    #: at D128, 411 at D256 on long sequences, 401 at 8x1000 (D128): a fixed ~110 us beside the rate
    BACKWARD_RATES = {64: 480.0, 128: 560.0, 256: 415.0}
    BACKWARD_OVERHEAD_US = 110.0
    HOST_US = 18.0
    #: cuDNN's fused kernels read q / k / v through TMA; SDPA's front end checks the 16-byte rule, the aten function
    #: called here does not: q / k / v sliced from rows of 196 bf16 elements (392 bytes) gave cosine 0.02 on the H200
    ALIGNMENT = "cuDNN fused kernels' TMA loads"

    @classmethod
    def kernel(cls, inp, causal, scale):
        return SdpaKernel(torch._scaled_dot_product_cudnn_attention, (None, inp.needs_grad(), inp.p, causal, False),
                          _scale_kwargs(scale))

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        # what torch's can_use_cudnn_attention (sdp_utils.cpp, check_cudnn_tensor_shapes) refuses: SDPA fails
        # such calls with "No available kernel" (cuDNN builds no graph for them)
        r = super().extra_reasons(p)
        if p.seqlen_k <= 1 or p.seqlen_q == 0:
            r.append(f"cuDNN SDPA needs key length >= 2 and query length >= 1 (got Mq={p.seqlen_q}, "
                     f"Mk={p.seqlen_k})")
        if max(p.batch, p.heads_q) > _CUDNN_MAX_DIM:
            r.append(f"cuDNN SDPA takes batch and heads <= {_CUDNN_MAX_DIM} (got B={p.batch}, Hq={p.heads_q})")
        limit = _cudnn_head_dim_limit(p.head_dim, p.head_dim_v, p.arch.capability)
        if max(p.head_dim, p.head_dim_v) > limit:
            r.append(f"cuDNN SDPA with this cuDNN ({torch.backends.cudnn.version()}) takes head dims <= {limit}")
        return r


@register
class SdpaFlashFwOp(_SdpaOp):
    """SDPA through its FlashAttention-2 kernels (CUDA), or the CPU flash kernel.

    On CUDA it calls ``aten::_flash_attention_forward``, the BMHK function behind
    ``_scaled_dot_product_flash_attention`` (which transposes its BHMK arguments to BMHK for it), with SDPA's
    autograd (``_flash_attention_backward``): no transposes on either side, four fewer tensor views per call.
    """

    NAME = "sdpa_flashF"
    ARCHS = ("cpu", "cuda>=8.0")
    DTYPES = _ALL_FLOAT
    OUT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    HEAD_DIMS = range(8, 257, 8)
    RATES = (340.0, 2.5, 8.0)
    CPU_RATES = (0.01, 0.01, 50.0)
    HOST_US = 17.5
    #: the CUDA FlashAttention-2 kernels copy q / k / v rows to shared memory in 16-byte vectors (cp.async) from
    #: wherever the strides put them: no check on this path (nor in SDPA's front end), and a row of 196 fp16
    #: elements (392 bytes) raised "misaligned address" on the H200. The CPU flash kernel takes any stride.
    ALIGNMENT = "FlashAttention-2 kernels' 16-byte vector loads (cp.async)"

    @classmethod
    def alignment(cls, p: Problem) -> str | None:
        return None if p.arch.kind == "cpu" else cls.ALIGNMENT

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        if p.arch.kind == "cpu":  # the CPU flash kernel's causal is top-left, as SDPA's
            r = super().extra_reasons(p)
            if p.dropout:
                r.append("dropout (p > 0) not supported by the CPU flash kernel")
            return r
        # the CUDA flash kernels align causal bottom-right (FlashAttention 2's rule; SDPA's front end refuses them
        # non-square causal calls): bottom-right causal runs at any Mq <= Mk, top-left only where the two coincide
        r = []
        if p.q_dtype == torch.float32:
            r.append("float32 runs only on the CPU flash kernel")
        if p.bias == ab.CAUSAL and p.seqlen_q != p.seqlen_k:
            r.append(f"top-left causal with Mq={p.seqlen_q} != Mk={p.seqlen_k} not supported (the CUDA flash "
                     f"kernels align causal bottom-right)")
        if p.bias == ab.CAUSAL_BR and p.seqlen_q > p.seqlen_k:
            r.append(f"bottom-right causal with Mq={p.seqlen_q} > Mk={p.seqlen_k} not supported")
        return r

    @classmethod
    def kernel(cls, inp, causal, scale):
        if inp.query.is_cuda:  # the function SDPA's flash path runs after transposing to BMHK: BMHK in and out
            return SdpaKernel(torch.ops.aten._flash_attention_forward.default,
                              (None, None, inp.query.shape[1], inp.key.shape[1], inp.p, causal, False),
                              _scale_kwargs(scale), bmhk=True)
        return SdpaKernel(torch._scaled_dot_product_flash_attention_for_cpu, (inp.p, causal), _scale_kwargs(scale))


@register
class SdpaEfficientFwOp(_SdpaOp):
    """SDPA through its memory-efficient (xformers cutlass) kernels."""

    NAME = "sdpa_efficientF"
    ARCHS = ("cuda>=5.0",)
    DTYPES = _ALL_FLOAT
    OUT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    HEAD_DIMS = range(1, 513)
    HEAD_DIMS_V = range(1, 513)
    GQA = False  # enable_gqa is not implemented by this backend (torch 2.11)
    DETERMINISTIC = False
    ATTN_MASK = True
    MASK_BACKEND = SDPBackend.EFFICIENT_ATTENTION
    WINDOW = True
    BIAS_KINDS = _SdpaOp.BIAS_KINDS | ab.TENSOR_KINDS
    RATES = (250.0, 2.0, 8.0)
    HOST_US = 18.0

    #: the cutlass kernels load q / k / v in 16-byte vectors (SDPA's front end checks it; the aten function called
    #: here does not, and a misaligned operand faults on the GPU)
    ALIGNMENT = "memory-efficient kernels' 16-byte vector loads"

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        """The cutlass kernels' head dims: K and Kv in whole 16-byte vectors on sm80+ (8 fp16 / bf16 or 4 fp32
        elements; 8 fp16 / bf16 elements before)."""
        r = super().extra_reasons(p)
        vector = _mem_efficient_alignment(p)
        for arg, dim in (("query/key head dim K", p.head_dim), ("value head dim Kv", p.head_dim_v)):
            if dim % vector:
                r.append(f"{arg}={dim} is not a multiple of {vector} {p.q_dtype} elements "
                         f"({MEM_EFFICIENT_ALIGNMENT_BYTES}-byte vectors the memory-efficient kernels load); "
                         f"supported: multiples of {vector}")
        return r

    @classmethod
    def kernel(cls, inp, causal, scale):
        return SdpaKernel(torch._scaled_dot_product_efficient_attention, (None, inp.needs_grad(), inp.p, causal),
                          _scale_kwargs(scale))


@register
class SdpaMathFwOp(_SdpaOp):
    """SDPA's composite math path (materializes the score matrix); any float dtype, CPU and CUDA."""

    NAME = "sdpa_mathF"
    ARCHS = ("cpu", "cuda>=0.0")
    DTYPES = _ALL_FLOAT
    OUT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    HEAD_DIMS = range(1, 1025)
    HEAD_DIMS_V = range(1, 1025)
    ATTN_MASK = True
    MASK_BACKEND = SDPBackend.MATH
    WINDOW = True
    BIAS_KINDS = _SdpaOp.BIAS_KINDS | ab.TENSOR_KINDS
    RATES = (60.0, 0.6, 15.0)
    HOST_US = 60.0
    PRIORITY = -10

    @classmethod
    def kernel(cls, inp, causal, scale):
        return SdpaKernel(torch._scaled_dot_product_attention_math, (None, inp.p, causal, None),
                          {**_scale_kwargs(scale), "enable_gqa": inp.query.shape[2] != inp.key.shape[2]})


#: bytes per vector load of the memory-efficient (cutlass) kernels' operands
MEM_EFFICIENT_ALIGNMENT_BYTES = 16


def _mem_efficient_alignment(p: Problem) -> int:
    """Elements per head-dim vector the memory-efficient kernels need (torch's ``minimum_gemm_alignment``):
    one 16-byte vector where tensor cores run the dtype (fp16 / bf16 on sm70+, fp32 on sm80+), else 4 elements
    on sm80+ and 1 before.

    Example
    -------
    >>> _mem_efficient_alignment(problem)  # fp16 on sm90; 4 for fp32
    8
    """
    capability = p.arch.capability if p.arch.kind == "cuda" else (0, 0)
    half = p.q_dtype in (torch.float16, torch.bfloat16)
    if (half and capability >= (7, 0)) or capability >= (8, 0):
        return MEM_EFFICIENT_ALIGNMENT_BYTES // p.q_dtype.itemsize
    return 1


def _causal(inp) -> bool:
    """Whether the call runs the fused kernels' causal mask: top-left causal, or bottom-right with Mq > 1 (the kinds'
    rules coincide there; ``extra_reasons`` refuses the rest unless a dense mask runs it)."""
    kind = inp.bias_kind
    return kind == ab.CAUSAL or (kind == ab.CAUSAL_BR and inp.query.shape[1] > 1)


def _scale_kwargs(scale: float | None) -> dict:
    """The ``scale`` keyword of the aten functions; none for the default (their 1/sqrt(K) is the same float)."""
    return {} if scale is None else {"scale": scale}


class SdpaKernel(NamedTuple):
    """An SDPA backend's aten function and its arguments after (query, key, value) (``_SdpaOp.kernel``)."""

    fn: Callable
    args: tuple
    kwargs: dict
    bmhk: bool = False  # fn takes the BMHK tensors and returns BMHK (else BHMK views in and out)
