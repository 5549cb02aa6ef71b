"""Which tokens of a sequence each rank of a context-parallel group holds, and moving between the two views.

A sequence of N tokens (for varlen: every packed sequence separately) is cut into equal chunks:
  "zigzag"      2W chunks; rank i holds chunks i and 2W-1-i, in that order (causal work is balanced)
  "contiguous"  W chunks; rank i holds chunk i
so every rank holds N / W tokens of every sequence. N must be a multiple of 2W (zigzag) or W
(contiguous); a length that does not split evenly raises ValueError.
"""
from __future__ import annotations

from typing import Sequence

import torch

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> None:
    """Raise ValueError unless ``layout`` is one of ``LAYOUTS``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} not supported; supported: {', '.join(map(repr, LAYOUTS))}")


def chunks_per_rank(layout: str) -> int:
    """Chunks of each sequence one rank holds: 2 (zigzag) or 1 (contiguous)."""
    check_layout(layout)
    return 2 if layout == "zigzag" else 1


def chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """Indices of the chunks rank ``rank`` of ``world`` holds, in the order it stores them.

    Examples
    --------
    >>> chunk_ids(1, 4, "zigzag"), chunk_ids(1, 4, "contiguous")
    ((1, 6), (1,))
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in [0, world={world})")
    return (rank, 2 * world - 1 - rank) if chunks_per_rank(layout) == 2 else (rank,)


def chunk_len(n: int, world: int, layout: str, what: str = "the sequence") -> int:
    """Tokens per chunk of a sequence of ``n`` tokens; ValueError naming ``what`` if it does not split evenly."""
    parts = world * chunks_per_rank(layout)
    if n % parts:
        raise ValueError(f"{what} has {n} tokens; layout={layout!r} over {world} ranks cuts it into {parts} equal "
                         f"chunks, so its length must be a multiple of {parts} (pad it)")
    return n // parts


def seqlens_of(cu_seqlens: Sequence[int] | torch.Tensor) -> list[int]:
    """Sequence lengths from sequence starts ``cu_seqlens`` (host list or 1-D integer tensor, length nseq + 1,
    starting at 0, non-decreasing). A device tensor is copied to the host once."""
    starts = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if not starts or starts[0] != 0 or any(not isinstance(s, int) for s in starts) \
            or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing integers starting at 0, got {starts}")
    return [b - a for a, b in zip(starts, starts[1:])]


def shard_cu_seqlens(cu_seqlens: Sequence[int] | torch.Tensor, world: int, layout: str = "zigzag") -> list[int]:
    """Sequence starts of one rank's shard of a packed batch (the same on every rank).

    Each sequence keeps its place and holds ``len / world`` tokens on each rank.

    Examples
    --------
    >>> shard_cu_seqlens([0, 8, 24], world=2)
    [0, 4, 12]
    """
    starts = [0]
    for b, n in enumerate(seqlens_of(cu_seqlens)):
        starts.append(starts[-1] + chunk_len(n, world, layout, f"sequence {b}") * chunks_per_rank(layout))
    return starts


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "zigzag", dim: int = 1,
          cu_seqlens: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """Rank ``rank``'s shard of ``x`` along ``dim`` (the sequence dim; 1 for BMHK).

    Parameters
    ----------
    x : torch.Tensor
        The whole sequence, e.g. BMHK (B, N, H, K); with ``cu_seqlens`` a packed batch (1, sum(lens), H, K).
    rank, world : int
        This rank and the group size.
    layout : str
        "zigzag" or "contiguous" (module docstring).
    cu_seqlens : sequence of int or tensor, optional
        Starts of the packed sequences along ``dim`` (varlen); each sequence is sharded separately and
        the shard holds the pieces in sequence order.

    Returns
    -------
    torch.Tensor
        ``x``'s size along ``dim`` divided by ``world``; other dims unchanged; a new tensor.

    Examples
    --------
    >>> shard(torch.arange(8), rank=0, world=2, dim=0)
    tensor([0, 1, 6, 7])
    >>> shard(torch.arange(8), rank=1, world=2, layout="contiguous", dim=0)
    tensor([4, 5, 6, 7])
    """
    pieces = []
    for start, n, what in _sequences(x, dim, cu_seqlens):
        c = chunk_len(n, world, layout, what)
        pieces += [x.narrow(dim, start + j * c, c) for j in chunk_ids(rank, world, layout)]
    return torch.cat(pieces, dim) if pieces else x.narrow(dim, 0, 0).clone()


def unshard(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 1,
            cu_seqlens: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """The whole sequence from every rank's shard (``shards[i]`` from rank i), the inverse of ``shard``.

    ``cu_seqlens`` are the starts of the packed sequences of the *whole* batch, as given to ``shard``.

    Examples
    --------
    >>> parts = [shard(torch.arange(8), r, 2, dim=0) for r in range(2)]
    >>> unshard(parts, dim=0)
    tensor([0, 1, 2, 3, 4, 5, 6, 7])
    """
    world = len(shards)
    if world == 0:
        raise ValueError("shards is empty; pass one shard per rank")
    for r, s in enumerate(shards):
        if s.shape != shards[0].shape:
            raise ValueError(f"shards[{r}] has shape {tuple(s.shape)} but shards[0] has {tuple(shards[0].shape)}")
    lens = [shards[0].shape[dim] * world] if cu_seqlens is None else seqlens_of(cu_seqlens)
    if sum(lens) != shards[0].shape[dim] * world:
        raise ValueError(f"cu_seqlens covers {sum(lens)} tokens but {world} shards of {shards[0].shape[dim]} "
                         f"along dim {dim} hold {shards[0].shape[dim] * world}")
    cpr = chunks_per_rank(layout)
    pieces, local_start = [], 0
    for b, n in enumerate(lens):
        c = chunk_len(n, world, layout, f"sequence {b}")
        by_chunk = {j: s.narrow(dim, local_start + slot * c, c)
                    for r, s in enumerate(shards) for slot, j in enumerate(chunk_ids(r, world, layout))}
        pieces += [by_chunk[j] for j in range(world * cpr)]
        local_start += cpr * c
    return torch.cat(pieces, dim) if pieces else shards[0].clone()


def _sequences(x: torch.Tensor, dim: int, cu_seqlens) -> list[tuple[int, int, str]]:
    """(start, length, name) of each sequence of ``x`` along ``dim``."""
    if cu_seqlens is None:
        return [(0, x.shape[dim], f"dim {dim} of x")]
    lens = seqlens_of(cu_seqlens)
    if sum(lens) != x.shape[dim]:
        raise ValueError(f"cu_seqlens covers {sum(lens)} tokens but x has {x.shape[dim]} along dim {dim}")
    out, start = [], 0
    for b, n in enumerate(lens):
        out.append((start, n, f"sequence {b}"))
        start += n
    return out
