"""FlashAttention-3-style functional API in front of the op registry.

Layout (batch, seqlen, heads, headdim), GQA/MQA by Hq % Hkv == 0, causal aligned bottom-right.
fp8 inputs take float32 descales ``(batch, num_kv_heads)`` or per-tensor and return bfloat16.
Performance hints FA3 takes (``num_splits``, ``pack_gqa``, ``sm_margin``, ``scheduler_metadata``,
``deterministic``) are accepted; features this package does not implement (sliding windows, softcap,
rotary embedding, ``qv``, chunked attention, ``seqused_*``, ``cache_leftpad``) raise
``NotImplementedError`` naming the argument.

Differentiating fp8 inputs needs ``set_fp8_dequantized_backward(True)``: the backward then runs on
the dequantized values with a bf16 kernel. For training, ``fmha_ops.fp8_attention`` takes bf16 q/k/v,
quantizes inside, runs the fp8 forward and returns bf16 gradients to the bf16 tensors.
"""
from __future__ import annotations

import functools

import torch

from . import attn_bias as ab
from .api import memory_efficient_attention, memory_efficient_attention_partial
from .fp8_backward import set_fp8_dequantized_backward

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "set_fp8_dequantized_backward"]


def _unsupported(**args) -> None:
    for name, (value, default) in args.items():
        if value != default and value is not default:
            raise NotImplementedError(f"{name}={value!r} is not implemented by fmha_ops (only {name}={default!r})")


def _run(q, k, v, bias, softmax_scale, q_descale, k_descale, v_descale, return_lse):
    kw = dict(scale=softmax_scale, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if return_lse:
        out_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        return memory_efficient_attention_partial(q, k, v, bias, output_dtype=out_dtype, **kw)
    return memory_efficient_attention(q, k, v, bias, **kw)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                    causal: bool = False, qv=None, q_descale: torch.Tensor | None = None,
                    k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                    window_size: tuple[int, int] = (-1, -1), attention_chunk: int = 0, softcap: float = 0.0,
                    num_splits: int = 1, pack_gqa=None, deterministic: bool = False, sm_margin: int = 0,
                    return_attn_probs: bool = False):
    """q (B, Mq, Hq, D), k (B, Mk, Hkv, D), v (B, Mk, Hkv, Dv) -> out (B, Mq, Hq, Dv)
    [, softmax_lse float32 (B, Hq, Mq) when ``return_attn_probs``]."""
    _unsupported(qv=(qv, None), window_size=(tuple(window_size), (-1, -1)), attention_chunk=(attention_chunk, 0),
                 softcap=(softcap, 0.0))
    bias = ab.LowerTriangularFromBottomRightMask() if causal else None
    return _run(q, k, v, bias, softmax_scale, q_descale, k_descale, v_descale, return_attn_probs)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, seqused_q=None,
                           seqused_k=None, softmax_scale: float | None = None, causal: bool = False, qv=None,
                           q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                           v_descale: torch.Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
                           attention_chunk: int = 0, softcap: float = 0.0, num_splits: int = 1, pack_gqa=None,
                           deterministic: bool = False, sm_margin: int = 0, return_attn_probs: bool = False):
    """Packed sequences: q (total_q, Hq, D), k/v (total_k, Hkv, D); cu_seqlens_* int32 (nseq + 1,).
    Descales are (nseq, Hkv) or per-tensor. Returns out (total_q, Hq, Dv) [, lse (Hq, total_q)].
    Reads cu_seqlens on the host once per call (one device sync)."""
    _unsupported(seqused_q=(seqused_q, None), seqused_k=(seqused_k, None), qv=(qv, None),
                 window_size=(tuple(window_size), (-1, -1)), attention_chunk=(attention_chunk, 0),
                 softcap=(softcap, 0.0))
    cls = ab.BlockDiagonalCausalFromBottomRightMask if causal else ab.BlockDiagonalMask
    bias = cls(_seqinfo(cu_seqlens_q, max_seqlen_q), _seqinfo(cu_seqlens_k, max_seqlen_k))
    res = _run(q[None], k[None], v[None], bias, softmax_scale, q_descale, k_descale, v_descale, return_attn_probs)
    if return_attn_probs:
        return res[0][0], res[1][0]
    return res[0]


def _seqinfo(cu: torch.Tensor, max_seqlen: int) -> ab._SeqLenInfo:
    starts = [int(x) for x in cu.tolist()]
    lens = [b - a for a, b in zip(starts, starts[1:])]
    return ab._SeqLenInfo(starts, cu.to(torch.int32), max(lens, default=0) if max_seqlen is None else max_seqlen,
                          min(lens, default=0))


