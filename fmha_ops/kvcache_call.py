"""``flash_attn_with_kvcache``'s plans: its checks, the append, the decode mask, and the plan a call runs.

``plan_kvcache_call`` is the whole miss path of ``flash_attn_with_kvcache``: it validates the arguments
(``kvcache_call``: ValueError / TypeError / NotImplementedError naming them, the append not yet made; the sinks with
the op path's ``Inputs``, when the op is selected) and returns the ``Plan`` the entry point runs, its op(s) selected
once, when the plan is made (``call.forward_plan``; under torch.compile where the trace checks the plan, before any
append, or runs it). Where a repeated call of the same key may skip the checks (paged, device index tensors outside
check mode, no autograd, contiguous sinks if any) that is the decode plan,
stored in the plan cache (``fmha_ops.plans``): the append kernel and the selected op's decode launcher on the call's
own index tensors (their values are read on the device, where the kernels guard them). Any other call gets a plan of
its own, not stored (its checks read values): the append, then the selected op(s) run by the forward plan (the op's
``apply``, the forward and backward pair under autograd, or the traced op under torch.compile).
``fmha_ops.decode_plan`` plans a decode loop on the same checks (``kvcache_call``) and its op with
``select_decode_op``.

Example
-------
>>> plan = plan_kvcache_call(key, q, k_cache, v_cache, None, None, lengths, None, table, None, None, None, None,
...                          True, (-1, -1), 0.0, False)  # doctest: +SKIP
>>> out = plan.run(q, k_cache, v_cache, None, None, lengths, table, None, None, None, None)  # doctest: +SKIP
"""
from __future__ import annotations

import functools
import os
from dataclasses import replace
from typing import Callable, NamedTuple

import torch

from . import arguments, checks, kv_cache
from . import attn_bias as ab
from .call import forward_plan
from .dispatch import SELECTOR
from .inputs import Inputs
from .plan import Plan
from .plans import PLANS
from .timing import autotune_seconds
from .validation import check_descale_values, make_problem

#: the append kernel runs on CPU tensors through Triton's interpreter
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def plan_kvcache_call(key, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, q_descale,
                      k_descale, v_descale, softmax_scale, causal, window_size, softcap, return_lse: bool,
                      sinks=None, cache_leftpad=None) -> Plan:
    """The plan of ``flash_attn_with_kvcache``'s call (its arguments as it takes them, ``key`` its call's plan key):
    ``run(q, k_cache, v_cache, k, v, cache_seqlens, page_table, k_descale, v_descale, sinks, cache_leftpad)``
    returns what the entry point returns. Validates the arguments first (raising as ``flash_attn_with_kvcache``
    documents; ``sinks`` by the selection's validation, on its memo miss, as every ``Inputs`` field: the signature
    holds all that ``validation.validate_sinks`` reads), then selects the op(s) once (``call.forward_plan``; under
    autotune timed as the plan will run them). Nothing is appended before the plan is made. A call whose repeated
    calls may skip the checks (``_plannable``) and whose op has a decode launcher gets the decode plan of its
    layout, stored under ``key``; any other call a plan of its own (the append, then the selected op(s)' run), not
    stored, as its values (host descales and index tables; all of them in check mode) are checked by
    ``kvcache_call`` before its run appends."""
    call = kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, q_descale, k_descale,
                        v_descale, softmax_scale, causal, window_size, cache_leftpad)
    inp = _decode_inputs(call, softmax_scale, softcap, return_lse, sinks)
    decodes = key is not None and _plannable(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                                             sinks, cache_leftpad)

    def decoded(op, new_tokens=None):  # op's decode run for calls laid out like this one (None: it has none)
        return decode_run(op, call, inp, q, v_cache, return_lse, new_tokens) if decodes else None

    def timed(op):  # what autotune times of a contender: its decode run on this call's tensors, nothing appended
        return _timed_decode(decoded(op), call, q, k_cache, v_cache, sinks)

    forward = forward_plan(inp, None, return_lse, timed)
    decode = decoded(forward.ops[0], k) if decodes else None  # (a traced plan, made without a key, has no ops)
    if decode is not None:
        return PLANS.put(key, Plan(decode, forward.ops, ("validation", "selection", "mask")))
    batch, mq, hq = q.shape[:3]

    def run(q, k_cache, v_cache, *_):  # this call's own: the append, then the selected op(s) on the caches as appended
        appended = inp
        if call.append is not None:  # pool views taken again after the append (a cache without a view was copied)
            forward.check(inp)  # a traced plan's checks: nothing is appended to a call they reject
            call.append()
            appended = replace(inp, key=_pool(k_cache), value=_pool(v_cache))
        out, lse = forward.run(appended)
        out = out.view(batch, mq, hq, out.shape[3])
        return (out, lse.view(hq, batch, mq).permute(1, 0, 2)) if return_lse else out
    return Plan(run, forward.ops, ())


