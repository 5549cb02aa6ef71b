"""Attention bias (mask) types with xformers-compatible names and semantics.

Layout conventions (BMHK, as in xformers):
- no bias / ``LowerTriangularMask``: q (B, Mq, H, K), k/v (B, Mk, Hkv, K). ``LowerTriangularMask`` is
  causal aligned top-left (query i sees keys j <= i); ``LowerTriangularFromBottomRightMask`` aligns
  bottom-right (j <= i + Mk - Mq), the FlashAttention convention.
- ``BlockDiagonal*Mask`` (varlen): batch 1, sequences packed along M; ``q_seqinfo`` / ``k_seqinfo``
  hold the sequence starts. ``BlockDiagonalCausalMask`` is causal top-left within each block,
  ``BlockDiagonalCausalFromBottomRightMask`` bottom-right.
- ``BlockDiagonal[CausalWithOffset]PaddedKeysMask`` (decode): q packed as above, keys padded:
  sequence b's keys live at rows [b * padding, b * padding + seqlen[b]) of the key tensor.
  The causal variant aligns each query block bottom-right to its keys (new tokens at the end).
- ``Paged*Mask`` (paged decode): like the padded masks, but the key tensor is a page pool of shape
  (1, num_pages * page_size, Hkv, K) and ``block_tables[b, i]`` is the page holding keys
  [i * page_size, (i + 1) * page_size) of sequence b.

Every mask validates itself against the call's tensors (``validate``), names what selection depends on
(``signature``), states the call's sizes as it sees them (``dims``) and can ``materialize`` itself (a
float tensor of 0 / -inf) for testing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, NamedTuple, Sequence

import torch

from . import arguments, checks

#: Mask kind names used in op declarations (``BIAS_KINDS``).
NONE = "none"
CAUSAL = "causal"  # top-left
CAUSAL_BR = "causal_bottom_right"
BLOCK_DIAGONAL = "block_diagonal"
BLOCK_DIAGONAL_CAUSAL = "block_diagonal_causal"
BLOCK_DIAGONAL_CAUSAL_BR = "block_diagonal_causal_bottom_right"
PADDED_KEYS = "padded_keys"
PADDED_KEYS_CAUSAL = "padded_keys_causal"
PAGED = "paged"
PAGED_CAUSAL = "paged_causal"
ALL_KINDS = frozenset({NONE, CAUSAL, CAUSAL_BR, BLOCK_DIAGONAL, BLOCK_DIAGONAL_CAUSAL, BLOCK_DIAGONAL_CAUSAL_BR,
                       PADDED_KEYS, PADDED_KEYS_CAUSAL, PAGED, PAGED_CAUSAL})
CAUSAL_KINDS = frozenset({CAUSAL, CAUSAL_BR, BLOCK_DIAGONAL_CAUSAL, BLOCK_DIAGONAL_CAUSAL_BR, PADDED_KEYS_CAUSAL,
                          PAGED_CAUSAL})
VARLEN_KINDS = frozenset({BLOCK_DIAGONAL, BLOCK_DIAGONAL_CAUSAL, BLOCK_DIAGONAL_CAUSAL_BR})
DECODE_KINDS = frozenset({PADDED_KEYS, PADDED_KEYS_CAUSAL, PAGED, PAGED_CAUSAL})
PAGED_KINDS = frozenset({PAGED, PAGED_CAUSAL})


class MaskDims(NamedTuple):
    """A call's sizes as its mask sees them (``AttentionBias.dims``)."""

    batch: int  # sequences (packed masks: the number of sequences)
    seqlen_q: int  # longest query sequence
    seqlen_k: int  # longest key sequence (decode: cache capacity per sequence)
    q_uniform: bool  # every sequence has seqlen_q queries
    page_size: int  # 0 unless paged


def dense_dims(query: torch.Tensor, key: torch.Tensor) -> MaskDims:
    """The sizes of a BMHK call without a packing mask: query (B, Mq, ...), key (B, Mk, ...)."""
    return MaskDims(query.shape[0], query.shape[1], key.shape[1], True, 0)


