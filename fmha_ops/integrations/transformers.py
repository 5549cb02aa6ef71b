"""Hugging Face transformers models on fmha_ops: ``attn_implementation="fmha_ops"`` after one import.

Importing this module registers, with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``:

* ``"fmha_ops"``: attention through ``memory_efficient_attention`` (the selector picks the op), with GQA as is
  (no repeated KV heads), the layer's scaling, sliding window, softcap, dropout in training, GPT-OSS's sinks
  (``s_aux``) and a value head dim of its own (DeepSeek-V3's K=192 / Kv=128, unpadded);
* ``"fmha_ops_fp8"`` / ``"fmha_ops_i8fp8"``: the same with q/k/v quantized inside: calls that need gradients go
  through ``fp8_attention`` / ``i8fp8_attention`` where those take the mask (causal or none; no padding, window,
  softcap or dropout), inference prefill through the fp8 (or int8 q/k + fp8 v) forward with the call's mask; decode steps
  (at most ``DECODE_QUERIES`` new tokens) and the rest run in the model's dtype.

The mask function hands the attention function a structured mask, never a dense bias where the mask is one of
transformers' own (causal, bidirectional, causal sliding window, with or without padding): ``None`` when no key is
padded (causal / window then come from the layer), else the key slots that hold tokens up to the last query, a
bool (B, slots) tensor like the 2D attention mask it comes from (so that generate's precomputed masks go back
through transformers' mask code unchanged); the attention packs the valid tokens into variable-length sequences
(``BlockDiagonalCausalFromBottomRightMask``, windowed ones for sliding layers) and scatters the outputs back
(padded query rows get 0). Sequences packed into batch rows (position_ids that restart) come as each token's
sequence index, and transformers' continuous batching (``generate_batch``, its paged cache read back into
sequences laid end to end: ``cu_seq_lens_q`` / ``cu_seq_lens_k``) with no mask; both become one block-diagonal
call. Continuous batching's decode-only steps on models whose layers are all full attention read and append to its
paged cache in place (``flash_attn_with_kvcache`` with its block table). Under torch.compile a causal decode step (at
most ``DECODE_QUERIES`` queries) with padding keeps static shapes instead of packing: each sequence's keys run from its
first token's slot to its last's, passed as ``cache_leftpad`` / ``cache_seqlens`` computed on the device
(``_left_padded_decode``; left padding, as ``generate()`` pads decoder-only models), so the step is one graph. Masks
transformers composes from other functions (image-token overlays, custom and / or masks) and bidirectional sliding
windows (encoders such as ModernBERT, whose layers' ``sliding_window`` need not match their mask's) are materialized
as a dense additive bias, as SDPA takes them.

Example
-------
>>> import fmha_ops.integrations.transformers  # registers "fmha_ops", "fmha_ops_fp8", "fmha_ops_i8fp8"
>>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fmha_ops")  # doctest: +SKIP
>>> model.generate(**inputs)  # doctest: +SKIP
"""
from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (AttentionMaskInterface, and_masks, bidirectional_mask_function,
                                        causal_mask_function, packed_sequence_mask_function, prepare_padding_mask,
                                        remap_positions_for_packed_sequence, sdpa_mask, sliding_window_overlay)

from .. import attn_bias as ab
from ..api import memory_efficient_attention
from ..flash_attn_interface import flash_attn_with_kvcache
from ..quant import quantize_i8fp8, quantize_qkv_fp8
from ..quantized import fp8_attention, i8fp8_attention

#: the attn_implementation names this module registers, and the quantization each applies inside
IMPLEMENTATIONS = {"fmha_ops": None, "fmha_ops_fp8": "fp8", "fmha_ops_i8fp8": "i8fp8"}
#: calls with at most this many new tokens per sequence are decode steps: the quantized variants leave them in
#: the model's dtype (quantizing the whole cache per step costs more than the fp8 kernel saves)
DECODE_QUERIES = 16
_is_compiling = torch.compiler.is_compiling
#: the code of the functions transformers' mask factories return (one code object per factory, whatever the
#: arguments): a mask function is told by its code's identity, which dynamo traces (a ``__qualname__`` read breaks
#: the graph of a compiled decode step that builds its sliding-window mask, Mistral's)
FACTORIES = {
    "and_masks": and_masks(causal_mask_function).__code__,
    "sliding_window_overlay": sliding_window_overlay(1).__code__,
    "remap_positions_for_packed_sequence": remap_positions_for_packed_sequence(
        causal_mask_function, torch.zeros(1, 1, dtype=torch.long)).__code__,
    "packed_sequence_mask_function": packed_sequence_mask_function(torch.zeros(1, 1, dtype=torch.long)).__code__,
}


