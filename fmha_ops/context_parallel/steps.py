"""One ring step's attention on one rank: partial attentions of its blocks merged into float32 accumulators
(forward), and their gradients given the merged output and LSE (backward).

Both run on the tensors in hand, with no communication, so a single process can run every rank's steps
in turn (``tests/test_context_parallel.py`` does, on the GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..api import memory_efficient_attention_partial, merge_attentions
from ..dispatch import SELECTOR
from ..inputs import make_inputs
from ..validation import make_problem
from .schedule import Block, ShardGeometry

_SEQ, _LSE_SEQ = 1, 2  # sequence dim of BMHK tensors and of (B, H, M) LSEs


@dataclass
class KVShard:
    """A key/value shard with its descales (None for float inputs): what travels around the ring."""

    key: torch.Tensor
    value: torch.Tensor
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None


@dataclass
class Accumulator:
    """Merged attention so far: out (B, M, Hq, Kv) float32 and lse (B, Hq, M) float32."""

    out: torch.Tensor
    lse: torch.Tensor


def partial_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """Output dtype of each block's partial attention: float16/bfloat16 inputs keep their dtype (the fast
    ops write it; merging is in float32), float32 and quantized inputs give float32."""
    return q_dtype if q_dtype in (torch.float16, torch.bfloat16) else torch.float32


def forward_step(acc: Accumulator | None, query: torch.Tensor, kv: KVShard, blocks: Sequence[Block],
                 geom: ShardGeometry, scale: float | None, q_descale: torch.Tensor | None = None,
                 op: Any = None) -> Accumulator | None:
    """Merge the attention of ``query`` (this rank's shard, BMHK) over ``kv`` for ``blocks`` into ``acc``.

    ``acc`` None starts the accumulation (the first block must cover every query row, as the first step's does).
    Returns the updated accumulator (None if still empty).
    """
    for block in blocks:
        rq, rk = geom.rows(block.q_rows), geom.rows(block.kv_rows)
        out, lse = memory_efficient_attention_partial(
            rq.take(query, _SEQ), rk.take(kv.key, _SEQ), rk.take(kv.value, _SEQ), geom.mask(block), scale=scale,
            op=op, output_dtype=partial_dtype(query.dtype), q_descale=q_descale, k_descale=kv.k_descale,
            v_descale=kv.v_descale)
        if acc is None:
            if not rq.is_all:
                raise ValueError("the first block of a ring step must cover every query row")
            acc = Accumulator(out.float(), lse)
            continue
        old_out, old_lse = rq.take(acc.out, _SEQ), rq.take(acc.lse, _LSE_SEQ)
        new_out, new_lse = merge_attentions([old_out, out.float()], [old_lse, lse], output_dtype=torch.float32)
        if rq.is_all:
            acc = Accumulator(new_out, new_lse)
        else:
            rq.put(acc.out, _SEQ, new_out)
            rq.put(acc.lse, _LSE_SEQ, new_lse)
    return acc


def backward_step(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, query: torch.Tensor, kv: KVShard,
                  out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, blocks: Sequence[Block],
                  geom: ShardGeometry, scale: float | None, q_descale: torch.Tensor | None = None,
                  op: Any = None) -> None:
    """Add the gradients of ``blocks`` to float32 ``dq`` (query's rows) and ``dk``/``dv`` (``kv``'s rows).

    ``out`` (B, M, Hq, Kv) and ``lse`` (B, Hq, M) are the attention merged over every step, ``grad_out``
    its gradient: each block's share of the gradient is then exactly its blocks' backward with them.
    """
    for block in blocks:
        rq, rk = geom.rows(block.q_rows), geom.rows(block.kv_rows)
        gq, gk, gv = partial_attention_backward(
            rq.take(grad_out, _SEQ), rq.take(out, _SEQ), rq.take(lse, _LSE_SEQ), rq.take(query, _SEQ),
            rk.take(kv.key, _SEQ), rk.take(kv.value, _SEQ), geom.mask(block), scale=scale, op=op,
            q_descale=q_descale, k_descale=kv.k_descale, v_descale=kv.v_descale)
        rq.add(dq, _SEQ, gq.float())
        rk.add(dk, _SEQ, gk.float())
        rk.add(dv, _SEQ, gv.float())


def partial_attention_backward(
    grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, attn_bias: Any = None, scale: float | None = None, *, op: Any = None,
    q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) through the attention of ``query`` over this slice of keys, given the output
    ``out`` and ``lse`` of the attention over *all* keys (the merge of every slice) and ``grad_out``.

    With P = exp(scale * q k^T - lse) on this slice: dv = P^T dO, dS = P * (dO v^T - rowsum(dO * out)),
    dq = scale * dS k, dk = scale * dS^T q; summed over the slices they are the gradients of the whole
    attention. Runs the backward op the selector chooses (``op`` forces one, as in
    ``memory_efficient_attention``).

    Parameters
    ----------
    grad_out, out : torch.Tensor
        (B, Mq, Hq, Kv), BMHK, the query's dtype (float32 accepted).
    lse : torch.Tensor
        float32 (B, Hq, Mq), natural log, of the whole attention.
    query, key, value : torch.Tensor
        (B, Mq, Hq, K), (B, Mk, Hkv, K), (B, Mk, Hkv, Kv) as for ``memory_efficient_attention_partial``,
        with its ``attn_bias`` and descales (fp8 inputs need ``set_fp8_dequantized_backward(True)``).

    Returns
    -------
    (dq, dk, dv) shaped like query, key, value (quantized inputs: gradients of the dequantized values).

    Examples
    --------
    >>> q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    >>> parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, s], v[:, s]) for s in (slice(0, 4), slice(4, 8))]
    >>> out, lse = fmha_ops.merge_attentions([p[0] for p in parts], [p[1] for p in parts])
    >>> go = torch.randn_like(out)
    >>> dq0, dk0, dv0 = partial_attention_backward(go, out, lse, q, k[:, :4], v[:, :4])
    """
    inp = make_inputs(query, key, value, attn_bias, scale=scale, is_partial=True, q_descale=q_descale,
                      k_descale=k_descale, v_descale=v_descale)
    bw = SELECTOR.select(inp.signature(), lambda: make_problem(inp, False), "bw", op)
    if query.dtype in (torch.float16, torch.bfloat16):
        out, grad_out = out.to(query.dtype), grad_out.to(query.dtype)
    return bw.apply_bw(inp, out.contiguous(), lse.contiguous(), grad_out.contiguous())