class AttentionBias:
    """Base of all masks. ``KIND`` names it in op declarations.

    Subclasses own three checks of a call (query and key BMHK, validated as tensors already):
    ``validate`` raises ValueError on tensors that do not fit the mask, ``signature`` is a hashable
    summary of everything validation and selection read from the mask (cached on the mask), and ``dims``
    gives the call's sizes as the mask sees them.
    """

    KIND: ClassVar[str]

    def validate(self, query: torch.Tensor, key: torch.Tensor) -> None:
        """Raise ValueError naming the mask, the value and what it needs, if query / key do not fit."""

    def check_values(self, key: torch.Tensor) -> None:
        """Raise ValueError on index values that do not fit ``key`` (BMHK): host-resident index tensors always,
        device-resident ones in check mode (``fmha_ops.checks``); runs on every call (``validate`` runs once
        per signature)."""

    def signature(self) -> Any:
        """Hashable: the mask type and the sizes it holds (not its device tensors' values)."""
        sig = self.__dict__.get("_signature")
        if sig is None:
            sig = self.__dict__["_signature"] = (type(self),) + self._signature_fields()
        return sig

    def _signature_fields(self) -> tuple:
        return ()

    def dims(self, query: torch.Tensor, key: torch.Tensor) -> MaskDims:
        """(batch, seqlen_q, seqlen_k, q_uniform, page_size) of the call under this mask."""
        return dense_dims(query, key)

    def materialize(self, shape: Sequence[int], dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> torch.Tensor:
        """A dense additive bias of ``shape`` (..., Mq, Mk): 0 where attending, -inf elsewhere."""
        mq, mk = shape[-2], shape[-1]
        allowed = torch.zeros(mq, mk, dtype=torch.bool, device=device)
        for seg in self.segments(mq, mk):
            rows = torch.arange(seg.q_start, seg.q_end, device=device)
            cols = torch.as_tensor(seg.key_rows(), device=device, dtype=torch.long)
            if len(rows) and len(cols):
                allowed[rows[:, None], cols[None, :]] = seg.visible(len(rows), len(cols)).to(device)
        out = torch.zeros(mq, mk, dtype=dtype, device=device).masked_fill(~allowed, -math.inf)
        return out.expand(*shape)

    def segments(self, mq: int, mk: int) -> Iterator["Segment"]:
        raise NotImplementedError


@dataclass(frozen=True)
class Segment:
    """One sequence of a call: query rows [q_start, q_end) attend ``key_rows`` (rows of the key
    tensor, or for paged masks rows of the flattened page pool), with a causal alignment."""

    q_start: int
    q_end: int
    keys: tuple[int, int] | torch.Tensor  # (start, end) or an index tensor
    causal: str = ""  # "" | "top_left" | "bottom_right"

    def key_rows(self) -> torch.Tensor:
        if isinstance(self.keys, tuple):
            return torch.arange(self.keys[0], self.keys[1])
        return self.keys

    def visible(self, mq: int, mk: int) -> torch.Tensor:
        """(mq, mk) bool: which keys each query row sees."""
        i = torch.arange(mq)[:, None]
        j = torch.arange(mk)[None, :]
        if self.causal == "top_left":
            return j <= i
        if self.causal == "bottom_right":
            return j <= i + (mk - mq)
        return torch.ones(mq, mk, dtype=torch.bool)


class LowerTriangularMask(AttentionBias):
    """Causal, top-left aligned: query i sees keys j <= i."""

    KIND = CAUSAL

    def segments(self, mq, mk):
        yield Segment(0, mq, (0, mk), "top_left")


class LowerTriangularFromBottomRightMask(AttentionBias):
    """Causal, bottom-right aligned: query i sees keys j <= i + Mk - Mq (FlashAttention's causal)."""

    KIND = CAUSAL_BR

    def segments(self, mq, mk):
        yield Segment(0, mq, (0, mk), "bottom_right")


def _lengths(name: str, seqlens: Any) -> list[int]:
    """``seqlens`` as a list of non-negative ints (ValueError / TypeError naming ``name``)."""
    if isinstance(seqlens, torch.Tensor) and seqlens.ndim == 1 and not seqlens.is_floating_point():
        seqlens = seqlens.tolist()
    if isinstance(seqlens, (str, bytes)) or not isinstance(seqlens, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(seqlens).__name__}")
    return [arguments.integer(f"{name}[{i}]", n, minimum=0) for i, n in enumerate(seqlens)]


@dataclass
class _SeqLenInfo:
    """Starts of packed sequences: ``seqstart_py`` (host list, len B+1) and ``seqstart`` (int32 tensor)."""

    seqstart_py: list[int]
    seqstart: torch.Tensor = field(repr=False)
    max_seqlen: int = 0
    min_seqlen: int = 0

    @classmethod
    def from_seqlens(cls, seqlens: Sequence[int], device: torch.device | str | None = None, *,
                     name: str = "seqlens") -> "_SeqLenInfo":
        lens = _lengths(name, seqlens)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        return cls(starts, torch.tensor(starts, dtype=torch.int32, device=device),
                   max(lens, default=0), min(lens, default=0))

    @property
    def seqlens(self) -> list[int]:
        return [b - a for a, b in zip(self.seqstart_py, self.seqstart_py[1:])]

    def to(self, device) -> "_SeqLenInfo":
        return _SeqLenInfo(self.seqstart_py, self.seqstart.to(device), self.max_seqlen, self.min_seqlen)


@dataclass
class _PaddedSeqLenInfo:
    """Keys of sequence b at rows [b * padding, b * padding + seqlen[b]); ``seqlen`` int32 tensor.
    ``seqlen_py`` (host copy) is None when the lengths live only on the device (no host sync;
    ``flash_attn_with_kvcache``); ``lengths()`` then syncs once, for slow paths only."""

    seqlen_py: list[int] | None
    seqlen: torch.Tensor = field(repr=False)
    padding: int = 0

    @classmethod
    def from_seqlens_padded(cls, seqlens: Sequence[int], padding: int,
                            device: torch.device | str | None = None) -> "_PaddedSeqLenInfo":
        padding = arguments.integer("kv_padding", padding, minimum=0)
        lens = _lengths("kv_seqlen", seqlens)
        if any(n > padding for n in lens):
            raise ValueError(f"kv_seqlen must be in [0, kv_padding={padding}], got {lens}")
        return cls(lens, torch.tensor(lens, dtype=torch.int32, device=device), padding)

    def to(self, device) -> "_PaddedSeqLenInfo":
        return _PaddedSeqLenInfo(self.seqlen_py, self.seqlen.to(device), self.padding)

    def lengths(self) -> list[int]:
        return self.seqlen_py if self.seqlen_py is not None else self.seqlen.tolist()


@dataclass
class BlockDiagonalMask(AttentionBias):
    """Varlen: packed sequences, each attending only its own keys (non-causal)."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _SeqLenInfo
    KIND: ClassVar[str] = BLOCK_DIAGONAL
    _CAUSAL: ClassVar[str] = ""

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqlen: Sequence[int] | None = None,
                     device: torch.device | str | None = None):
        q = _SeqLenInfo.from_seqlens(q_seqlen, device, name="q_seqlen")
        k = q if kv_seqlen is None else _SeqLenInfo.from_seqlens(kv_seqlen, device, name="kv_seqlen")
        if len(k.seqstart_py) != len(q.seqstart_py):
            raise ValueError(f"q_seqlen has {len(q_seqlen)} sequences but kv_seqlen has {len(kv_seqlen)}")
        return cls(q, k)

    def make_causal(self) -> "BlockDiagonalCausalMask":
        return BlockDiagonalCausalMask(self.q_seqinfo, self.k_seqinfo)

    def make_causal_from_bottomright(self) -> "BlockDiagonalCausalFromBottomRightMask":
        return BlockDiagonalCausalFromBottomRightMask(self.q_seqinfo, self.k_seqinfo)

    def validate(self, query, key):
        _validate_packed_queries(self, query)
        nq, nk = len(self.q_seqinfo.seqstart_py), len(self.k_seqinfo.seqstart_py)
        if nk != nq:
            raise ValueError(f"attn_bias has {nq - 1} query sequences but {nk - 1} key sequences")
        if key.shape[1] != self.k_seqinfo.seqstart_py[-1]:
            raise ValueError(f"key has {key.shape[1]} tokens but attn_bias k_seqinfo covers "
                             f"{self.k_seqinfo.seqstart_py[-1]}")

    def _signature_fields(self):
        return _packed_queries_signature(self) + (self.k_seqinfo.seqstart_py[-1], self.k_seqinfo.max_seqlen)

    def dims(self, query, key):
        qi = self.q_seqinfo
        return MaskDims(len(qi.seqstart_py) - 1, qi.max_seqlen, self.k_seqinfo.max_seqlen,
                        qi.min_seqlen == qi.max_seqlen, 0)

    def to(self, device):
        return type(self)(self.q_seqinfo.to(device), self.k_seqinfo.to(device))

    def segments(self, mq, mk):
        for b in range(len(self.q_seqinfo.seqstart_py) - 1):
            qs, qe = self.q_seqinfo.seqstart_py[b], self.q_seqinfo.seqstart_py[b + 1]
            ks, ke = self.k_seqinfo.seqstart_py[b], self.k_seqinfo.seqstart_py[b + 1]
            yield Segment(qs, qe, (ks, ke), self._CAUSAL)


@dataclass
class BlockDiagonalCausalMask(BlockDiagonalMask):
    """Varlen, causal top-left within each sequence."""

    KIND: ClassVar[str] = BLOCK_DIAGONAL_CAUSAL
    _CAUSAL: ClassVar[str] = "top_left"


@dataclass
class BlockDiagonalCausalFromBottomRightMask(BlockDiagonalMask):
    """Varlen, causal bottom-right within each sequence (FlashAttention varlen causal)."""

    KIND: ClassVar[str] = BLOCK_DIAGONAL_CAUSAL_BR
    _CAUSAL: ClassVar[str] = "bottom_right"


@dataclass
class BlockDiagonalPaddedKeysMask(AttentionBias):
    """Decode, non-causal: packed queries, padded keys (see module docstring)."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _PaddedSeqLenInfo
    KIND: ClassVar[str] = PADDED_KEYS
    _CAUSAL: ClassVar[str] = ""

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_padding: int, kv_seqlen: Sequence[int],
                     device: torch.device | str | None = None):
        q = _SeqLenInfo.from_seqlens(q_seqlen, device, name="q_seqlen")
        k = _PaddedSeqLenInfo.from_seqlens_padded(kv_seqlen, kv_padding, device)
        if len(k.seqlen_py) != len(q.seqstart_py) - 1:
            raise ValueError(f"q_seqlen has {len(q_seqlen)} sequences but kv_seqlen has {len(kv_seqlen)}")
        return cls(q, k)

    def make_paged(self, block_tables: torch.Tensor, page_size: int, paged_type=None):
        """The paged twin of this mask (xformers' ``make_paged``)."""
        cls = paged_type or (PagedBlockDiagonalCausalWithOffsetPaddedKeysMask if self._CAUSAL
                             else PagedBlockDiagonalPaddedKeysMask)
        return cls(self.q_seqinfo, self.k_seqinfo, block_tables, page_size)

    def validate(self, query, key):
        _validate_padded_keys(self, query)
        nseq = len(self.q_seqinfo.seqstart_py) - 1
        if key.shape[1] != nseq * self.k_seqinfo.padding:
            raise ValueError(f"key has {key.shape[1]} rows but attn_bias expects {nseq} sequences x "
                             f"kv_padding {self.k_seqinfo.padding}")

    def _signature_fields(self):
        return _packed_queries_signature(self) + (self.k_seqinfo.padding, self.k_seqinfo.seqlen.device)

    def dims(self, query, key):
        qi = self.q_seqinfo
        return MaskDims(len(qi.seqstart_py) - 1, qi.max_seqlen, self.k_seqinfo.padding,
                        qi.min_seqlen == qi.max_seqlen, 0)

    def to(self, device):
        return type(self)(self.q_seqinfo.to(device), self.k_seqinfo.to(device))

    def segments(self, mq, mk):
        pad = self.k_seqinfo.padding
        for b, n in enumerate(self.k_seqinfo.lengths()):
            qs, qe = self.q_seqinfo.seqstart_py[b], self.q_seqinfo.seqstart_py[b + 1]
            yield Segment(qs, qe, (b * pad, b * pad + n), self._CAUSAL)