def structured_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                    mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask interface for the fmha_ops implementations (``AttentionMaskInterface``).

    Returns None (no padded key: the layer's causal flag and window say the rest); or the padding: bool
    (B, slots), slot j (key j of the layer's keys) holding a token, the slots ending with the last query's (a
    static cache's later, empty slots left out; the queries are the last q_length slots); under torch.compile, for
    a decode step (at most ``DECODE_QUERIES`` queries) on keys from slot 0, bool (B, kv_length) instead, every slot
    of the layer's keys (shapes that do not follow the step; ``_left_padded_decode``); or, for sequences
    packed into batch rows (position_ids that restart, no attention_mask, no cache), the sequence index of each
    token: int64 (B, q_length), as transformers finds it; or, for mask functions other than transformers' causal /
    bidirectional / sliding-window ones, a dense float additive bias (B, 1, q_length, kv_length) in
    ``kwargs["dtype"]``.
    """
    use_vmap = kwargs.get("use_vmap", False)
    # transformers' plain functions by identity, the others by their code and closure (_made_by, _closure)
    plain = mask_function is causal_mask_function or mask_function is bidirectional_mask_function
    segments = None if use_vmap or plain else _packed_sequences(mask_function)
    if segments is not None:
        return segments
    if use_vmap or not (plain or _structured(mask_function)):
        allowed = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                            allow_is_causal_skip=False, device=kwargs.get("device", "cpu"), use_vmap=use_vmap)
        dtype = kwargs.get("dtype", torch.float32)
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)
    if attention_mask is None and q_offset + q_length == kv_offset + kv_length:
        return None
    device = kwargs.get("device", attention_mask.device if attention_mask is not None else "cpu")
    if _is_compiling() and attention_mask is not None and _static_decode(q_length, kv_offset):
        return prepare_padding_mask(attention_mask.bool(), kv_length, 0)[:, :kv_length]
    end = q_offset + q_length  # absolute position after the last query
    if attention_mask is None:
        padding = torch.ones((batch_size, end), dtype=torch.bool, device=device)
    else:
        padding = prepare_padding_mask(attention_mask.bool(), end - kv_offset, kv_offset)
    keys = padding[:, kv_offset:end]
    if not _is_compiling() and keys.shape[1] == kv_length and bool(keys.all()):
        return None
    return keys


def _static_decode(q_length: int, kv_offset) -> bool:
    """Whether a traced call is a decode step whose keys start at slot 0 (the static cache's full layers, a sliding
    layer's cache until it wraps): ``_left_padded_decode`` takes it."""
    return q_length <= DECODE_QUERIES and isinstance(kv_offset, int) and kv_offset == 0


def _closure(fn) -> dict:
    """The variables a mask function closes over, by name (empty for a plain function)."""
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells))) if cells else {}


def _made_by(fn, factory: str) -> bool:
    """Whether mask function ``fn`` is the inner function of transformers' ``factory`` (a key of ``FACTORIES``)."""
    return getattr(fn, "__code__", None) is FACTORIES[factory]


def _structured(fn) -> bool:
    """Whether ``fn`` is one of the mask functions a causal / window / padding structure describes: transformers'
    causal or bidirectional function, or its sliding-window causal one (``and_masks`` of the window overlay and
    causal)."""
    if fn is causal_mask_function or fn is bidirectional_mask_function:
        return True
    inner = _closure(fn).get("mask_functions", ()) if _made_by(fn, "and_masks") else ()
    return (len(inner) == 2 and causal_mask_function in inner
            and any(_made_by(p, "sliding_window_overlay") for p in inner))


def _packed_sequences(fn) -> torch.Tensor | None:
    """For transformers' packed-sequence mask (``and_masks`` of a structured mask function on the positions within
    each sequence and the same-sequence test): the sequence index of each token, int (B, T); else None."""
    inner = _closure(fn).get("mask_functions", ()) if _made_by(fn, "and_masks") else ()
    if len(inner) != 2 or not _made_by(inner[0], "remap_positions_for_packed_sequence") \
            or not _made_by(inner[1], "packed_sequence_mask_function"):
        return None
    if not _structured(_closure(inner[0]).get("mask_function")):
        return None
    return _closure(inner[1]).get("packed_sequence_mask")


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask, scaling: float | None = None, dropout: float = 0.0,
              sliding_window: int | None = None, softcap: float | None = None, s_aux: torch.Tensor | None = None,
              quantize: str | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for ``"fmha_ops"``: query (B, Hq, Mq, K), key (B, Hkv, Mk, K), value
    (B, Hkv, Mk, Kv) -> (out (B, Mq, Hq, Kv), None). ``attention_mask``: what ``structured_mask`` returned.
    ``s_aux``: GPT-OSS's sinks (Hq,) in any float dtype (used as float32, differentiable). ``quantize``: "fp8" /
    "i8fp8" for the quantized variants."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # BMHK views
    sinks = None if s_aux is None else s_aux.float()
    window = sliding_window if causal and sliding_window is not None and sliding_window > 0 else None
    options = dict(scale=scaling, softcap=softcap or 0.0, sinks=sinks,
                   p=dropout if module.training else 0.0)
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.dtype != torch.bool:
        return _segments(q, k, v, attention_mask, causal, window, options, quantize), None  # packed sequences
    if attention_mask is not None and attention_mask.dim() == 2 and causal and _is_compiling() \
            and q.shape[1] <= DECODE_QUERIES and not options["p"]:  # a traced decode step: no data-dependent shape
        return _left_padded_decode(q, k, v, attention_mask, window, options), None
    if attention_mask is not None and attention_mask.dim() == 2:  # the padding of structured_mask
        return _packed(q, k, v, attention_mask, causal, window, options, quantize), None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    table, k_cache, v_cache = (kwargs.get(name) for name in ("block_table", "k_cache", "v_cache"))
    if table is not None and k_cache is not None and v_cache is not None:  # continuous batching's decode-only steps
        return _paged_decode(q, k, v, k_cache, v_cache, table, cu_k, window, options), None
    if attention_mask is None and isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor):
        return _concatenated(q, k, v, cu_q, cu_k, causal, window, options, quantize), None
    if attention_mask is not None:  # a dense mask (B, 1, Mq, Mk): an additive bias, or the allowed pairs (bool)
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~attention_mask, torch.finfo(q.dtype).min)
        bias = attention_mask.to(q.dtype)[..., :k.shape[1]].expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        return memory_efficient_attention(q, k, v, bias, **options), None
    mask = None
    if causal:
        mask = _causal_mask(window if window is not None and window < k.shape[1] else None)
    if quantize is not None and q.shape[1] > DECODE_QUERIES:
        return _quantized(q, k, v, mask, options, quantize), None
    return memory_efficient_attention(q, k, v, mask, **options), None