def _decode_inputs(call: "KVCacheCall", softmax_scale, softcap, return_lse: bool, sinks=None) -> Inputs:
    """The op path's ``Inputs`` of a validated call (``kvcache_call``, which checked the values of its descales and
    index tables too): BMHK, our own paged mask, descales checked, so there is nothing for ``make_inputs`` to
    convert or check."""
    return Inputs(call.query, call.key, call.value, call.bias, scale=softmax_scale, is_partial=return_lse,
                  k_descale=call.k_descale, v_descale=call.v_descale, softcap=softcap, sinks=sinks)


def select_decode_op(inp: Inputs, return_lse: bool, repeated: Callable):
    """The forward op of a decode loop's plan (``fmha_ops.decode_plan``; the selector's memo, on a miss validation
    and the ``Problem``), timed under autotune as its runs run (``timing.autotune_seconds``): ``repeated(op)``, the
    plan's run of ``op`` as a call without arguments (None where ``op`` has none: its ``apply``)."""
    return SELECTOR.select(inp.signature(return_lse), lambda: make_problem(inp, return_lse), "fw", None,
                           lambda ops: autotune_seconds(
                               ops, lambda op: repeated(op) or functools.partial(op.apply, inp, return_lse),
                               inp.query.device.type))


def _timed_decode(run: Callable | None, call: "KVCacheCall", q, k_cache, v_cache, sinks) -> Callable | None:
    """What autotune times of a contender for a decode plan: its ``run`` (``decode_run``, without new tokens; None
    where the op has none) on the call's tensors at the mask's lengths and page table (the appended tokens counted,
    nothing appended: a timed call leaves the cache as it was) with the call's ``sinks``, as a call without
    arguments."""
    if run is None:
        return None
    lengths, table = call.bias.k_seqinfo.seqlen, call.bias.block_tables
    return functools.partial(run, q, k_cache, v_cache, None, None, lengths, table, call.k_descale, call.v_descale,
                             sinks, call.bias.key_start)


def _plannable(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, sinks,
               cache_leftpad=None) -> bool:
    """Whether repeated calls like this one may run a decode plan: paged, device index tensors outside check mode
    (host ones are read back on every call), no autograd, index strides the kernels read as they lie, sinks (if
    any) contiguous as the kernels read them, and an append (if any) the append kernel can do (on a GPU, or through
    Triton's interpreter)."""
    if cache_batch_idx is not None or type(cache_seqlens) is not torch.Tensor or type(page_table) is not torch.Tensor:
        return False
    if sinks is not None and not (isinstance(sinks, torch.Tensor) and sinks.is_contiguous()):
        return False
    starts = () if cache_leftpad is None else (cache_leftpad,)
    if checks.wanted(cache_seqlens, page_table, *starts):  # on q's device (validated): a host q has host indices
        return False
    if not all(_unit_stride(t, 0) for t in starts):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        return False
    if k is not None and not (type(k) is torch.Tensor and type(v) is torch.Tensor and (q.is_cuda or _INTERPRET)):
        return False
    return _unit_stride(cache_seqlens, 0) and _unit_stride(page_table, 1)


