"""Autotune's measurement of a call: each op timed on the call's own inputs (``registry.select`` decides what to
time and keeps the seconds; ``timing.call_seconds`` times).

A measurement never runs where it would change what the caller asked for: under a CUDA-graph capture (the timed
calls would be captured) or a torch.compile trace (the callers pass no measurement there; the table decides).
Ops only read their inputs (a KV-cache call's append is made by the plan's run, after the selection), so timing
one leaves the caller's tensors as they were.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from .inputs import Inputs
from .timing import calls_seconds

_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)


def forward_measure(inp: Inputs, needs_lse: bool, route: str = "apply") -> Callable[[list], dict[str, float]]:
    """``measure(ops)`` -> {op name: seconds per back-to-back forward call on ``inp``} (validated; no gradients),
    the ops' rounds interleaved (``timing.calls_seconds``); {} where nothing can be timed (a CUDA-graph capture). An
    op that raises is left out, with a warning naming it and the error (the selector ranks it by its estimate).

    ``route``: how the caller's repeated calls will run an op, so that is what is timed: ``"apply"`` (the full
    path: ``op.apply``), ``"plan"`` (the launch plan of a repeated call, ``op.launcher``) or ``"decode"`` (a planned
    decode step, ``op.decode_launcher`` where the op has one). A plan skips host work ``apply`` redoes per call
    (for a Triton op ~50 us): timing ``apply`` would rank such ops behind ops without that work.

    Example
    -------
    >>> measure = forward_measure(inp, False, "plan")
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
                    fn = _repeated_call(op, inp, needs_lse, route)
                    fn()  # the first call compiles and raises what the op cannot do here
                except Exception as e:  # noqa: BLE001  (reported, and the op ranked by its estimate)
                    warnings.warn(f"fmha_ops autotune: {op.NAME} raised while timed, so it is ranked by its "
                                  f"estimate: {type(e).__name__}: {e}", stacklevel=2)
                    continue
                fns[op.NAME] = fn
            return calls_seconds(fns, device) if fns else {}
    return measure


def _repeated_call(op, inp: Inputs, needs_lse: bool, route: str) -> Callable[[], object]:
    """One repeated call of ``op`` on ``inp`` by ``route`` (see ``forward_measure``)."""
    if route == "plan":
        run = op.launcher(inp, needs_lse)
        args = (inp.query, inp.key, inp.value, inp.attn_bias, inp.q_descale, inp.k_descale, inp.v_descale)
        return lambda: run(*args)
    planner = getattr(op, "decode_launcher", None)
    if route == "decode" and planner is not None:
        from .ops.common import decode_views

        launch = planner(inp, needs_lse)
        q, k, v, seqlens, table, k_scale, v_scale = decode_views(inp)
        out = torch.empty(q.shape[:3] + (v.shape[3],), dtype=inp.out_dtype, device=q.device)
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device) \
            if needs_lse else None
        return lambda: launch(q, k, v, k_scale, v_scale, seqlens, table, out, lse)
    return lambda: op.apply(inp, needs_lse)
