"""Merge of partial attentions over disjoint key sets in one launch (``merge_attentions`` on CUDA).

Each part s holds out_s (B, M, H, K) and its natural-log LSE lse_s (B, H, M). The merge per query row is
``lse = m + log(sum_s exp(lse_s - m))`` with m = max_s lse_s, and ``out = sum_s exp(lse_s - lse) * out_s``, in
float32; parts with lse -inf weigh 0, a row whose parts are all -inf gives out 0 and lse -inf. Up to
``MAX_PARTS`` parts are read where they lie (one pointer per part, no stacking copy); more are merged in groups,
each group's result being one part of the next (the merge is associative).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch, next_pow2

MAX_PARTS = 8  # parts one launch reads (the kernel's pointer parameters per tensor)
BLOCK_M = 32  # query rows per program
NUM_WARPS = 4


@triton.jit
def _part(s: tl.constexpr, P0, P1, P2, P3, P4, P5, P6, P7):
    """Part ``s``'s pointer (``s`` is a compile-time index)."""
    if s == 0:
        return P0
    elif s == 1:
        return P1
    elif s == 2:
        return P2
    elif s == 3:
        return P3
    elif s == 4:
        return P4
    elif s == 5:
        return P5
    elif s == 6:
        return P6
    else:
        return P7


@triton.jit
def _merge_kernel(A0, A1, A2, A3, A4, A5, A6, A7, L0, L1, L2, L3, L4, L5, L6, L7, OUT, LSE_OUT,
                  stride_ab, stride_am, stride_ah, stride_lb, stride_lh, stride_lm,
                  stride_ob, stride_om, stride_oh, stride_sb, stride_sh, M, H, K,
                  NUM_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, WRITE_LSE: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    l_offs = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + rows.to(tl.int64) * stride_lm
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_PARTS):
        lse_s = tl.load(_part(s, L0, L1, L2, L3, L4, L5, L6, L7) + l_offs, mask=row_ok, other=float("-inf"))
        top = tl.maximum(top, lse_s.to(tl.float32))
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    a_offs = (b.to(tl.int64) * stride_ab + h.to(tl.int64) * stride_ah + rows.to(tl.int64)[:, None] * stride_am
              + cols[None, :])
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    ok = row_ok[:, None] & col_ok[None, :]
    for s in tl.static_range(NUM_PARTS):
        lse_s = tl.load(_part(s, L0, L1, L2, L3, L4, L5, L6, L7) + l_offs, mask=row_ok, other=float("-inf"))
        w = tl.exp(lse_s.to(tl.float32) - top_safe)  # exp(-inf) = 0: an empty part weighs nothing
        total += w
        a = tl.load(_part(s, A0, A1, A2, A3, A4, A5, A6, A7) + a_offs, mask=ok, other=0.0)
        acc += w[:, None] * a.to(tl.float32)
    seen = total > 0.0
    safe_total = tl.where(seen, total, 1.0)
    inv = tl.where(seen, 1.0 / safe_total, 0.0)
    o_offs = (b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows.to(tl.int64)[:, None] * stride_om
              + cols[None, :])
    tl.store(OUT + o_offs, (acc * inv[:, None]).to(OUT.dtype.element_ty), mask=ok)
    if WRITE_LSE:
        merged = tl.where(seen, top_safe + tl.log(safe_total), float("-inf"))
        s_offs = b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh + rows.to(tl.int64)
        tl.store(LSE_OUT + s_offs, merged, mask=row_ok)


def merge_parts(outs: list[torch.Tensor], lses: list[torch.Tensor], out_dtype: torch.dtype,
                write_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge S >= 1 partial attentions.

    Parameters
    ----------
    outs : list of torch.Tensor
        S parts (B, M, H, K), one shape, float16 / bfloat16 / float32, last dim contiguous, every part with the
        same strides.
    lses : list of torch.Tensor
        S float32 LSEs (B, H, M) (natural log, -inf for a row that saw no key), every one with the same strides.
    out_dtype : torch.dtype
        The merged output's dtype.
    write_lse : bool
        Also return the merged LSE.

    Returns
    -------
    (out (B, M, H, K) contiguous in ``out_dtype``, lse float32 (B, H, M) contiguous, or None)

    Example
    -------
    >>> out, lse = merge_parts([o1, o2], [l1, l2], torch.bfloat16)  # doctest: +SKIP
    """
    B, M, H, K = outs[0].shape
    device = outs[0].device
    while len(outs) > MAX_PARTS:  # merge a full group, its result becomes the first part of the rest
        head_out, head_lse = merge_parts(outs[:MAX_PARTS], lses[:MAX_PARTS], torch.float32, True)
        outs, lses = [head_out, *outs[MAX_PARTS:]], [head_lse, *lses[MAX_PARTS:]]
        if any(t.stride() != head_out.stride() for t in outs) or any(t.stride() != head_lse.stride() for t in lses):
            outs, lses = [t.contiguous() for t in outs], [t.contiguous() for t in lses]
    out = torch.empty((B, M, H, K), dtype=out_dtype, device=device)
    lse = torch.empty((B, H, M), dtype=torch.float32, device=device) if write_lse else None
    if out.numel() == 0:
        if lse is not None:
            lse.fill_(float("-inf"))
        return out, lse
    n = len(outs)
    a_ptrs = outs + [outs[0]] * (MAX_PARTS - n)
    l_ptrs = lses + [lses[0]] * (MAX_PARTS - n)
    a, lp = outs[0], lses[0]
    lse_arg = lse if lse is not None else lp
    launch(_merge_kernel)[(cdiv(M, BLOCK_M), B * H)](
        *a_ptrs, *l_ptrs, out, lse_arg,
        a.stride(0), a.stride(1), a.stride(2), lp.stride(0), lp.stride(1), lp.stride(2),
        out.stride(0), out.stride(1), out.stride(2), lse_arg.stride(0), lse_arg.stride(1), M, H, K,
        NUM_PARTS=n, BLOCK_M=BLOCK_M, BLOCK_K=max(next_pow2(K), 16), WRITE_LSE=write_lse, num_warps=NUM_WARPS)
    return out, lse
