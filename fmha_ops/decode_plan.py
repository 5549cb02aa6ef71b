"""Decode loops: ``plan_kvcache(...)`` once, ``PagedDecodePlan.run(q)`` per step.

``flash_attn_with_kvcache`` validates its arguments, builds the decode mask, looks the op up and sizes the split
workspace on every call. A decode loop calls it with the same shapes at every step, so the plan does all of that
once: ``plan_kvcache`` takes the arguments ``flash_attn_with_kvcache`` takes (without ``k`` / ``v``: append the new
tokens first, e.g. with ``kv_cache.append_to_cache`` or ``flash_attn_with_kvcache``), selects the op, its split
count and the tile configuration, and allocates the output and the split workspace. ``run(q)`` then only launches
the kernels. The lengths (``cache_seqlens``) and ``page_table`` tensors are the plan's: their values are read on the
GPU at every run (``cache_leftpad`` too, when planned with it), so a loop updates them in place
(``cache_seqlens += 1``), as a CUDA-graph replay would; ``run`` is capturable in a CUDA graph. Their values (and the
descales') are checked again at each run as the planning call checked them: host tensors always, device ones in
check mode (``fmha_ops.check_inputs``), so a value changed out of range raises the function's error. The caches may be
swapped per run (one plan for all layers of a model) for caches of the planned shape, dtype, strides and device.

Example
-------
>>> plan = fmha_ops.plan_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, page_table=table,
...                              k_descale=k_scale, v_descale=v_scale, causal=True)  # doctest: +SKIP
>>> for step in range(steps):  # doctest: +SKIP
...     out = plan.run(q)                       # (B, 1, Hq, D), the plan's buffer, rewritten by the next run
...     lengths += 1                            # after appending each sequence's new token
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from . import checks
from .inputs import make_inputs
from .kvcache_call import key_start_arg, kvcache_call, select_decode_op
from .validation import check_descale_values, validate_sinks

__all__ = ["PagedDecodePlan", "plan_kvcache"]


class PagedDecodePlan:
    """A planned ``flash_attn_with_kvcache`` call (``plan_kvcache`` builds it): ``run`` launches the selected op's
    kernels on new queries (and optionally other caches of the same layout).

    Attributes: ``op`` (the selected op class), ``out`` (B, Mq, Hq, Dv) and, with ``return_softmax_lse``, ``lse``
    float32 (B, Hq, Mq): the buffers ``run`` writes unless given others.
    """

    def __init__(self, op, launch, template, cache, descales, index, out, lse, return_lse: bool,
                 sinks: torch.Tensor | None = None, key_start: dict | None = None,
                 values: tuple[Callable, tuple, bool] | None = None) -> None:
        self.op, self.out, self.lse = op, out, lse if return_lse else None
        self._lse = lse  # written by every run (the kernels write an LSE), returned only when planned
        self._launch, self._return_lse = launch, return_lse
        self._cache, self._descales, self._index = cache, descales, index
        self._sinks = sinks
        self._key_start = key_start or {}  # the launcher's key-start keyword (``kvcache_call.key_start_arg``)
        # (``KVCacheCall.check_values``, the planned descales as given, whether the checked tensors are on the host)
        self._values = values
        q = template
        self._q_meta = (q.shape, q.dtype, q.device)
        self._cache_meta = tuple(_meta(t) for t in cache)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
            k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None, *,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
        """Attention of ``q`` (B, Mq, Hq, D), the planned shape, dtype and device, against the planned cache (or
        ``k_cache`` / ``v_cache`` with their ``k_descale`` / ``v_descale``, each of the planned shape, dtype,
        strides and device) at the lengths and page table the plan holds; with the planned sinks, or ``sinks``
        (float32 (Hq,) on q's device: another layer's) when the plan was made with sinks. Descales passed here are
        checked as ``flash_attn_with_kvcache`` checks them (finite, >= 0: host ones always, device ones in check
        mode, ``fmha_ops.check_inputs``). The plan's own index tensors (``cache_seqlens``, ``page_table`` /
        ``cache_batch_idx``, ``cache_leftpad``) and, unless others are passed, its descales are checked again as
        ``plan_kvcache`` checked them: host ones at every run, device ones in check mode (one host sync).

        Returns out (B, Mq, Hq, D) [, softmax_lse float32 (B, Hq, Mq) when planned with ``return_softmax_lse``]:
        ``out`` / ``lse`` when given (contiguous, of those shapes), else the plan's buffers, which the next run
        rewrites.

        Example
        -------
        >>> out = plan.run(q)  # doctest: +SKIP
        """
        if (q.shape, q.dtype, q.device) != self._q_meta or q.stride(-1) != 1:
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} on {q.device} (last stride {q.stride(-1)}) does not match "
                             f"the plan's {tuple(self._q_meta[0])} {self._q_meta[1]} on {self._q_meta[2]} (last dim "
                             f"contiguous); make a plan for it")
        k, v = self._cache if k_cache is None and v_cache is None else self._swapped(k_cache, v_cache)
        planned_descales = k_descale is None and v_descale is None
        if self._values is not None and (self._values[2] or checks.checks_enabled()):
            check_values, descales, _ = self._values
            check_values(*(descales if planned_descales else (None, None)))
        ks, vs = self._descales if planned_descales else self._swapped_descales(k_descale, v_descale)
        out = self.out if out is None else _check_out("out", out, self.out)
        lse_buf = self._lse if lse is None else _check_out("lse", lse, self.lse)
        if sinks is None and self._sinks is None:
            self._launch(q, k, v, ks, vs, *self._index, out, lse_buf, **self._key_start)
        else:
            self._launch(q, k, v, ks, vs, *self._index, out, lse_buf, sinks=self._swapped_sinks(sinks),
                         **self._key_start)
        return (out, lse_buf) if self._return_lse else out

    def _swapped_sinks(self, sinks):
        if sinks is None:
            return self._sinks
        if self._sinks is None:
            raise ValueError("sinks are given but the plan was made without them (plan_kvcache(..., sinks=...))")
        validate_sinks(sinks, self._sinks.shape[0], self._sinks.device)
        return sinks.detach().contiguous()

    def _swapped(self, k_cache, v_cache):
        for name, t, want in (("k_cache", k_cache, self._cache_meta[0]), ("v_cache", v_cache, self._cache_meta[1])):
            if not isinstance(t, torch.Tensor) or _meta(t) != want:
                got = _meta(t) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} {got} does not match the plan's cache (shape, dtype, strides, device) {want}; "
                                 f"pass both caches of the planned layout, or make a plan for these")
        return k_cache, v_cache

    def _swapped_descales(self, k_descale, v_descale):
        planned = self._descales
        if planned[0] is None:
            raise ValueError("k_descale / v_descale are for an fp8 cache; this plan's cache is not fp8")
        for name, d, want in (("k_descale", k_descale, planned[0]), ("v_descale", v_descale, planned[1])):
            if not isinstance(d, torch.Tensor) or d.dtype != torch.float32 or d.device != want.device:
                raise ValueError(f"{name} must be a float32 tensor on {want.device} like the planned one")
            if d.numel() == 1 and want.stride() == (0,) * want.ndim:
                continue
            if _meta(d) != _meta(want):
                raise ValueError(f"{name} {_meta(d)} does not match the plan's per-token descales {_meta(want)}")
        check_descale_values(("k_descale", k_descale), ("v_descale", v_descale))  # host ones; device in check mode
        return tuple(d.reshape(1, 1, 1).expand(w.shape) if d.numel() == 1 and w.stride() == (0,) * w.ndim else d
                     for d, w in zip((k_descale, v_descale), planned))


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.stride(), t.device


def _check_out(name: str, t, want: torch.Tensor | None) -> torch.Tensor:
    if want is None:
        raise ValueError(f"{name} is given but the plan returns no {name} (plan with return_softmax_lse=True)")
    if (not isinstance(t, torch.Tensor) or t.shape != want.shape or t.dtype != want.dtype or t.device != want.device
            or not t.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous {want.dtype} tensor of shape {tuple(want.shape)} on "
                         f"{want.device}")
    return t


def plan_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                 cache_seqlens: torch.Tensor | int, page_table: torch.Tensor | None = None,
                 cache_batch_idx: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                 v_descale: torch.Tensor | None = None, softmax_scale: float | None = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 return_softmax_lse: bool = False, sinks: torch.Tensor | None = None,
                 cache_leftpad: torch.Tensor | None = None) -> PagedDecodePlan:
    """Plan ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., ...)`` for repeated calls.

    Arguments as ``flash_attn_with_kvcache`` takes them (``q`` fixes the query's shape, dtype and device; its
    values are not kept), without appended ``k`` / ``v``. ``cache_seqlens`` int32 (B,) on q's device and
    ``page_table`` int32 (B, max_pages) / ``cache_batch_idx`` are kept by the plan: update their values in place
    between runs (an int ``cache_seqlens`` plans fixed lengths: every sequence holds that many tokens). Validates once (raising as
    ``flash_attn_with_kvcache`` would), selects the op once (``PagedDecodePlan.op``) and allocates the output (and
    for split-K decoders the split workspace) once. ``sinks``: float32 (Hq,) attention sinks (``fmha_ops.sinks``),
    kept by the plan (their values read at every run; ``run(q, sinks=...)`` passes another layer's).
    ``cache_leftpad``: int32 (B,) on q's device, each sequence's first key (``flash_attn_with_kvcache``'s), kept by the
    plan like ``cache_seqlens``.

    Returns
    -------
    PagedDecodePlan
        ``run(q)`` per step: out (B, Mq, Hq, D) [, lse (B, Hq, Mq)].

    Example
    -------
    >>> plan = plan_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, page_table=table, causal=True)  # doctest: +SKIP
    >>> out = plan.run(q)  # doctest: +SKIP
    """
    call = kvcache_call(q, k_cache, v_cache, None, None, cache_seqlens, cache_batch_idx, page_table, None,
                        k_descale, v_descale, softmax_scale, causal, window_size, cache_leftpad=cache_leftpad)
    inp = make_inputs(call.query, call.key, call.value, call.bias, scale=softmax_scale, k_descale=call.k_descale,
                      v_descale=call.v_descale, softcap=softcap, is_partial=return_softmax_lse, sinks=sinks)
    op = select_decode_op(inp, return_softmax_lse, lambda op: _timed_launch(op, inp, return_softmax_lse))
    batch, mq, hq, _ = q.shape
    out = torch.empty(q.shape[:3] + (v_cache.shape[3],), dtype=inp.out_dtype, device=q.device)
    lse = torch.empty((batch, hq, mq), dtype=torch.float32, device=q.device)
    planner = getattr(op, "decode_launcher", None)
    if planner is not None:  # the caches pass to the kernels as they are: (pages, page_size, Hkv, D) / (B, L, ...)
        from .ops.common import decode_views

        launch = planner(inp, return_softmax_lse)
        views = decode_views(inp)
        index, descales = views[3:5], views[5:]  # lengths and block table; descales per token or broadcast (views)
        key_start = key_start_arg(call.bias.key_start)
    else:  # the call's mask holds the lengths, table and key starts
        launch = _apply_launcher(op, inp, batch, mq, return_softmax_lse)
        index, descales, key_start = (None, None), (call.k_descale, call.v_descale), {}
    host = q.device.type == "cpu"  # the index tensors and descales are on q's device (validated)
    return PagedDecodePlan(op, launch, q, (k_cache, v_cache), descales, index, out, lse, return_softmax_lse,
                           None if sinks is None else sinks.detach().contiguous(), key_start,
                           (call.check_values, (call.k_descale, call.v_descale), host))


def _timed_launch(op, inp, return_lse: bool):
    """What autotune times of ``op`` for a plan: its decode launcher on the call's own views and buffers of the
    planned shapes, as a call without arguments (None where the op has no decode launcher: its ``apply``)."""
    planner = getattr(op, "decode_launcher", None)
    if planner is None:
        return None
    from .ops.common import decode_views

    launch = planner(inp, return_lse)
    q, k, v, seqlens, table, k_scale, v_scale = decode_views(inp)
    out = torch.empty(q.shape[:3] + (v.shape[3],), dtype=inp.out_dtype, device=q.device)
    lse = None if not return_lse else torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32,
                                                   device=q.device)
    starts = key_start_arg(inp.attn_bias.key_start)
    return lambda: launch(q, k, v, k_scale, v_scale, seqlens, table, out, lse, **starts)


def _apply_launcher(op, inp, batch: int, mq: int, needs_lse: bool):
    """``launch(q, k_cache, v_cache, k_scale, v_scale, seqlens, table, out, lse)`` through ``op.apply`` on the
    planned call with these tensors, its own mask's lengths and table (ops without a decode launcher of their own,
    e.g. the reference op on a CPU)."""
    def launch(q, k_cache, v_cache, k_scale, v_scale, _seqlens, _table, out, lse, sinks=None):
        pool = (1, k_cache.shape[0] * k_cache.shape[1])
        call = replace(inp, query=q.reshape(1, batch * mq, *q.shape[2:]), key=k_cache.reshape(pool + k_cache.shape[2:]),
                       value=v_cache.reshape(pool + v_cache.shape[2:]), k_descale=k_scale, v_descale=v_scale,
                       sinks=inp.sinks if sinks is None else sinks)
        o, lse_packed = op.apply(call, needs_lse)
        out.copy_(o.view(out.shape))
        if lse is not None and lse_packed is not None:
            lse.copy_(lse_packed.view(lse_packed.shape[1], batch, mq).permute(1, 0, 2))
    return launch
