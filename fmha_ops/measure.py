"""Autotune's measurement of a call: each op timed on the call's own inputs (``registry.select`` decides what to
time and keeps the seconds; ``timing.call_seconds`` times).

A measurement never runs where it would change what the caller asked for: under a CUDA-graph capture (the timed
calls would be captured) or a torch.compile trace (the callers pass no measurement there; the table decides).
Ops only read their inputs (a KV-cache call's append is made by the plan's run, after the selection), so timing
one leaves the caller's tensors as they were.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from .timing import calls_seconds

Inputs = Any  # an fmha_ops.inputs.Inputs: measured through the ops, which read it (this module sits below it)

_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)


def forward_measure(inp: Inputs, needs_lse: bool,
                    repeated: Callable[[type], Callable[[], object] | None] | None = None
                    ) -> Callable[[list], dict[str, float]]:
    """``measure(ops)`` -> {op name: seconds per back-to-back forward call on ``inp``} (validated; no gradients),
    the ops' rounds interleaved (``timing.calls_seconds``); {} where nothing can be timed (a CUDA-graph capture). An
    op that raises is left out, with a warning naming it and the error (the selector ranks it by its estimate).

    ``repeated(op)``: the caller's repeated call of ``op`` on these inputs, as a call without arguments (None, or no
    ``repeated``: ``op.apply``), so that what is timed is what repeated calls will run: a launch plan
    (``call.py``) or a decode plan (``kvcache_call.py``, ``decode_plan.py``) skips host work ``apply`` redoes per
    call (for a Triton op ~50 us), and timing ``apply`` would rank such ops behind ops without that work.

    Example
    -------
    >>> measure = forward_measure(inp, False, lambda op: functools.partial(op.apply, inp, False))
    >>> SELECTOR.select(sig, lambda: make_problem(inp, False), "fw", None, measure)  # doctest: +SKIP
    """
    device = inp.query.device.type

    def measure(ops) -> dict[str, float]:
        if device == "cuda" and _capturing():
            return {}
        with torch.no_grad():
            fns = {}
            for op in ops:
                try:
                    fn = (None if repeated is None else repeated(op)) or (lambda op=op: op.apply(inp, needs_lse))
                    fn()  # the first call compiles and raises what the op cannot do here
                except Exception as e:  # noqa: BLE001  (reported, and the op ranked by its estimate)
                    warnings.warn(f"fmha_ops autotune: {op.NAME} raised while timed, so it is ranked by its "
                                  f"estimate: {type(e).__name__}: {e}", stacklevel=2)
                    continue
                fns[op.NAME] = fn
            return calls_seconds(fns, device) if fns else {}
    return measure
