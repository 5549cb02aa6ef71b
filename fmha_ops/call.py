"""The eager call path every public function shares: signature, memoized selection, the op's launch.

``run_forward(inp, op, needs_lse)`` computes the call's ``Signature``, asks the selector for the forward op (one
dict lookup on a repeated signature; validation and the ``Problem`` only on a miss), and runs it; when autograd
needs gradients and the forward op does not differentiate itself, a backward op is selected too and the pair runs
under ``_Attention``. Under ``torch.compile`` the traced twin in ``fmha_ops.compiled`` runs instead.

Repeated calls skip even that: a public function looks its call up in the plan cache (``fmha_ops.plans``) first,
and ``run_forward`` given the call's ``plan_key`` stores there the launch plan of a call that can have one (the
selected op's ``AttentionFwOp.launcher``): no ``Inputs``, no signature, no selector lookup, no validation on the
next call of that signature. Calls whose values need per-call checks (host descales, masks with index tables,
check mode) and non-BMHK layouts keep the full path. ``forward_plan(inp, op, needs_lse)`` is the selection and run
of that path, apart: the op(s) chosen once and their run, for a caller that builds a plan of its own around them
(``kvcache_call``).

Example
-------
>>> key = plans.call_key("attention", (q, k, v, mask))
>>> plan = plans.PLANS.get(key)
>>> out, lse = plan.run(q, k, v, mask, None, None, None, None) if plan else run_forward(
...     make_inputs(q, k, v, mask), None, False, key)
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from . import checks, compiled
from .dispatch import SELECTOR
from .dtypes import FLOAT_DTYPES
from .inputs import BMHK, Inputs, checks_values
from .plan import Plan
from .plans import PLANS
from .timing import autotune_seconds
from .validation import make_problem

OpArg = Any  # an op class, name/alias, or (FwOp, BwOp) tuple
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


def run_forward(inp: Inputs, op: OpArg, needs_lse: bool, plan_key: tuple | None = None,
                bind: Callable | None = None, bound: object = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Select the forward op for ``inp`` (and the backward op when autograd needs one) and run it.

    Returns out (B, Mq, Hq, Kv) in ``inp.out_dtype`` and lse float32 (B, Hq, Mq) (None unless ``needs_lse``
    or a backward op is attached). ``plan_key``: the call's key (``plans.call_key``); the launch plan of this call,
    ``run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks) -> (out, lse)``, is stored under it in
    ``plans.PLANS`` when the call can have one, as ``bind(run)`` when ``bind`` is given (an entry point's own
    arguments and results around the launch), with ``bound`` (what the entry point passes the launch besides the
    call's tensors: its mask) as ``Plan.bound``. A call without a key runs its ``forward_plan``. Example:
    ``out, _ = run_forward(make_inputs(q, k, v), None, False)``.
    """
    plannable = plan_key is not None and _plannable(inp)
    forward = forward_plan(inp, op, needs_lse, _launch_plan_call(inp, needs_lse) if plannable else None)
    result = forward.run(inp)
    if plannable:
        fw, *bw = forward.ops
        launch = fw.launcher(inp, needs_lse) if not bw else _autograd_plan(fw, bw[0], inp)
        PLANS.put(plan_key, Plan(launch if bind is None else bind(launch), forward.ops, bound=bound))
    return result


