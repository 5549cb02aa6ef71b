"""FlashAttention-3-style functional API in front of the op registry.

Layout (batch, seqlen, heads, headdim), GQA/MQA by Hq % Hkv == 0, causal aligned bottom-right.
fp8 inputs take float32 descales ``(batch, num_kv_heads)`` or per-tensor and return bfloat16.
Performance hints FA3 takes (``num_splits``, ``pack_gqa``, ``sm_margin``, ``scheduler_metadata``,
``deterministic``) are accepted. ``window_size=(left, right)`` (-1 = unbounded; ``causal`` sets right = 0)
becomes the matching local attention mask (``fmha_ops.attn_bias``), aligned bottom-right as in FA3, and
``softcap`` caps the scores; the selector then picks an op that declares windows / softcap. Features this
package does not implement (rotary embedding, ``qv``, chunked attention, ``seqused_*``, ``cache_leftpad``,
non-causal windows on a KV cache) raise ``NotImplementedError`` naming the argument.

Differentiating fp8 inputs needs ``set_fp8_dequantized_backward(True)``: the backward then runs on
the dequantized values with a bf16 kernel. For training, ``fmha_ops.fp8_attention`` takes bf16 q/k/v,
quantizes inside, runs the fp8 forward and returns bf16 gradients to the bf16 tensors.
"""
from __future__ import annotations

import ast
import os
from typing import NamedTuple, Optional

import torch

from . import attn_bias as ab
from . import arguments, checks, compiled, kv_cache
from .api import memory_efficient_attention
from .call import find_plan, make_problem, run_forward
from .dispatch import SELECTOR
from .dtypes import FLOAT_DTYPES
from .inputs import make_inputs
from .measure import forward_measure
from .fp8_backward import set_fp8_dequantized_backward

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # the append kernel runs on CPU tensors

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "set_fp8_dequantized_backward"]


def _unsupported(**args) -> None:
    for name, (value, default) in args.items():
        if value != default and value is not default:
            raise NotImplementedError(f"{name}={value!r} is not implemented by fmha_ops (only {name}={default!r})")


def _run(q, k, v, bias, softmax_scale, q_descale, k_descale, v_descale, return_lse, softcap=0.0, sinks=None):
    """out in q's dtype (bfloat16 for fp8 inputs), differentiable; with ``return_lse`` also the lse (float32,
    not differentiable, as FA3 returns it). A repeated layout runs its plan (the one ``memory_efficient_attention``
    keeps for the same call without the LSE); calls with ``sinks`` take the full path."""
    layout, plan = find_plan(q, k, v, bias, 0.0, softmax_scale, None, None, return_lse, softcap, q_descale,
                             k_descale, v_descale, False) if sinks is None else (None, None)
    if plan is not None:
        out, lse = plan(q, k, v, bias, q_descale, k_descale, v_descale)
    elif not return_lse:
        return memory_efficient_attention(q, k, v, bias, scale=softmax_scale, q_descale=q_descale,
                                          k_descale=k_descale, v_descale=v_descale, softcap=softcap, sinks=sinks)
    else:
        inp = make_inputs(q, k, v, bias, is_partial=True, scale=softmax_scale, q_descale=q_descale,
                          k_descale=k_descale, v_descale=v_descale, softcap=softcap, sinks=sinks)
        out, lse = run_forward(inp, None, True, layout)
    return (out, lse.detach()) if return_lse else out


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                    causal: bool = False, qv=None, q_descale: torch.Tensor | None = None,
                    k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                    window_size: tuple[int, int] = (-1, -1), attention_chunk: int = 0, softcap: float = 0.0,
                    num_splits: int = 1, pack_gqa=None, deterministic: bool = False, sm_margin: int = 0,
                    return_attn_probs: bool = False, sinks: torch.Tensor | None = None):
    """q (B, Mq, Hq, D), k (B, Mk, Hkv, D), v (B, Mk, Hkv, Dv) -> out (B, Mq, Hq, Dv)
    [, softmax_lse float32 (B, Hq, Mq) when ``return_attn_probs``]. ``sinks``: float32 (Hq,) attention sinks
    (``fmha_ops.sinks``; FA4's ``learnable_sink``), differentiable; the LSE includes them."""
    if qv is not None or attention_chunk != 0:
        _unsupported(qv=(qv, None), attention_chunk=(attention_chunk, 0))
    if not (type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and q.ndim == 4 and k.ndim == 4
            and v.ndim == 4):
        for name, t in (("q", q), ("k", k), ("v", v)):
            arguments.tensor(name, t, ndim=4, layout="(batch, seqlen, heads, headdim)")
    if softmax_scale is not None or type(causal) is not bool:
        _check_scalars(softmax_scale, causal)
    if type(window_size) is tuple and window_size == (-1, -1):  # the default: no window
        bias = _CAUSAL if causal else None
    else:
        left, right = _window(window_size, causal)
        if causal:
            bias = _CAUSAL if left < 0 else ab.LowerTriangularFromBottomRightLocalAttentionMask(left + 1)
        else:
            bias = None if (left, right) == (-1, -1) else ab.LocalAttentionFromBottomRightMask(left, right)
    return _run(q, k, v, bias, softmax_scale, q_descale, k_descale, v_descale, return_attn_probs, softcap, sinks)


