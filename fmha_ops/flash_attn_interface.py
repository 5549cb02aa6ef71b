"""FlashAttention-3-style functional API in front of the op registry.

Layout (batch, seqlen, heads, headdim), GQA/MQA by Hq % Hkv == 0, causal aligned bottom-right.
fp8 inputs take float32 descales ``(batch, num_kv_heads)`` or per-tensor and return bfloat16.
Performance hints FA3 takes (``num_splits``, ``pack_gqa``, ``sm_margin``, ``scheduler_metadata``,
``deterministic``) are accepted. ``window_size=(left, right)`` (-1 = unbounded; ``causal`` sets right = 0)
becomes the matching local attention mask (``fmha_ops.attn_bias``), aligned bottom-right as in FA3, and
``softcap`` caps the scores; the selector then picks an op that declares windows / softcap. Features this
package does not implement (rotary embedding, ``qv``, chunked attention, ``seqused_*``,
non-causal windows on a KV cache) raise ``NotImplementedError`` naming the argument.

Differentiating fp8 inputs needs ``set_fp8_dequantized_backward(True)``: the backward then runs on
the dequantized values with a bf16 kernel. For training, ``fmha_ops.fp8_attention`` takes bf16 q/k/v,
quantizes inside, runs the fp8 forward and returns bf16 gradients to the bf16 tensors.
"""
from __future__ import annotations

import ast
from typing import Hashable, Optional

import torch

from . import attn_bias as ab
from . import arguments, compiled
from .call import run_forward
from .dtypes import FLOAT_DTYPES
from .fp8_backward import set_fp8_dequantized_backward
from .inputs import make_inputs
from .kvcache_call import plan_kvcache_call
from .plan import Plan, on_packed
from .plans import PLANS, call_key, plan_finder

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "set_fp8_dequantized_backward"]


def _unsupported(**args) -> None:
    for name, (value, default) in args.items():
        if value != default and value is not default:
            raise NotImplementedError(f"{name}={value!r} is not implemented by fmha_ops (only {name}={default!r})")


def _attention(key, q, k, v, bias, softmax_scale, q_descale, k_descale, v_descale, return_lse, softcap, sinks,
               keep_mask: bool = False):
    """The full path of a dense call (``flash_attn_func``'s, or a varlen call packed in batch 1): out in q's dtype
    (bfloat16 for fp8 inputs), differentiable; with ``return_lse`` also the lse (float32, not differentiable, as
    FA3 returns it). Stores under ``key`` the plan of repeated calls (``_run_plan`` runs it); ``keep_mask``: with
    ``bias`` as its ``bound`` (``flash_attn_func``'s masks hold no tensor: one per causal flag and window, which the
    key holds; a varlen mask holds its call's sequence starts, so each call passes its own)."""
    inp = make_inputs(q, k, v, bias, is_partial=return_lse, scale=softmax_scale, q_descale=q_descale,
                      k_descale=k_descale, v_descale=v_descale, softcap=softcap, sinks=sinks)
    out, lse = run_forward(inp, None, return_lse, key, bound=bias if keep_mask else None)
    return (out, lse.detach()) if return_lse else out


def _run_plan(plan, q, k, v, bias, q_descale, k_descale, v_descale, return_lse: bool, sinks):
    """What ``_attention`` returns, by the plan it stored, on this call's mask ``bias`` (a varlen call's own
    sequence starts, of the signature the key holds) and ``sinks``."""
    out, lse = plan.run(q, k, v, bias, q_descale, k_descale, v_descale, sinks)
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
    plan, key = _FIND_FUNC(q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, num_splits, pack_gqa, deterministic, sm_margin, return_attn_probs,
                           sinks)
    if plan is not None:
        out, lse = plan.run(q, k, v, plan.bound, q_descale, k_descale, v_descale, sinks)
        return (out, lse.detach()) if return_attn_probs else out
    _unsupported(qv=(qv, None), attention_chunk=(attention_chunk, 0))
    for name, t in (("q", q), ("k", k), ("v", v)):
        arguments.tensor(name, t, ndim=4, layout="(batch, seqlen, heads, headdim)")
    arguments.scale_and_causal(softmax_scale, causal)
    left, right = arguments.window(window_size, causal)
    if causal:
        bias = _CAUSAL if left < 0 else ab.LowerTriangularFromBottomRightLocalAttentionMask(left + 1)
    else:
        bias = None if (left, right) == (-1, -1) else ab.LocalAttentionFromBottomRightMask(left, right)
    return _attention(key, q, k, v, bias, softmax_scale, q_descale, k_descale, v_descale, return_attn_probs, softcap,
                      sinks, keep_mask=True)


