"""Our ops as xformers op classes, so xformers' own API runs our kernels.

Where xformers is installed (its op interface as of 0.0.35: ``AttentionFwOpBase.apply(inp,
needs_gradient) -> (out, Context | None)``, ``AttentionBwOpBase.apply(ctx, inp, grad) ->
Gradients``), this module builds, on first use, one xformers op class per registered op of ours
(``fw_op(name)`` / ``bw_op(name)``) and two that leave the choice to our selector (``FwOp`` /
``BwOp``)::

    import xformers.ops as xops
    from fmha_ops import xformers_ops
    out = xops.memory_efficient_attention(q, k, v, xops.LowerTriangularMask(),
                                          op=(xformers_ops.FwOp, xformers_ops.BwOp))

A class's declarations are read off our op's (devices from ``ARCHS``, float dtypes from
``DTYPES``, head dims, partial, determinism); xformers' generic checks run first, then our op's
own reasons for the call (``fmha_ops.explain``), so xformers reports why ours refuses. Masks are
xformers' own objects (converted by ``fmha_ops.attn_bias.from_xformers``) or tensors. The classes
declare no dropout: xformers' backward replays dropout from its own RNG state, ours cannot. The backward
classes give a dense tensor bias its gradient (``tensor_bias_gradient``, from the forward's out and lse).
Each class carries ``FMHA_OPS_OP`` (our op, None for the selector's), so ``fmha_ops`` calls accept
them as ``op=`` too. Without xformers, attribute access raises ImportError naming the package.

Example
-------
>>> from fmha_ops import xformers_ops           # doctest: +SKIP (needs xformers)
>>> xformers_ops.fw_op("torch_referenceF").NAME
'fmha_ops-torch_referenceF'
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from . import attn_bias as ab
from .api import explain, memory_efficient_attention_forward, memory_efficient_attention_partial
from .dispatch import REGISTRY
from .dtypes import FLOAT_DTYPES

NAME_PREFIX = "fmha_ops-"
#: xformers' own refusal of bf16 off A100+ GPUs; our CPU ops run bf16, so it is dropped for them
_XFORMERS_BF16_REASON = "bf16 is only supported on A100+ GPUs"
#: xformers' refusal of CUDA inputs when its own C++/CUDA extension did not load: our ops do not use it
_XFORMERS_NO_CUDA_BUILD_REASON = "xFormers wasn't build with CUDA support"


def fw_op(name: str) -> type:
    """The xformers forward op class running our op ``name`` (its NAME or an alias)."""
    return _op_class(REGISTRY.get(name).NAME, "fw")


def bw_op(name: str) -> type:
    """The xformers backward op class running our op ``name`` (its NAME or an alias)."""
    return _op_class(REGISTRY.get(name).NAME, "bw")


def install() -> None:
    """Make xformers' own dispatcher try our selector's ops first (``FwOp`` / ``BwOp``), so calls without
    ``op=`` run fmha_ops too; xformers' ops stay next in its priority order. Idempotent.

    Example
    -------
    >>> xformers_ops.install()                                   # doctest: +SKIP
    >>> xformers.ops.memory_efficient_attention(q, k, v)         # runs fmha_ops' choice
    """
    fmha = _xformers()
    dispatch = fmha.dispatch
    if getattr(dispatch, "_fmha_ops_installed", False):
        return
    fw_list, bw_dispatch = dispatch._dispatch_fw_priority_list, dispatch._dispatch_bw

    def fw_priority(inp, needs_gradient):
        return [_op_class(None, "fw"), *fw_list(inp, needs_gradient)]

    def dispatch_bw(inp, varlen_lse_packed):
        ours = _op_class(None, "bw")
        return ours if not ours.not_supported_reasons(inp) else bw_dispatch(inp, varlen_lse_packed)

    dispatch._dispatch_fw_priority_list, dispatch._dispatch_bw, fmha._dispatch_bw = fw_priority, dispatch_bw, dispatch_bw
    dispatch._fmha_ops_installed = True


def all_ops(kind: str = "fw") -> list[type]:
    """xformers op classes of ``kind`` for every registered op of ours that takes float inputs,
    then the selector's (``FwOp`` / ``BwOp``)."""
    ours = [_op_class(op.NAME, kind) for op in REGISTRY.ops(kind) if _float_dtypes(op)]
    return ours + [_op_class(None, kind)]


def __getattr__(name: str) -> Any:
    if name == "FwOp":
        return _op_class(None, "fw")
    if name == "BwOp":
        return _op_class(None, "bw")
    raise AttributeError(f"module 'fmha_ops.xformers_ops' has no attribute {name!r}")