_Tensor = torch.Tensor
#: FA3's causal mask (holds no state: one instance serves every call, its signature computed once)
_CAUSAL = ab.LowerTriangularFromBottomRightMask()


def _window(window_size, causal: bool) -> tuple[int, int]:
    """FA3's ``window_size`` as (left, right), -1 = unbounded (any negative value is); ``causal`` sets right = 0."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    left, right = max(left, -1), max(right, -1)
    return left, (-1 if causal else right)


def _check_scalars(softmax_scale, causal) -> None:
    if softmax_scale is not None:
        arguments.finite_float("softmax_scale", softmax_scale)
    arguments.flag("causal", causal)


#: varlen masks built from device cu_seqlens, per call layout: (mask, the two tensors, their versions); reading
#: device starts on the host is a sync that waits for all queued GPU work. An entry holds its tensors (the mask
#: reads them on the device anyway), so their ids stay theirs while cached.
_VARLEN_MASKS: dict = {}
_VARLEN_MASK_LIMIT = 64


def _read_is_a_sync(cu: torch.Tensor) -> bool:
    """Whether reading ``cu`` on the host waits for the device (a CUDA tensor)."""
    return cu.is_cuda


def _varlen_mask(kind, window: tuple, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q,
                 max_seqlen_k, q: torch.Tensor, k: torch.Tensor):
    """``kind.from_cu_seqlens`` on q's device. Device starts are read once per tensor and version: a repeated call
    with the same two tensors, unchanged (``Tensor._version``, which every torch write bumps), reuses the mask."""
    key = None
    if _read_is_a_sync(cu_seqlens_q) and _read_is_a_sync(cu_seqlens_k):
        key = (kind, window, id(cu_seqlens_q), id(cu_seqlens_k), max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0],
               q.device)
        hit = _VARLEN_MASKS.get(key)
        if hit is not None:
            mask, held_q, held_k, versions = hit
            if (held_q is cu_seqlens_q and held_k is cu_seqlens_k
                    and versions == (cu_seqlens_q._version, cu_seqlens_k._version)):
                return mask
    bias = kind.from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, *window, max_seqlen_q=max_seqlen_q,
                                max_seqlen_k=max_seqlen_k, total_q=q.shape[0], total_k=k.shape[0])
    if bias.q_seqinfo.seqstart.device != q.device or bias.k_seqinfo.seqstart.device != q.device:
        bias = bias.to(q.device)  # starts given on the host: read there, the kernels read a device copy
    if key is not None:
        if len(_VARLEN_MASKS) >= _VARLEN_MASK_LIMIT:
            _VARLEN_MASKS.clear()
        _VARLEN_MASKS[key] = (bias, cu_seqlens_q, cu_seqlens_k,
                              (cu_seqlens_q._version, cu_seqlens_k._version))
    return bias


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, seqused_q=None,
                           seqused_k=None, softmax_scale: float | None = None, causal: bool = False, qv=None,
                           q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                           v_descale: torch.Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
                           attention_chunk: int = 0, softcap: float = 0.0, num_splits: int = 1, pack_gqa=None,
                           deterministic: bool = False, sm_margin: int = 0, return_attn_probs: bool = False,
                           sinks: torch.Tensor | None = None):
    """Packed sequences: q (total_q, Hq, D), k/v (total_k, Hkv, D); cu_seqlens_* int32 (nseq + 1,).
    Descales are (nseq, Hkv) or per-tensor. ``sinks``: float32 (Hq,) attention sinks, differentiable (not under
    torch.compile). Returns out (total_q, Hq, Dv) [, lse (Hq, total_q)].
    Reads cu_seqlens on the host (one device sync per tensor and version: repeated calls with the same unchanged
    cu_seqlens tensors reuse what was read); under torch.compile the call is one custom op
    (``fmha_ops::varlen_attention``) that does so when it runs."""
    layout, checked = _varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size,
                                      softcap) if (seqused_q is None and seqused_k is None and qv is None
                                                   and attention_chunk == 0) else (None, None)
    if checked is not None:  # these arguments passed the checks below before
        bias = _varlen_mask(*checked, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
        res = _run(q[None], k[None], v[None], bias, softmax_scale, q_descale, k_descale, v_descale,
                   return_attn_probs, softcap, sinks)
        return (res[0][0], res[1][0]) if return_attn_probs else res[0]
    _unsupported(seqused_q=(seqused_q, None), seqused_k=(seqused_k, None), qv=(qv, None),
                 attention_chunk=(attention_chunk, 0))
    for name, t in (("q", q), ("k", k), ("v", v)):
        arguments.tensor(name, t, ndim=3, layout="(total_tokens, heads, headdim)")
    _check_scalars(softmax_scale, causal)
    left, right = _window(window_size, causal)
    if torch.compiler.is_compiling():  # cu_seqlens are data to a trace: the call runs behind a custom op
        if (left, right) != (-1, -1) or softcap or sinks is not None:
            raise NotImplementedError(f"window_size={tuple(window_size)} / softcap={softcap} / sinks are not "
                                      f"implemented for flash_attn_varlen_func under torch.compile (eager calls "
                                      f"take them)")
        return _traced_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, causal, (q_descale, k_descale, v_descale), return_attn_probs)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        arguments.tensor(name, cu, ndim=1, dtypes=(torch.int32,), layout="int32 (num_sequences + 1,)")
        if cu.device != q.device and cu.device.type != "cpu":
            raise ValueError(f"{name} is on {cu.device} but {name[-1]} is on {q.device}")
    if causal:
        kind, window = (ab.BlockDiagonalCausalFromBottomRightMask, ()) if left < 0 else \
            (ab.BlockDiagonalCausalLocalAttentionFromBottomRightMask, (None, left + 1))
    elif (left, right) == (-1, -1):
        kind, window = ab.BlockDiagonalMask, ()
    else:
        kind, window = ab.BlockDiagonalLocalAttentionFromBottomRightMask, (None, left, right)
    if layout is not None:
        if len(_VARLEN_CHECKED) >= _VARLEN_CHECKED_LIMIT:
            _VARLEN_CHECKED.clear()
        _VARLEN_CHECKED[layout] = (kind, window)
    bias = _varlen_mask(kind, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    res = _run(q[None], k[None], v[None], bias, softmax_scale, q_descale, k_descale, v_descale, return_attn_probs,
               softcap, sinks)
    if return_attn_probs:
        return res[0][0], res[1][0]
    return res[0]


#: flash_attn_varlen_func argument layouts that passed its checks (``_varlen_checked``) -> (mask kind, window
#: arguments): a repeated layout goes straight to the mask and the call's plan
_VARLEN_CHECKED: dict = {}
_VARLEN_CHECKED_LIMIT = 4096


def _varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size,
                    softcap) -> tuple[tuple | None, tuple | None]:
    """(the layout of a flash_attn_varlen_func call, the (mask kind, window arguments) kept for it or None): the
    layout is what the function's own checks read from its arguments (tensor types, shapes and devices, the
    cu_seqlens dtypes, the scalars and the window), for eager calls with plain tensors and Python scalars; None
    otherwise (the checks then run and name what is wrong)."""
    if not (type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and type(cu_seqlens_q) is _Tensor
            and type(cu_seqlens_k) is _Tensor and type(causal) is bool and type(window_size) is tuple
            and (softmax_scale is None or type(softmax_scale) is float) and type(softcap) in (float, int)):
        return None, None
    if torch.compiler.is_compiling():
        return None, None
    layout = (q.shape, k.shape, v.shape, q.device, cu_seqlens_q.shape, cu_seqlens_q.dtype, cu_seqlens_q.device,
              cu_seqlens_k.shape, cu_seqlens_k.dtype, cu_seqlens_k.device, softmax_scale, causal, window_size, softcap)
    try:
        return layout, _VARLEN_CHECKED.get(layout)
    except TypeError:  # a window_size of unhashable items: the checks name it
        return None, None


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None, qv=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens: torch.Tensor | int | None = None,
                            cache_batch_idx: torch.Tensor | None = None, cache_leftpad=None,
                            page_table: torch.Tensor | None = None, cu_seqlens_q=None, cu_seqlens_k_new=None,
                            max_seqlen_q=None, rotary_seqlens=None, q_descale: torch.Tensor | None = None,
                            k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                            softmax_scale: float | None = None, causal: bool = False,
                            window_size: tuple[int, int] = (-1, -1), attention_chunk: int = 0, softcap: float = 0.0,
                            rotary_interleaved: bool = True, scheduler_metadata=None, num_splits: int = 0,
                            pack_gqa=None, sm_margin: int = 0, return_softmax_lse: bool = False,
                            sinks: torch.Tensor | None = None):
    """Decode against a KV cache, appending new tokens first (FA3 semantics).

    q (B, Mq, Hq, D) bf16/fp16 with Mq new tokens per sequence. Cache: dense (B_cache, L, Hkv, D)
    (rows picked by ``cache_batch_idx`` int (B,) when given) or paged (num_pages, page_size, Hkv, D)
    with ``page_table`` int32 (B, max_pages). A bf16/fp16 cache, or fp8 e4m3 with ``k_descale`` /
    ``v_descale`` float32 per token (the cache's shape without D; any strides, fastest with each head's slots
    contiguous: ``kv_cache.keys_contiguous``) or per tensor (numel 1, no append). ``cache_seqlens`` int32 (B,)
    (or an int): tokens already in the cache. If ``k``/``v`` (B, Mnew, Hkv, D) are given they are written at
    ``cache_seqlens`` (quantized per token into an fp8 cache) and attended too. ``causal`` aligns the
    queries to the end of each sequence. No host sync: capturable in a CUDA graph. ``sinks``: float32 (Hq,)
    attention sinks (GPT-OSS; the LSE includes them). The value cache may have a head dim Dv of its own.
    Returns out (B, Mq, Hq, Dv) [, softmax_lse float32 (B, Hq, Mq)].

    Index tensors on the GPU are not read back: an out-of-range ``cache_seqlens`` is clamped to the cache, a
    ``page_table`` / ``cache_batch_idx`` entry that is not a page (row) of the cache ends that sequence's keys
    there, and appended tokens that fall outside the cache are dropped. ``fmha_ops.check_inputs()`` (or
    ``FMHA_OPS_CHECK=1``) validates them instead (one host sync) and raises ValueError naming the entry; index
    tensors on the CPU are always validated.

    Example
    -------
    >>> k_cache, v_cache, k_scale, v_scale, table = kv_cache.build_fp8_paged_cache(k, v, 64)  # doctest: +SKIP
    >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, page_table=table,
    ...                               k_descale=k_scale, v_descale=v_scale, causal=True)  # doctest: +SKIP
    """
    if (qv is not None or rotary_cos is not None or rotary_sin is not None or cache_leftpad is not None
            or cu_seqlens_q is not None or cu_seqlens_k_new is not None or rotary_seqlens is not None
            or attention_chunk != 0):
        _unsupported(qv=(qv, None), rotary_cos=(rotary_cos, None), rotary_sin=(rotary_sin, None),
                     cache_leftpad=(cache_leftpad, None), cu_seqlens_q=(cu_seqlens_q, None),
                     cu_seqlens_k_new=(cu_seqlens_k_new, None), rotary_seqlens=(rotary_seqlens, None),
                     attention_chunk=(attention_chunk, 0))
    appending = None
    if cache_batch_idx is None and q_descale is None and sinks is None and type(cache_seqlens) is torch.Tensor \
            and type(page_table) is torch.Tensor and not torch.compiler.is_compiling():
        fast = _fast_key(q, k_cache, v_cache, cache_seqlens, page_table, k_descale, v_descale, softmax_scale, causal,
                         window_size, softcap, return_softmax_lse)
        if k is None and fast is not None:
            launcher = _DECODE_RUNS.get(fast)
            if launcher is None:  # the layout's first call (or the first after SELECTOR.clear()): select, plan
                launcher = _fast_launcher(fast, q, k_cache, v_cache, cache_seqlens, page_table, k_descale, v_descale,
                                          softmax_scale, causal, window_size, softcap, return_softmax_lse) \
                    if _unit_index_strides(cache_seqlens, page_table) else None
                if len(_DECODE_RUNS) >= _FAST_LIMIT:
                    _DECODE_RUNS.clear()
                _DECODE_RUNS[fast] = launcher or False
            if launcher:
                return launcher(q, k_cache, v_cache, k_descale, v_descale, cache_seqlens, page_table)
        elif fast is not None and type(k) is torch.Tensor and type(v) is torch.Tensor:
            appending = fast + (_meta(k), _meta(v))
            plan = _APPEND.get(appending)
            if plan:
                return plan(q, k_cache, v_cache, k, v, k_descale, v_descale, cache_seqlens, page_table)
            if plan is False or not _unit_index_strides(cache_seqlens, page_table):
                appending = None  # this layout's op has no decode launcher, or its indices' strides: the full path
    call = kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, q_descale, k_descale,
                        v_descale, softmax_scale, causal, window_size)
    batch, mq = q.shape[:2]
    res = _run(call.query, call.key, call.value, call.bias, softmax_scale, None, call.k_descale, call.v_descale,
               return_softmax_lse, softcap, sinks)
    if appending is not None:
        _remember_append(appending, call, q, v_cache, k.shape[1], softmax_scale, softcap, return_softmax_lse)
    if return_softmax_lse:
        out, lse = res
        return out.view(q.shape[:3] + out.shape[3:]), lse.view(lse.shape[1], batch, mq).permute(1, 0, 2)
    return res.view(q.shape[:3] + res.shape[3:])


#: the fast path of repeated paged decode calls: (selected op, ``_fast_key``) -> launcher or None (see
#: ``_fast_launcher``); the op comes from the selector's memo, so ``use_ops`` scopes and ``SELECTOR.clear()`` apply
_FAST: dict = {}
_FAST_LIMIT = 256  # distinct call layouts kept (each is one decode shape of a model)


def _meta(t) -> tuple | None:
    return None if t is None else (t.shape, t.dtype, t.stride(), t.device)


def _fast_key(q, k_cache, v_cache, cache_seqlens, page_table, k_descale, v_descale, softmax_scale, causal,
              window_size, softcap, return_lse):
    """The layout of a paged decode call without append on device tensors (everything its validation, selection
    and launch depend on but the tensors' values, and the ``use_ops`` scope), or None when the call must take the
    full path: autograd, check mode (``fmha_ops.checks``), host tensors, non-tensor arguments."""
    if not (type(q) is torch.Tensor and type(k_cache) is torch.Tensor and type(v_cache) is torch.Tensor):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        return None
    if checks.wanted(q, cache_seqlens, page_table):  # host tensors (always checked) or check mode: the full path
        return None
    try:  # the tensors' metadata inline (no call per tensor: this runs on every decode step)
        return (q.shape, q.dtype, q.stride(), q.device, k_cache.shape, k_cache.dtype, k_cache.stride(),
                k_cache.device, v_cache.shape, v_cache.dtype, v_cache.stride(), v_cache.device,
                cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.stride(), cache_seqlens.device,
                page_table.shape, page_table.dtype, page_table.stride(), page_table.device,
                None if k_descale is None else (k_descale.shape, k_descale.dtype, k_descale.stride(), k_descale.device),
                None if v_descale is None else (v_descale.shape, v_descale.dtype, v_descale.stride(), v_descale.device),
                softmax_scale, causal, tuple(window_size), softcap, return_lse, _deterministic(), _scope())
    except (TypeError, AttributeError):  # descales that are not tensors, window_size not a pair: the full path says
        return None


_deterministic = torch._C._get_deterministic_algorithms
_scope = SELECTOR.current_scope


def _unit_index_strides(cache_seqlens, page_table) -> bool:
    """Whether the kernels can read these lengths and page-table rows where they lie (the full path makes them
    contiguous otherwise): checked once per fast-path layout, whose key holds both tensors' strides."""
    return _unit_stride(cache_seqlens, 0) and _unit_stride(page_table, 1)


def _unit_stride(t, dim: int) -> bool:
    """Whether the kernels can read ``t``'s entries along ``dim`` as consecutive ints (they index a length or a
    page-table row by its position)."""
    return t.ndim <= dim or t.shape[dim] <= 1 or t.stride(dim) == 1


def _fast_launcher(fast, q, k_cache, v_cache, cache_seqlens, page_table, k_descale, v_descale, softmax_scale, causal,
                   window_size, softcap, return_lse):
    """The fast path of calls of layout ``fast``: ``run(q, k_cache, v_cache, k_descale, v_descale, cache_seqlens,
    page_table)`` -> what ``flash_attn_with_kvcache`` returns, through the selected op's ``decode_launcher``; None
    when that op has none (the call keeps the full path). The selector memoizes the op under ``fast``: the first
    call of a layout (and the first after ``SELECTOR.clear()``) validates it in full, raising as the full path
    would."""
    built = []

    def problem():
        call = kvcache_call(q, k_cache, v_cache, None, None, cache_seqlens, None, page_table, None, k_descale,
                            v_descale, softmax_scale, causal, window_size)
        inp = make_inputs(call.query, call.key, call.value, call.bias, scale=softmax_scale, k_descale=call.k_descale,
                          v_descale=call.v_descale, softcap=softcap, is_partial=return_lse)
        built.append((call, inp))
        return make_problem(inp, return_lse)

    op = SELECTOR.select(fast, problem, "fw", None, lambda ops: forward_measure(built[0][1], return_lse, "decode")(ops))
    try:
        return _FAST[op, fast]
    except KeyError:
        pass
    if not built:
        problem()
    call, inp = built[0]
    if len(_FAST) >= _FAST_LIMIT:
        _FAST.clear()
    run = _FAST[op, fast] = _decode_run(op, call, inp, q, v_cache, return_lse)
    return run


def _decode_run(op, call: "KVCacheCall", inp, q, v_cache, return_lse, seqlen_offset: int = 0):
    """``run(q, k_cache, v_cache, k_descale, v_descale, seqlens, page_table)`` -> what ``flash_attn_with_kvcache``
    returns, by ``op``'s ``decode_launcher`` for calls laid out like ``call`` / ``inp`` (validated, ``op`` selected
    for them), at lengths ``seqlens + seqlen_offset`` (added on the device); None when the op has no such launcher.
    Per run: the output (``torch.empty_like(q)`` where it has q's shape and dtype) and, only when returned, the
    LSE are allocated, and the kernels launch."""
    from .ops.common import decode_views

    planner = getattr(op, "decode_launcher", None)
    if planner is None:
        return None
    launch = planner(inp, return_lse, own_workspace=False)
    per_tensor = call.k_descale is not None and decode_views(inp)[5].stride() == (0, 0, 0)
    batch, mq, hq, _ = q.shape
    out_shape, out_dtype, device = q.shape[:3] + (v_cache.shape[3],), inp.out_dtype, q.device
    like_q = out_shape == q.shape and out_dtype == q.dtype and q.is_contiguous()
    empty_like = torch.empty_like

    if like_q and not per_tensor and not return_lse:  # the common decode step: one allocation, one launch
        def run(q, k_cache, v_cache, k_descale, v_descale, cache_seqlens, page_table):
            out = empty_like(q)
            launch(q, k_cache, v_cache, k_descale, v_descale, cache_seqlens, page_table, out, None, seqlen_offset)
            return out
        return run

    def run(q, k_cache, v_cache, k_descale, v_descale, cache_seqlens, page_table):
        if per_tensor:
            k_descale = k_descale.reshape(1, 1, 1).expand(k_cache.shape[:3])
            v_descale = v_descale.reshape(1, 1, 1).expand(v_cache.shape[:3])
        out = empty_like(q) if like_q else torch.empty(out_shape, dtype=out_dtype, device=device)
        lse = torch.empty((batch, hq, mq), dtype=torch.float32, device=device) if return_lse else None
        launch(q, k_cache, v_cache, k_descale, v_descale, cache_seqlens, page_table, out, lse, seqlen_offset)
        return (out, lse) if return_lse else out
    return run


#: the fast path's launchers by layout (``_fast_key``): no selection per call; False where the selected op has no
#: decode launcher; cleared with the selector's memo
_DECODE_RUNS: dict = SELECTOR.derived_memo()

#: the fast path of repeated paged decode calls that append: ``_fast_key`` + the new tokens' layout -> run(q,
#: k_cache, v_cache, k, v, k_descale, v_descale, cache_seqlens, page_table), built after the call's full path (which
#: validated it, appended and ran the decode), or False where the selected op has no decode launcher; cleared with
#: the selector's memo
_APPEND: dict = SELECTOR.derived_memo()


def _remember_append(layout, call: "KVCacheCall", q, v_cache, new_tokens: int, softmax_scale, softcap,
                     return_lse) -> None:
    """Keep the plan of appending calls laid out like this one: the append kernel, then the selected decode op's
    launch on ``cache_seqlens`` with ``new_tokens`` added on the device (what the full path's mask holds)."""
    inp = make_inputs(call.query, call.key, call.value, call.bias, scale=softmax_scale, k_descale=call.k_descale,
                      v_descale=call.v_descale, softcap=softcap, is_partial=return_lse)
    op = SELECTOR.select(layout, lambda: make_problem(inp, return_lse), "fw", None)
    decode = _decode_run(op, call, inp, q, v_cache, return_lse, new_tokens)
    if len(_APPEND) >= _FAST_LIMIT:
        _APPEND.clear()
    if decode is None or not (q.is_cuda or _INTERPRET):
        _APPEND[layout] = False
        return
    from .kernels.triton.kv_append import kv_append

    def run(q, k_cache, v_cache, k, v, k_descale, v_descale, cache_seqlens, page_table):
        kv_append(k, v, k_cache, v_cache, cache_seqlens, block_table=page_table, k_scale=k_descale, v_scale=v_descale)
        return decode(q, k_cache, v_cache, k_descale, v_descale, cache_seqlens, page_table)
    _APPEND[layout] = run


class KVCacheCall(NamedTuple):
    """``flash_attn_with_kvcache``'s call as the op path takes it: query (1, B * Mq, Hq, D), key / value the cache
    pool (1, pages * page_size, Hkv, D) (views), the paged decode mask, per-token (or per-tensor) descales."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    bias: ab.AttentionBias
    k_descale: torch.Tensor | None
    v_descale: torch.Tensor | None


def kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, q_descale, k_descale,
                 v_descale, softmax_scale, causal, window_size) -> KVCacheCall:
    """Validate ``flash_attn_with_kvcache``'s arguments (ValueError / TypeError / NotImplementedError naming them),
    append ``k`` / ``v`` when given, and return the call for the op path (``fmha_ops.decode_plan`` plans it)."""
    left, right = _window(window_size, causal)
    if not causal and (left, right) != (-1, -1):
        raise NotImplementedError(f"window_size={tuple(window_size)} with causal=False is not implemented by "
                                  f"flash_attn_with_kvcache (causal=True windows are)")
    if q_descale is not None:
        raise NotImplementedError("q_descale is not implemented for flash_attn_with_kvcache (pass a bf16/fp16 q)")
    _check_cache_tensors(q, k_cache, v_cache, k, v)
    _check_scalars(softmax_scale, causal)
    batch, mq = q.shape[:2]
    page = k_cache.shape[1]
    mnew = 0 if k is None else k.shape[1]
    paged = page_table is not None
    if paged:
        _check_index_tensor("page_table", page_table, (batch, None), (torch.int32,), q.device)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is for dense caches; with page_table, reorder the page table instead")
        capacity = page_table.shape[1] * page
    else:
        if cache_batch_idx is None:
            if k_cache.shape[0] != batch:
                raise ValueError(f"k_cache has {k_cache.shape[0]} sequences but q has {batch}; pass cache_batch_idx")
            page_table = torch.arange(batch, dtype=torch.int32, device=q.device)[:, None]  # row b is page b
        else:
            _check_index_tensor("cache_batch_idx", cache_batch_idx, (batch,), (torch.int32, torch.int64), q.device)
            page_table = cache_batch_idx.to(torch.int32)[:, None]
        capacity = page
    cache_seqlens = _cache_seqlens(cache_seqlens, q, capacity - mnew)
    if not _unit_stride(cache_seqlens, 0):  # the kernels read lengths and page-table rows as consecutive ints
        cache_seqlens = cache_seqlens.contiguous()
    if paged and not _unit_stride(page_table, 1):
        page_table = page_table.contiguous()
    _validate_indices(cache_seqlens, cache_batch_idx, page_table if paged else None, capacity, mnew, k_cache)
    kd, vd = _cache_descales(k_cache, k_descale, v_descale, q.device)
    if k is not None:
        if kd is not None and kd.shape != k_cache.shape[:3]:
            raise NotImplementedError("appending k/v to an fp8 cache needs per-token k_descale/v_descale (shaped "
                                      f"like the cache without D, {tuple(k_cache.shape[:3])}) to hold the new "
                                      f"tokens' scales; got shape {tuple(kd.shape)}")
        if k_cache.is_cuda or _INTERPRET:
            from .kernels.triton.kv_append import kv_append as append
        else:
            append = kv_cache.append_to_cache
        append(k, v, k_cache, v_cache, cache_seqlens, block_table=page_table, k_scale=kd, v_scale=vd)
        seqlens = cache_seqlens + mnew
    else:
        seqlens = cache_seqlens
    if left >= 0:
        bias = ab.PagedBlockDiagonalCausalLocalPaddedKeysMask.from_device_seqlens(mq, seqlens, page_table, page,
                                                                                 left + 1)
    elif causal:
        bias = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_device_seqlens(mq, seqlens, page_table, page)
    else:
        bias = ab.PagedBlockDiagonalPaddedKeysMask.from_device_seqlens(mq, seqlens, page_table, page)
    pool = (1, k_cache.shape[0] * page)
    # per-token descales pass in the cache's own (num_pages, page_size, Hkv) layout: no copy, any strides
    return KVCacheCall(q.reshape(1, batch * mq, *q.shape[2:]), k_cache.reshape(pool + k_cache.shape[2:]),
                       v_cache.reshape(pool + v_cache.shape[2:]), bias, kd, vd)


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
    _check_index_tensor("cache_seqlens", cache_seqlens, (batch,), (torch.int32,), q.device)
    return cache_seqlens


def _check_index_tensor(name: str, t, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    """``t`` is a tensor of ``shape`` (None: any size there), one of ``dtypes``, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.ndim != len(shape) or any(n is not None and n != m for n, m in zip(shape, t.shape)):
        want = "(" + ", ".join("any" if n is None else str(n) for n in shape) + ")"
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {' or '.join(map(str, dtypes))}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _validate_indices(cache_seqlens, cache_batch_idx, page_table, capacity: int, mnew: int, k_cache) -> None:
    """Host checks of the index tensors (always on the CPU, with ``fmha_ops.checks`` enabled on a GPU)."""
    tensors = [t for t in (cache_seqlens, cache_batch_idx, page_table) if t is not None]
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


# ---- flash_attn_varlen_func under torch.compile: one custom op ------------------------------------

def _traced_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float | None, causal: bool, descales: tuple, return_lse: bool):
    """The traced twin of ``flash_attn_varlen_func``: its mask needs the sequence starts on the host, which a
    trace does not have, so the whole call (selection included, memoized) runs inside the custom op."""
    text = repr((int(max_seqlen_q), int(max_seqlen_k), softmax_scale, bool(causal), bool(return_lse)))
    out, lse = torch.ops.fmha_ops.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, list(descales), text)
    return (out, lse) if return_lse else out