def _causal_mask(window: int | None) -> ab.AttentionBias:
    """The bottom-right causal mask, local with a ``window``-key window (None: none): a new one per call, with its
    plan-key signature, ~0.8 us on the CPU (0.4 us without a window)."""
    mask = ab.LowerTriangularFromBottomRightMask()
    return mask if window is None else mask.make_local_attention(window)


def _packed(q, k, v, keys: torch.Tensor, causal: bool, window: int | None, options: dict,
            quantize: str | None) -> torch.Tensor:
    """A padded call as variable-length sequences: each sequence's query tokens and key tokens (``keys``: bool
    (B, slots) from ``structured_mask``, the queries its last Mq slots) gathered into one packed batch (bottom-right
    causal, or bidirectional, per sequence), the outputs scattered back (0 at padded query positions)."""
    b, mq, hq, _ = q.shape
    mk = k.shape[1]
    queries = keys[:, -mq:]
    keys = torch.nn.functional.pad(keys, (0, mk - keys.shape[1]))  # slots past the last query: no token
    q_rows = queries.reshape(-1).nonzero().squeeze(1)
    k_rows = keys.reshape(-1).nonzero().squeeze(1)
    q_lens, k_lens = queries.sum(1).tolist(), keys.sum(1).tolist()
    qp = q.reshape(b * mq, hq, q.shape[3]).index_select(0, q_rows)[None]
    kp = k.reshape(b * mk, *k.shape[2:]).index_select(0, k_rows)[None]
    vp = v.reshape(b * mk, *v.shape[2:]).index_select(0, k_rows)[None]
    out = _sequences(qp, kp, vp, q_lens, k_lens, causal, window, options, quantize if mq > DECODE_QUERIES else None)
    full = out.new_zeros((b * mq, hq, out.shape[3]))
    return full.index_copy(0, q_rows, out[0]).view(b, mq, hq, out.shape[3])


