"""``Plan``: what a repeated call of one signature runs (the plan cache, ``fmha_ops.plans``, keeps them by key).

A leaf: a plan holds its run (the launch with everything but the per-call tensors bound), the ops it was built
from and the names of the work a hit skips; it imports nothing of the package, so any layer that builds a plan
(an entry point, the call layer, a traced call) stands above it.

Example
-------
>>> plan = Plan(lambda q, k, v: (q, None), ops=(), skips=("validation",))
>>> plan.run(1, 2, 3)
(1, None)
"""
from __future__ import annotations

from typing import Callable


def _checked_when_made(call) -> None:
    """A plan made from its call checks nothing more when it runs: the call was checked when the plan was made."""


class Plan:
    """What a repeated call of one signature runs: ``run(*args)`` (the entry point says which arguments it passes:
    the tensors whose values change between calls) launches the selected op(s) with everything else bound.

    ``ops``: the selected op classes (forward[, backward]; empty where the entry point chooses none, e.g. a merge).
    ``skips``: what a hit does not redo (names, for readers and tests), e.g. ``("validation", "selection")``;
    what reads tensor values is never among them. ``bound``: the constants ``run`` is bound to where a caller
    reads them (a traced call's ``compiled.CallSpec``), else None. ``check(call)``: what ``run`` checks of a call,
    for a caller with work of its own on the call before the run (an append); it raises as ``run`` would: nothing
    for a plan made from its call (checked when it was made), a traced plan's validation and selection.
    """

    __slots__ = ("run", "ops", "skips", "bound", "check", "used")

    def __init__(self, run: Callable, ops: tuple = (), skips: tuple = ("validation", "selection"),
                 bound: object = None, check: Callable = _checked_when_made) -> None:
        self.run, self.ops, self.skips, self.bound, self.check = run, ops, skips, bound, check
        self.used = False  # looked up since the cache last considered dropping it (``PlanCache``)

    def __repr__(self) -> str:
        return f"Plan(ops={[op.NAME for op in self.ops]}, skips={self.skips})"


def on_packed(batched: Callable) -> Callable:
    """A run on packed varlen tensors (total, H, D) made from ``batched``, a forward run on their batch-1 views:
    ``run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks=None) -> (out (total, Hq, Kv),
    lse (Hq, total_q) or None)``.

    Example
    -------
    >>> run = on_packed(plan.run)  # doctest: +SKIP
    >>> out, lse = run(q, k, v, mask, None, None, None)  # doctest: +SKIP
    """
    def run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks=None):
        out, lse = batched(query[None], key[None], value[None], attn_bias, q_descale, k_descale, v_descale, sinks)
        return out[0], (None if lse is None else lse[0])
    return run
