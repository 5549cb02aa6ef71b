"""Host-side logic of the FlyDSL decode kernels; imports neither FlyDSL nor a GPU runtime.

Layouts shared with :mod:`.decode`:

- q ``(B, Mq, Hq, D)`` f16/bf16, last dim contiguous; ``Hq = G * Hkv``, query head
  ``hkv * G + g`` belongs to kv head ``hkv``.
- KV cache ``(num_pages, page_size, Hkv, D)``, K and V with identical strides, last dim
  contiguous; ``block_table`` int32 ``(B, max_pages)``; ``seqlens`` int32 ``(B,)``.
- fp8 KV: ``k_scale``/``v_scale`` float32 ``(num_pages, page_size, Hkv)``, real value =
  fp8 value * scale (symmetric, per token and kv head).
- out ``(B, Mq, Hq, D)`` in q's dtype; lse float32 natural log ``(B, Hq, Mq)``.
- split-K partials: out ``(B, S, Mq, Hq, D)`` float32, lse ``(B, S, Hq, Mq)`` float32;
  split ``s`` of batch ``b`` owns keys ``[s * c, min((s + 1) * c, seqlen))`` with
  ``c = roundup(ceil(seqlen / S), 16)`` (:func:`split_bounds`); an empty split writes
  out 0 and lse -inf.
"""
from __future__ import annotations

import importlib.util
import math

import torch

ARCHS = ("gfx942", "gfx950")
HEAD_DIMS = (128, 256)
BLOCK_KEYS = 16
MAX_SPLITS = 64
# Compute units per arch (MI300X, MI355X), for the split heuristic.
NUM_CUS = {"gfx942": 304, "gfx950": 256}


def fp8_dtype(arch: str) -> torch.dtype:
    """The native fp8 KV format the kernel decodes on ``arch`` (``v_cvt_pk_f32_fp8``)."""
    return {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}[arch]


def kernel_configs() -> list[dict]:
    """Every kernel specialization the launchers can request (same for every arch)."""
    cfgs = []
    for d in HEAD_DIMS:
        for bf16 in (False, True):
            for fp8 in (False, True):
                for out_f32 in (False, True):
                    cfgs.append({"kind": "decode", "D": d, "BF16": bf16, "FP8": fp8, "OUT_F32": out_f32})
            cfgs.append({"kind": "reduce", "D": d, "BF16": bf16})
    return cfgs


def config_name(cfg: dict) -> str:
    dt = "bf16" if cfg["BF16"] else "f16"
    if cfg["kind"] == "reduce":
        return f"reduce_d{cfg['D']}_{dt}"
    kv = "fp8" if cfg["FP8"] else dt
    return f"decode_d{cfg['D']}_q{dt}_kv{kv}_{'split' if cfg['OUT_F32'] else 'single'}"


def device_arch(device=None) -> str | None:
    """``gfx942``-style arch name of a ROCm device, or None without a ROCm GPU."""
    if torch.version.hip is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


def available() -> str | None:
    """None when the kernels can run here, else the reason they cannot."""
    if importlib.util.find_spec("flydsl") is None:
        return "flydsl is not importable (pip install flydsl)"
    arch = device_arch()
    if arch is None:
        return "no ROCm GPU (FlyDSL decode kernels need gfx942 or gfx950)"
    if arch not in ARCHS:
        return f"ROCm GPU {arch} is not supported (gfx942, gfx950)"
    return None