@functools.lru_cache(maxsize=256)
def _uniform_q(batch: int, mq: int) -> ab._SeqLenInfo:
    return ab._SeqLenInfo.from_seqlens([mq] * batch)


@functools.lru_cache(maxsize=64)
def _identity_table(device: torch.device, batch: int) -> torch.Tensor:
    return torch.arange(batch, dtype=torch.int32, device=device)[:, None]


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
                            pack_gqa=None, sm_margin: int = 0, return_softmax_lse: bool = False):
    """Decode against a KV cache, appending new tokens first (FA3 semantics).

    q (B, Mq, Hq, D) bf16/fp16 with Mq new tokens per sequence. Cache: dense (B_cache, L, Hkv, D)
    (rows picked by ``cache_batch_idx`` int32 (B,) when given) or paged (num_pages, page_size, Hkv, D)
    with ``page_table`` int32 (B, max_pages). A bf16/fp16 cache, or fp8 e4m3 with ``k_descale`` /
    ``v_descale`` float32 per token (the cache's shape without D; any strides, fastest with each head's slots
    contiguous: ``kv_cache.keys_contiguous``). ``cache_seqlens`` int32 (B,) (or an
    int): tokens already in the cache. If ``k``/``v`` (B, Mnew, Hkv, D) are given they are written at
    ``cache_seqlens`` (quantized per token into an fp8 cache) and attended too. ``causal`` aligns the
    queries to the end of each sequence. No host sync: capturable in a CUDA graph.
    Returns out (B, Mq, Hq, D) [, softmax_lse float32 (B, Hq, Mq)].
    """
    _unsupported(qv=(qv, None), rotary_cos=(rotary_cos, None), rotary_sin=(rotary_sin, None),
                 cache_leftpad=(cache_leftpad, None), cu_seqlens_q=(cu_seqlens_q, None),
                 cu_seqlens_k_new=(cu_seqlens_k_new, None), rotary_seqlens=(rotary_seqlens, None),
                 window_size=(tuple(window_size), (-1, -1)), attention_chunk=(attention_chunk, 0),
                 softcap=(softcap, 0.0))
    if q_descale is not None:
        raise NotImplementedError("q_descale is not implemented for flash_attn_with_kvcache (pass a bf16/fp16 q)")
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} "
                         f"must be 4-D (batch/pages, seqlen/page_size, heads, headdim)")
    batch, mq = q.shape[:2]
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required (int32 (batch,) or an int)")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must be int32 of shape ({batch},), got {cache_seqlens.dtype} "
                         f"{tuple(cache_seqlens.shape)}")
    if page_table is None:
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            raise ValueError(f"k_cache has {k_cache.shape[0]} sequences but q has {batch}; pass cache_batch_idx")
        page_table = (_identity_table(q.device, batch) if cache_batch_idx is None
                      else cache_batch_idx.to(torch.int32)[:, None])
    elif cache_batch_idx is not None:
        raise ValueError("cache_batch_idx is for dense caches; with page_table, reorder the page table instead")
    page = k_cache.shape[1]
    per_token = k_descale is not None and k_descale.numel() > 1
    if k is not None:
        if v is None or k.shape[0] != batch:
            raise ValueError(f"k and v must both be given with batch {batch}")
        from .kernels.triton.kv_append import kv_append

        kv_append(k, v, k_cache, v_cache, cache_seqlens, block_table=page_table,
                  k_scale=k_descale if per_token else None, v_scale=v_descale if per_token else None)
        seqlens = cache_seqlens + k.shape[1]
    else:
        seqlens = cache_seqlens
    kind = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask if causal else ab.PagedBlockDiagonalPaddedKeysMask
    bias = kind(_uniform_q(batch, mq), ab._PaddedSeqLenInfo(None, seqlens, page_table.shape[1] * page),
                page_table, page)
    pool = (1, k_cache.shape[0] * page)
    kd = k_descale.reshape(pool + k_descale.shape[2:]) if per_token else k_descale
    vd = v_descale.reshape(pool + v_descale.shape[2:]) if per_token else v_descale
    res = _run(q.reshape(1, batch * mq, *q.shape[2:]), k_cache.reshape(pool + k_cache.shape[2:]),
               v_cache.reshape(pool + v_cache.shape[2:]), bias, softmax_scale, None, kd, vd, return_softmax_lse)
    if return_softmax_lse:
        out, lse = res
        return out.view(q.shape[:3] + out.shape[3:]), lse.view(lse.shape[1], batch, mq).permute(1, 0, 2)
    return res.view(q.shape[:3] + res.shape[3:])
