"""The eager call path every public function shares: signature, memoized selection, the op's launch.

``run_forward(inp, op, needs_lse)`` computes the call's ``Signature``, asks the selector for the forward op (one
dict lookup on a repeated signature; validation and the ``Problem`` only on a miss), and runs it; when autograd
needs gradients and the forward op does not differentiate itself, a backward op is selected too and the pair runs
under ``_Attention``. Under ``torch.compile`` the traced twin in ``fmha_ops.compiled`` runs instead.

Repeated calls skip even that: ``find_plan`` turns the user's arguments into one tuple of cheap attributes
(shapes, dtypes, devices, strides, grad mode, the mask's signature, the scalars, the selector's scope and the
process switches) and looks it up in ``PLANS``, which maps it to the launch plan built on the first call of that
layout (the selected op's ``AttentionFwOp.launcher``): no ``Inputs``, no signature, no selector lookup, no
validation. Calls whose values need per-call checks (host descales, masks with index tables, check mode) and
non-BMHK layouts always take the full path.

Example
-------
>>> key, plan = find_plan(q, k, v, mask, 0.0, None, None, None, False, 0.0, None, None, None, False)
>>> # plan: None until one full call of this layout ran
>>> out, lse = plan(q, k, v, mask, None, None, None) if plan else run_forward(make_inputs(q, k, v, mask), None,
...                                                                            False, key)
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from . import checks, compiled, fp8_backward
from .dispatch import SELECTOR
from .dtypes import FLOAT_DTYPES
from .inputs import BMHK, Inputs, checks_values
from .measure import forward_measure
from .problem import Problem
from .sinks import sink_grad

OpArg = Any  # an op class, name/alias, or (FwOp, BwOp) tuple
#: a launch plan: run(query, key, value, attn_bias, q_descale, k_descale, v_descale) -> (out, lse | None)
Plan = Callable[..., tuple]
_is_compiling = torch.compiler.is_compiling


class _GradOff:
    """``torch.no_grad()`` for the eager hot path: the grad mode switched off and back, nothing else (torch's
    context manager costs several microseconds per use on the host)."""

    __slots__ = ("previous",)

    def __enter__(self) -> None:
        self.previous = _grad_enabled()
        _set_grad_enabled(False)

    def __exit__(self, *exc) -> None:
        _set_grad_enabled(self.previous)


_grad_enabled, _set_grad_enabled = torch._C.is_grad_enabled, torch._C._set_grad_enabled


def no_grad():
    """A context manager that disables autograd like ``torch.no_grad()``: torch's own under torch.compile (which
    traces it), a cheaper one in eager calls.

    Example: ``with no_grad(): out, lse = run_forward(inp, None, True)``.
    """
    return torch.no_grad() if _is_compiling() else _GradOff()


def make_problem(inp: Inputs, needs_lse: bool) -> Problem:
    """Validate ``inp`` and build its ``Problem`` (what the selector runs on a memo miss)."""
    inp.validate()
    return inp.problem(needs_lse)


#: launch plans of repeated calls: ``find_plan``'s key -> run(query, key, value, attn_bias, q_descale, k_descale,
#: v_descale) -> (out, lse), as ``run_forward`` returns them; cleared with the selector's memo
PLANS: dict = SELECTOR.derived_memo()
PLAN_LIMIT = 1 << 12  # distinct call layouts kept before the plans are dropped (varlen-like workloads)

_scope = SELECTOR.current_scope
_deterministic = torch._C._get_deterministic_algorithms
_fp8_backward = fp8_backward.enabled_now
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)


#: ``find_plan``'s key starts with whether autograd records the call (q, k or v requires grad in grad mode)
KEY_NEEDS_GRAD = 0


def find_plan(query, key, value, attn_bias, p, scale, op, output_dtype, is_partial, softcap, q_descale, k_descale,
              v_descale, quantize_kv) -> tuple[tuple | None, Plan | None]:
    """(the call's plan key, the plan kept under it or None), for the arguments as the public functions take them.

    The key is one tuple of everything validation, selection and the launch read from the arguments and the
    process (all but the tensors' values); it is None when the call cannot have a plan: a trace (``PLANS`` is not
    read, so compiled graphs hold no guard on it), non-tensor or unhashable arguments, a mask without a signature
    (the full path converts or names them), checked descales. Key and lookup are one function: the hot path of
    every repeated call.

    Example: ``key, plan = find_plan(q, k, v, None, 0.0, None, None, None, False, 0.0, None, None, None, False)``.
    """
    if _is_compiling():
        return None, None
    try:
        descales = None
        if q_descale is not None or k_descale is not None or v_descale is not None:
            if checks.checks_enabled():  # device descales are read back per call: the full path does that
                return None, None
            descales = tuple([None if d is None else (d.shape, d.dtype, d.device, d.stride())
                              for d in (q_descale, k_descale, v_descale)])
        # strides: True for a contiguous tensor (they follow from its shape but for size-1 dims, which the call
        # signature does not key either), else the tuple
        key_ = (_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad),
                query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, query.device, key.device,
                value.device, query.is_contiguous() or query.stride(), key.is_contiguous() or key.stride(),
                value.is_contiguous() or value.stride(), None if attn_bias is None else attn_bias.signature(), p,
                scale, op, output_dtype, is_partial, softcap, quantize_kv, descales, _deterministic(), _scope(),
                _fp8_backward(),
                query.is_cuda and ((query.data_ptr() | key.data_ptr() | value.data_ptr()) & 15, _capturing()))
        return key_, PLANS.get(key_)
    except (AttributeError, TypeError):  # not tensors, a mask of another library or a mask class, an unhashable
        return None, None  # argument: the full path converts or names it, and keeps no plan


def run_forward(inp: Inputs, op: OpArg, needs_lse: bool,
                plan_key: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Select the forward op for ``inp`` (and the backward op when autograd needs one) and run it.

    Returns out (B, Mq, Hq, Kv) in ``inp.out_dtype`` and lse float32 (B, Hq, Mq) (None unless ``needs_lse``
    or a backward op is attached). ``plan_key``: the call's key from ``find_plan``; the launch plan of this call is
    kept under it in ``PLANS`` when the call can have one. Example:
    ``out, _ = run_forward(make_inputs(q, k, v), None, False)``.
    """
    if _is_compiling():
        return compiled.run_forward(inp, op, needs_lse)
    sig = inp.signature()
    fw = SELECTOR.select(sig, lambda: make_problem(inp, needs_lse), "fw", op,
                         None if sig.needs_grad else lambda ops: _measure(inp, needs_lse, plan_key)(ops))
    bw = None
    if sig.needs_grad and not (fw.AUTOGRAD and inp.query.dtype in FLOAT_DTYPES):
        bw = SELECTOR.select(sig, lambda: make_problem(inp, needs_lse), "bw", op)
    result = (fw.apply(inp, needs_lse) if bw is None
              else _Attention.apply(fw, bw, inp, inp.query, inp.key, inp.value, inp.sinks))
    if plan_key is not None and _plannable(inp):
        if len(PLANS) >= PLAN_LIMIT:
            PLANS.clear()
        PLANS[plan_key] = fw.launcher(inp, needs_lse) if bw is None else _autograd_plan(fw, bw, inp)
    return result


def _measure(inp: Inputs, needs_lse: bool, plan_key: tuple | None):
    """Autotune's ``measure(ops)`` for this call (built only on a selector memo miss under autotune): repeated calls
    that keep a launch plan are timed through it."""
    return forward_measure(inp, needs_lse, "plan" if plan_key is not None and _plannable(inp) else "apply")


def _plannable(inp: Inputs) -> bool:
    """Whether repeated calls like ``inp`` may skip the full path: BMHK as given, no per-call value checks (host
    descales, masks with index tables), no tensor bias (its gradient follows the grad mode)."""
    bias = inp.attn_bias
    if inp.layout is not BMHK or (bias is not None and (bias.tensor_bias is not None or checks_values(type(bias)))):
        return False
    return all(d is None or d.device.type != "cpu" for d in (inp.q_descale, inp.k_descale, inp.v_descale))


def _autograd_plan(fw, bw, inp: Inputs):
    """The plan of a differentiated call whose forward op has no autograd of its own: the pair under
    ``_Attention``, on an ``Inputs`` rebuilt from the call's arguments."""
    fields = (inp.p, inp.scale, inp.output_dtype, inp.is_partial)
    quantize_kv, softcap = inp.quantize_kv_to_fp8, inp.softcap

    def run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks=None):
        call = Inputs(query, key, value, attn_bias, *fields, q_descale, k_descale, v_descale, quantize_kv, BMHK,
                      softcap, sinks)
        return _Attention.apply(fw, bw, call, query, key, value, sinks)
    return run


class _Attention(torch.autograd.Function):
    """Autograd for a forward op without native autograd, paired with a backward op; the sinks' gradient (when
    they require one) from the output and the sink-inclusive LSE (``sinks.sink_grad``)."""

    @staticmethod
    def forward(ctx, fw, bw, inp: Inputs, query, key, value, sinks=None):
        out, lse = fw.apply(inp, True)
        ctx.bw, ctx.inp = bw, inp
        ctx.save_for_backward(out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq, dk, dv = ctx.bw.apply_bw(ctx.inp, out, lse, grad_out)
        sinks = ctx.inp.sinks
        dsinks = sink_grad(out, grad_out, lse, sinks) if sinks is not None and ctx.needs_input_grad[6] else None
        return None, None, None, dq, dk, dv, dsinks
