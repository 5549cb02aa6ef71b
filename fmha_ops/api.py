"""xformers-style public API: memory_efficient_attention[_forward|_partial], merge_attentions, explain.

Tensors are BMHK (batch, seqlen, heads, headdim); BMGHK (batch, seqlen, groups, heads, headdim, with
key/value expanded over heads for MQA/GQA) and BMK (single head) are accepted and returned in the
same layout. Quantized calls pass float32 descales as keyword arguments (see ``fmha_ops.inputs``).
Validation runs once per call signature; a repeated call runs the plan its first call left in the plan cache
(``fmha_ops.plans``): one key, one lookup, the op's launch.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import torch

from registry import Op, Report

from . import arguments
from . import attn_bias as ab
from .call import no_grad, run_forward
from .dispatch import REGISTRY, SELECTOR
from .dtypes import FLOAT_DTYPES
from .inputs import BMHK, Inputs, checks_values, make_inputs
from .plan import Plan
from .plans import PLANS, plan_finder
from .timing import autotune_seconds
from .validation import make_problem

OpArg = Any  # an op class, name/alias, or (FwOp, BwOp) tuple
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch._C.is_grad_enabled
_F32 = torch.float32


def memory_efficient_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: Any = None, p: float = 0.0,
    scale: float | None = None, *, op: OpArg = None, output_dtype: torch.dtype | None = None,
    q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None, quantize_kv_to_fp8: bool = False, softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention ``softmax(q @ k^T * scale + bias) @ v``; differentiable when the chosen ops allow.

    query (B, Mq, Hq, K), key (B, Mk, Hkv, K), value (B, Mk, Hkv, Kv), Hq % Hkv == 0.
    ``scale`` defaults to 1/sqrt(K). ``op`` forces an op (raises if it cannot run the call): one of ours,
    or an xformers / MSLK op class, name or (FwOp, BwOp) tuple (``fmha_ops.ops.aliases``). ``attn_bias``:
    a mask from ``fmha_ops.attn_bias``, an xformers mask, or an additive tensor (B, Hq, Mq, Mk).
    ``softcap`` > 0 caps the scores: softcap * tanh(score / softcap) (Gemma 2; not in xformers).
    ``sinks``: float32 (Hq,) attention sinks (GPT-OSS's learned per-head logits, transformers' ``s_aux``), each
    joining its head's softmax denominators (``fmha_ops.sinks``); differentiable (autograd gives their gradient).
    Returns (B, Mq, Hq, Kv) in ``output_dtype`` (default: query's dtype; bfloat16 for fp8/int8 inputs).
    ``output_dtype=torch.float8_e4m3fn`` (fp8 e4m3fn inputs, for fp8 pipelines): the output in the value's fp8
    units, i.e. attention = out.float() * v_descale (it cannot saturate: attention averages value rows).

    Example
    -------
    >>> out = memory_efficient_attention(q, k, v, LowerTriangularMask())
    >>> o8 = memory_efficient_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
    ...                                 output_dtype=torch.float8_e4m3fn)  # attention = o8.float() * vd
    """
    plan, key_ = _FIND_MEA(query, key, value, attn_bias, p, scale, op, output_dtype, q_descale, k_descale, v_descale,
                           quantize_kv_to_fp8, softcap, sinks)
    if plan is not None:
        return plan.run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks)[0]
    inp = make_inputs(query, key, value, attn_bias, p=p, scale=scale, output_dtype=output_dtype,
                      q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                      quantize_kv_to_fp8=quantize_kv_to_fp8, softcap=softcap, sinks=sinks)
    return inp.layout(run_forward(inp, op, False, key_)[0])


