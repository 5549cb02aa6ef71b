"""``attention``: context-parallel (ring) attention over a process group, forward and backward."""
from __future__ import annotations

import contextvars
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..dtypes import FLOAT_DTYPES, dtype_name
from .layout import check_layout, chunk_len, chunks_per_rank, seqlens_of, shard_cu_seqlens
from .ring import Packet, Ring, resolve_group
from .schedule import ShardGeometry, geometry, step_blocks
from .steps import Accumulator, KVShard, backward_step, forward_step

_GRAD_TAG = 1  # the dK/dV transfers' tag (K/V transfers use 0)
_DESCALE_KINDS = "a scalar (numel 1, per tensor) or (batch, Hkv) (per kv head; varlen: (num_sequences, Hkv))"


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, group: Any = None,
    mesh_dim: int | str | None = None, layout: str = "zigzag", softmax_scale: float | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None, q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
    output_dtype: torch.dtype | None = None, op: Any = None, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a sequence split across the ranks of ``group``; each rank passes its shard and gets its
    shard of the output. Differentiable (gradients land on each rank's shards of q, k, v).

    Parameters
    ----------
    q, k, v : torch.Tensor
        This rank's shards, BMHK: q (B, M, Hq, K), k (B, M, Hkv, K), v (B, M, Hkv, Kv), Hq % Hkv == 0, with
        M = N / W tokens of the whole length N in ``layout`` (``fmha_ops.context_parallel.shard``).
        float16 / bfloat16 / float32, or fp8 e4m3 with float32 descales.
    causal : bool
        Causal over the whole sequence (every packed sequence, with ``cu_seqlens``).
    group : ProcessGroup, DeviceMesh or None
        The context-parallel ranks (None: the default group); a DeviceMesh with ``mesh_dim`` (any 1-D mesh
        alone). The ring order is the group's rank order. NCCL (CUDA tensors) and gloo (CPU tensors).
    layout : str
        "zigzag" (rank i holds chunks i and 2W-1-i of 2W; balanced causal work) or "contiguous".
    softmax_scale : float, optional
        Default 1 / sqrt(K).
    cu_seqlens : sequence of int or tensor, optional
        Varlen: sequence starts of the *whole* packed batch (nseq + 1 values); B must be 1 and every
        sequence's length a multiple of 2W (zigzag) or W. The shard holds each sequence's share in order.
    q_descale, k_descale, v_descale : torch.Tensor, optional
        fp8 inputs: float32, per tensor (numel 1) or per (batch, kv head); k/v descales are of this rank's
        shards and travel with them.
    output_dtype : torch.dtype, optional
        Default: q's dtype (bfloat16 for fp8).
    op : optional
        Forces the forward op (or an (FwOp, BwOp) tuple), as in ``memory_efficient_attention``.
    return_lse : bool
        Also return the float32 LSE (B, Hq, M) of this rank's rows (no gradient flows through it).

    Returns
    -------
    torch.Tensor
        (B, M, Hq, Kv) in ``output_dtype``; with ``return_lse``, (out, lse).

    Examples
    --------
    On each of W ranks (``torchrun --nproc-per-node W``), with the whole q/k/v known everywhere:

    >>> from fmha_ops import context_parallel as cp
    >>> rank, world = dist.get_rank(), dist.get_world_size()
    >>> q_i, k_i, v_i = (cp.shard(t, rank, world) for t in (q, k, v))
    >>> out_i = cp.attention(q_i, k_i, v_i, causal=True)           # this rank's rows of the output
    >>> out = cp.unshard(gathered_outs)                             # all ranks' out_i, in rank order
    """
    pg = resolve_group(group, mesh_dim)
    check_layout(layout)
    _check_inputs(q, k, v, pg)
    geom = _geometry(q, layout, cu_seqlens, dist.get_world_size(pg))
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        _check_descale(name, d, q, k, geom)
    out_dtype = output_dtype or (q.dtype if q.dtype in FLOAT_DTYPES else torch.bfloat16)
    if output_dtype is not None and output_dtype not in FLOAT_DTYPES:
        raise ValueError(f"output_dtype={output_dtype} not supported; use one of "
                         f"{', '.join(map(dtype_name, FLOAT_DTYPES))}")
    ctx = _Context(Ring(pg, q.device), geom, causal, softmax_scale, op, out_dtype, q_descale)
    kv = KVShard(k, v, k_descale, v_descale)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _RingAttention.apply(ctx, kv, q, k, v)
    else:
        out, lse = _ring_forward(ctx, q, kv)
    return (out, lse) if return_lse else out


class _Context:
    """What both passes of one call share."""

    def __init__(self, ring: Ring, geom: ShardGeometry, causal: bool, scale: float | None, op: Any,
                 out_dtype: torch.dtype, q_descale: torch.Tensor | None) -> None:
        self.ring, self.geom, self.causal, self.scale, self.op = ring, geom, causal, scale, op
        self.out_dtype, self.q_descale = out_dtype, q_descale


def _ring_forward(ctx: _Context, q: torch.Tensor, kv: KVShard) -> tuple[torch.Tensor, torch.Tensor]:
    ring, world = ctx.ring, ctx.ring.world
    if q.shape[1] == 0 or q.shape[0] == 0:
        return (q.new_zeros(*q.shape[:3], kv.value.shape[3], dtype=ctx.out_dtype),
                torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device))
    fields = [kv.key, kv.value, kv.k_descale, kv.v_descale]
    packet = Packet(fields)
    buf = packet.pack(fields, q.device) if world > 1 else None
    acc: Accumulator | None = None
    for step in range(world):
        transfer = ring.start(buf) if step < world - 1 else None
        source = (ring.rank - step) % world
        acc = forward_step(acc, q, kv, step_blocks(ring.rank, source, ctx.geom.layout, ctx.causal), ctx.geom,
                           ctx.scale, ctx.q_descale, _fw(ctx.op))
        if transfer is not None:
            buf = transfer.finish()
            kv = KVShard(*packet.unpack(buf))
    return acc.out.to(ctx.out_dtype), acc.lse


def _ring_backward(ctx: _Context, q: torch.Tensor, kv: KVShard, out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ring, world, device = ctx.ring, ctx.ring.world, q.device
    fields = [kv.key, kv.value, kv.k_descale, kv.v_descale]
    packet = Packet(fields)
    grads = Packet([kv.key, kv.value], dtype=torch.float32)  # dk, dv travel with (behind) their key/value
    buf = packet.pack(fields, device) if world > 1 else None
    dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
    grad_transfer = None
    for step in range(world):
        transfer = ring.start(buf) if step < world - 1 else None
        source = (ring.rank - step) % world
        dkv = grads.zeros(device)
        dk, dv = grads.unpack(dkv)
        backward_step(dq, dk, dv, q, kv, out, lse, grad_out, step_blocks(ring.rank, source, ctx.geom.layout, ctx.causal),
                      ctx.geom, ctx.scale, ctx.q_descale, _bw(ctx.op))
        if grad_transfer is not None:  # the gradients the previous ranks computed for this key/value
            dkv.view(torch.float32).add_(grad_transfer.finish().view(torch.float32))
        grad_transfer = ring.start(dkv, _GRAD_TAG) if world > 1 else None
        if transfer is not None:
            buf = transfer.finish()
            kv = KVShard(*packet.unpack(buf))
    if grad_transfer is not None:
        dkv = grad_transfer.finish()
    dk, dv = grads.unpack(dkv)
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    """The backward selects its ops in the forward's context (``use_ops``, ``set_fp8_dequantized_backward``
    are context-local, and autograd runs CUDA backwards on its own thread)."""

    @staticmethod
    def forward(fctx, ctx: _Context, kv: KVShard, q, k, v):
        out, lse = _ring_forward(ctx, q, kv)
        fctx.ctx, fctx.kv, fctx.context = ctx, kv, contextvars.copy_context()
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(fctx, grad_out, _grad_lse):
        q, k, v, out, lse = fctx.saved_tensors
        kv = KVShard(k, v, fctx.kv.k_descale, fctx.kv.v_descale)
        dq, dk, dv = fctx.context.run(_ring_backward, fctx.ctx, q, kv, out, lse, grad_out.contiguous())
        return None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fw(op: Any) -> Any:
    return op[0] if isinstance(op, tuple) else op


def _bw(op: Any) -> Any:
    return op[1] if isinstance(op, tuple) else None


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: dist.ProcessGroup) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D BMHK (batch, seqlen shard, heads, headdim), got shape {tuple(t.shape)}")
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must be shards of the "
                         f"same sequence as q (same batch and shard length), with the same kv heads")
    backend = dist.get_backend(pg)
    if backend == "nccl" and q.device.type != "cuda":
        raise ValueError(f"the group's backend is NCCL but q is on {q.device}; NCCL needs CUDA tensors")
    if backend == "gloo" and q.device.type != "cpu":
        raise ValueError(f"the group's backend is gloo but q is on {q.device}; use NCCL for CUDA tensors")


def _geometry(q: torch.Tensor, layout: str, cu_seqlens, world: int) -> ShardGeometry:
    m = q.shape[1]
    if cu_seqlens is None:
        if m % chunks_per_rank(layout):
            raise ValueError(f"q's shard has {m} tokens; layout={layout!r} holds {chunks_per_rank(layout)} equal "
                             f"chunks per rank, so the shard length must be a multiple of {chunks_per_rank(layout)}")
        return geometry(m, None, layout, q.device)
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens (varlen) needs batch 1 (sequences packed along dim 1), got q batch {q.shape[0]}")
    lens = seqlens_of(cu_seqlens)
    starts = shard_cu_seqlens(cu_seqlens, world, layout)
    if starts[-1] != m:
        raise ValueError(f"cu_seqlens covers {sum(lens)} tokens, {starts[-1]} per rank over {world} ranks, but q's "
                         f"shard has {m}")
    local = tuple(chunk_len(n, world, layout) * chunks_per_rank(layout) for n in lens)
    return geometry(m, local, layout, q.device)


def _check_descale(name: str, d: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, geom: ShardGeometry) -> None:
    if d is None:
        return
    if not isinstance(d, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor, got {type(d).__name__}")
    per_head = (q.shape[0] if geom.local_seqlens is None else len(geom.local_seqlens), k.shape[2])
    if d.numel() != 1 and tuple(d.shape) != per_head:
        raise NotImplementedError(f"{name} of shape {tuple(d.shape)} not supported by context-parallel attention; "
                                  f"supported: {_DESCALE_KINDS} = {per_head}")