def _varlen_eager(q, k, v, cu_q, cu_k, descales, spec, return_lse: bool | None = None):
    max_q, max_k, scale, causal, lse_wanted = ast.literal_eval(spec)
    qd, kd, vd = descales
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal,
                                  q_descale=qd, k_descale=kd, v_descale=vd,
                                  return_attn_probs=lse_wanted if return_lse is None else return_lse)


@torch.library.custom_op("fmha_ops::varlen_attention", mutates_args=())
def varlen_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, descales: list[Optional[torch.Tensor]],
                        spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_varlen_func``: out (total_q, Hq, Dv) contiguous and lse float32 (Hq, total_q) (empty unless
    the spec asks for it)."""
    res = _varlen_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, descales, spec)
    if isinstance(res, tuple):
        return res[0].contiguous(), res[1].contiguous()
    return res.contiguous(), q.new_empty((0,), dtype=torch.float32)


@varlen_attention_op.register_fake
def _varlen_attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, descales, spec):
    lse_wanted = ast.literal_eval(spec)[4]
    out_dtype = q.dtype if q.dtype in FLOAT_DTYPES else torch.bfloat16
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=out_dtype)
    return out, q.new_empty((q.shape[1], q.shape[0]) if lse_wanted else (0,), dtype=torch.float32)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, descales, spec = inputs
    ctx.spec = spec
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *descales)


def _varlen_backward(ctx, grad_out, _grad_lse):
    """Recompute the forward with torch autograd on and differentiate it (the eager call's own gradients)."""
    q, k, v, cu_q, cu_k, *descales = ctx.saved_tensors
    return (*torch.ops.fmha_ops.varlen_attention_backward(grad_out, q, k, v, cu_q, cu_k, descales, ctx.spec),
            None, None, None, None)


@torch.library.custom_op("fmha_ops::varlen_attention_backward", mutates_args=())
def varlen_attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                 descales: list[Optional[torch.Tensor]],
                                 spec: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``flash_attn_varlen_func``'s output, by recomputation under autograd."""
    with compiled.autograd_dispatch(), torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = _varlen_eager(*leaves, cu_seqlens_q, cu_seqlens_k, descales, spec, return_lse=False)
        grads = torch.autograd.grad(out, leaves, grad_out)
    return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, (q, k, v)))


@varlen_attention_backward_op.register_fake
def _varlen_attention_backward_fake(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, descales, spec):
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


varlen_attention_op.register_autograd(_varlen_backward, setup_context=_varlen_setup)