_FIND_FUNC = plan_finder(flash_attn_func)
#: FA3's causal mask (holds no state: one instance serves every call, its signature computed once)
_CAUSAL = ab.LowerTriangularFromBottomRightMask()


#: cu_seqlens pairs whose mask and packed call's plan a varlen plan keeps (a workload alternates few pairs per layout)
VARLEN_MASKS_PER_PLAN = 8


def _read_is_a_sync(cu: torch.Tensor) -> bool:
    """Whether reading ``cu`` on the host waits for the device (a CUDA tensor)."""
    return cu.is_cuda


def _starts_stamp(cu: torch.Tensor) -> Hashable:
    """What a kept mask read from ``cu`` needs to be reused: a device tensor's version (``Tensor._version``, which
    every torch write bumps; reading the values would be a sync that waits for all queued GPU work), a host tensor's
    values (read without a sync, so a write torch does not count, e.g. through a numpy view, finds no stale mask)."""
    return cu._version if _read_is_a_sync(cu) else tuple(cu.tolist())


def _starts_stamps(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> tuple:
    """``_starts_stamp`` of both starts tensors (one read where they are the same tensor)."""
    stamp_q = _starts_stamp(cu_seqlens_q)
    return stamp_q, stamp_q if cu_seqlens_k is cu_seqlens_q else _starts_stamp(cu_seqlens_k)


def _varlen_plan(kind, window_args: tuple, max_seqlen_q, max_seqlen_k, softmax_scale, return_lse: bool, softcap):
    """``run(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale, sinks)`` of one validated varlen
    layout: the packed call (batch 1) under the mask ``kind.from_cu_seqlens`` reads from the starts. Where the
    starts are on q's device (the mask then holds those tensors, nothing newly allocated), the mask and the packed
    call's plan are kept per pair of starts tensors, with their stamps (``_starts_stamp``), so a repeated call with
    the same unchanged tensors is one lookup and the packed call's launch, and a written tensor replaces its entry.
    At most ``VARLEN_MASKS_PER_PLAN`` pairs, the oldest dropped first; an entry holds its two tensors, so their ids
    stay theirs while kept. Host starts of a CUDA call are read and copied to the device on every call (a kept copy
    would be memory a CUDA graph pool may own)."""
    # (id q starts, id k starts) -> [stamps, mask, packed call's plan or None, its packed launch (``_packed_run``,
    # made at the pair's first reuse: calls with new starts tensors each time never pay for it), the two tensors]
    kept: dict = {}

    def run(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale, sinks):
        pair = (id(cu_seqlens_q), id(cu_seqlens_k))
        entry = kept.get(pair)  # only starts on q's device are kept: the others are never stamped
        if entry is not None and entry[0] == _starts_stamps(cu_seqlens_q, cu_seqlens_k):
            _, bias, plan, packed, _ = entry
            if packed is not None:  # the repeated call: the packed call's launch on the tensors as given
                out, lse = packed(q, k, v, bias, q_descale, k_descale, v_descale, sinks)
                return (out, lse.detach()) if return_lse else out
            if plan is not None:  # the pair's first reuse: its packed launch made once, then run as above
                packed = entry[3] = _packed_run(plan, q[None], k[None], v[None], bias, softmax_scale, q_descale,
                                                k_descale, v_descale, return_lse, softcap, sinks)
                out, lse = packed(q, k, v, bias, q_descale, k_descale, v_descale, sinks)
                return (out, lse.detach()) if return_lse else out
            # no plan (the packed call checks values on every call): its full path
            res = _attention(None, q[None], k[None], v[None], bias, softmax_scale, q_descale, k_descale, v_descale,
                             return_lse, softcap, sinks)
        else:
            q, k, v = q[None], k[None], v[None]
            bias = kind.from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, *window_args, max_seqlen_q=max_seqlen_q,
                                        max_seqlen_k=max_seqlen_k, total_q=q.shape[1], total_k=k.shape[1])
            on_device = bias.q_seqinfo.seqstart.device == q.device and bias.k_seqinfo.seqstart.device == q.device
            if not on_device:
                bias = bias.to(q.device)  # starts given on the host: read there, the kernels read a device copy
            key = call_key(_attention, (q, k, v, bias, softmax_scale, q_descale, k_descale, v_descale, return_lse,
                                        softcap, sinks))
            plan = PLANS.get(key)
            if plan is not None:
                res = _run_plan(plan, q, k, v, bias, q_descale, k_descale, v_descale, return_lse, sinks)
            else:
                res = _attention(key, q, k, v, bias, softmax_scale, q_descale, k_descale, v_descale, return_lse,
                                 softcap, sinks)
                plan = PLANS.get(key)
            if on_device:
                kept.pop(pair, None)
                if len(kept) >= VARLEN_MASKS_PER_PLAN:
                    del kept[next(iter(kept))]
                kept[pair] = [_starts_stamps(cu_seqlens_q, cu_seqlens_k), bias, plan, None,
                              (cu_seqlens_q, cu_seqlens_k)]
        return (res[0][0], res[1][0]) if return_lse else res[0]
    return run