@functools.lru_cache(maxsize=None)
def _xformers():
    try:
        from xformers.ops import fmha
    except ImportError as e:
        raise ImportError(f"fmha_ops.xformers_ops needs xformers (pip install xformers): {e}") from None
    return fmha


def _float_dtypes(op) -> set[torch.dtype]:
    return {q for q, k, v in op.DTYPES if q in FLOAT_DTYPES and q == k == v}


def _devices_and_capability(op) -> tuple[set[str], tuple[int, int]]:
    specs = op.arch_specs()
    devices = {"cpu" if spec.kind == "cpu" else "cuda" for spec in specs}  # ROCm devices are torch's "cuda" too
    cuda = [spec.min_cc for spec in specs if spec.kind == "cuda"]
    return devices, min(cuda, default=(0, 0))


def _bias_types(fmha) -> tuple:
    """xformers mask types with a counterpart here, plus None and dense tensors (our op's own reasons then say
    which of them it runs)."""
    names = [n for n in dir(fmha.attn_bias) if n != "AttentionBias" and isinstance(getattr(ab, n, None), type)
             and issubclass(getattr(ab, n), ab.AttentionBias) and isinstance(getattr(fmha.attn_bias, n), type)]
    return (type(None), torch.Tensor, *(getattr(fmha.attn_bias, n) for n in sorted(names)))


@functools.lru_cache(maxsize=None)
def _op_class(name: str | None, kind: str) -> type:
    fmha = _xformers()
    ours = None if name is None else REGISTRY.get(name)
    if ours is not None and not _float_dtypes(ours):
        raise ValueError(f"{name} takes no float16/bfloat16/float32 inputs (xformers passes no descales)")
    if ours is not None:
        devices, capability = _devices_and_capability(ours)
        decl = dict(
            SUPPORTED_DTYPES=_float_dtypes(ours), SUPPORTED_MAX_K=max(ours.HEAD_DIMS),
            SUPPORTED_MIN_K=min(ours.HEAD_DIMS), SUPPORTS_DIFFERENT_VALUE_EMBED=ours.HEAD_DIMS_V is not None,
            SUPPORTS_PARTIAL=ours.PARTIAL or kind == "bw", IS_DETERMINISTIC=ours.DETERMINISTIC,
            SUPPORTED_DEVICES=devices, CUDA_MINIMUM_COMPUTE_CAPABILITY=capability,
        )
    else:
        decl = dict(SUPPORTED_DTYPES=set(FLOAT_DTYPES), SUPPORTED_MAX_K=1024, SUPPORTED_MIN_K=1,
                    SUPPORTS_DIFFERENT_VALUE_EMBED=True, SUPPORTS_PARTIAL=True, IS_DETERMINISTIC=False,
                    SUPPORTED_DEVICES={"cpu", "cuda"})
    base = fmha.common.AttentionFwOpBase if kind == "fw" else fmha.common.AttentionBwOpBase
    label = ours.NAME if ours is not None else f"fmha_ops{'F' if kind == 'fw' else 'B'}"
    ns = dict(
        decl, OPERATOR=True, NAME=label if ours is None else NAME_PREFIX + label, FMHA_OPS_OP=ours,
        SUPPORTED_ATTN_BIAS_TYPES=_bias_types(fmha), SUPPORTS_ATTN_BIAS_GRAD=kind == "bw", SUPPORTS_DROPOUT=False,
        SUPPORTS_CUSTOM_SCALE=True, SUPPORTS_OUTPUT_DTYPE=True, SUPPORTS_BMGHK=kind == "fw", VARLEN_LSE_PACKED=True,
        KIND_OURS=kind,
        not_supported_reasons=classmethod(_not_supported_reasons),
        apply=classmethod(_apply_fw if kind == "fw" else _apply_bw),
        __module__=__name__, __qualname__=("FwOp" if kind == "fw" else "BwOp") + (f"[{label}]" if ours else ""),
        __doc__=f"xformers {kind} op running fmha_ops' {label}.",
    )
    return type(ns["__qualname__"], (base,), ns)