def decode_run(op, call: "KVCacheCall", inp, q, v_cache, return_lse: bool, new_tokens: torch.Tensor | None = None):
    """``run(q, k_cache, v_cache, k, v, cache_seqlens, page_table, k_descale, v_descale, sinks, cache_leftpad)`` ->
    what ``flash_attn_with_kvcache`` returns, by ``op``'s ``decode_launcher`` for calls laid out like ``call`` / ``inp``
    (validated, ``op`` selected for them); None when the op has no such launcher. With ``new_tokens`` (the first
    call's ``k``) each run first appends ``k`` / ``v`` at ``cache_seqlens`` (the append kernel) and attends at
    ``cache_seqlens`` + their count (added on the device). Per run: the output (``torch.empty_like(q)`` where it has
    q's shape and dtype) and, only when returned, the LSE are allocated, and the kernels launch."""
    planner = getattr(op, "decode_launcher", None)
    if planner is None:
        return None
    launch = planner(inp, return_lse, own_workspace=False)
    per_tensor = call.k_descale is not None and tuple(call.k_descale.shape) != tuple(v_cache.shape[:3])  # numel 1
    batch, mq, hq, _ = q.shape
    out_shape, out_dtype, device = q.shape[:3] + (v_cache.shape[3],), inp.out_dtype, q.device
    like_q = out_shape == q.shape and out_dtype == q.dtype and q.is_contiguous()
    empty_like = torch.empty_like
    offset = 0 if new_tokens is None else new_tokens.shape[1]
    appender = None  # the append's bound launch, made at the first run (``KVAppender``)

    def kv_append(k, v, k_cache, v_cache, cache_seqlens, page_table, k_descale, v_descale):
        nonlocal appender
        if appender is None:
            from .kernels.triton.kv_append import KVAppender

            appender = KVAppender(k, v, k_cache, v_cache, block_table=page_table, k_scale=k_descale,
                                  v_scale=v_descale, bound=True)
        appender(k, v, k_cache, v_cache, cache_seqlens, page_table, k_descale, v_descale)

    if like_q and not per_tensor and not return_lse and new_tokens is None and call.bias.key_start is None:
        # the common decode step: one launch (the key holds cache_leftpad None, so no call of this plan passes one)
        def run(q, k_cache, v_cache, k, v, cache_seqlens, page_table, k_descale, v_descale, sinks, cache_leftpad):
            out = empty_like(q)
            launch(q, k_cache, v_cache, k_descale, v_descale, cache_seqlens, page_table, out, None, 0, sinks)
            return out
        return run

    def run(q, k_cache, v_cache, k, v, cache_seqlens, page_table, k_descale, v_descale, sinks, cache_leftpad):
        if new_tokens is not None:
            kv_append(k, v, k_cache, v_cache, cache_seqlens, page_table, k_descale, v_descale)
        if per_tensor:
            k_descale = k_descale.reshape(1, 1, 1).expand(k_cache.shape[:3])
            v_descale = v_descale.reshape(1, 1, 1).expand(v_cache.shape[:3])
        out = empty_like(q) if like_q else torch.empty(out_shape, dtype=out_dtype, device=device)
        lse = torch.empty((batch, hq, mq), dtype=torch.float32, device=device) if return_lse else None
        launch(q, k_cache, v_cache, k_descale, v_descale, cache_seqlens, page_table, out, lse, offset, sinks,
               **key_start_arg(cache_leftpad))
        return (out, lse) if return_lse else out
    return run


def key_start_arg(key_start: torch.Tensor | None) -> dict:
    """The keyword a decode launcher takes the key starts by: only an op declaring ``KEY_START`` is selected for
    calls with them, so launchers of other ops are never passed one."""
    return {} if key_start is None else {"key_start": key_start}


def _unit_stride(t, dim: int) -> bool:
    """Whether the kernels can read ``t``'s entries along ``dim`` as consecutive ints (they index a length or a
    page-table row by its position)."""
    return t.ndim <= dim or t.shape[dim] <= 1 or t.stride(dim) == 1



