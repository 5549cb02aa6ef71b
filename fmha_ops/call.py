"""The eager call path every public function shares: signature, memoized selection, the op's launch.

``run_forward(inp, op, needs_lse)`` computes the call's ``Signature``, asks the selector for the forward op (one
dict lookup on a repeated signature; validation and the ``Problem`` only on a miss), and runs it; when autograd
needs gradients and the forward op does not differentiate itself, a backward op is selected too and the pair runs
under ``_Attention``. Under ``torch.compile`` the traced twin in ``fmha_ops.compiled`` runs instead.
"""
from __future__ import annotations

from typing import Any

import torch

from . import compiled
from .dispatch import SELECTOR
from .dtypes import FLOAT_DTYPES
from .inputs import Inputs
from .problem import Problem

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


_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled


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


def run_forward(inp: Inputs, op: OpArg, needs_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Select the forward op for ``inp`` (and the backward op when autograd needs one) and run it.

    Returns out (B, Mq, Hq, Kv) in ``inp.out_dtype`` and lse float32 (B, Hq, Mq) (None unless ``needs_lse``
    or a backward op is attached). Example: ``out, _ = run_forward(make_inputs(q, k, v), None, False)``.
    """
    if _is_compiling():
        return compiled.run_forward(inp, op, needs_lse)
    sig = inp.signature()
    fw = SELECTOR.select(sig, lambda: make_problem(inp, needs_lse), "fw", op)
    if not sig.needs_grad or (fw.AUTOGRAD and inp.query.dtype in FLOAT_DTYPES):
        return fw.apply(inp, needs_lse)
    bw = SELECTOR.select(sig, lambda: make_problem(inp, needs_lse), "bw", op)
    return _Attention.apply(fw, bw, inp, inp.query, inp.key, inp.value)


class _Attention(torch.autograd.Function):
    """Autograd for a forward op without native autograd, paired with a backward op."""

    @staticmethod
    def forward(ctx, fw, bw, inp: Inputs, query, key, value):
        out, lse = fw.apply(inp, True)
        ctx.bw, ctx.inp = bw, inp
        ctx.save_for_backward(out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.bw.apply_bw(ctx.inp, out, lse, grad_out.contiguous())
        return None, None, None, dq, dk, dv