def memory_efficient_attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: Any = None, p: float = 0.0,
    scale: float | None = None, *, op: OpArg = None, output_dtype: torch.dtype | None = None,
    q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None, quantize_kv_to_fp8: bool = False, softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Like ``memory_efficient_attention`` without autograd (inference)."""
    plan, key_ = _FIND_FORWARD(query, key, value, attn_bias, p, scale, op, output_dtype, q_descale, k_descale,
                               v_descale, quantize_kv_to_fp8, softcap, sinks)
    if plan is not None:
        return plan.run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks)[0]
    inp = make_inputs(query, key, value, attn_bias, p=p, scale=scale, output_dtype=output_dtype,
                      q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                      quantize_kv_to_fp8=quantize_kv_to_fp8, softcap=softcap, sinks=sinks)
    if not (_grad_enabled() and (_may_record_graph(query, key, value, attn_bias)
                                 or getattr(sinks, "requires_grad", False))):
        return inp.layout(run_forward(inp, op, False, key_)[0])
    with no_grad():  # the plan of this call switches autograd off around its launch too
        return inp.layout(run_forward(inp, op, False, key_, _without_grad)[0])


_FIND_MEA = plan_finder(memory_efficient_attention)
_FIND_FORWARD = plan_finder(memory_efficient_attention_forward)


def _without_grad(launch):
    """A launch plan run with autograd switched off (a call in grad mode whose inputs require grad)."""
    def run(*args):
        with no_grad():
            return launch(*args)
    return run


def _may_record_graph(query, key, value, attn_bias) -> bool:
    """Whether a call in grad mode could record an autograd graph: an input requires grad, or the mask may carry a
    tensor that does (a tensor bias, a foreign mask)."""
    return (getattr(query, "requires_grad", False) or getattr(key, "requires_grad", False)
            or getattr(value, "requires_grad", False)
            or not (attn_bias is None or (isinstance(attn_bias, ab.AttentionBias) and attn_bias.tensor_bias is None)))


def memory_efficient_attention_partial(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: Any = None, p: float = 0.0,
    scale: float | None = None, *, op: OpArg = None, output_dtype: torch.dtype | None = None,
    q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None, quantize_kv_to_fp8: bool = False, softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a slice of the keys, with its log-sum-exp for ``merge_attentions``.

    Returns out (B, Mq, Hq, Kv) (default dtype float32, as xformers) and lse float32 (B, Hq, Mq)
    (BMGHK inputs: (B, G, H, Mq)), natural log; rows that see no key have lse -inf and out 0. With ``sinks`` the
    LSE includes them (a row without keys: the sink): give them to one part only before ``merge_attentions``.
    Dropout is refused (``p`` must be 0), as in xformers: the parts could not be merged exactly.
    """
    plan, key_ = _FIND_PARTIAL(query, key, value, attn_bias, p, scale, op, output_dtype, q_descale, k_descale,
                               v_descale, quantize_kv_to_fp8, softcap, sinks)
    if plan is not None:  # plans exist only for calls that need no gradient (the full path refuses the rest)
        return plan.run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks)
    _no_dropout(p, "memory_efficient_attention_partial")
    output_dtype = output_dtype or torch.float32
    inp = make_inputs(query, key, value, attn_bias, p=p, scale=scale, output_dtype=output_dtype,
                      is_partial=True, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                      quantize_kv_to_fp8=quantize_kv_to_fp8, softcap=softcap, sinks=sinks)
    if inp.needs_grad():
        grads = [n for n, t in (("query", query), ("key", key), ("value", value)) if t.requires_grad]
        raise NotImplementedError(f"memory_efficient_attention_partial returns no gradients, but {'/'.join(grads)} "
                                  f"requires_grad=True; call it under torch.no_grad() or pass detached tensors "
                                  f"(memory_efficient_attention is differentiable)")
    with no_grad():
        out, lse = run_forward(inp, op, True, key_)
    return inp.layout(out), inp.layout.lse(lse)


_FIND_PARTIAL = plan_finder(memory_efficient_attention_partial)