class KVCacheCall(NamedTuple):
    """``flash_attn_with_kvcache``'s call as the op path takes it: query (1, B * Mq, Hq, D), key / value the cache
    pool (1, pages * page_size, Hkv, D) (views), the paged decode mask (its lengths count the appended tokens),
    per-token (or per-tensor) descales, ``append()``, which writes the call's new tokens into the cache (None
    when it appends none): the mask's keys are there only once it has run, and ``check_values(k_descale,
    v_descale)``, which checks the values of the call's index tensors (as given, after any contiguous copy) and of
    the given descales again as the validation did (host ones always, device ones in check mode), for a plan whose
    runs read them after the user may have changed them (``fmha_ops.decode_plan``)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    bias: ab.AttentionBias
    k_descale: torch.Tensor | None
    v_descale: torch.Tensor | None
    append: Callable[[], None] | None
    check_values: Callable[[torch.Tensor | None, torch.Tensor | None], None]


def kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, q_descale, k_descale,
                 v_descale, softmax_scale, causal, window_size, cache_leftpad=None) -> KVCacheCall:
    """Validate ``flash_attn_with_kvcache``'s arguments (ValueError / TypeError / NotImplementedError naming them)
    and return the call for the op path, its append (of ``k`` / ``v`` when given) not yet made (``KVCacheCall``).
    The values of host index tensors and descales are checked too (device ones in check mode: ``fmha_ops.checks``).
    ``sinks`` are not an argument here: the op path's ``Inputs`` carry them, and ``validation.validate`` checks them
    on the selection's memo miss, with the call's other fields. ``cache_leftpad`` int32 (B,) on q's device, or None:
    each sequence's first key, the mask's ``key_start``."""
    left, right = arguments.window(window_size, causal)
    if not causal and (left, right) != (-1, -1):
        raise NotImplementedError(f"window_size={tuple(window_size)} with causal=False is not implemented by "
                                  f"flash_attn_with_kvcache (causal=True windows are)")
    if q_descale is not None:
        raise NotImplementedError("q_descale is not implemented for flash_attn_with_kvcache (pass a bf16/fp16 q)")
    _check_cache_tensors(q, k_cache, v_cache, k, v)
    arguments.scale_and_causal(softmax_scale, causal)
    batch, mq = q.shape[:2]
    page = k_cache.shape[1]
    mnew = 0 if k is None else k.shape[1]
    paged = page_table is not None
    if paged:
        _check_tensor("page_table", page_table, (batch, None), (torch.int32,), q.device)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is for dense caches; with page_table, reorder the page table instead")
        capacity = page_table.shape[1] * page
    else:
        if cache_batch_idx is None:
            if k_cache.shape[0] != batch:
                raise ValueError(f"k_cache has {k_cache.shape[0]} sequences but q has {batch}; pass cache_batch_idx")
            page_table = torch.arange(batch, dtype=torch.int32, device=q.device)[:, None]  # row b is page b
        else:
            _check_tensor("cache_batch_idx", cache_batch_idx, (batch,), (torch.int32, torch.int64), q.device)
            page_table = cache_batch_idx.to(torch.int32)[:, None]
        capacity = page
    cache_seqlens = _cache_seqlens(cache_seqlens, q, capacity - mnew)
    if not _unit_stride(cache_seqlens, 0):  # the kernels read lengths and page-table rows as consecutive ints
        cache_seqlens = cache_seqlens.contiguous()
    if paged and not _unit_stride(page_table, 1):
        page_table = page_table.contiguous()
    if cache_leftpad is not None:
        _check_tensor("cache_leftpad", cache_leftpad, (batch,), (torch.int32,), q.device)
        if not _unit_stride(cache_leftpad, 0):
            cache_leftpad = cache_leftpad.contiguous()
    _validate_indices(cache_seqlens, cache_batch_idx, page_table if paged else None, capacity, mnew, k_cache,
                      cache_leftpad)
    kd, vd = _cache_descales(k_cache, k_descale, v_descale, q.device)
    if k is not None:
        if kd is not None and kd.shape != k_cache.shape[:3]:
            raise NotImplementedError("appending k/v to an fp8 cache needs per-token k_descale/v_descale (shaped "
                                      f"like the cache without D, {tuple(k_cache.shape[:3])}) to hold the new "
                                      f"tokens' scales; got shape {tuple(kd.shape)}")
        if k_cache.is_cuda or _INTERPRET:
            from .kernels.triton.kv_append import kv_append as append_kernel
        else:
            append_kernel = kv_cache.append_to_cache
        append = functools.partial(append_kernel, k, v, k_cache, v_cache, cache_seqlens, block_table=page_table,
                                   k_scale=kd, v_scale=vd)
        seqlens = cache_seqlens + mnew
    else:
        append, seqlens = None, cache_seqlens
    if left >= 0:
        bias = ab.PagedBlockDiagonalCausalLocalPaddedKeysMask.from_device_seqlens(mq, seqlens, page_table, page,
                                                                                 left + 1, key_start=cache_leftpad)
    elif causal:
        bias = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_device_seqlens(mq, seqlens, page_table, page,
                                                                                      key_start=cache_leftpad)
    else:
        bias = ab.PagedBlockDiagonalPaddedKeysMask.from_device_seqlens(mq, seqlens, page_table, page,
                                                                       key_start=cache_leftpad)
    check_descale_values(("k_descale", kd), ("v_descale", vd))
    # per-token descales pass in the cache's own (num_pages, page_size, Hkv) layout: no copy, any strides
    check_values = functools.partial(_check_values, (cache_seqlens, cache_batch_idx, page_table if paged else None,
                                                     capacity, mnew, k_cache, cache_leftpad))
    return KVCacheCall(q.reshape(1, batch * mq, *q.shape[2:]), _pool(k_cache), _pool(v_cache), bias, kd, vd, append,
                       check_values)


def _check_values(indices: tuple, k_descale: torch.Tensor | None, v_descale: torch.Tensor | None) -> None:
    """``KVCacheCall.check_values``: ``_validate_indices(*indices)``, then the descales' values."""
    _validate_indices(*indices)
    check_descale_values(("k_descale", k_descale), ("v_descale", v_descale))


