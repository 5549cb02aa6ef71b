"""KV-cache helpers in plain torch: fp8 per-token quantization, dense <-> paged conversion.

Cost of fp8 KV: decode is bound by reading K and V, so an fp8 cache (1 byte per element plus
one float32 scale per token and head, i.e. 1 + 4/D bytes) halves the bytes of a bf16 one. Scales are
laid out with the tokens of each head contiguous (any strides work; this layout is the fast one).
That only pays when the cache is built once and reused across decode steps
(``build_fp8_paged_cache`` here, or the append of ``flash_attn_with_kvcache`` quantizing each new token as it
is written: the ``kv_append`` kernel on a GPU, ``append_to_cache`` in torch).
Quantizing a bf16 cache on every call reads 2 bytes and writes 1 + 4/D bytes per element before
the decode reads 1 + 4/D again: about 4 bytes per element against 2 for plain bf16 decode,
so per-call quantization is roughly 2x slower than bf16 decode and 4x slower than a prebuilt
fp8 cache.
"""
from __future__ import annotations

import torch

from . import arguments, checks

_FLOAT_INPUTS = arguments.FLOATS + (torch.float64,)


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """Symmetric per-row fp8 quantization over the last dim: ``x ~= x8 * scale[..., None]``.

    scale = amax / fp8_max in float32 (1 for an all-zero row); returns (x8, scale) with scale
    shaped like x without its last dim. Matches ``kv_append``'s in-kernel quantization.

    Example
    -------
    >>> x8, scale = quantize_fp8(torch.tensor([[1.0, -4.0], [0.0, 0.0]]))
    >>> scale.tolist(), x8.float().tolist()
    ([0.008928571827709675, 1.0], [[112.0, -448.0], [0.0, 0.0]])
    """
    arguments.tensor("x", x, dtypes=_FLOAT_INPUTS)
    arguments.dtype("dtype", dtype, arguments.FP8)
    fmax = torch.finfo(dtype).max
    xf = x.float()
    amax = xf.abs().amax(-1)
    # divide by a tensor: torch on CUDA turns division by a Python scalar into a multiply by its rounded
    # reciprocal (1 ulp off amax / fmax), and the scales must match the kernels' correctly rounded quotient
    scale = torch.where(amax > 0, amax / amax.new_full((), fmax), torch.ones_like(amax))
    x8 = (xf / scale[..., None]).clamp(-fmax, fmax).to(dtype)
    return x8, scale


def keys_contiguous(scale: torch.Tensor) -> torch.Tensor:
    """The same (..., L, H) scales laid out with L contiguous per head (strides of a (..., H, L) tensor): the
    layout in which the sm90 fp8 decoder reads a tile's scales in 16-byte copies.

    Example
    -------
    >>> keys_contiguous(torch.zeros(2, 16, 4)).stride()
    (64, 1, 16)
    """
    arguments.tensor("scale", scale)
    if scale.ndim < 2:
        raise ValueError(f"scale must have >= 2 dims (..., L, H), got shape {tuple(scale.shape)}")
    return scale.transpose(-1, -2).contiguous().transpose(-1, -2)