@dataclass
class BlockDiagonalCausalWithOffsetPaddedKeysMask(BlockDiagonalPaddedKeysMask):
    """Decode, causal: each sequence's queries are its last tokens (bottom-right aligned)."""

    KIND: ClassVar[str] = PADDED_KEYS_CAUSAL
    _CAUSAL: ClassVar[str] = "bottom_right"


@dataclass
class PagedBlockDiagonalPaddedKeysMask(AttentionBias):
    """Paged decode, non-causal. ``block_tables`` int32 (B, max_pages); keys of sequence b are the first
    ``k_seqinfo.seqlen[b]`` rows of its pages in order; ``k_seqinfo.padding`` = max_pages * page_size."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _PaddedSeqLenInfo
    block_tables: torch.Tensor
    page_size: int
    KIND: ClassVar[str] = PAGED
    _CAUSAL: ClassVar[str] = ""

    def __post_init__(self) -> None:
        b = len(self.q_seqinfo.seqstart_py) - 1
        arguments.tensor("block_tables", self.block_tables, layout="int32 (batch, max_pages)")
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError(f"block_tables must be (batch={b}, max_pages), got {tuple(self.block_tables.shape)}")
        arguments.integer("page_size", self.page_size, minimum=1)
        cap = self.block_tables.shape[1] * self.page_size
        if self.k_seqinfo.seqlen_py is not None and any(n > cap for n in self.k_seqinfo.seqlen_py):
            raise ValueError(f"kv_seqlen {self.k_seqinfo.seqlen_py} exceeds block_tables capacity {cap}")

    def validate(self, query, key):
        _validate_padded_keys(self, query)
        if key.shape[1] % self.page_size:
            raise ValueError(f"paged key has {key.shape[1]} rows, not a multiple of page_size={self.page_size}")
        if self.block_tables.dtype != torch.int32 or self.block_tables.device != query.device:
            raise ValueError(f"block_tables must be int32 on {query.device}, got "
                             f"{str(self.block_tables.dtype).replace('torch.', '')} on {self.block_tables.device}")

    def check_values(self, key):
        lengths = self.k_seqinfo.seqlen
        if self.block_tables.device != key.device or lengths.device != key.device:
            return  # validate() names the device mismatch
        if not checks.wanted(self.block_tables, lengths):
            return
        pages = key.shape[1] // self.page_size
        checks.validate_indices(
            checks.IndexCheck("attn_bias k_seqinfo.seqlen", lengths, 0, self.k_seqinfo.padding,
                              f"block_tables hold {self.k_seqinfo.padding} keys per sequence"),
            checks.page_table_check("attn_bias block_tables", self.block_tables, lengths, self.page_size, pages,
                                    f"the key ({key.shape[1]} rows of page_size={self.page_size})"))

    def _signature_fields(self):
        bt = self.block_tables
        return _packed_queries_signature(self) + (self.k_seqinfo.padding, self.k_seqinfo.seqlen.device,
                                                  self.page_size, bt.shape, bt.dtype, bt.device)

    def dims(self, query, key):
        qi = self.q_seqinfo
        return MaskDims(len(qi.seqstart_py) - 1, qi.max_seqlen, self.block_tables.shape[1] * self.page_size,
                        qi.min_seqlen == qi.max_seqlen, self.page_size)

    def to(self, device):
        return type(self)(self.q_seqinfo.to(device), self.k_seqinfo.to(device), self.block_tables.to(device),
                          self.page_size)

    def segments(self, mq, mk):
        table = self.block_tables.cpu().long()
        for b, n in enumerate(self.k_seqinfo.lengths()):
            qs, qe = self.q_seqinfo.seqstart_py[b], self.q_seqinfo.seqstart_py[b + 1]
            pos = torch.arange(n)
            rows = table[b, pos // self.page_size] * self.page_size + pos % self.page_size
            yield Segment(qs, qe, rows, self._CAUSAL)


@dataclass
class PagedBlockDiagonalCausalWithOffsetPaddedKeysMask(PagedBlockDiagonalPaddedKeysMask):
    """Paged decode, causal (queries are each sequence's last tokens)."""

    KIND: ClassVar[str] = PAGED_CAUSAL
    _CAUSAL: ClassVar[str] = "bottom_right"


def _validate_packed_queries(mask: AttentionBias, query: torch.Tensor) -> None:
    """Packed masks: batch 1, and the query tokens the mask's q_seqinfo covers."""
    if query.shape[0] != 1:
        raise ValueError(f"attn_bias {type(mask).__name__} needs batch 1 (sequences packed along dim 1), "
                         f"got query batch {query.shape[0]}")
    nq = mask.q_seqinfo.seqstart_py[-1]
    if query.shape[1] != nq:
        raise ValueError(f"query has {query.shape[1]} tokens but attn_bias q_seqinfo covers {nq}")


def _validate_padded_keys(mask: AttentionBias, query: torch.Tensor) -> None:
    """Padded-keys and paged masks: packed queries, one key length per sequence on the query's device."""
    _validate_packed_queries(mask, query)
    nseq = len(mask.q_seqinfo.seqstart_py) - 1
    seqlen = mask.k_seqinfo.seqlen
    if seqlen.shape != (nseq,):
        raise ValueError(f"attn_bias has {nseq} query sequences but k_seqinfo.seqlen has shape {tuple(seqlen.shape)}")
    if seqlen.device != query.device:
        raise ValueError(f"attn_bias k_seqinfo.seqlen is on {seqlen.device}, query on {query.device}; "
                         f"create the mask with device=")


def _packed_queries_signature(mask: AttentionBias) -> tuple:
    qi = mask.q_seqinfo
    return (len(qi.seqstart_py), qi.seqstart_py[-1], qi.max_seqlen, qi.min_seqlen)


_XFORMERS_NAMES = {
    "LowerTriangularMask": lambda b: LowerTriangularMask(),
    "LowerTriangularFromBottomRightMask": lambda b: LowerTriangularFromBottomRightMask(),
}


def from_xformers(bias: object) -> AttentionBias:
    """Convert an xformers ``attn_bias`` object into ours (same semantics)."""
    name = type(bias).__name__
    if name in _XFORMERS_NAMES:
        return _XFORMERS_NAMES[name](bias)
    ours = MASK_CLASSES.get(name)
    if ours is None:
        raise ValueError(f"attn_bias of type xformers {name} is not supported; supported: "
                         f"{', '.join(sorted(MASK_CLASSES))}")
    q = _SeqLenInfo.from_seqlens(_seqlens(bias.q_seqinfo.seqstart_py), bias.q_seqinfo.seqstart.device)
    if issubclass(ours, BlockDiagonalMask):
        k = _SeqLenInfo.from_seqlens(_seqlens(bias.k_seqinfo.seqstart_py), bias.k_seqinfo.seqstart.device)
        return ours(q, k)
    k = _PaddedSeqLenInfo.from_seqlens_padded(bias.k_seqinfo.seqlen_py, bias.k_seqinfo.padding,
                                              bias.k_seqinfo.seqlen.device)
    if issubclass(ours, PagedBlockDiagonalPaddedKeysMask):
        return ours(q, k, bias.block_tables, bias.page_size)
    return ours(q, k)


def _seqlens(starts: Sequence[int]) -> list[int]:
    return [b - a for a, b in zip(starts, starts[1:])]


#: our mask classes by name (every AttentionBias subclass of this module), for ``from_xformers``: a plain dict
#: torch.compile reads at trace time
MASK_CLASSES: dict[str, type[AttentionBias]] = {
    c.__name__: c for c in list(globals().values())
    if isinstance(c, type) and issubclass(c, AttentionBias) and c is not AttentionBias}