def _pool(cache: torch.Tensor) -> torch.Tensor:
    """A (pages, page_size, Hkv, D) or (B, L, Hkv, D) cache as one sequence (1, pages * page_size, Hkv, D): a view,
    or a copy where its strides allow none (taken after the append, so that it holds the new tokens)."""
    return cache.reshape((1, cache.shape[0] * cache.shape[1]) + cache.shape[2:])


def _check_cache_tensors(q, k_cache, v_cache, k, v) -> None:
    """Shapes and dtypes of q, the caches and the appended k/v (host metadata only)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is None and name in ("k", "v"):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be 4-D (batch/pages, seqlen/page_size, "
                             f"heads, headdim)")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree in "
                         f"(pages, slots, heads)")
    if k_cache.shape[1] == 0:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)}: a page (or dense sequence) needs >= 1 slot")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if q.shape[3] != k_cache.shape[3]:
        raise ValueError(f"q head dim {q.shape[3]} != k_cache head dim {k_cache.shape[3]} (q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)})")
    if k_cache.shape[2] == 0 or q.shape[2] % k_cache.shape[2]:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of k_cache heads ({k_cache.shape[2]}) (GQA/MQA)")
    if (k is None) != (v is None):
        raise ValueError(f"k and v are appended together; got k={'None' if k is None else 'a tensor'}, "
                         f"v={'None' if v is None else 'a tensor'}")
    if k is None:
        return
    want_k = (q.shape[0], k.shape[1], k_cache.shape[2], k_cache.shape[3])
    want_v = (q.shape[0], k.shape[1], v_cache.shape[2], v_cache.shape[3])
    if tuple(k.shape) != want_k:
        raise ValueError(f"k has shape {tuple(k.shape)}; appended keys must be (batch={q.shape[0]}, Mnew, "
                         f"k_cache heads={k_cache.shape[2]}, k_cache head dim={k_cache.shape[3]}), i.e. {want_k}")
    if tuple(v.shape) != want_v:
        raise ValueError(f"v has shape {tuple(v.shape)}; appended values must be (batch={q.shape[0]}, Mnew, "
                         f"v_cache heads={v_cache.shape[2]}, v_cache head dim={v_cache.shape[3]}), i.e. {want_v}")
    floats = (torch.float16, torch.bfloat16, torch.float32)
    if k.dtype not in floats or v.dtype != k.dtype:
        raise ValueError(f"k and v must share a float16/bfloat16/float32 dtype (quantized into an fp8 cache); "
                         f"got {k.dtype} and {v.dtype}")


def _cache_seqlens(cache_seqlens, q: torch.Tensor, most: int) -> torch.Tensor:
    """``cache_seqlens`` as an int32 (batch,) tensor; an int must lie in [0, ``most``]."""
    batch = q.shape[0]
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required (int32 (batch,) or an int)")
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= most:
            raise ValueError(f"cache_seqlens={cache_seqlens} is outside [0, {most}]: the cache's capacity less the "
                             f"appended tokens")
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor of shape ({batch},), got "
                        f"{type(cache_seqlens).__name__}")
    _check_tensor("cache_seqlens", cache_seqlens, (batch,), (torch.int32,), q.device)
    return cache_seqlens


def _check_tensor(name: str, t, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    """``t`` is a tensor of ``shape`` (None: any size there), one of ``dtypes``, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.ndim != len(shape) or any(n is not None and n != m for n, m in zip(shape, t.shape)):
        sizes = ["any" if n is None else str(n) for n in shape]
        want = f"({sizes[0]},)" if len(sizes) == 1 else "(" + ", ".join(sizes) + ")"
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {' or '.join(map(str, dtypes))}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _validate_indices(cache_seqlens, cache_batch_idx, page_table, capacity: int, mnew: int, k_cache,
                      cache_leftpad=None) -> None:
    """Host checks of the index tensors (always on the CPU, with ``fmha_ops.checks`` enabled on a GPU)."""
    tensors = [t for t in (cache_seqlens, cache_batch_idx, page_table, cache_leftpad) if t is not None]
    if not checks.wanted(*tensors):
        return
    lens = [checks.IndexCheck("cache_seqlens", cache_seqlens, 0, capacity - mnew,
                              f"the cache holds {capacity} keys per sequence"
                              + (f" and {mnew} new tokens are appended" if mnew else ""))]
    if cache_batch_idx is not None:
        lens.append(checks.IndexCheck("cache_batch_idx", cache_batch_idx, 0, k_cache.shape[0] - 1,
                                      f"k_cache holds {k_cache.shape[0]} sequences"))
    if page_table is not None:
        lens.append(checks.page_table_check("page_table", page_table, cache_seqlens + mnew, k_cache.shape[1],
                                            k_cache.shape[0], "k_cache"))
    if cache_leftpad is not None:
        lens.append(checks.StartCheck("cache_leftpad", cache_leftpad, cache_seqlens, "cache_seqlens"))
    checks.validate_indices(*lens)


