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


def forward_measure(inp: Inputs, needs_lse: bool) -> Callable[[type], float | None]:
    """``measure(op)`` -> seconds per back-to-back forward call of ``op`` on ``inp`` (validated; no gradients), or
    None where it cannot be timed (a CUDA-graph capture) or the op raised (warned, naming the op and the error).

    Example
    -------
    >>> SELECTOR.select(sig, lambda: make_problem(inp, False), "fw", None, forward_measure(inp, False))  # doctest: +SKIP
    """
    device = inp.query.device.type

    def measure(op) -> float | None:
        if device == "cuda" and _capturing():
            return None
        try:
            with torch.no_grad():
                return call_seconds(lambda: op.apply(inp, needs_lse), device)
        except Exception as e:  # noqa: BLE001  (a supported op that fails here is reported, not chosen by time)
            warnings.warn(f"fmha_ops autotune: {op.NAME} raised while timed, so it is ranked by its estimate: "
                          f"{type(e).__name__}: {e}", stacklevel=2)
            return None
    return measure