def _left_padded_decode(q, k, v, keys: torch.Tensor, window: int | None, options: dict) -> torch.Tensor:
    """A traced decode step on a left-padded batch, shapes static: q (B, Mq, Hq, K), k / v (B, Mk, Hkv, K / Kv) the
    layer's cache (a static cache's every slot), ``keys`` bool (B, slots <= Mk) from ``structured_mask``, slot j
    holding a token. Each sequence's keys run from its first token to its last, the last query's (left padding, as
    ``generate()`` pads decoder-only models): ``flash_attn_with_kvcache`` on the cache as it is, ``cache_leftpad``
    the first token's slot and ``cache_seqlens`` the last one's + 1, both computed on the device (argmax, no host
    read). Returns (B, Mq, Hq, Kv)."""
    slots = keys.int()
    starts = slots.argmax(1).to(torch.int32)
    ends = (keys.shape[1] - slots.flip(1).argmax(1)).to(torch.int32)
    window_size = (-1, -1) if window is None else (window - 1, 0)  # ``window`` keys, the query's own included
    return flash_attn_with_kvcache(q, k, v, cache_seqlens=ends, cache_leftpad=starts, softmax_scale=options["scale"],
                                   causal=True, window_size=window_size, softcap=options["softcap"],
                                   sinks=options["sinks"])


def _segments(q, k, v, segments: torch.Tensor, causal: bool, window: int | None, options: dict,
              quantize: str | None) -> torch.Tensor:
    """Sequences packed into batch rows (``segments``: int (B, T), each token's sequence index in its row, from
    ``structured_mask``): every row's runs become variable-length sequences of one packed batch, queries and keys
    alike (q / k / v: (B, T, H, K / Kv)). Returns (B, T, Hq, Kv)."""
    b, t, hq, _ = q.shape
    if k.shape[1] != t:
        raise ValueError(f"packed sequences (sequence index per token, {tuple(segments.shape)}) need as many keys as "
                         f"queries; got {t} queries and {k.shape[1]} keys")
    row = torch.arange(b, device=segments.device)[:, None] * (t + 1)  # runs never join across rows
    lens = torch.unique_consecutive((segments + row).reshape(-1), return_counts=True)[1].tolist()
    out = _sequences(q.reshape(1, b * t, hq, q.shape[3]), k.reshape(1, b * t, *k.shape[2:]),
                     v.reshape(1, b * t, *v.shape[2:]), lens, lens, causal, window, options,
                     quantize if max(lens) > DECODE_QUERIES else None)
    return out.reshape(b, t, hq, out.shape[3])