def _packed_run(plan: Plan, q, k, v, bias, softmax_scale, q_descale, k_descale, v_descale, return_lse: bool,
                softcap, sinks):
    """``run(q, k, v, mask, q_descale, k_descale, v_descale, sinks) -> (out, lse)`` on packed tensors (total, H, D)
    of the packed call ``plan`` serves (``q`` / ``k`` / ``v`` its batch-1 tensors, validated): its op's
    ``varlen_launcher`` where the plan is that op's launch alone, else the plan's run on batch-1 views (an
    autograd pair)."""
    if len(plan.ops) == 1:
        inp = make_inputs(q, k, v, bias, is_partial=return_lse, scale=softmax_scale, q_descale=q_descale,
                          k_descale=k_descale, v_descale=v_descale, softcap=softcap, sinks=sinks)
        return plan.ops[0].varlen_launcher(inp, return_lse)
    return on_packed(plan.run)


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
    plan, key = _FIND_VARLEN(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                             softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size, attention_chunk,
                             softcap, num_splits, pack_gqa, deterministic, sm_margin, return_attn_probs, sinks)
    if plan is not None:  # these arguments passed the checks below before: the mask, then the packed call
        return plan.run(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale, sinks)
    _unsupported(seqused_q=(seqused_q, None), seqused_k=(seqused_k, None), qv=(qv, None),
                 attention_chunk=(attention_chunk, 0))
    for name, t in (("q", q), ("k", k), ("v", v)):
        arguments.tensor(name, t, ndim=3, layout="(total_tokens, heads, headdim)")
    arguments.scale_and_causal(softmax_scale, causal)
    left, right = arguments.window(window_size, causal)
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
    if causal and left < 0:
        kind, window_args = ab.BlockDiagonalCausalFromBottomRightMask, ()
    elif causal:
        kind, window_args = ab.BlockDiagonalCausalLocalAttentionFromBottomRightMask, (None, left + 1)
    elif (left, right) == (-1, -1):
        kind, window_args = ab.BlockDiagonalMask, ()
    else:
        kind, window_args = ab.BlockDiagonalLocalAttentionFromBottomRightMask, (None, left, right)
    run = _varlen_plan(kind, window_args, max_seqlen_q, max_seqlen_k, softmax_scale, return_attn_probs, softcap)
    if key is not None:
        PLANS.put(key, Plan(run, (), ("validation",)))
    return run(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale, sinks)