def split_bounds(seqlen: int, num_splits: int, split: int) -> tuple[int, int]:
    """Key range ``[start, end)`` of ``split`` (may be empty), as the kernel computes it."""
    chunk = (-(-seqlen // num_splits) + BLOCK_KEYS - 1) // BLOCK_KEYS * BLOCK_KEYS
    start = split * chunk
    return start, max(start, min(seqlen, start + chunk))


def choose_num_splits(batch: int, num_kv_heads: int, rows: int, max_seqlen: int, arch: str = "gfx942",
                      min_keys_per_split: int = 256) -> int:
    """Splits so that about two workgroups per CU exist, each with >= ``min_keys_per_split`` keys.

    ``rows`` = Mq * (Hq // Hkv) query rows per kv head (packed 16 per workgroup).
    """
    tiles = batch * num_kv_heads * -(-rows // BLOCK_KEYS)
    want = -(-2 * NUM_CUS.get(arch, 304) // max(tiles, 1))
    cap = max(1, max_seqlen // min_keys_per_split)
    return max(1, min(want, cap, MAX_SPLITS))


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(token, head) fp8 quantization over the last dim: ``x ~ q * scale``."""
    fmax = torch.finfo(dtype).max
    amax = x.float().abs().amax(-1)
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    q = (x.float() / scale.unsqueeze(-1)).clamp(-fmax, fmax).to(dtype)
    return q, scale


def dense_to_paged(k: torch.Tensor, v: torch.Tensor, seqlens: torch.Tensor, page_size: int,
                   *, shuffle: bool = False, generator: torch.Generator | None = None, spare_pages: int = 0):
    """Copy a dense cache ``(B, L, Hkv, D)`` into the paged layout.

    Returns ``(k_cache, v_cache, block_table)``: caches ``(num_pages, page_size, Hkv, D)``
    and int32 ``block_table (B, max_pages)``. Batch ``b`` gets ``ceil(seqlens[b] / page_size)``
    pages (page order randomised when ``shuffle``); unused table entries and slots are 0.
    ``spare_pages`` extra pages are allocated (filled with zeros) so tests can place garbage.
    """
    B, L, Hkv, D = k.shape
    counts = [-(-int(s) // page_size) for s in seqlens.tolist()]
    max_pages = max(max(counts, default=0), 1)
    total = sum(counts) + spare_pages
    order = torch.randperm(total, generator=generator) if shuffle else torch.arange(total)
    kc = k.new_zeros(max(total, 1), page_size, Hkv, D)
    vc = v.new_zeros(max(total, 1), page_size, Hkv, D)
    table = torch.zeros(B, max_pages, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(counts):
        s = int(seqlens[b])
        for p in range(n):
            page = int(order[nxt])
            nxt += 1
            table[b, p] = page
            lo, hi = p * page_size, min(s, (p + 1) * page_size)
            kc[page, : hi - lo] = k[b, lo:hi]
            vc[page, : hi - lo] = v[b, lo:hi]
    return kc, vc, table.to(k.device)


def paged_to_dense(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Gather ``(B, length, Hkv, ...)`` from a paged cache (positions past a page list read page 0)."""
    page_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    pages = block_table.long()[:, pos // page_size]
    return cache[pages, (pos % page_size)[None, :]]


def flat(t: torch.Tensor) -> torch.Tensor:
    """1-D view from ``t``'s first element over every element it addresses.

    The kernels index with explicit strides, so passing 1-D views makes each compiled
    specialization depend on dtypes only (not on ranks or which dims have stride 1).
    """
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 1
    return t.as_strided((span,), (1,))


def _check(q, k_cache, v_cache, block_table, seqlens, k_scale, v_scale):
    assert q.dim() == 4 and k_cache.dim() == 4 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert q.shape[-1] == k_cache.shape[-1] and q.shape[-1] in HEAD_DIMS
    assert q.shape[2] % k_cache.shape[2] == 0
    assert block_table.dtype == torch.int32 and seqlens.dtype == torch.int32 and block_table.stride(-1) == 1
    fp8 = k_cache.element_size() == 1
    if fp8:
        assert k_scale is not None and v_scale is not None and k_scale.stride() == v_scale.stride()
        assert k_scale.shape == k_cache.shape[:3] and k_scale.dtype == torch.float32
    return fp8


def decode_args(q, k_cache, v_cache, block_table, seqlens, out, lse, *, k_scale=None, v_scale=None,
                scale=None, num_splits=1):
    """Positional runtime arguments of :func:`.decode.paged_decode` (before the constexprs).

    ``out``/``lse`` are the final tensors when ``num_splits == 1`` else the float32
    partials ``(B, S, Mq, Hq, D)`` / ``(B, S, Hq, Mq)``. Returns ``(args, constexprs)``.
    """
    fp8 = _check(q, k_cache, v_cache, block_table, seqlens, k_scale, v_scale)
    B, Mq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    split = out.dim() == 5
    assert out.stride(-1) == 1 and (out.dtype == torch.float32) == split and lse.dtype == torch.float32
    if split:
        assert out.shape == (B, num_splits, Mq, Hq, D) and lse.shape == (B, num_splits, Hq, Mq)
        o_st = out.stride()[:4]
        l_st = lse.stride()
    else:
        assert num_splits == 1 and out.shape == q.shape and lse.shape == (B, Hq, Mq)
        o_st = (out.stride(0), 0, out.stride(1), out.stride(2))
        l_st = (lse.stride(0), 0, lse.stride(1), lse.stride(2))
    ks = k_scale if fp8 else lse
    vs = v_scale if fp8 else lse
    sc_st = k_scale.stride() if fp8 else (0, 0, 0)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    tensors = tuple(flat(t) for t in (q, k_cache, v_cache, ks, vs, block_table, seqlens, out, lse))
    args = (*tensors,
            q.stride(0), q.stride(1), q.stride(2), *k_cache.stride()[:3], *sc_st, block_table.stride(0),
            *o_st, *l_st, B, Mq, Hq // Hkv, Hkv, k_cache.shape[1], num_splits, scale)
    consts = (D, q.dtype == torch.bfloat16, fp8, split)
    return args, consts


def reduce_args(part_out, part_lse, out, lse):
    """Positional runtime arguments of :func:`.decode.split_reduce` and its constexprs."""
    B, S, Mq, Hq, D = part_out.shape
    assert part_out.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == (B, Mq, Hq, D)
    assert part_lse.shape == (B, S, Hq, Mq) and lse.shape == (B, Hq, Mq)
    args = (*(flat(t) for t in (part_out, part_lse, out, lse)), *part_out.stride()[:4], *part_lse.stride(),
            out.stride(0), out.stride(1), out.stride(2), *lse.stride(), B, Mq, Hq, S)
    return args, (D, out.dtype == torch.bfloat16)


def decode_reference(q, k_cache, v_cache, block_table, seqlens, *, k_scale=None, v_scale=None, scale=None,
                     num_splits=1, dtype=torch.float64):
    """Reference in ``dtype`` of what the decode kernel writes.

    ``num_splits == 1``: ``(out, lse)`` in the final layouts (out in ``dtype``).
    ``num_splits > 1``: the partials ``(B, S, Mq, Hq, D)`` and ``(B, S, Hq, Mq)``.
    """
    B, Mq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = k_cache.to(dtype)
    v = v_cache.to(dtype)
    if k_scale is not None:
        k = k * k_scale.to(dtype).unsqueeze(-1)
        v = v * v_scale.to(dtype).unsqueeze(-1)
    out = torch.zeros(B, num_splits, Mq, Hq, D, dtype=dtype, device=q.device)
    lse = torch.full((B, num_splits, Hq, Mq), float("-inf"), dtype=dtype, device=q.device)
    for b in range(B):
        n = int(seqlens[b])
        kb = paged_to_dense(k, block_table[b:b + 1], n)[0].repeat_interleave(G, dim=1)  # (n, Hq, D)
        vb = paged_to_dense(v, block_table[b:b + 1], n)[0].repeat_interleave(G, dim=1)
        s_all = torch.einsum("mhd,nhd->hmn", q[b].to(dtype), kb) * scale
        for s in range(num_splits):
            lo, hi = split_bounds(n, num_splits, s)
            if hi <= lo:
                continue
            sc = s_all[..., lo:hi]
            ls = torch.logsumexp(sc, dim=-1)  # (Hq, Mq)
            p = torch.exp(sc - ls.unsqueeze(-1))
            out[b, s] = torch.einsum("hmn,nhd->mhd", p, vb[lo:hi])
            lse[b, s] = ls
    if num_splits == 1:
        return out[:, 0], lse[:, 0]
    return out, lse


def reduce_reference(part_out: torch.Tensor, part_lse: torch.Tensor):
    """Combine split partials ``(B, S, Mq, Hq, D)`` / ``(B, S, Hq, Mq)`` into ``(out, lse)``.

    The maths of the reduce kernel: weights ``exp(lse_s - max_s lse)``, empty splits
    (lse -inf) weigh 0; all-empty rows give out 0 and lse -inf.
    """
    pl = part_lse.permute(0, 3, 1, 2)  # (B, Mq, S, Hq)
    m = pl.amax(dim=2, keepdim=True)
    w = torch.where(pl > float("-inf"), torch.exp(pl - m), torch.zeros_like(pl))
    den = w.sum(dim=2)  # (B, Mq, Hq)
    num = (part_out * w.unsqueeze(-1).transpose(1, 2)).sum(dim=1)  # (B, Mq, Hq, D)
    out = torch.where(den.unsqueeze(-1) > 0, num / den.clamp_min(1e-30).unsqueeze(-1), torch.zeros_like(num))
    lse = (m.squeeze(2) + torch.log(den)).permute(0, 2, 1)  # (B, Hq, Mq)
    return out, lse