def _concatenated(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, window: int | None, options: dict,
                  quantize: str | None) -> torch.Tensor:
    """Sequences laid end to end in one batch row, as transformers' continuous batching (``generate_batch``: the
    keys read back from its paged cache) and padding-free training pass them: q (1, Tq, Hq, K), k / v (1, Tk, Hkv,
    K / Kv); sequence i's queries are rows cu_q[i]:cu_q[i+1] (``cu_seq_lens_q``, int (S + 1,)), its keys rows
    cu_k[i]:cu_k[i+1] (``cu_seq_lens_k``), queries aligned with the last keys. Rows past cu_q[-1] / cu_k[-1]
    (padding to static shapes) are left out; their outputs are 0. Returns (1, Tq, Hq, Kv)."""
    if q.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q / cu_seq_lens_k: the sequences lie end to end in one batch row; got a batch "
                         f"of {q.shape[0]} rows")
    q_lens, k_lens = cu_q.diff().tolist(), cu_k.diff().tolist()
    nq, nk = sum(q_lens), sum(k_lens)
    out = _sequences(q[:, :nq], k[:, :nk], v[:, :nk], q_lens, k_lens, causal, window, options,
                     quantize if max(q_lens, default=0) > DECODE_QUERIES else None)
    return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, q.shape[1] - nq))


def _paged_decode(q, k, v, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, cu_k: torch.Tensor,
                  window: int | None, options: dict) -> torch.Tensor:
    """A decode-only step of transformers' continuous batching on its paged cache, read in place: one new token per
    sequence, q (1, S, Hq, K) and k / v (1, S, Hkv, K / Kv) in one batch row; the cache's pages k_cache / v_cache
    (pages, page size, Hkv, K / Kv), ``table`` int32 (S, pages per sequence) (``block_table``), ``cu_k`` int (S + 1,)
    the sequences' lengths with the new token (``cu_seq_lens_k``). ``flash_attn_with_kvcache`` writes the new tokens
    into their pages and runs the paged decoders over them, with no host sync (a CUDA-graph batch's padding, sequences
    of length 0 whose page-table rows hold -1, writes and reads nothing on the GPU). Returns (1, S, Hq, Kv)."""
    s = q.shape[1]
    cached = (cu_k[1:s + 1] - cu_k[:s] - 1).clamp_min(0).to(torch.int32)  # tokens before the new one
    window_size = (-1, -1) if window is None else (window - 1, 0)  # ``window`` keys, the query's own included
    out = flash_attn_with_kvcache(q[0, :, None], k_cache, v_cache, k[0, :, None], v[0, :, None], cache_seqlens=cached,
                                  page_table=table, softmax_scale=options["scale"], causal=True,
                                  window_size=window_size, softcap=options["softcap"], sinks=options["sinks"])
    return out.transpose(0, 1)


def _sequences(q, k, v, q_lens: list[int], k_lens: list[int], causal: bool, window: int | None, options: dict,
               quantize: str | None) -> torch.Tensor:
    """Attention over packed sequences: q (1, sum(q_lens), Hq, K), k / v (1, sum(k_lens), Hkv, K / Kv); per sequence
    bottom-right causal (local with a ``window``) or bidirectional. ``quantize``: "fp8" / "i8fp8" to quantize
    inside, None for the model's dtype. Returns (1, sum(q_lens), Hq, Kv)."""
    mask = ab.BlockDiagonalMask.from_seqlens(q_lens, k_lens, device=q.device)
    if causal:
        mask = (mask.make_local_attention_from_bottomright(window) if window is not None
                else mask.make_causal_from_bottomright())
    if quantize is not None:
        return _quantized(q, k, v, mask, options, quantize)
    return memory_efficient_attention(q, k, v, mask, **options)