def memory_efficient_attention_forward_requires_grad(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: Any = None, p: float = 0.0,
    scale: float | None = None, *, op: OpArg = None, output_dtype: torch.dtype | None = None, softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """xformers' low-level forward: (out, lse) for a later ``memory_efficient_attention_backward``.

    out (B, Mq, Hq, Kv) in ``output_dtype`` (default: query's dtype); lse float32 (B, Hq, Mq) (BMGHK:
    (B, G, H, Mq); BMK: (B, 1, Mq)), the ``sinks`` included. No autograd graph is recorded. Dropout is refused
    (``p`` must be 0).

    Example
    -------
    >>> out, lse = memory_efficient_attention_forward_requires_grad(q, k, v, LowerTriangularMask())
    >>> dq, dk, dv = memory_efficient_attention_backward(torch.ones_like(out), out, lse, q, k, v,
    ...                                                  LowerTriangularMask())
    """
    plan, key_ = _FIND_FORWARD_REQUIRES_GRAD(query, key, value, attn_bias, p, scale, op, output_dtype, softcap, sinks)
    if plan is not None:
        return plan.run(query, key, value, attn_bias, None, None, None, sinks)
    _no_dropout(p, "memory_efficient_attention_forward_requires_grad")
    inp = make_inputs(query, key, value, attn_bias, p=p, scale=scale, output_dtype=output_dtype, softcap=softcap,
                      sinks=sinks)
    with no_grad():
        out, lse = run_forward(inp, op, True, key_, _without_grad)
    return inp.layout(out), _lse_layout(inp, lse)


_FIND_FORWARD_REQUIRES_GRAD = plan_finder(memory_efficient_attention_forward_requires_grad)


def memory_efficient_attention_backward(
    grad: torch.Tensor, output: torch.Tensor, lse: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, attn_bias: Any = None, p: float = 0.0, scale: float | None = None, *, op: OpArg = None,
    softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xformers' low-level backward: (dq, dk, dv) shaped like query, key, value.

    ``output`` and ``lse`` come from ``memory_efficient_attention_forward_requires_grad`` on the same
    inputs (``sinks`` too: the LSE includes them, and a backward op that takes them is selected; their own
    gradient is ``fmha_ops.sinks.sink_grad(output, grad, lse, sinks)``); ``grad`` is d(loss)/d(output). BMHK or BMK tensors (for GQA pass key / value with Hkv heads
    in BMHK). ``op``: a backward op, or an (FwOp, BwOp) tuple. Dropout is refused (``p`` must be 0). Under
    ``fmha_ops.autotune()`` the first call of a problem times the backward ops on these tensors.
    """
    plan, key_ = _FIND_BACKWARD(grad, output, lse, query, key, value, attn_bias, p, scale, op, softcap, sinks)
    if plan is not None:
        return plan.run(grad, output, lse, query, key, value, attn_bias, sinks)
    _no_dropout(p, "memory_efficient_attention_backward")
    if query.ndim == 5:
        raise ValueError("memory_efficient_attention_backward takes BMHK (B, M, H, K) or BMK tensors, got a 5-D "
                         "query; for GQA pass key / value with their Hkv heads in BMHK")
    inp = make_inputs(query, key, value, attn_bias, p=p, scale=scale, softcap=softcap, sinks=sinks)
    out, grad = (t[:, :, None] if inp.layout.bmk and t.ndim == 3 else t for t in (output, grad))
    lse = lse[:, None] if inp.layout.bmk and lse.ndim == 2 else lse
    b, mq, hq, _ = inp.query.shape
    want = {"output": (b, mq, hq, inp.value.shape[3]), "grad": (b, mq, hq, inp.value.shape[3]), "lse": (b, hq, mq)}
    for name, t in (("output", out), ("grad", grad), ("lse", lse)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want[name]} (BMHK) for query "
                             f"{tuple(query.shape)} and value {tuple(value.shape)}")
    sig, lse, grad = inp.signature(True), lse.float(), grad.contiguous()
    bw = SELECTOR.select(sig, lambda: make_problem(inp, True), "bw", op, lambda ops: autotune_seconds(
        ops, lambda o: functools.partial(o.apply_bw, inp, out, lse, grad), inp.query.device.type))
    dq, dk, dv = bw.apply_bw(inp, out, lse, grad)
    if inp.layout is BMHK and inp.attn_bias is attn_bias and (attn_bias is None or (
            attn_bias.tensor_bias is None and not checks_values(type(attn_bias)))):
        PLANS.put(key_, Plan(_backward_plan(bw, inp), (bw,)))
    return inp.layout(dq), inp.layout(dk), inp.layout(dv)


_FIND_BACKWARD = plan_finder(memory_efficient_attention_backward)


def _backward_plan(bw, inp: Inputs):
    """``run(grad, output, lse, query, key, value, attn_bias, sinks) -> (dq, dk, dv)``: the backward op on BMHK calls
    laid out like ``inp`` (validated, ``bw`` selected for them)."""
    p, scale, softcap = inp.p, inp.scale, inp.softcap

    def run(grad, output, lse, query, key, value, attn_bias, sinks):
        call = Inputs(query, key, value, attn_bias, p, scale, None, False, None, None, None, False, BMHK, softcap,
                      sinks)
        return bw.apply_bw(call, output, lse.float(), grad.contiguous())
    return run


def _no_dropout(p: float, name: str) -> None:
    if p != 0.0:
        raise NotImplementedError(f"p={p}: {name} does not support dropout (as in xformers); call "
                                  f"memory_efficient_attention, whose autograd replays the dropout mask")


def _lse_layout(inp: Inputs, lse: torch.Tensor) -> torch.Tensor:
    """lse (B, Hq, Mq) in the caller's layout; BMK keeps its head dim, (B, 1, Mq), as xformers does."""
    return lse if inp.layout.bmk else inp.layout.lse(lse)


def merge_attentions(
    attn_split: torch.Tensor | Sequence[torch.Tensor], lse_split: torch.Tensor | Sequence[torch.Tensor],
    write_lse: bool = True, output_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Combine partial attentions over disjoint key sets.

    attn_split (S, B, M, [G,] H, K) or a list of S such tensors; lse_split (S, B, [G,] H, M) or a list.
    Returns attn (B, M, [G,] H, K) in ``output_dtype`` (default: the parts' dtype) and, if ``write_lse``,
    lse (B, [G,] H, M) float32. Parts with lse -inf contribute nothing; all -inf gives 0 and -inf.
    On CUDA one kernel launch reads the parts where they lie (``kernels/triton/merge.py``).

    Example
    -------
    >>> parts = [memory_efficient_attention_partial(q, k[:, s], v[:, s]) for s in (slice(0, 512), slice(512, None))]
    >>> out, lse = merge_attentions([o for o, _ in parts], [lse for _, lse in parts])
    """
    plan, key_ = _FIND_MERGE(attn_split, lse_split, write_lse, output_dtype)
    if plan is not None:  # a layout validated before: straight to its path
        return plan.run(attn_split, lse_split)
    attns, lses = _parts("attn_split", attn_split), _parts("lse_split", lse_split)
    a, lp = attns[0], lses[0]
    if a.ndim not in (4, 5) or lp.ndim != a.ndim - 1 or len(attns) != len(lses):
        raise ValueError(f"attn_split {_stacked_shape(attns)} / lse_split {_stacked_shape(lses)}: expected "
                         f"(S, B, M, [G,] H, K) and (S, B, [G,] H, M)")
    arguments.tensor("attn_split", a, dtypes=FLOAT_DTYPES)
    arguments.tensor("lse_split", lp, dtypes=FLOAT_DTYPES)
    arguments.same_device("lse_split", lp, "attn_split", a)
    write_lse = arguments.flag("write_lse", write_lse)
    if output_dtype is not None:
        arguments.dtype("output_dtype", output_dtype, FLOAT_DTYPES)
    if (lp.shape[0], lp.shape[-1], *lp.shape[1:-1]) != tuple(a.shape[:-1]):  # lse (B, [G,] H, M) vs (B, M, [G,] H)
        raise ValueError(f"lse_split {_stacked_shape(lses)} does not match attn_split {_stacked_shape(attns)}")
    if key_ is not None:
        PLANS.put(key_, Plan(_merge_plan(a.is_cuda, _as_they_lie(attns, lses), output_dtype or a.dtype, write_lse,
                                         type(attn_split) is list and type(lse_split) is list), skips=("validation",)))
    if a.is_cuda and not _is_compiling():
        return _merge_on_device(attns, lses, output_dtype or a.dtype, write_lse)
    return _merge_torch(attn_split, lse_split, output_dtype, write_lse)


_FIND_MERGE = plan_finder(merge_attentions)


def _merge_plan(on_device: bool, as_they_lie: bool, out_dtype: torch.dtype, write_lse: bool, lists: bool = False):
    """``run(attn_split, lse_split)`` for validated merges of one layout: the merge kernel on the parts as they lie
    (``_as_they_lie``), the kernel after layout conversions, or torch ops (CPU; they check host lse values).
    ``lists``: both splits are lists (the key holds their types), which the kernel takes as they are."""
    if not on_device:
        return lambda attn_split, lse_split: _merge_torch(attn_split, lse_split, out_dtype, write_lse)
    if as_they_lie:  # BMHK parts with one stride set, float32 lse
        merge = _merge_kernel()
        if lists:
            return lambda attn_split, lse_split: merge(attn_split, lse_split, out_dtype, write_lse)
        return lambda attn_split, lse_split: merge(_part_list(attn_split), _part_list(lse_split), out_dtype,
                                                   write_lse)
    return lambda attn_split, lse_split: _merge_on_device(_part_list(attn_split), _part_list(lse_split), out_dtype,
                                                          write_lse)


def _merge_torch(attn_split, lse_split, output_dtype: torch.dtype | None,
                 write_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``merge_attentions`` in torch ops on validated arguments (the CPU and traced path): attn (S, B, M, [G,] H, K)
    and lse (S, B, [G,] H, M), stacked or lists of S parts. The merged lse is the log-sum-exp over the parts, shifted
    by their maximum (``torch.logsumexp`` takes several times the host time on tiny calls), and the parts weigh
    exp(lse - merged); rows no part sees (all -inf) come out 0 and -inf. Host lse values are checked (finite or
    -inf) on the merged lse: NaN and +inf propagate into it."""
    attn = attn_split if isinstance(attn_split, torch.Tensor) else torch.stack(attn_split)
    lse = lse_split if isinstance(lse_split, torch.Tensor) else torch.stack(lse_split)
    if lse.dtype != _F32:
        lse = lse.float()
    shift = lse.amax(dim=0).nan_to_num_(neginf=0.0)  # (B, [G,] H, M); 0 for rows every part leaves at -inf
    weights = torch.exp(lse - shift)
    total = weights.sum(dim=0)  # >= 1 where a part saw keys (its maximum contributes exp(0)), else 0
    merged = torch.log(total).add_(shift)
    if (lse.device.type == "cpu" and merged.numel() and not _is_compiling()
            and not merged.amax().item() < math.inf):
        raise ValueError("lse_split must be finite or -inf (a part that saw no key); it holds NaN or +inf")
    weights = weights.div_(total.clamp_min_(1.0)).movedim(-1, 2)  # (S, B, M, [G,] H); rows no part sees: 0
    out = (weights[..., None] * (attn if attn.dtype == _F32 else attn.float())).sum(dim=0)
    out_dtype = output_dtype or attn.dtype
    if out_dtype != _F32:
        out = out.to(out_dtype)
    return out, (merged if write_lse else None)


def _part_list(split) -> list[torch.Tensor]:
    """The S parts of a validated split (a tensor (S, ...), or a list / tuple of S tensors) as a list (what the
    merge kernel takes; a list is passed as it is)."""
    if type(split) is list:
        return split
    return list(split.unbind(0)) if isinstance(split, torch.Tensor) else list(split)


def _as_they_lie(attns: list[torch.Tensor], lses: list[torch.Tensor]) -> bool:
    """Whether ``_merge_on_device`` would hand these parts to the kernel unchanged: BMHK (B, M, H, K) parts with one
    stride set and a unit last stride, float32 lse parts with one stride set."""
    strides = attns[0].stride()
    return (attns[0].ndim == 4 and strides[-1] == 1 and all(t.stride() == strides for t in attns)
            and lses[0].dtype == torch.float32 and all(t.stride() == lses[0].stride() for t in lses))


def _merge_on_device(attns: list[torch.Tensor], lses: list[torch.Tensor], out_dtype: torch.dtype,
                     write_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``merge_attentions`` by the merge kernel: the parts as (B, M, H, K) / float32 (B, H, M) views with one
    stride set each (copies only where a part's layout differs), BMGHK folded to BMHK and back."""
    grouped = attns[0].ndim == 5
    if grouped:
        b, m, g, h, k = attns[0].shape
        attns, lses = [t.flatten(2, 3) for t in attns], [t.flatten(1, 2) for t in lses]
    strides = attns[0].stride()
    if strides[-1] != 1 or any(t.stride() != strides for t in attns):
        attns = [t.contiguous() for t in attns]
    if lses[0].dtype != torch.float32:
        lses = [t.float() for t in lses]
    if any(t.stride() != lses[0].stride() for t in lses):
        lses = [t.contiguous() for t in lses]
    out, lse = _merge_kernel()(attns, lses, out_dtype, write_lse)
    if grouped:
        out, lse = out.view(b, m, g, h, k), (None if lse is None else lse.view(b, g, h, m))
    return out, lse


@functools.cache
def _merge_kernel():
    """``kernels.triton.merge.merge_parts``, imported at its first use (Triton loads only when a merge runs on a GPU)."""
    from .kernels.triton.merge import merge_parts

    return merge_parts


def _parts(name: str, parts: Any) -> list[torch.Tensor]:
    """A tensor (S, ...) or a non-empty list of same-shape tensors as a list of S tensors."""
    if isinstance(parts, torch.Tensor):
        if parts.ndim == 0 or parts.shape[0] == 0:
            raise ValueError(f"{name} must hold at least one part along dim 0, got shape {tuple(parts.shape)}")
        return list(parts.unbind(0))
    if not isinstance(parts, (list, tuple)) or not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        raise TypeError(f"{name} must be a tensor or a non-empty list of tensors, got {_described(parts)}")
    first = parts[0]
    if any(p.shape != first.shape or p.dtype != first.dtype or p.device != first.device for p in parts[1:]):
        shapes = {tuple(p.shape) for p in parts}
        raise ValueError(f"{name}: every part must have one shape, dtype and device; got shapes {sorted(shapes)}")
    return list(parts)


def _described(parts: Any) -> str:
    """What a ``merge_attentions`` argument that is not a tensor or a list of tensors is, in words."""
    if not isinstance(parts, (list, tuple)):
        return f"a {type(parts).__name__}"
    if not parts:
        return f"an empty {type(parts).__name__}"
    return f"a {type(parts).__name__} of {', '.join(sorted({type(p).__name__ for p in parts}))}"


def _stacked_shape(parts: list[torch.Tensor]) -> tuple[int, ...]:
    return (len(parts), *parts[0].shape)


def explain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: Any = None, p: float = 0.0,
            scale: float | None = None, *, op: OpArg = None, output_dtype: torch.dtype | None = None,
            q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
            v_descale: torch.Tensor | None = None, quantize_kv_to_fp8: bool = False, partial: bool = False,
            kind: str = "fw", softcap: float = 0.0, sinks: torch.Tensor | None = None) -> Report:
    """For one call: every registered op of ``kind`` ("fw"/"bw") with availability, reasons, estimate
    and its source, ranked; ``.selected`` is the op the call would use (None if none can)."""
    arguments.choice("kind", kind, ("fw", "bw"))
    partial = arguments.flag("partial", partial)
    inp = make_inputs(query, key, value, attn_bias, p=p, scale=scale, output_dtype=output_dtype, is_partial=partial,
                      q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                      quantize_kv_to_fp8=quantize_kv_to_fp8, softcap=softcap, sinks=sinks)
    inp.validate()
    return SELECTOR.explain(inp.problem(needs_lse=partial), kind, op)


def get_op(name: str) -> type[Op]:
    """The op class registered under ``name`` or an alias (legacy aliases warn once)."""
    return REGISTRY.get(name)