_FIND_VARLEN = plan_finder(flash_attn_varlen_func)


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
    queries to the end of each sequence. ``cache_leftpad`` int32 (B,) on q's device (FA3's; None: 0): sequence b's
    keys start at that slot of its cache row, the slots before it are invisible (a left-padded batch), with
    0 <= cache_leftpad[b] <= cache_seqlens[b] (equal: the sequence's queries see no key but those appended; with
    none, out 0 and lse -inf). No host sync: capturable in a CUDA graph. ``sinks``: float32 (Hq,)
    attention sinks (GPT-OSS; the LSE includes them). The value cache may have a head dim Dv of its own.
    Returns out (B, Mq, Hq, Dv) [, softmax_lse float32 (B, Hq, Mq)].

    Index tensors on the GPU are not read back: an out-of-range ``cache_seqlens`` is clamped to the cache, a
    ``page_table`` / ``cache_batch_idx`` entry that is not a page (row) of the cache ends that sequence's keys
    there, a ``cache_leftpad`` entry is clamped to [0, the sequence's length], and appended tokens that fall outside
    the cache are dropped (our kernels' guards; the ``fa3F`` op hands lengths and starts to FlashAttention-3 as
    they are). ``fmha_ops.check_inputs()`` (or
    ``FMHA_OPS_CHECK=1``) validates them instead (one host sync) and raises ValueError naming the entry; index
    tensors on the CPU are always validated.

    Example
    -------
    >>> k_cache, v_cache, k_scale, v_scale, table = kv_cache.build_fp8_paged_cache(k, v, 64)  # doctest: +SKIP
    >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, page_table=table,
    ...                               k_descale=k_scale, v_descale=v_scale, causal=True)  # doctest: +SKIP
    """
    if (qv is not None or rotary_cos is not None or rotary_sin is not None or cu_seqlens_q is not None
            or cu_seqlens_k_new is not None or rotary_seqlens is not None or attention_chunk != 0):
        _unsupported(qv=(qv, None), rotary_cos=(rotary_cos, None), rotary_sin=(rotary_sin, None),
                     cu_seqlens_q=(cu_seqlens_q, None), cu_seqlens_k_new=(cu_seqlens_k_new, None),
                     rotary_seqlens=(rotary_seqlens, None), attention_chunk=(attention_chunk, 0))
    plan, key = _FIND_KVCACHE(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                              max_seqlen_q, q_descale, k_descale, v_descale, softmax_scale, causal, window_size,
                              softcap, rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin,
                              return_softmax_lse, sinks)
    if plan is None:  # validated here once per layout; a decode step of a planned one runs its launches alone
        plan = plan_kvcache_call(key, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                                 q_descale, k_descale, v_descale, softmax_scale, causal, window_size, softcap,
                                 return_softmax_lse, sinks, cache_leftpad)
    return plan.run(q, k_cache, v_cache, k, v, cache_seqlens, page_table, k_descale, v_descale, sinks, cache_leftpad)


#: checked on every call, before the lookup (the FA3 features we reject unless left at their defaults): no key holds
#: them, and the finder takes 24 arguments (a call of 31 is compiled through a list: ~0.3 us more on the CPU)
_KVCACHE_UNKEYED = ("qv", "rotary_cos", "rotary_sin", "cu_seqlens_q", "cu_seqlens_k_new", "rotary_seqlens",
                    "attention_chunk")
_FIND_KVCACHE = plan_finder(flash_attn_with_kvcache, _KVCACHE_UNKEYED)


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
