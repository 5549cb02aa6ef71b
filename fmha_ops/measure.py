"""Autotune's measurement of a call: each op timed on the call's own inputs (``registry.select`` decides what to
time and keeps the seconds; ``timing.call_seconds`` times).

A measurement never runs where it would change what the caller asked for: under a CUDA-graph capture (the timed
calls would be captured) or a torch.compile trace (the callers pass no measurement there; the table decides).
Ops only read their inputs (a KV append runs before the decode op is selected), so timing one leaves the caller's
tensors as they were.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from .inputs import Inputs
from .timing import call_seconds

_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)


def forward_measure(inp: Inputs, needs_lse: bool, route: str = "apply") -> Callable[[type], float | None]:
    """``measure(op)`` -> seconds per back-to-back forward call of ``op`` on ``inp`` (validated; no gradients), or
    None where it cannot be timed (a CUDA-graph capture) or the op raised (warned, naming the op and the error).

    ``route``: how the caller's repeated calls will run the op, so that is what is timed: ``"apply"`` (the full
    path: ``op.apply``), ``"plan"`` (the launch plan of a repeated call, ``op.launcher``) or ``"decode"`` (a planned
    decode step, ``op.decode_launcher`` where the op has one). A plan skips host work ``apply`` redoes per call
    (for a Triton op ~50 us): timing ``apply`` would rank such ops behind ops without that work.

    Example
    -------
    >>> measure = forward_measure(inp, False, "plan")
    >>> SELECTOR.select(sig, lambda: make_problem(inp, False), "fw", None, measure)  # doctest: +SKIP
    """
    device = inp.query.device.type

    def measure(op) -> float | None:
        if device == "cuda" and _capturing():
            return None
        try:
            with torch.no_grad():
                return call_seconds(_repeated_call(op, inp, needs_lse, route), device)
        except Exception as e:  # noqa: BLE001  (a supported op that fails here is reported, not chosen by time)
            warnings.warn(f"fmha_ops autotune: {op.NAME} raised while timed, so it is ranked by its estimate: "
                          f"{type(e).__name__}: {e}", stacklevel=2)
            return None
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
