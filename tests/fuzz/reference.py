"""float64 attention written for the fuzz, independent of the package's reference op.

Every function takes float64 (or any float) BMHK-style tensors and returns float64 values; a query row
that sees no key gets output 0 and lse -inf. Differentiable by torch autograd.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def visible(mq: int, mk: int, causal: str | None) -> torch.Tensor:
    """(mq, mk) bool: key j is visible from query i. causal None, "top_left" (j <= i) or
    "bottom_right" (j <= i + mk - mq)."""
    i = torch.arange(mq)[:, None]
    j = torch.arange(mk)[None, :]
    if causal == "top_left":
        return j <= i
    if causal == "bottom_right":
        return j <= i + (mk - mq)
    return torch.ones(mq, mk, dtype=torch.bool)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q (Mq, Hq, D), k (Mk, Hkv, D), v (Mk, Hkv, Dv) -> out (Mq, Hq, Dv), lse (Hq, Mq)."""
    q, k, v = q.double(), k.double(), v.double()
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q, k) * scale
    s = s.masked_fill(~visible(q.shape[0], k.shape[0], causal), -math.inf)
    if k.shape[0] == 0:
        lse = s.new_full((hq, q.shape[0]), -math.inf)
    else:
        lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe[..., None])
    return torch.einsum("hmn,nhd->mhd", p, v), lse


def dense(q, k, v, scale: float, causal: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched: q (B, Mq, Hq, D), k/v (B, Mk, Hkv, D) -> out (B, Mq, Hq, Dv), lse (B, Hq, Mq)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        o, l = attend(q[b], k[b], v[b], scale, causal)
        outs.append(o)
        lses.append(l)
    if not outs:
        return (q.new_zeros(q.shape[:3] + v.shape[3:], dtype=torch.float64),
                q.new_zeros((0, q.shape[2], q.shape[1]), dtype=torch.float64))
    return torch.stack(outs), torch.stack(lses)


def varlen(q, k, v, cu_q: Sequence[int], cu_k: Sequence[int], scale: float,
           causal: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed: q (Tq, Hq, D), k/v (Tk, Hkv, D), sequence i at rows [cu[i], cu[i+1]) ->
    out (Tq, Hq, Dv), lse (Hq, Tq)."""
    out = q.new_zeros(q.shape[:2] + v.shape[2:], dtype=torch.float64)
    lse = q.new_full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        o, l = attend(q[qs:qe], k[ks:ke], v[ks:ke], scale, causal)
        out[qs:qe], lse[:, qs:qe] = o, l
    return out, lse


def sequence_keys(cache: torch.Tensor, b: int, length: int, page_table: torch.Tensor | None,
                  batch_idx: torch.Tensor | None) -> torch.Tensor:
    """The first ``length`` rows of sequence b of a dense (B, L, ...) or paged (pages, page_size, ...) cache."""
    if page_table is None:
        row = int(batch_idx[b]) if batch_idx is not None else b
        return cache[row, :length]
    page = cache.shape[1]
    pos = torch.arange(length)
    return cache[page_table[b].long()[pos // page], pos % page]


def merge(parts: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions: parts (S, B, M, H, K), lses (S, B, H, M) -> out (B, M, H, K), lse (B, H, M)."""
    lse_t = lses.double().movedim(-1, 2)  # (S, B, M, H)
    top = lse_t.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse_t - top)
    total = w.sum(0)
    out = (w[..., None] * parts.double()).sum(0) / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return out, (top + torch.log(total)).movedim(1, -1)