def forward_plan(inp: Inputs, op: OpArg, needs_lse: bool, repeated: Callable | None = None) -> Plan:
    """The forward op(s) of calls like ``inp``, selected once, and their run: ``Plan.run(call) -> (out, lse)`` on
    ``inp`` or a call of its signature (``Inputs`` of the same metadata, e.g. ``inp`` with its caches appended).

    ``Plan.ops``: the forward op from the selector's memo (validation and the ``Problem`` on a miss), and the
    backward op when autograd needs this call's gradients and the forward op does not differentiate itself; the
    run is then the pair under ``_Attention``, else the forward op's ``apply``. Under ``torch.compile`` the traced
    plan (``compiled.traced_plan``: no ops; its ``check`` and ``run`` validate the call and select in the trace).
    Under autotune the forward ops are timed as repeated calls will run them (``timing.autotune_seconds``):
    ``repeated(op)``, the caller's repeated call of ``op`` without arguments (``repeated`` None, or a None from it:
    ``op.apply`` on ``inp``); with gradients ``op.apply`` keeping the LSE (what ``_Attention`` runs), then the
    backward ops on the output and LSE of the fastest of the forward ops they pair with (``_backward_timed``), so
    those are ranked with the measured backward (an op with autograd of its own adds its modelled backward). lse
    as ``run_forward`` returns it.

    Example
    -------
    >>> plan = forward_plan(make_inputs(q, k, v), None, False)  # doctest: +SKIP
    >>> out, _ = plan.run(make_inputs(q, k, v))  # doctest: +SKIP
    """
    if _is_compiling():  # validated and selected at trace time, where the trace checks or runs the plan
        return compiled.traced_plan(op, needs_lse)

    sig, device = inp.signature(needs_lse), inp.query.device.type

    def timed(o):  # what autotune times of a contender: its repeated call; with gradients, its forward with the LSE
        call = None if repeated is None or sig.needs_grad else repeated(o)
        return functools.partial(o.apply, inp, needs_lse or sig.needs_grad) if call is None else call

    def own_backward(o) -> bool:  # o differentiates itself: no backward op runs after it
        return o.AUTOGRAD and inp.query.dtype in FLOAT_DTYPES

    def select_backward(fw):  # under autotune its contenders timed on fw's output and LSE
        return SELECTOR.select(sig, lambda: make_problem(inp, needs_lse), "bw", op,
                               lambda ops: autotune_seconds(ops, _backward_timed(fw, inp), device))

    def measure(ops):  # autotune: the forward ops; with gradients then the backward ops, before the forward is ranked
        seconds = autotune_seconds(ops, timed, device)
        paired = [o for o in ops if o.NAME in seconds and o.PARTIAL and not own_backward(o)] if sig.needs_grad else []
        if paired:
            select_backward(min(paired, key=lambda o: seconds[o.NAME]))
        return seconds

    fw = SELECTOR.select(sig, lambda: make_problem(inp, needs_lse), "fw", op, measure)
    if not sig.needs_grad or own_backward(fw):
        def run(call: Inputs):
            return fw.apply(call, needs_lse)
        return Plan(run, (fw,))
    bw = select_backward(fw)

    def paired(call: Inputs):
        return _Attention.apply(fw, bw, call, call.query, call.key, call.value, call.sinks)
    return Plan(paired, (fw, bw))


def _backward_timed(fw, inp: Inputs) -> Callable:
    """``timed(op)`` for autotune's measurement of a call's backward ops: ``op.apply_bw`` on ``inp`` with the output
    and LSE of the forward op ``fw`` and a random output gradient, as a call without arguments. The forward runs
    once, at the first op timed (never where autotune times nothing: under a CUDA-graph capture); every op is timed on
    the same output, LSE and gradient, and none writes to the caller's tensors."""
    operands: list[tuple[torch.Tensor, ...]] = []

    def timed(op):
        if not operands:
            with torch.no_grad():
                out, lse = fw.apply(inp, True)
            operands.append((out, lse, torch.randn_like(out)))
        return functools.partial(op.apply_bw, inp, *operands[0])
    return timed


def _launch_plan_call(inp: Inputs, needs_lse: bool) -> Callable:
    """``repeated(op)`` for autotune's measurement of a call that keeps a launch plan: ``op``'s launch plan
    (``AttentionFwOp.launcher``) bound to the call's arguments, as a call without arguments."""
    def repeated(op):
        args = (inp.query, inp.key, inp.value, inp.attn_bias, inp.q_descale, inp.k_descale, inp.v_descale, inp.sinks)
        return functools.partial(op.launcher(inp, needs_lse), *args)
    return repeated


def _plannable(inp: Inputs) -> bool:
    """Whether repeated calls like ``inp`` may skip the full path: BMHK as given, no per-call value checks (host
    descales, masks with index tables), no tensor bias (its gradient follows the grad mode). Sinks are an argument of
    the plan's run, like the tensors (the key holds their layout; ``validate_sinks`` reads nothing else)."""
    bias = inp.attn_bias
    if inp.layout is not BMHK or (bias is not None and (bias.tensor_bias is not None or checks_values(type(bias)))):
        return False
    descales = [d for d in (inp.q_descale, inp.k_descale, inp.v_descale) if d is not None]
    return not descales or not (checks.checks_enabled() or any(d.device.type == "cpu" for d in descales))


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
    they require one) from the backward op with dq / dk / dv (``AttentionBwOp.apply_bw_sinks``)."""

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
        if ctx.inp.sinks is not None and ctx.needs_input_grad[6]:
            dq, dk, dv, dsinks = ctx.bw.apply_bw_sinks(ctx.inp, out, lse, grad_out)
        else:
            (dq, dk, dv), dsinks = ctx.bw.apply_bw(ctx.inp, out, lse, grad_out), None
        return None, None, None, dq, dk, dv, dsinks