def quantize_kv_fp8(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """Per-token, per-head fp8 quantization of K and V (..., L, Hkv, D): (k8, v8, k_scale, v_scale), scales
    (..., L, Hkv) float32 with L contiguous per head (``keys_contiguous``).

    Example
    -------
    >>> k8, v8, ks, vs = quantize_kv_fp8(torch.randn(2, 16, 4, 64), torch.randn(2, 16, 4, 64))
    >>> k8.dtype, tuple(ks.shape)
    (torch.float8_e4m3fn, (2, 16, 4))
    """
    arguments.tensor("k", k, dtypes=_FLOAT_INPUTS)
    arguments.tensor("v", v, dtypes=_FLOAT_INPUTS)
    k8, ks = quantize_fp8(k, dtype)
    v8, vs = quantize_fp8(v, dtype)
    return k8, v8, keys_contiguous(ks), keys_contiguous(vs)


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``x8 * scale[..., None]``.

    Example
    -------
    >>> dequantize_fp8(*quantize_fp8(torch.tensor([[1.0, -4.0]]))).tolist()
    [[1.0, -4.0]]
    """
    arguments.tensor("x8", x8)
    arguments.tensor("scale", scale)
    arguments.shape("scale", scale, tuple(x8.shape[:-1]), f"(x8's shape {tuple(x8.shape)} without its last dim)")
    return x8.float() * scale[..., None]


def paged_from_dense(tensors, page_size: int, *, num_pages: int | None = None,
                     generator: torch.Generator | None = None):
    """Scatter dense (B, L, ...) tensors into shuffled pages (num_pages, page_size, ...).

    All tensors share one int32 block table (B, ceil(L / page_size)) of distinct pages drawn
    at random from ``num_pages`` (default: exactly as many as needed). Slots past L stay zero.
    Returns (list of paged tensors, block_table).

    Example
    -------
    >>> (k_pages,), table = paged_from_dense([torch.randn(2, 50, 4, 64)], 16)
    >>> tuple(k_pages.shape), tuple(table.shape)
    ((8, 16, 4, 64), (2, 4))
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if (not isinstance(tensors, (list, tuple)) or not tensors
            or any(not isinstance(t, torch.Tensor) or t.ndim < 2 for t in tensors)):
        raise ValueError(f"tensors must be a non-empty list of (B, L, ...) tensors, got {type(tensors).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    B, L = tensors[0].shape[:2]
    if any(t.shape[:2] != (B, L) or t.device != tensors[0].device for t in tensors):
        raise ValueError(f"tensors must share (B, L) and a device; got "
                         f"{[(tuple(t.shape[:2]), str(t.device)) for t in tensors]}")
    per_seq = -(-L // page_size)
    total = B * per_seq
    num_pages = total if num_pages is None else num_pages
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < total:
        raise ValueError(f"num_pages={num_pages!r} cannot hold {B} sequences of {L} keys in pages of {page_size} "
                         f"(needs an int >= {total})")
    device = tensors[0].device
    perm = torch.randperm(num_pages, generator=generator)[:total].to(device)
    block_table = perm.view(B, per_seq).to(torch.int32)
    out = []
    for x in tensors:
        padded = x.new_zeros((B, per_seq * page_size, *x.shape[2:]))
        padded[:, :L] = x
        pages = x.new_zeros((num_pages, page_size, *x.shape[2:]))
        pages[perm] = padded.view(total, page_size, *x.shape[2:])
        out.append(pages)
    return out, block_table


def dense_from_paged(pages: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Gather (num_pages, page_size, ...) through block_table (B, P) into (B, length, ...).

    Example
    -------
    >>> x = torch.randn(2, 50, 4, 64)
    >>> (pages,), table = paged_from_dense([x], 16)
    >>> torch.equal(dense_from_paged(pages, table, 50), x)
    True
    """
    arguments.tensor("pages", pages)
    if pages.ndim < 2:
        raise ValueError(f"pages must be (num_pages, page_size, ...), got shape {tuple(pages.shape)}")
    arguments.tensor("block_table", block_table, ndim=2, dtypes=(torch.int32, torch.int64), layout="(B, max_pages)")
    checks.validate_indices(checks.IndexCheck("block_table", block_table, 0, pages.shape[0] - 1,
                                              f"pages has {pages.shape[0]} pages"))
    B, P = block_table.shape
    arguments.integer("length", length, minimum=0, maximum=P * pages.shape[1])
    g = pages[block_table.long()]
    return g.reshape(B, P * pages.shape[1], *pages.shape[2:])[:, :length]


def build_fp8_paged_cache(k: torch.Tensor, v: torch.Tensor, page_size: int,
                          dtype: torch.dtype = torch.float8_e4m3fn, *, num_pages: int | None = None,
                          generator: torch.Generator | None = None):
    """Quantize dense bf16/fp16 K (B, L, Hkv, D) and V (B, L, Hkv, Dv) once and page them (Dv may differ from D).

    Returns (k_cache, v_cache, k_scale, v_scale, block_table): caches (num_pages, page_size,
    Hkv, D) and (..., Dv) in ``dtype``, scales float32 (num_pages, page_size, Hkv) with the slots of each page contiguous per
    head (``keys_contiguous``), block_table int32.

    Example
    -------
    >>> k, v = torch.randn(2, 100, 8, 128, dtype=torch.bfloat16), torch.randn(2, 100, 8, 128, dtype=torch.bfloat16)
    >>> k_cache, v_cache, k_scale, v_scale, table = build_fp8_paged_cache(k, v, 64)
    >>> tuple(k_cache.shape), tuple(k_scale.shape), tuple(table.shape)
    ((4, 64, 8, 128), (4, 64, 8), (2, 2))
    """
    arguments.tensor("k", k, ndim=4, dtypes=_FLOAT_INPUTS, layout="(B, L, Hkv, D)")
    arguments.tensor("v", v, ndim=4, dtypes=_FLOAT_INPUTS, layout="(B, L, Hkv, Dv)")
    arguments.shape("v", v, tuple(k.shape[:3]) + (v.shape[3],), "(k's (B, L, Hkv))")
    arguments.dtype("dtype", dtype, arguments.FP8)
    (k8, ks), (v8, vs) = quantize_fp8(k, dtype), quantize_fp8(v, dtype)  # paging copies: lay the scales out after
    (kc, vc, kss, vss), bt = paged_from_dense([k8.view(torch.uint8), v8.view(torch.uint8), ks, vs],
                                              page_size, num_pages=num_pages, generator=generator)
    return kc.view(dtype), vc.view(dtype), keys_contiguous(kss), keys_contiguous(vss), bt


def append_to_cache(k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cache_seqlens: torch.Tensor, *, block_table: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write k_new/v_new (B, Mnew, Hkv, D) into the cache at positions cache_seqlens[b] + 0..Mnew-1, in torch.

    The same contract as the ``kv_append`` kernel (``fmha_ops.kernels.triton.kv_append``), for any device:
    caches paged (num_pages, page_size, Hkv, D) through ``block_table`` int32 (B, max_pages) or dense
    (B, Lmax, Hkv, D); an fp8 cache gets each row quantized per token (``quantize_fp8``) with its scale in
    ``k_scale`` / ``v_scale`` (the cache's shape without D, any strides). Positions outside the cache and
    block-table entries outside [0, num_pages) are skipped.

    Example
    -------
    >>> k_cache, v_cache = torch.zeros(2, 8, 1, 16), torch.zeros(2, 8, 1, 16)
    >>> append_to_cache(torch.ones(2, 1, 1, 16), torch.ones(2, 1, 1, 16), k_cache, v_cache,
    ...                 torch.tensor([3, 0], dtype=torch.int32))
    >>> k_cache[0, 3, 0, 0].item(), k_cache[1, 0, 0, 0].item()
    (1.0, 1.0)
    """
    B, mnew = k_new.shape[:2]
    device = k_cache.device
    pos = cache_seqlens.to(device, torch.int64)[:, None] + torch.arange(mnew, device=device)
    seq = torch.arange(B, device=device)[:, None].expand(B, mnew)
    if block_table is None:
        ok = (pos >= 0) & (pos < k_cache.shape[1])
        page, slot = seq, pos
    else:
        page_size = k_cache.shape[1]
        ok = (pos >= 0) & (pos < block_table.shape[1] * page_size)
        page = torch.zeros_like(pos)
        page[ok] = block_table.to(device, torch.int64)[seq[ok], pos[ok] // page_size]
        ok &= (page >= 0) & (page < k_cache.shape[0])
        slot = pos % page_size
    page, slot = page[ok], slot[ok]
    for new, cache, scale in ((k_new, k_cache, k_scale), (v_new, v_cache, v_scale)):
        rows = new.to(device)[ok]
        if cache.element_size() == 1:  # index_put on the bytes: fp8 dtypes lack it
            rows, row_scale = quantize_fp8(rows, cache.dtype)
            scale[page, slot] = row_scale
            cache.view(torch.uint8)[page, slot] = rows.view(torch.uint8)
        else:
            cache[page, slot] = rows.to(cache.dtype)
