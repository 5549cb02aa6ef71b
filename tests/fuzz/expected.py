"""float64 expected results of memory_efficient_attention-style calls, from the call's own arguments.

Reads the masks' xformers fields (``q_seqinfo.seqstart_py``, ``k_seqinfo``, ``block_tables``,
``page_size``) and the descale shapes (module docstring of ``fmha_ops.inputs``), and computes with
``reference`` only.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from fmha_ops import attn_bias as ab
from fmha_ops.quant import K_SCALE_BLOCK, Q_SCALE_BLOCK

from . import reference as ref

_CAUSAL = {ab.LowerTriangularMask: "top_left", ab.LowerTriangularFromBottomRightMask: "bottom_right",
           ab.BlockDiagonalCausalMask: "top_left", ab.BlockDiagonalCausalFromBottomRightMask: "bottom_right",
           ab.BlockDiagonalCausalWithOffsetPaddedKeysMask: "bottom_right",
           ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask: "bottom_right"}


def causal_of(bias: Any) -> str | None:
    for cls in type(bias).__mro__:
        if cls in _CAUSAL:
            return _CAUSAL[cls]
    return None


def dequantize(x: torch.Tensor, d: torch.Tensor | None, role: str, nseq: int | None, seq_of_row=None) -> torch.Tensor:
    """float64 x (B, M, H, D) times its descale ``d`` (kind read from its shape)."""
    xd = x.double()
    if d is None:
        return xd
    d = d.double()
    b, m, h, dim = x.shape
    if d.numel() == 1:
        return xd * d.reshape(())
    if d.shape == x.shape[:3]:  # per token
        return xd * d[..., None]
    if d.ndim == 2 and seq_of_row is not None:  # (nseq, Hkv) with packed sequences
        per_row = d[seq_of_row]  # (M, Hkv)
        return xd * per_row.repeat_interleave(h // d.shape[1], 1)[None, :, :, None]
    if d.ndim == 2:  # (B, Hkv)
        return xd * d.repeat_interleave(h // d.shape[1], 1)[:, None, :, None]
    if role in ("q", "k") and d.ndim == 3 and d.shape[:2] == (b, h):  # per block of tokens
        block = Q_SCALE_BLOCK if role == "q" else K_SCALE_BLOCK
        return xd * d.repeat_interleave(block, 2)[:, :, :m].transpose(1, 2)[..., None]
    if role == "v" and d.ndim == 3:  # per channel (B, Hkv, Dv)
        return xd * d[:, None]
    raise AssertionError(f"fuzz expected(): unknown descale shape {tuple(d.shape)} for {role}")


def _rows_of(seqstart: list[int]) -> torch.Tensor:
    lens = [b - a for a, b in zip(seqstart, seqstart[1:])]
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.long))


def attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, q_descale=None, k_descale=None,
              v_descale=None, quantize_kv_to_fp8=False, **_ignored) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out, lse) of a memory_efficient_attention call: out in the query's layout (BMHK, BMGHK or
    BMK), lse (B, Hq, Mq) / (B, G, H, Mq) / (B, Mq)."""
    fold = None
    if query.ndim == 5:
        b, m, g, h, _ = query.shape
        fold = ("bmghk", b, m, g, h)
        expanded = key.shape[3] == 1 or key.stride(3) == 0
        query = query.reshape(b, m, g * h, query.shape[-1])
        key = key[:, :, :, 0] if expanded else key.flatten(2, 3)
        value = value[:, :, :, 0] if expanded else value.flatten(2, 3)
    elif query.ndim == 3:
        fold = ("bmk",)
        query, key, value = query[:, :, None], key[:, :, None], value[:, :, None]
    sc = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    varlen = isinstance(attn_bias, ab.BlockDiagonalMask)
    q_rows = _rows_of(attn_bias.q_seqinfo.seqstart_py) if varlen else None
    k_rows = _rows_of(attn_bias.k_seqinfo.seqstart_py) if varlen else None
    q = dequantize(query, q_descale, "q", None, q_rows)
    if quantize_kv_to_fp8:
        k, v = _fp8_roundtrip(key), _fp8_roundtrip(value)
    else:
        k = dequantize(key, k_descale, "k", None, k_rows)
        v = dequantize(value, v_descale, "v", None, k_rows)
    causal = causal_of(attn_bias)
    if attn_bias is None or isinstance(attn_bias, (ab.LowerTriangularMask, ab.LowerTriangularFromBottomRightMask)):
        out, lse = ref.dense(q, k, v, sc, causal)
    elif varlen:
        o, l = ref.varlen(q[0], k[0], v[0], attn_bias.q_seqinfo.seqstart_py, attn_bias.k_seqinfo.seqstart_py,
                          sc, causal)
        out, lse = o[None], l[None]
    else:
        out, lse = _decode(q, k, v, attn_bias, sc, causal)
    if fold is None:
        return out, lse
    if fold[0] == "bmk":
        return out[:, :, 0], lse[:, 0]
    _, b, m, g, h = fold
    return out.reshape(b, m, g, h, out.shape[-1]), lse.reshape(b, g, h, m)


def _fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Per-(token, head) fp8 e4m3 quantization and back, as quantize_kv_to_fp8 does."""
    fmax = torch.finfo(torch.float8_e4m3fn).max
    xf = x.float()
    amax = xf.abs().amax(-1)
    s = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    return ((xf / s[..., None]).clamp(-fmax, fmax).to(torch.float8_e4m3fn).float() * s[..., None]).double()


def _decode(q, k, v, bias, scale, causal):
    """Padded / paged keys masks: q (1, sum Mq, Hq, D), keys of sequence i from its rows or pages."""
    starts = bias.q_seqinfo.seqstart_py
    lens = bias.k_seqinfo.seqlen.tolist()
    out = torch.zeros(q.shape[:3] + v.shape[3:], dtype=torch.float64)
    lse = torch.full((1, q.shape[2], q.shape[1]), -math.inf, dtype=torch.float64)
    paged = isinstance(bias, ab.PagedBlockDiagonalPaddedKeysMask)
    for i in range(len(starts) - 1):
        n = lens[i]
        if paged:
            pos = torch.arange(n)
            rows = bias.block_tables[i].long()[pos // bias.page_size] * bias.page_size + pos % bias.page_size
        else:
            rows = torch.arange(n) + i * bias.k_seqinfo.padding
        o, l = ref.attend(q[0, starts[i]:starts[i + 1]], k[0, rows], v[0, rows], scale, causal)
        out[0, starts[i]:starts[i + 1]], lse[0, :, starts[i]:starts[i + 1]] = o, l
    return out, lse