def _not_supported_reasons(cls, inp) -> list[str]:
    reasons = [r for r in super(cls, cls).not_supported_reasons(inp)
               if not (r == _XFORMERS_BF16_REASON and "cpu" in cls.SUPPORTED_DEVICES)
               and r != _XFORMERS_NO_CUDA_BUILD_REASON]
    if reasons:
        return reasons
    q, k, v = inp.query, inp.key, inp.value
    bias = _bias(inp.attn_bias, inp.query.ndim)
    try:
        report = explain(q, k, v, bias, inp.p, inp.scale, op=cls.FMHA_OPS_OP, output_dtype=inp.get_output_dtype(),
                         partial=inp.is_partial, kind=cls.KIND_OURS)
    except (ValueError, TypeError, NotImplementedError) as e:
        return [str(e)]
    if report.selected is None:
        return [f"{v.op.NAME}: {v.why_not()}" for v in report.verdicts] or ["no op of ours is allowed here"]
    return []


def _bias(bias, ndim: int):
    """xformers' bias as our API takes it: BMK tensors (B*H, Mq, Mk) gain their heads dim."""
    if isinstance(bias, torch.Tensor) and ndim == 3:
        return bias[:, None]
    return bias


@torch.no_grad()
def _apply_fw(cls, inp, needs_gradient: bool):
    """xformers' op contract: plain tensors out, no autograd graph (xformers' own autograd function, or
    ``memory_efficient_attention_forward_requires_grad`` + ``_backward``, handle the gradients)."""
    fmha = _xformers()
    bias = _bias(inp.attn_bias, inp.query.ndim)
    kw = dict(op=cls.FMHA_OPS_OP, output_dtype=inp.get_output_dtype())
    if needs_gradient or inp.is_partial:
        out, lse = memory_efficient_attention_partial(inp.query, inp.key, inp.value, bias, inp.p, inp.scale, **kw)
        return out, fmha.common.Context(lse=lse, out=out)
    return memory_efficient_attention_forward(inp.query, inp.key, inp.value, bias, inp.p, inp.scale, **kw), None


@torch.no_grad()
def _apply_bw(cls, ctx, inp, grad):
    from .api import memory_efficient_attention_backward

    fmha = _xformers()
    bias = _bias(inp.attn_bias, inp.query.ndim)
    grads = memory_efficient_attention_backward(grad, ctx.out, ctx.lse, inp.query, inp.key, inp.value, bias, inp.p,
                                                inp.scale, op=cls.FMHA_OPS_OP)
    tensor = inp.attn_bias
    db = (tensor_bias_gradient(grad, ctx.out, ctx.lse, inp.query, inp.key, inp.value, tensor, inp.scale)
          if isinstance(tensor, torch.Tensor) and tensor.requires_grad else None)
    return fmha.common.Gradients(*grads, db=db)


def tensor_bias_gradient(grad: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, query: torch.Tensor,
                         key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """d(loss)/d(bias) of softmax(scale * q k^T + bias) v for a dense additive bias, from the forward's
    ``out`` and natural-log ``lse``: dS = P * (dO v^T - rowsum(dO * out)), P = exp(scale * q k^T + bias - lse),
    summed over the dims ``bias`` broadcasts. BMHK tensors (B, M, H, K) (key / value with Hkv heads repeat
    per query-head group), grad / out (B, Mq, H, Kv), lse (B, H, Mq), bias broadcastable to (B, H, Mq, Mk).
    Returns a tensor of ``bias``'s shape and dtype. Rows that saw no key (lse -inf) get 0.

    Example
    -------
    >>> out, lse = fmha_ops.memory_efficient_attention_forward_requires_grad(q, k, v, bias)   # doctest: +SKIP
    >>> db = tensor_bias_gradient(grad, out, lse, q, k, v, bias)                          # doctest: +SKIP
    """
    group = query.shape[2] // key.shape[2]
    k, v = (t.float().repeat_interleave(group, dim=2) for t in (key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bmhk,bnhk->bhmn", query.float(), k) * scale + bias.float()
    lse = lse.float()[..., None]
    p = torch.where(torch.isfinite(lse), torch.exp(s - lse.nan_to_num(neginf=0.0)), torch.zeros_like(s))
    dp = torch.einsum("bmhk,bnhk->bhmn", grad.float(), v)
    rowsum = (grad.float() * out.float()).sum(-1).transpose(1, 2)[..., None]
    ds = p * (dp - rowsum)
    extra = ds.ndim - bias.ndim
    if extra:
        ds = ds.sum(dim=tuple(range(extra)))
    broadcast = tuple(d for d, n in enumerate(bias.shape) if n == 1 and ds.shape[d] != 1)
    if broadcast:  # (an empty dim tuple would sum everything)
        ds = ds.sum(dim=broadcast, keepdim=True)
    return ds.to(bias.dtype)