def _cache_descales(k_cache, k_descale, v_descale, device):
    """(k_descale, v_descale) for an fp8 cache: per token (shaped like the cache without D) or per tensor;
    None for a bf16/fp16 cache. Raises naming the argument otherwise."""
    if k_cache.element_size() != 1:
        if k_descale is not None or v_descale is not None:
            raise ValueError(f"k_descale/v_descale are for an fp8 cache; k_cache is {k_cache.dtype}")
        return None, None
    token = tuple(k_cache.shape[:3])
    for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
        if d is None:
            raise ValueError(f"{name} is required with a {k_cache.dtype} cache: float32 per token {token} "
                             f"(kv_cache.build_fp8_paged_cache) or per tensor (numel 1)")
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{name} must be a float32 tensor, got {type(d).__name__}")
        if d.dtype != torch.float32 or d.device != device:
            raise ValueError(f"{name} must be float32 on {device}, got {d.dtype} on {d.device}")
        if tuple(d.shape) != token and d.numel() != 1:
            raise ValueError(f"{name} has shape {tuple(d.shape)}; an fp8 k_cache {tuple(k_cache.shape)} takes "
                             f"per-token descales {token} (the cache's shape without D) or one per-tensor value; "
                             f"per-(sequence, head) descales (batch, Hkv) are not supported here")
    if (tuple(k_descale.shape) == token) != (tuple(v_descale.shape) == token):
        raise ValueError(f"k_descale {tuple(k_descale.shape)} and v_descale {tuple(v_descale.shape)} must both be "
                         f"per token {token} or both per tensor")
    return k_descale, v_descale
