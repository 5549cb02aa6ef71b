"""What one rank computes at each ring step, and the row selections and masks of its shard.

At step s rank i holds the key/value shard of rank ``source = (i - s) mod W``. Which of its query rows
attend which of those key rows (``step_blocks``):

  not causal        every query row attends every key row
  causal contiguous source < i: all rows, full; source == i: causal (top-left); source > i: nothing
  causal zigzag     source == i: causal over the whole shard (its two chunks are in sequence order);
                    source < i: all query rows attend the source's first chunk, full;
                    source > i: the second query chunk attends both source chunks, full.
                    Every step after the first is one chunk x two chunks of work on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import attn_bias as ab
from ..plan import Plan
from ..plans import PLANS, plan_finder
from .layout import chunks_per_rank

ALL, FIRST, SECOND = "all", "first", "second"  # rows of a shard: all, or its first / second chunk


@dataclass(frozen=True)
class Block:
    """One partial attention of a step: query rows ``q_rows`` over key rows ``kv_rows`` (ALL / FIRST / SECOND
    chunk of the shard, per sequence for varlen), causal top-left or full."""

    q_rows: str
    kv_rows: str
    causal: bool


_FULL = Block(ALL, ALL, False)


def step_blocks(rank: int, source: int, layout: str, causal: bool) -> tuple[Block, ...]:
    """The blocks rank ``rank`` computes against the key/value shard of rank ``source`` (module docstring).

    Examples
    --------
    >>> step_blocks(0, 1, "zigzag", causal=True)
    (Block(q_rows='second', kv_rows='all', causal=False),)
    """
    if not causal:
        return (_FULL,)
    if source == rank:
        return (Block(ALL, ALL, True),)
    if chunks_per_rank(layout) == 1:
        return (_FULL,) if source < rank else ()
    return (Block(ALL, FIRST, False),) if source < rank else (Block(SECOND, ALL, False),)


class Rows:
    """A selection of rows of a shard along one dim: everything, a slice (dense) or an index (varlen)."""

    def __init__(self, sel: slice | torch.Tensor) -> None:
        self.sel = sel
        self.is_all = isinstance(sel, slice) and sel == slice(None)

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The selected rows of ``x`` along ``dim`` (a view for slices, a copy for an index)."""
        if isinstance(self.sel, slice):
            return x[(slice(None),) * dim + (self.sel,)]
        return x.index_select(dim, self.sel)

    def put(self, dst: torch.Tensor, dim: int, src: torch.Tensor) -> None:
        """``dst``'s selected rows along ``dim`` = ``src``."""
        if isinstance(self.sel, slice):
            dst[(slice(None),) * dim + (self.sel,)] = src
        else:
            dst.index_copy_(dim, self.sel, src)

    def add(self, dst: torch.Tensor, dim: int, src: torch.Tensor) -> None:
        """``dst``'s selected rows along ``dim`` += ``src``."""
        if isinstance(self.sel, slice):
            dst[(slice(None),) * dim + (self.sel,)] += src
        else:
            dst.index_add_(dim, self.sel, src)


class ShardGeometry:
    """Row selections and masks of one rank's shard (the same on every rank).

    ``local_seqlens`` None: a dense shard of ``m_local`` tokens per batch row; else a packed shard (batch 1)
    whose sequence b holds ``local_seqlens[b]`` tokens (its chunks in order). Build with ``geometry``.
    """

    def __init__(self, m_local: int, local_seqlens: tuple[int, ...] | None, layout: str,
                 device: torch.device) -> None:
        self.m_local, self.local_seqlens, self.layout = m_local, local_seqlens, layout
        cpr = chunks_per_rank(layout)
        self._rows = {ALL: Rows(slice(None))}
        if local_seqlens is None:
            lens = {ALL: None, FIRST: None, SECOND: None}
            if cpr == 2:
                half = m_local // 2
                self._rows.update({FIRST: Rows(slice(0, half)), SECOND: Rows(slice(half, m_local))})
        else:
            halves = [n // cpr for n in local_seqlens]
            lens = {ALL: list(local_seqlens), FIRST: halves, SECOND: halves}
            if cpr == 2:
                starts = [0]
                for n in local_seqlens:
                    starts.append(starts[-1] + n)
                first = [torch.arange(s, s + h) for s, h in zip(starts, halves)]
                second = [torch.arange(s + h, s + 2 * h) for s, h in zip(starts, halves)]
                self._rows.update({FIRST: Rows(_cat_index(first, device)), SECOND: Rows(_cat_index(second, device))})
        self._masks = {}
        for q_rows, kv_rows, causal in ((ALL, ALL, True), (ALL, ALL, False), (ALL, FIRST, False),
                                        (SECOND, ALL, False)):
            if q_rows in self._rows and kv_rows in self._rows:
                self._masks[(q_rows, kv_rows, causal)] = _mask(lens[q_rows], lens[kv_rows], causal, device)

    def rows(self, which: str) -> Rows:
        return self._rows[which]

    def mask(self, block: Block) -> ab.AttentionBias | None:
        return self._masks[(block.q_rows, block.kv_rows, block.causal)]


def geometry(m_local: int, local_seqlens: tuple[int, ...] | None, layout: str, device: torch.device) -> ShardGeometry:
    """The ``ShardGeometry`` of a shard, kept in the plan cache (``fmha_ops.plans``) as the plan of its arguments
    (``Plan.run(block)``: the block's mask): its masks and indices are built on ``device`` once per shard layout
    (134 us on the CPU for two packed sequences under zigzag, 3.6 us dense).

    Example
    -------
    >>> geometry(8, None, "zigzag", torch.device("cpu")) is geometry(8, None, "zigzag", torch.device("cpu"))
    True
    """
    plan, key = _FIND_GEOMETRY(m_local, local_seqlens, layout, device)
    if plan is None:
        geom = ShardGeometry(m_local, local_seqlens, layout, device)
        plan = PLANS.put(key, Plan(geom.mask, (), ("masks and indices",), geom))
    return plan.bound


_FIND_GEOMETRY = plan_finder(geometry)


def _cat_index(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).to(device)


def _mask(q_lens: list[int] | None, kv_lens: list[int] | None, causal: bool,
          device: torch.device) -> ab.AttentionBias | None:
    if q_lens is None:
        return ab.LowerTriangularMask() if causal else None
    cls = ab.BlockDiagonalCausalMask if causal else ab.BlockDiagonalMask
    return cls.from_seqlens(q_lens, kv_lens, device=device)