def _quantized(q, k, v, mask, options: dict, kind: str) -> torch.Tensor:
    """The quantized variants' prefill: ``fp8_attention`` / ``i8fp8_attention`` when gradients are needed and
    they take the call (causal or no mask: no window, softcap, dropout or padding), else q/k/v quantized here and the
    quantized forward with the call's mask and sinks (no gradients: inference)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        plain = mask is None or type(mask) is ab.LowerTriangularFromBottomRightMask
        if plain and not options["softcap"] and not options["p"]:
            fn = fp8_attention if kind == "fp8" else i8fp8_attention
            return fn(q, k, v, causal=mask is not None, softmax_scale=options["scale"], sinks=options["sinks"])
        return memory_efficient_attention(q, k, v, mask, **options)
    with torch.no_grad():
        if kind == "fp8":
            q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
            if isinstance(mask, ab.BlockDiagonalMask):  # packed sequences: one descale per sequence
                nseq = len(mask.q_seqinfo.seqstart_py) - 1
                qd, kd, vd = (d.expand(nseq, d.shape[1]).contiguous() for d in (qd, kd, vd))
            return memory_efficient_attention(q8, k8, v8, mask, q_descale=qd, k_descale=kd, v_descale=vd,
                                              output_dtype=q.dtype, scale=options["scale"],
                                              softcap=options["softcap"], sinks=options["sinks"])
        x = quantize_i8fp8(q, k, v, scale=options["scale"], qk_granularity="tensor", v_granularity="tensor")
        return memory_efficient_attention(x.q, x.k, x.v, mask, q_descale=x.q_descale, k_descale=x.k_descale,
                                          v_descale=x.v_descale, scale=x.softmax_scale, output_dtype=q.dtype,
                                          softcap=options["softcap"], sinks=options["sinks"])


def _variant(kind: str | None):
    def fn(module, query, key, value, attention_mask, **kwargs):
        return attention(module, query, key, value, attention_mask, quantize=kind, **kwargs)
    return fn


def _keep_for_continuous_batching() -> None:
    """Let transformers' continuous batching (``generate_batch``) run the ``IMPLEMENTATIONS``: it accepts only
    "paged|eager", "sdpa" and flash implementations and raises for others. Ours take its batches as they come
    (no mask; sequences end to end with ``cu_seq_lens_q`` / ``cu_seq_lens_k``, see ``_concatenated``), so its
    switch leaves them in place; other implementations go through transformers' own switch. Idempotent."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    switch = ContinuousBatchingManager.switch_to_cb_friendly_attn
    if getattr(switch, "keeps_fmha_ops", False):
        return

    @functools.wraps(switch)
    def keep_ours(self, model, *args, **kwargs):
        if model.config._attn_implementation in IMPLEMENTATIONS:
            return None
        return switch(self, model, *args, **kwargs)
    keep_ours.keeps_fmha_ops = True
    ContinuousBatchingManager.switch_to_cb_friendly_attn = keep_ours


def _keep_decode_fast_path() -> None:
    """Let transformers' continuous batching read its paged cache in place on decode-only steps (its "decode fast
    path", which it keeps for FlashAttention 2 / 3 on CUDA only): for the ``IMPLEMENTATIONS`` it stays on wherever
    every layer's cache takes a block table (full-attention layers; transformers turns it off where a layer slides
    a window), and those steps reach ``attention`` with ``block_table`` / ``k_cache`` / ``v_cache``
    (``_paged_decode``) instead of the cache gathered into sequences. ``max_blocks_per_request=0`` in the
    ``ContinuousBatchingConfig`` still turns it off. Idempotent."""
    from transformers.generation.continuous_batching import initialization

    check = initialization.ensure_decode_fast_path_is_available
    if getattr(check, "keeps_fmha_ops", False):
        return

    @functools.wraps(check)
    def keep_ours(config, cb_config, *args, **kwargs):
        if config._attn_implementation not in IMPLEMENTATIONS:
            return check(config, cb_config, *args, **kwargs)
        allocators = initialization.ATTN_TYPE_TO_ALLOCATOR
        if not all(allocators[kind].supports_block_table for kind in initialization.group_layers_by_attn_type(config)):
            cb_config.max_blocks_per_request = 0
        return None
    keep_ours.keeps_fmha_ops = True
    initialization.ensure_decode_fast_path_is_available = keep_ours


def register() -> None:
    """Register the attention and mask functions of ``IMPLEMENTATIONS`` with transformers and let its continuous
    batching run them, decode-only steps on its paged cache in place (idempotent; importing this module does it)."""
    for name, kind in IMPLEMENTATIONS.items():
        AttentionInterface.register(name, attention if kind is None else _variant(kind))
        AttentionMaskInterface.register(name, structured_mask)
    _keep_for_continuous_batching()
    _keep_decode_fast_path()


register()
