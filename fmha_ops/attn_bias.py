"""Attention bias (mask) types with xformers' names, constructors, transforms and semantics.

Layout conventions (BMHK, as in xformers):
- no bias / ``LowerTriangularMask``: q (B, Mq, H, K), k/v (B, Mk, Hkv, K). ``LowerTriangularMask`` is
  causal aligned top-left (query i sees keys j <= i); ``LowerTriangularFromBottomRightMask`` aligns
  bottom-right (j <= i + Mk - Mq), the FlashAttention convention.
- ``BlockDiagonal*Mask`` (varlen): batch 1, sequences packed along M; ``q_seqinfo`` / ``k_seqinfo``
  hold the sequence starts. ``BlockDiagonalCausalMask`` is causal top-left within each block,
  ``BlockDiagonalCausalFromBottomRightMask`` bottom-right.
- ``BlockDiagonal[CausalWithOffset]PaddedKeysMask`` (decode): q packed as above, keys padded:
  sequence b's keys live at rows [b * padding, b * padding + seqlen[b]) of the key tensor (rows past
  ``nseq * padding`` are allowed and unused). The causal variant aligns each query block bottom-right
  to its keys (new tokens at the end).
- ``Paged*Mask`` (paged decode): like the padded masks, but the key tensor is a page pool of shape
  (1, num_pages * page_size, Hkv, K) and ``block_tables[b, i]`` is the page holding keys
  [i * page_size, (i + 1) * page_size) of sequence b.
- ``*GappyKeysMask``: each sequence's keys start anywhere (``k_seqinfo.seqstart``) and run for
  ``seqlen`` rows; the paged variants address offsets within each sequence's pages.

Local attention (``*LocalAttention*`` masks, ``make_local_attention[_from_bottomright]``) is a window on
top of a mask kind: every mask has ``window_left`` / ``window_right`` (-1 = unbounded), and key j is
visible from query i iff the kind allows it and i_al - window_left <= j <= i_al + window_right, with
i_al = i for the top-left kinds and i + Mk - Mq (per sequence) for bottom-right and non-causal kinds.
xformers' ``window_size`` w of a causal local mask is ``window_left = w - 1``.

Additive tensor biases: a dense tensor ``attn_bias`` (wrapped as ``TensorBias``) or
``LowerTriangularMaskWithTensorBias``; shape (B, Hq, Mq, Mk), or broadcastable to it.

Every mask validates itself against the call's tensors (``validate``), names what selection depends on
(``signature``), states the call's sizes as it sees them (``dims``) and can ``materialize`` itself (a
float tensor of 0 / -inf plus any tensor bias) for testing; ``from_xformers`` converts xformers' own
mask objects.

Where this module deliberately differs from xformers: masks are created on the CPU unless ``device=``
is given (xformers picks CUDA when available; here a mask whose lengths the kernels read must be on the
query's device, and validation says so); ``_PaddedSeqLenInfo.seqlen_py`` may be None when the lengths live
only on the device (the decode masks' ``from_device_seqlens``); ``LocalAttentionFromBottomRightMask`` also takes -1 for an
unbounded side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Iterator, NamedTuple, Sequence

import torch

from . import arguments, checks

#: Mask kind names used in op declarations (``BIAS_KINDS``).
NONE = "none"
CAUSAL = "causal"  # top-left
CAUSAL_BR = "causal_bottom_right"
TENSOR = "tensor"  # dense additive bias
CAUSAL_TENSOR = "causal_tensor"  # top-left causal plus a dense additive bias
BLOCK_DIAGONAL = "block_diagonal"
BLOCK_DIAGONAL_CAUSAL = "block_diagonal_causal"
BLOCK_DIAGONAL_CAUSAL_BR = "block_diagonal_causal_bottom_right"
PADDED_KEYS = "padded_keys"
PADDED_KEYS_CAUSAL = "padded_keys_causal"
PAGED = "paged"
PAGED_CAUSAL = "paged_causal"
GAPPY_KEYS = "gappy_keys"
GAPPY_KEYS_CAUSAL = "gappy_keys_causal"
PAGED_GAPPY_KEYS = "paged_gappy_keys"
PAGED_GAPPY_KEYS_CAUSAL = "paged_gappy_keys_causal"
ALL_KINDS = frozenset({NONE, CAUSAL, CAUSAL_BR, TENSOR, CAUSAL_TENSOR, BLOCK_DIAGONAL, BLOCK_DIAGONAL_CAUSAL,
                       BLOCK_DIAGONAL_CAUSAL_BR, PADDED_KEYS, PADDED_KEYS_CAUSAL, PAGED, PAGED_CAUSAL, GAPPY_KEYS,
                       GAPPY_KEYS_CAUSAL, PAGED_GAPPY_KEYS, PAGED_GAPPY_KEYS_CAUSAL})
CAUSAL_KINDS = frozenset({CAUSAL, CAUSAL_BR, CAUSAL_TENSOR, BLOCK_DIAGONAL_CAUSAL, BLOCK_DIAGONAL_CAUSAL_BR,
                          PADDED_KEYS_CAUSAL, PAGED_CAUSAL, GAPPY_KEYS_CAUSAL, PAGED_GAPPY_KEYS_CAUSAL})
TENSOR_KINDS = frozenset({TENSOR, CAUSAL_TENSOR})
VARLEN_KINDS = frozenset({BLOCK_DIAGONAL, BLOCK_DIAGONAL_CAUSAL, BLOCK_DIAGONAL_CAUSAL_BR})
GAPPY_KINDS = frozenset({GAPPY_KEYS, GAPPY_KEYS_CAUSAL, PAGED_GAPPY_KEYS, PAGED_GAPPY_KEYS_CAUSAL})
DECODE_KINDS = frozenset({PADDED_KEYS, PADDED_KEYS_CAUSAL, PAGED, PAGED_CAUSAL}) | GAPPY_KINDS
PAGED_KINDS = frozenset({PAGED, PAGED_CAUSAL, PAGED_GAPPY_KEYS, PAGED_GAPPY_KEYS_CAUSAL})

TOP_LEFT, BOTTOM_RIGHT = "top_left", "bottom_right"  # causal alignments of a Segment ("" = non-causal)


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
    """Base of all masks. ``KIND`` names it in op declarations; ``window_left`` / ``window_right`` bound
    its local attention window (-1 = unbounded, see the module docstring).

    Subclasses own three checks of a call (query and key BMHK, validated as tensors already):
    ``validate`` raises ValueError on tensors that do not fit the mask, ``signature`` is a hashable
    summary of everything validation and selection read from the mask (cached on the mask), and ``dims``
    gives the call's sizes as the mask sees them.
    """

    KIND: ClassVar[str]
    window_left: int = -1
    window_right: int = -1
    #: additive bias broadcastable to (B, Hq, Mq, Mk), or None
    tensor_bias: torch.Tensor | None = None
    #: int32 (B,) per-sequence first visible key (keys before it are masked out), or None: from key 0
    key_start: torch.Tensor | None = None

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
            sig = self.__dict__["_signature"] = ((type(self), self.window_left, self.window_right)
                                                 + self._signature_fields())
        return sig

    def _signature_fields(self) -> tuple:
        return ()

    def dims(self, query: torch.Tensor, key: torch.Tensor) -> MaskDims:
        """(batch, seqlen_q, seqlen_k, q_uniform, page_size) of the call under this mask."""
        return dense_dims(query, key)

    def to(self, device: torch.device | str) -> "AttentionBias":
        """This mask with its tensors on ``device`` (masks without tensors return themselves)."""
        return self

    def materialize(self, shape: Sequence[int], dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> torch.Tensor:
        """A dense additive bias of ``shape`` (..., Mq, Mk): 0 where attending, -inf elsewhere (plus the
        tensor bias, if any). Paged masks take xformers' shape: see ``PagedBlockDiagonalPaddedKeysMask``.

        Example
        -------
        >>> LocalAttentionFromBottomRightMask(window_left=1, window_right=2).materialize((4, 4)).exp()
        tensor([[1., 1., 1., 0.], [1., 1., 1., 1.], [0., 1., 1., 1.], [0., 0., 1., 1.]])
        """
        mq, mk = shape[-2], shape[-1]
        out = _allowed(self.segments(mq, mk), mq, mk, device)
        out = torch.zeros(mq, mk, dtype=dtype, device=device).masked_fill(~out, -math.inf)
        if self.tensor_bias is not None:
            out = out + self.tensor_bias.to(device=device, dtype=dtype)
        return out.expand(*shape)

    def segments(self, mq: int, mk: int) -> Iterator["Segment"]:
        """The call's sequences: query rows and the key rows each attends (``Segment``)."""
        raise NotImplementedError


def _allowed(segments: Iterator["Segment"], mq: int, mk: int, device) -> torch.Tensor:
    allowed = torch.zeros(mq, mk, dtype=torch.bool, device=device)
    for seg in segments:
        rows = torch.arange(seg.q_start, seg.q_end, device=device)
        cols = torch.as_tensor(seg.key_rows(), device=device, dtype=torch.long)
        if len(rows) and len(cols):
            allowed[rows[:, None], cols[None, :]] = seg.visible(len(rows), len(cols)).to(device)
    return allowed


@dataclass(frozen=True)
class Segment:
    """One sequence of a call: query rows [q_start, q_end) attend ``key_rows`` (rows of the key
    tensor, or for paged masks rows of the flattened page pool), with a causal alignment and a window."""

    q_start: int
    q_end: int
    keys: tuple[int, int] | torch.Tensor  # (start, end) or an index tensor
    causal: str = ""  # "" | TOP_LEFT | BOTTOM_RIGHT
    window: tuple[int, int] = (-1, -1)  # (left, right), -1 = unbounded

    def key_rows(self) -> torch.Tensor:
        if isinstance(self.keys, tuple):
            return torch.arange(self.keys[0], self.keys[1])
        return self.keys

    def visible(self, mq: int, mk: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(mq, mk) bool: which of the segment's keys each of its query rows sees."""
        i = torch.arange(mq, device=device)[:, None]
        j = torch.arange(mk, device=device)[None, :]
        aligned = i if self.causal == TOP_LEFT else i + (mk - mq)
        ok = torch.ones(mq, mk, dtype=torch.bool, device=device)
        if self.causal:
            ok &= j <= aligned
        left, right = self.window
        if left >= 0:
            ok &= j >= aligned - left
        if right >= 0:
            ok &= j <= aligned + right
        return ok


def _check_window(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _window_of(size: int) -> int:
    """``window_left`` of xformers' causal ``window_size`` (the query's own key included)."""
    return size - 1


# ---- dense masks ----------------------------------------------------------------------------------------

class LowerTriangularMask(AttentionBias):
    """Causal, top-left aligned: query i sees keys j <= i. ``device`` is accepted and unused (xformers'
    signature)."""

    KIND = CAUSAL

    def __init__(self, device: torch.device | str | None = None) -> None:
        pass

    def segments(self, mq, mk):
        yield Segment(0, mq, (0, mk), TOP_LEFT, (self.window_left, self.window_right))

    def add_bias(self, bias: torch.Tensor) -> "LowerTriangularMaskWithTensorBias":
        """This causal mask plus an additive ``bias`` (B, Hq, Mq, Mk) tensor."""
        return LowerTriangularMaskWithTensorBias(bias)


class _WithTensorBias:
    """A mask that also adds a dense ``bias`` tensor broadcastable to (B, Hq, Mq, Mk); rebuilt from that tensor
    alone (``type(mask)(bias)``), which is how layouts fold it and traces carry it."""

    def __init__(self, bias: torch.Tensor) -> None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
        self._bias = bias

    @property
    def tensor_bias(self) -> torch.Tensor:
        return self._bias

    def to(self, device):
        return type(self)(self._bias.to(device))

    def validate(self, query, key):
        _validate_tensor_bias(self, self._bias, query, key)

    def signature(self):
        return (type(self), -1, -1) + _tensor_bias_signature(self._bias)


class LowerTriangularMaskWithTensorBias(_WithTensorBias, LowerTriangularMask):
    """Causal (top-left) plus an additive tensor ``bias`` broadcastable to (B, Hq, Mq, Mk); gradients
    flow to the bias where the op supports it."""

    KIND = CAUSAL_TENSOR


class TensorBias(_WithTensorBias, AttentionBias):
    """A dense additive bias tensor broadcastable to (B, Hq, Mq, Mk) (an ``attn_bias`` tensor is wrapped
    in this); ``-inf`` entries mask keys out."""

    KIND = TENSOR

    def segments(self, mq, mk):
        yield Segment(0, mq, (0, mk))


def _validate_tensor_bias(mask: AttentionBias, bias: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
    want = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    name = f"attn_bias {type(mask).__name__}"
    if bias.ndim > 4 or any(b not in (1, w) for b, w in zip(bias.shape[::-1], want[::-1])):
        raise ValueError(f"{name} has shape {tuple(bias.shape)}; it must be broadcastable to (B, Hq, Mq, Mk) = {want}")
    if not bias.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {bias.dtype}")
    if bias.device != query.device:
        raise ValueError(f"{name} is on {bias.device} but query is on {query.device}")


def _tensor_bias_signature(bias: torch.Tensor) -> tuple:
    return (tuple(bias.shape), bias.stride(), bias.dtype, bias.device, bias.requires_grad)


@dataclass
class LocalAttentionFromBottomRightMask(AttentionBias):
    """Local attention, non-causal, bottom-right aligned: query i sees keys j with
    i + Mk - Mq - window_left <= j <= i + Mk - Mq + window_right (-1: unbounded on that side)."""

    window_left: int
    window_right: int
    KIND: ClassVar[str] = NONE

    def __post_init__(self) -> None:
        _check_window("window_left", self.window_left, -1)
        _check_window("window_right", self.window_right, -1)

    def segments(self, mq, mk):
        yield Segment(0, mq, (0, mk), "", (self.window_left, self.window_right))


class LowerTriangularFromBottomRightMask(AttentionBias):
    """Causal, bottom-right aligned: query i sees keys j <= i + Mk - Mq (FlashAttention's causal)."""

    KIND = CAUSAL_BR

    def segments(self, mq, mk):
        yield Segment(0, mq, (0, mk), BOTTOM_RIGHT, (self.window_left, self.window_right))

    def make_local_attention(self, window_size: int) -> "LowerTriangularFromBottomRightLocalAttentionMask":
        """Causal bottom-right plus a window of ``window_size`` keys ending at each query's own."""
        return LowerTriangularFromBottomRightLocalAttentionMask(window_size)


@dataclass
class LowerTriangularFromBottomRightLocalAttentionMask(LowerTriangularFromBottomRightMask):
    """Causal bottom-right with local attention: query i sees keys j with
    i + Mk - Mq - window_size < j <= i + Mk - Mq."""

    _window_size: int

    def __post_init__(self) -> None:
        _check_window("window_size", self._window_size, 1)

    @property
    def window_left(self) -> int:
        return _window_of(self._window_size)


# ---- sequence layouts ---------------------------------------------------------------------------------------

def _int32(values: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def _padded_starts(device: torch.device, n: int, padding: int) -> torch.Tensor:
    """int32 [0, padding, ..., n * padding] on ``device``, a new tensor per call (one launch): a cached one made
    during a CUDA-graph capture would live in the graph's memory pool."""
    if padding == 0:
        return torch.zeros(n + 1, dtype=torch.int32, device=device)
    return torch.arange(0, (n + 1) * padding, padding, dtype=torch.int32, device=device)


def _uniform_queries(batch: int, per_sequence: int) -> "_SeqLenInfo":
    """The packed queries of ``batch`` sequences of ``per_sequence`` tokens each (host starts, CPU tensor), a new
    object per call (``from_seqlens_inplace`` may change it): the starts as one range, ~3.5 us on the CPU against
    ~25 us through ``from_seqlens``' per-length checks at batch 8."""
    starts = list(range(0, (batch + 1) * per_sequence, per_sequence)) if per_sequence else [0] * (batch + 1)
    longest = per_sequence if batch else 0
    return _SeqLenInfo(seqstart=_padded_starts(torch.device("cpu"), batch, per_sequence), max_seqlen=longest,
                       min_seqlen=longest, seqstart_py=starts)


def _query_info(q_seqlen: "int | Sequence[int]", batch: int) -> "_SeqLenInfo":
    """``q_seqlen`` (per-sequence lengths, or one int for every one of ``batch`` sequences) as packed queries."""
    if isinstance(q_seqlen, int) and not isinstance(q_seqlen, bool):
        return _uniform_queries(batch, arguments.integer("q_seqlen", q_seqlen, minimum=0))
    q = _SeqLenInfo.from_seqlens(q_seqlen, name="q_seqlen")
    if len(q.seqstart_py) - 1 != batch:
        raise ValueError(f"q_seqlen has {len(q.seqstart_py) - 1} sequences but kv_seqlen has {batch}")
    return q


def _lengths(name: str, seqlens: Any) -> list[int]:
    """``seqlens`` as a list of non-negative ints (ValueError / TypeError naming ``name``)."""
    if isinstance(seqlens, torch.Tensor) and seqlens.ndim == 1 and not seqlens.is_floating_point():
        seqlens = seqlens.tolist()
    if isinstance(seqlens, (str, bytes)) or not isinstance(seqlens, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(seqlens).__name__}")
    return [arguments.integer(f"{name}[{i}]", n, minimum=0) for i, n in enumerate(seqlens)]


@dataclass
class _SeqLenInfo:
    """Packed sequences along one dim: ``seqstart_py`` (host list, len B+1) and ``seqstart`` (int32 tensor)
    hold the starts; fields in xformers' order.

    Example
    -------
    >>> info = _SeqLenInfo.from_seqlens([2, 3, 2])
    >>> info.seqstart_py, info.max_seqlen, info.min_seqlen, list(info.intervals())
    ([0, 2, 5, 7], 3, 2, [(0, 2), (2, 5), (5, 7)])
    """

    seqstart: torch.Tensor = field(repr=False)
    max_seqlen: int
    min_seqlen: int
    seqstart_py: list[int]

    @classmethod
    def from_seqlens(cls, seqlens: Sequence[int], device: torch.device | str | None = None, *,
                     name: str = "seqlens") -> "_SeqLenInfo":
        """From sequence lengths (>= 0; ``name`` is the argument errors name); tensors on ``device`` (default CPU)."""
        lens = _lengths(name, seqlens)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        return cls(seqstart=_int32(starts, device), max_seqlen=max(lens, default=0), min_seqlen=min(lens, default=0),
                   seqstart_py=starts)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, max_seqlen: int | None = None, total: int | None = None, *,
                        name: str = "cu_seqlens", role: str = "") -> "_SeqLenInfo":
        """From cumulative lengths int32 (B + 1,) (0 first, never decreasing, ``total`` last when given; read on the
        host, kept on their device); ``max_seqlen`` (None: the longest) at least the longest sequence; errors name
        ``name`` (and ``role``, the packed tensor the starts index)."""
        arguments.tensor(name, cu_seqlens, ndim=1, dtypes=(torch.int32,), layout="int32 (num_sequences + 1,)")
        starts = [int(x) for x in cu_seqlens.tolist()]
        if (not starts or starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:]))
                or total is not None and starts[-1] != total):
            shown = starts if len(starts) <= 12 else starts[:6] + ["..."] + starts[-3:]
            end = "" if total is None else f" and end at {role + chr(39) + 's ' if role else ''}{total} tokens"
            raise ValueError(f"{name} must start at 0, never decrease{end}; got {shown}")
        lens = [b - a for a, b in zip(starts, starts[1:])]
        longest = max(lens, default=0)
        max_name = name.replace("cu_seqlens", "max_seqlen")
        if max_seqlen is None:
            max_seqlen = longest
        elif arguments.integer(max_name, max_seqlen, minimum=0) < longest:
            raise ValueError(f"{max_name}={max_seqlen} is smaller than the longest sequence in {name} ({longest})")
        return cls(seqstart=cu_seqlens, max_seqlen=max_seqlen, min_seqlen=min(lens, default=0), seqstart_py=starts)

    def from_seqlens_inplace(self, seqlens: Sequence[int]) -> None:
        """Update the lengths in place (same count, longest no longer than before: CUDA graphs keep working)."""
        new = _SeqLenInfo.from_seqlens(seqlens, self.seqstart.device)
        if len(new.seqstart_py) != len(self.seqstart_py) or new.max_seqlen > self.max_seqlen:
            raise ValueError(f"in-place update needs {len(self.seqstart_py) - 1} lengths <= max_seqlen="
                             f"{self.max_seqlen}, got {list(seqlens)}")
        self.seqstart_py[:] = new.seqstart_py
        self.seqstart.copy_(new.seqstart, non_blocking=True)

    @property
    def seqlens(self) -> list[int]:
        return [b - a for a, b in zip(self.seqstart_py, self.seqstart_py[1:])]

    def intervals(self) -> Iterator[tuple[int, int]]:
        """(start, end) of each sequence."""
        yield from zip(self.seqstart_py, self.seqstart_py[1:])

    def split(self, x: torch.Tensor, batch_sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Cut a packed (1, total, ...) tensor into its sequences (``batch_sizes``: sequences per piece)."""
        if x.ndim < 2 or x.shape[0] != 1 or x.shape[1] != self.seqstart_py[-1]:
            raise ValueError(f"tensor of shape {tuple(x.shape)} cannot be split: expected (1, "
                             f"{self.seqstart_py[-1]}, ...) (sequence starts {self.seqstart_py})")
        batch_sizes = [1] * (len(self.seqstart_py) - 1) if batch_sizes is None else list(batch_sizes)
        chunks, it = [], 0
        for bs in batch_sizes:
            chunks.append(self.seqstart_py[it + bs] - self.seqstart_py[it])
            it += bs
        return [t.reshape(bs, -1, *t.shape[2:]) for bs, t in zip(batch_sizes, x.split(chunks, dim=1))]

    def to(self, device) -> "_SeqLenInfo":
        return _SeqLenInfo(seqstart=self.seqstart.to(device), max_seqlen=self.max_seqlen,
                           min_seqlen=self.min_seqlen, seqstart_py=self.seqstart_py)


@dataclass
class _PaddedSeqLenInfo(_SeqLenInfo):
    """Keys of sequence b at rows [b * padding, b * padding + seqlen[b]); ``seqlen`` int32 tensor; fields in
    xformers' order. ``seqlen_py`` (host copy) is None when the lengths live only on the device (no host
    sync; ``from_device_seqlens``): then max_seqlen = padding and min_seqlen = 0 are bounds, and
    ``lengths()`` syncs once, for slow paths only. ``key_start`` int32 (B,) on the device (FlashAttention's
    ``cache_leftpad``; None: 0): sequence b's keys begin at row b * padding + key_start[b] instead, the slots
    before it hold no key (a left-padded batch), its length ``seqlen[b]`` still counted from the row's start."""

    seqlen: torch.Tensor = field(repr=False)
    seqlen_py: list[int] | None
    padding: int
    key_start: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_seqlens(cls, seqlens, device=None):
        raise NotImplementedError("use _SeqLenInfo.from_seqlens or _PaddedSeqLenInfo.from_seqlens_padded")

    @classmethod
    def from_seqlens_padded(cls, seqlens: Sequence[int], padding: int,
                            device: torch.device | str | None = None) -> "_PaddedSeqLenInfo":
        """Lengths in [0, padding], each sequence in its own ``padding`` rows."""
        padding = arguments.integer("kv_padding", padding, minimum=0)
        lens = _lengths("kv_seqlen", seqlens)
        if any(n > padding for n in lens):
            raise ValueError(f"kv_seqlen must be in [0, kv_padding={padding}], got {lens}")
        starts = list(range(0, len(lens) * padding + 1, padding)) if padding else [0] * (len(lens) + 1)
        return cls(seqstart=_int32(starts, device), max_seqlen=max(lens, default=0), min_seqlen=min(lens, default=0),
                   seqstart_py=starts, seqlen=_int32(lens, device), seqlen_py=lens, padding=padding)

    @classmethod
    def from_device_seqlens(cls, seqlen: torch.Tensor, padding: int,
                            key_start: torch.Tensor | None = None) -> "_PaddedSeqLenInfo":
        """Lengths (and ``key_start``, when given) that stay on their device (int32 (B,)): no host copy, no sync."""
        n = seqlen.shape[0]
        return cls(seqstart=_padded_starts(seqlen.device, n, padding), max_seqlen=padding, min_seqlen=0,
                   seqstart_py=[b * padding for b in range(n + 1)], seqlen=seqlen, seqlen_py=None, padding=padding,
                   key_start=key_start)

    def from_seqlens_padded_inplace(self, seqlens: Sequence[int]) -> None:
        """Update the lengths in place (same count, each <= padding and <= max_seqlen; padding kept)."""
        lens = [int(n) for n in seqlens]
        if len(lens) != self.seqlen.shape[0] or any(n < 0 or n > min(self.padding, self.max_seqlen) for n in lens):
            raise ValueError(f"in-place update needs {self.seqlen.shape[0]} lengths in [0, "
                             f"{min(self.padding, self.max_seqlen)}], got {lens}")
        if self.seqlen_py is not None:
            self.seqlen_py[:] = lens
        self.seqlen.copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)

    def intervals(self) -> Iterator[tuple[int, int]]:
        """(first row, last row + 1) of each sequence's keys."""
        for start, first, n in zip(self.seqstart_py, self.starts(), self.lengths()):
            yield start + first, start + n

    def lengths(self) -> list[int]:
        return self.seqlen_py if self.seqlen_py is not None else self.seqlen.tolist()

    def starts(self) -> list[int]:
        """Each sequence's first key within its rows (``key_start``; zeros without): one sync, slow paths only."""
        return [0] * self.seqlen.shape[0] if self.key_start is None else self.key_start.tolist()

    def split(self, x, batch_sizes=None):
        raise NotImplementedError("_PaddedSeqLenInfo.split: padded keys are not packed")

    def to(self, device) -> "_PaddedSeqLenInfo":
        return _PaddedSeqLenInfo(seqstart=self.seqstart.to(device), max_seqlen=self.max_seqlen,
                                 min_seqlen=self.min_seqlen, seqstart_py=self.seqstart_py,
                                 seqlen=self.seqlen.to(device), seqlen_py=self.seqlen_py, padding=self.padding,
                                 key_start=None if self.key_start is None else self.key_start.to(device))


@dataclass
class _GappySeqInfo(_SeqLenInfo):
    """Sequences anywhere along a dim: sequence b starts at ``seqstart[b]`` and has ``seqlen[b]`` keys;
    the last start is the dim's length. For paged masks, starts are offsets within each sequence's pages,
    ``seqlen[b]`` is start + length, and the last start is -1 (xformers' convention)."""

    seqlen: torch.Tensor = field(repr=False)
    seqlen_py: list[int]

    @classmethod
    def from_seqlens(cls, seqlens, device=None):
        raise NotImplementedError("use _GappySeqInfo.from_seqlens_gappy")

    @classmethod
    def from_seqlens_gappy(cls, seqstarts: Sequence[int], seqlens: Sequence[int], paged: bool,
                           device: torch.device | str | None = None) -> "_GappySeqInfo":
        """``seqstarts`` (B + 1 for non-paged, B for paged) and ``seqlens`` (B)."""
        starts, lens = [int(s) for s in seqstarts], _lengths("kv_seqlen", seqlens)
        if not lens:
            raise ValueError("kv_seqlen must hold at least one sequence")
        if len(starts) != len(lens) + (0 if paged else 1):
            raise ValueError(f"kv_seqstarts has {len(starts)} entries; {len(lens) + (0 if paged else 1)} expected "
                             f"for {len(lens)} sequences ({'paged' if paged else 'the last is the key count'})")
        if paged:
            starts.append(-1)
            lens = [s + n for s, n in zip(starts, lens)]
        return cls(seqstart=_int32(starts, device), max_seqlen=max(seqlens), min_seqlen=min(seqlens), seqstart_py=starts,
                   seqlen=_int32(lens, device), seqlen_py=lens)

    def intervals(self) -> Iterator[tuple[int, int]]:
        for start, n in zip(self.seqstart_py, self.seqlen_py):
            yield start, start + n

    def split(self, x, batch_sizes=None):
        raise NotImplementedError("_GappySeqInfo.split: gappy keys are not packed")

    def to(self, device) -> "_GappySeqInfo":
        return _GappySeqInfo(seqstart=self.seqstart.to(device), max_seqlen=self.max_seqlen, min_seqlen=self.min_seqlen,
                             seqstart_py=self.seqstart_py, seqlen=self.seqlen.to(device), seqlen_py=self.seqlen_py)


# ---- packed-query masks: varlen, padded keys, paged, gappy --------------------------------------------------

class _PackedQueriesMask(AttentionBias):
    """Base of the dataclass masks whose queries are packed sequences (``q_seqinfo``, batch 1) and whose
    ``k_seqinfo`` gives each sequence's keys: their dims, device moves and segments. Subclasses say which key
    rows each sequence sees (``_key_rows``) and how many keys per sequence the kernels span (``_key_dims``)."""

    def _key_rows(self) -> Iterator[Any]:
        """Per sequence, the key rows it sees: (start, end) or a tensor of row indices."""
        return self.k_seqinfo.intervals()

    def _key_dims(self) -> tuple[int, int]:
        """(keys per sequence as the kernels see them, page size; 0 = not paged)."""
        return self.k_seqinfo.max_seqlen, 0

    def _signature_fields(self):
        return _packed_queries_signature(self) + (self.k_seqinfo.seqstart_py[-1], self.k_seqinfo.max_seqlen)

    def dims(self, query, key):
        qi = self.q_seqinfo
        keys, page_size = self._key_dims()
        return MaskDims(len(qi.seqstart_py) - 1, qi.max_seqlen, keys, qi.min_seqlen == qi.max_seqlen, page_size)

    def to(self, device):
        moved = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        return type(self)(**{name: x.to(device) if isinstance(x, (torch.Tensor, _SeqLenInfo)) else x
                             for name, x in moved.items()})

    def segments(self, mq, mk):
        window = (self.window_left, self.window_right)
        for (qs, qe), keys in zip(self.q_seqinfo.intervals(), self._key_rows()):
            yield Segment(qs, qe, keys, self._CAUSAL, window)


class _PagedMask(_PackedQueriesMask):
    """Base of the paged masks (``block_tables`` int32 (B, max_pages), ``page_size``): keys live in the pool."""

    def _key_dims(self) -> tuple[int, int]:
        return self.block_tables.shape[1] * self.page_size, self.page_size

    def _page_signature(self) -> tuple:
        bt = self.block_tables
        return (self.page_size, bt.shape, bt.dtype, bt.device)

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        return _materialize_paged(self, shape, dtype, device)


# ---- varlen (block-diagonal) masks ------------------------------------------------------------------------

@dataclass
class BlockDiagonalMask(_PackedQueriesMask):
    """Varlen: packed sequences, each attending only its own keys (non-causal). ``_batch_sizes`` (set by
    ``from_tensor_list``) says how many sequences each input tensor held, for ``split``.

    Example
    -------
    >>> mask, x = BlockDiagonalMask.from_tensor_list([torch.randn(1, 3, 2, 8), torch.randn(2, 5, 2, 8)])
    >>> x.shape, [t.shape[:2] for t in mask.split(x)]
    (torch.Size([1, 13, 2, 8]), [torch.Size([1, 3]), torch.Size([2, 5])])
    """

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _SeqLenInfo
    _batch_sizes: Sequence[int] | None = None
    KIND: ClassVar[str] = BLOCK_DIAGONAL
    _CAUSAL: ClassVar[str] = ""

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None = None, *fields,
                        max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, total_q: int | None = None,
                        total_k: int | None = None):
        """From FlashAttention's cumulative lengths: int32 (B + 1,) sequence starts, 0 first, never decreasing,
        ending at ``total_*`` when given (the packed tensors' token counts; keys default to the queries'), read on
        the host once (one sync for device tensors) and kept on their device; ``max_seqlen_*`` (default: the
        longest) at least the longest sequence; ``fields``: the mask's own fields after the two seqinfos (a
        window's sizes).

        Example
        -------
        >>> mask = BlockDiagonalCausalMask.from_cu_seqlens(torch.tensor([0, 3, 8], dtype=torch.int32))
        >>> mask.q_seqinfo.seqstart_py, mask.q_seqinfo.max_seqlen
        ([0, 3, 8], 5)
        """
        q = _SeqLenInfo.from_cu_seqlens(cu_seqlens_q, max_seqlen_q, total_q, name="cu_seqlens_q", role="q")
        same = cu_seqlens_k is None or (cu_seqlens_k is cu_seqlens_q and (max_seqlen_k, total_k) == (max_seqlen_q,
                                                                                                   total_q))
        k = q if same else _SeqLenInfo.from_cu_seqlens(cu_seqlens_k, max_seqlen_k, total_k, name="cu_seqlens_k",
                                                       role="k")  # self-attention's one tensor is read once
        if len(k.seqstart_py) != len(q.seqstart_py):
            raise ValueError(f"cu_seqlens_q has {len(q.seqstart_py) - 1} sequences but cu_seqlens_k has "
                             f"{len(k.seqstart_py) - 1}")
        return cls(q, k, *fields)

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqlen: Sequence[int] | None = None,
                     device: torch.device | str | None = None) -> "BlockDiagonalMask":
        """From per-sequence query and key lengths (keys default to the queries'); tensors on ``device``."""
        q = _SeqLenInfo.from_seqlens(q_seqlen, device, name="q_seqlen")
        same = kv_seqlen is None or list(kv_seqlen) == list(q_seqlen)
        k = q if same else _SeqLenInfo.from_seqlens(kv_seqlen, device, name="kv_seqlen")
        if len(k.seqstart_py) != len(q.seqstart_py):
            raise ValueError(f"q_seqlen has {len(q_seqlen)} sequences but kv_seqlen has {len(kv_seqlen)}")
        return cls(q, k)

    @classmethod
    def from_tensor_list(cls, tensors: Sequence[torch.Tensor]) -> tuple["BlockDiagonalMask", torch.Tensor]:
        """The mask for tensors (B_i, M_i, ...) and their concatenation (1, sum B_i * M_i, ...)."""
        lens = [t.shape[1] for t in tensors for _ in range(t.shape[0])]
        mask = cls.from_seqlens(lens, device=tensors[0].device if tensors else None)
        mask._batch_sizes = [t.shape[0] for t in tensors]
        return mask, torch.cat([t.reshape(1, -1, *t.shape[2:]) for t in tensors], dim=1)

    @classmethod
    def from_tensor_lists_qkv(cls, tensors_q: Sequence[torch.Tensor], tensors_k: Sequence[torch.Tensor],
                              tensors_v: Sequence[torch.Tensor] | None = None):
        """(mask, q, k, v or None): the mask for per-sequence q / k (/ v) tensors, each list concatenated."""
        if len(tensors_q) != len(tensors_k) or (tensors_v is not None and len(tensors_v) != len(tensors_q)):
            raise ValueError(f"tensor lists differ in length: q {len(tensors_q)}, k {len(tensors_k)}"
                             + ("" if tensors_v is None else f", v {len(tensors_v)}"))
        for i, (q, k) in enumerate(zip(tensors_q, tensors_k)):
            if q.shape[0] != k.shape[0] or (tensors_v is not None and tensors_v[i].shape[:2] != k.shape[:2]):
                raise ValueError(f"tensors #{i}: query {tuple(q.shape)}, key {tuple(k.shape)} differ in batch"
                                 + ("" if tensors_v is None else f" or value {tuple(tensors_v[i].shape)} in (B, M)"))
        q_lens = [q.shape[1] for q in tensors_q for _ in range(q.shape[0])]
        k_lens = [k.shape[1] for k in tensors_k for _ in range(k.shape[0])]
        mask = cls.from_seqlens(q_lens, k_lens, device=tensors_q[0].device if tensors_q else None)
        mask._batch_sizes = [q.shape[0] for q in tensors_q]

        def cat(ts):
            return torch.cat([t.reshape(1, -1, *t.shape[2:]) for t in ts], dim=1)
        return mask, cat(tensors_q), cat(tensors_k), None if tensors_v is None else cat(tensors_v)

    def split_queries(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """A packed (1, total_q, ...) tensor back to the per-input tensors."""
        return self.q_seqinfo.split(tensor, self._batch_sizes)

    def split_kv(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """A packed (1, total_k, ...) tensor back to the per-input tensors."""
        return self.k_seqinfo.split(tensor, self._batch_sizes)

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of ``from_tensor_list`` (queries and keys share one layout)."""
        if self.q_seqinfo is not self.k_seqinfo:
            raise ValueError("split needs queries and keys packed alike; use split_queries / split_kv")
        return self.q_seqinfo.split(tensor, self._batch_sizes)

    def make_causal(self) -> "BlockDiagonalCausalMask":
        return BlockDiagonalCausalMask(self.q_seqinfo, self.k_seqinfo, self._batch_sizes)

    def make_causal_from_bottomright(self) -> "BlockDiagonalCausalFromBottomRightMask":
        """Each block causal, bottom-right aligned; every block needs as many keys as queries (xformers'
        rule; the FA3 wrappers build the mask directly and allow fewer: those queries see no key)."""
        for b, (nq, nk) in enumerate(zip(self.q_seqinfo.seqlens, self.k_seqinfo.seqlens)):
            if nk < nq:
                raise ValueError(f"sequence {b} has {nq} queries but {nk} keys; a bottom-right causal block needs "
                                 f"num_keys >= num_queries")
        return BlockDiagonalCausalFromBottomRightMask(self.q_seqinfo, self.k_seqinfo, self._batch_sizes)

    def make_local_attention(self, window_size: int) -> "BlockDiagonalCausalLocalAttentionMask":
        """Each block causal (top-left) with a window of ``window_size`` keys ending at the query's own."""
        return BlockDiagonalCausalLocalAttentionMask(self.q_seqinfo, self.k_seqinfo, self._batch_sizes, window_size)

    def make_local_attention_from_bottomright(self, window_size: int
                                              ) -> "BlockDiagonalCausalLocalAttentionFromBottomRightMask":
        """Each block causal (bottom-right) with a window of ``window_size`` keys."""
        return BlockDiagonalCausalLocalAttentionFromBottomRightMask(self.q_seqinfo, self.k_seqinfo, self._batch_sizes,
                                                                    window_size)

    def validate(self, query, key):
        _validate_packed_queries(self, query)
        for name in ("q_seqinfo", "k_seqinfo"):  # the kernels read both starts (FlashAttention's cu_seqlens)
            device = getattr(self, name).seqstart.device
            if device != query.device:
                raise ValueError(f"attn_bias {name}.seqstart is on {device}, query on {query.device}; create the "
                                 f"mask with device=query.device (e.g. {type(self).__name__}.from_seqlens(..., "
                                 f"device=...)) or move it with attn_bias.to(device)")
        nq, nk = len(self.q_seqinfo.seqstart_py), len(self.k_seqinfo.seqstart_py)
        if nk != nq:
            raise ValueError(f"attn_bias has {nq - 1} query sequences but {nk - 1} key sequences")
        if key.shape[1] != self.k_seqinfo.seqstart_py[-1]:
            raise ValueError(f"key has {key.shape[1]} tokens but attn_bias k_seqinfo covers "
                             f"{self.k_seqinfo.seqstart_py[-1]}")


@dataclass
class BlockDiagonalCausalMask(BlockDiagonalMask):
    """Varlen, causal top-left within each sequence."""

    KIND: ClassVar[str] = BLOCK_DIAGONAL_CAUSAL
    _CAUSAL: ClassVar[str] = TOP_LEFT


@dataclass
class BlockDiagonalCausalFromBottomRightMask(BlockDiagonalMask):
    """Varlen, causal bottom-right within each sequence (FlashAttention varlen causal)."""

    KIND: ClassVar[str] = BLOCK_DIAGONAL_CAUSAL_BR
    _CAUSAL: ClassVar[str] = BOTTOM_RIGHT


@dataclass
class BlockDiagonalCausalLocalAttentionMask(BlockDiagonalCausalMask):
    """Varlen, causal top-left, local: the i-th query of a block sees the block's keys j with
    i - window_size < j <= i."""

    _window_size: int = 0

    def __post_init__(self) -> None:
        _check_window("window_size", self._window_size, 1)
        for b, (nq, nk) in enumerate(zip(self.q_seqinfo.seqlens, self.k_seqinfo.seqlens)):
            if nq - self._window_size >= nk:
                raise ValueError(f"sequence {b} has {nq} queries and {nk} keys: with window_size="
                                 f"{self._window_size} its last queries see no key")

    @property
    def window_left(self) -> int:
        return _window_of(self._window_size)


@dataclass
class BlockDiagonalCausalLocalAttentionFromBottomRightMask(BlockDiagonalCausalFromBottomRightMask):
    """Varlen, causal bottom-right, local: query i of a block sees keys j with
    i + Mk - Mq - window_size < j <= i + Mk - Mq."""

    _window_size: int = 0

    def __post_init__(self) -> None:
        _check_window("window_size", self._window_size, 1)

    @property
    def window_left(self) -> int:
        return _window_of(self._window_size)


@dataclass
class BlockDiagonalLocalAttentionFromBottomRightMask(BlockDiagonalMask):
    """Varlen, non-causal, local, bottom-right aligned per block: query i sees keys j with
    i + Mk - Mq - window_left <= j <= i + Mk - Mq + window_right (-1: unbounded). The varlen form of
    ``LocalAttentionFromBottomRightMask`` (FlashAttention's varlen ``window_size``)."""

    window_left: int = -1
    window_right: int = -1

    def __post_init__(self) -> None:
        _check_window("window_left", self.window_left, -1)
        _check_window("window_right", self.window_right, -1)


# ---- decode (padded keys) masks ---------------------------------------------------------------------------

@dataclass
class BlockDiagonalPaddedKeysMask(_PackedQueriesMask):
    """Decode, non-causal: packed queries, padded keys (see module docstring)."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _PaddedSeqLenInfo
    KIND: ClassVar[str] = PADDED_KEYS
    _CAUSAL: ClassVar[str] = ""

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_padding: int, kv_seqlen: Sequence[int],
                     causal_diagonal: Any = None, *, device: torch.device | str | None = None):
        """From query lengths, the padding and key lengths (``causal_diagonal``: unused, xformers' signature)."""
        q = _SeqLenInfo.from_seqlens(q_seqlen, device, name="q_seqlen")
        k = _PaddedSeqLenInfo.from_seqlens_padded(kv_seqlen, kv_padding, device)
        if len(k.seqlen_py) != len(q.seqstart_py) - 1:
            raise ValueError(f"q_seqlen has {len(q_seqlen)} sequences but kv_seqlen has {len(kv_seqlen)}")
        return cls(q, k)

    @classmethod
    def from_device_seqlens(cls, q_seqlen: int | Sequence[int], kv_padding: int, kv_seqlen: torch.Tensor, *fields):
        """Key lengths that stay on their device (int32 (B,): no host copy, no sync, CUDA-graph capturable);
        ``q_seqlen``: per-sequence query lengths, or one int for all; ``fields``: the mask's own fields after the
        seqinfos (a window's sizes). The kernels clamp each length to [0, kv_padding].

        Example
        -------
        >>> lens = torch.tensor([5, 2], dtype=torch.int32)
        >>> BlockDiagonalCausalWithOffsetPaddedKeysMask.from_device_seqlens(1, 8, lens).k_seqinfo.padding
        8
        """
        arguments.tensor("kv_seqlen", kv_seqlen, ndim=1, dtypes=(torch.int32,), layout="int32 (batch,)")
        k = _PaddedSeqLenInfo.from_device_seqlens(kv_seqlen, arguments.integer("kv_padding", kv_padding, minimum=0))
        return cls(_query_info(q_seqlen, kv_seqlen.shape[0]), k, *fields)

    def make_paged(self, block_tables: torch.Tensor, page_size: int, paged_type: type | None = None
                   ) -> "PagedBlockDiagonalPaddedKeysMask":
        """The paged twin of this mask: same lengths, keys in ``block_tables`` pages of ``page_size``."""
        cls = paged_type or _PAGED_TWIN.get(type(self))
        if cls is None:
            raise ValueError(f"{type(self).__name__} has no paged form; paged masks: "
                             f"{', '.join(c.__name__ for c in _PAGED_TWIN.values())}")
        arguments.tensor("block_tables", block_tables, layout="int32 (batch, max_pages)")
        k = self.k_seqinfo
        paged_k = _PaddedSeqLenInfo(seqstart=k.seqstart, max_seqlen=k.max_seqlen, min_seqlen=k.min_seqlen,
                                    seqstart_py=k.seqstart_py, seqlen=k.seqlen, seqlen_py=k.seqlen_py,
                                    padding=block_tables.shape[-1] * page_size if block_tables.ndim else 0)
        window = {"_window_size": self._window_size} if "_window_size" in self.__dataclass_fields__ else {}
        return cls(self.q_seqinfo, paged_k, block_tables, page_size, **window)

    def make_local_attention(self, window_left: int, window_right: int) -> "BlockDiagonalLocalAttentionPaddedKeysMask":
        """Non-causal local attention over each sequence's keys (bottom-right aligned)."""
        return BlockDiagonalLocalAttentionPaddedKeysMask(self.q_seqinfo, self.k_seqinfo, window_left, window_right)

    def validate(self, query, key):
        _validate_padded_keys(self, query)
        nseq = len(self.q_seqinfo.seqstart_py) - 1
        if key.shape[1] < nseq * self.k_seqinfo.padding:
            raise ValueError(f"key has {key.shape[1]} rows but attn_bias needs at least {nseq} sequences x "
                             f"kv_padding {self.k_seqinfo.padding}")

    def _signature_fields(self):
        return _packed_queries_signature(self) + (self.k_seqinfo.padding, self.k_seqinfo.seqlen.device)

    def _key_dims(self):
        return self.k_seqinfo.padding, 0


@dataclass
class BlockDiagonalCausalWithOffsetPaddedKeysMask(BlockDiagonalPaddedKeysMask):
    """Decode, causal: each sequence's queries are its last tokens (bottom-right aligned)."""

    KIND: ClassVar[str] = PADDED_KEYS_CAUSAL
    _CAUSAL: ClassVar[str] = BOTTOM_RIGHT
    causal_diagonal: Any = None  # unused; xformers keeps it for old callers


@dataclass
class BlockDiagonalLocalAttentionPaddedKeysMask(BlockDiagonalPaddedKeysMask):
    """Decode, non-causal, local: query i of a sequence sees its keys j with
    i + n_k - n_q - window_left <= j <= i + n_k - n_q + window_right."""

    window_left: int = -1
    window_right: int = -1

    def __post_init__(self) -> None:
        _check_window("window_left", self.window_left, -1)
        _check_window("window_right", self.window_right, -1)

    @classmethod
    def from_seqlens_local(cls, q_seqlen, kv_padding, kv_seqlen, window_left, window_right, *, device=None):
        base = BlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen, kv_padding, kv_seqlen, device=device)
        return cls(base.q_seqinfo, base.k_seqinfo, window_left, window_right)


@dataclass
class BlockDiagonalCausalLocalAttentionPaddedKeysMask(BlockDiagonalPaddedKeysMask):
    """Decode, causal (bottom-right), local: query i of a sequence sees its keys j with
    i + n_k - n_q - window_size < j <= i + n_k - n_q."""

    _window_size: int = 0
    KIND: ClassVar[str] = PADDED_KEYS_CAUSAL
    _CAUSAL: ClassVar[str] = BOTTOM_RIGHT

    def __post_init__(self) -> None:
        _check_window("window_size", self._window_size, 1)

    @property
    def window_left(self) -> int:
        return _window_of(self._window_size)

    @classmethod
    def from_seqlens_local(cls, q_seqlen, kv_padding, kv_seqlen, window_size, *, device=None):
        base = BlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen, kv_padding, kv_seqlen, device=device)
        return cls(base.q_seqinfo, base.k_seqinfo, window_size)


@dataclass
class PagedBlockDiagonalPaddedKeysMask(_PagedMask):
    """Paged decode, non-causal. ``block_tables`` int32 (B, max_pages); keys of sequence b are the first
    ``k_seqinfo.seqlen[b]`` rows of its pages in order; ``k_seqinfo.padding`` = max_pages * page_size.

    ``materialize(shape)`` takes xformers' shape: (..., Mq, B * max_pages * page_size) (the keys as if
    unpaged) and returns (..., Mq, (max page index + 1) * page_size), columns in the page pool.
    """

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _PaddedSeqLenInfo
    block_tables: torch.Tensor
    page_size: int
    KIND: ClassVar[str] = PAGED
    _CAUSAL: ClassVar[str] = ""
    _UNPAGED_TYPE: ClassVar[type] = BlockDiagonalPaddedKeysMask

    def __post_init__(self) -> None:
        b = len(self.q_seqinfo.seqstart_py) - 1
        arguments.tensor("block_tables", self.block_tables, layout="int32 (batch, max_pages)")
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError(f"block_tables must be (batch={b}, max_pages), got {tuple(self.block_tables.shape)}")
        arguments.integer("page_size", self.page_size, minimum=1)
        cap = self.block_tables.shape[1] * self.page_size
        if self.k_seqinfo.seqlen_py is not None and any(n > cap for n in self.k_seqinfo.seqlen_py):
            raise ValueError(f"kv_seqlen {self.k_seqinfo.seqlen_py} exceeds block_tables capacity {cap}")

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqlen: Sequence[int], block_tables: torch.Tensor,
                     page_size: int, *, device: torch.device | str | None = None):
        """From query / key lengths, ``block_tables`` (B, max_pages) and ``page_size`` (tensors on ``device``,
        default ``block_tables``' device)."""
        if len(kv_seqlen) != len(q_seqlen):
            raise ValueError(f"q_seqlen has {len(q_seqlen)} sequences but kv_seqlen has {len(kv_seqlen)}")
        arguments.tensor("block_tables", block_tables, layout="int32 (batch, max_pages)")
        device = block_tables.device if device is None else device
        padding = block_tables.shape[-1] * page_size if block_tables.ndim == 2 else 0
        return cls(_SeqLenInfo.from_seqlens(q_seqlen, device),
                   _PaddedSeqLenInfo.from_seqlens_padded(kv_seqlen, padding, device), block_tables, page_size)

    @classmethod
    def from_device_seqlens(cls, q_seqlen: int | Sequence[int], kv_seqlen: torch.Tensor, block_tables: torch.Tensor,
                            page_size: int, *fields, key_start: torch.Tensor | None = None):
        """Key lengths that stay on their device (int32 (B,): no host copy, no sync, CUDA-graph capturable);
        ``q_seqlen``: per-sequence query lengths, or one int for all; ``block_tables`` int32 (B, max_pages);
        ``fields``: the mask's own fields after ``page_size`` (a window's size); ``key_start``: int32 (B,) on the
        device, each sequence's first key (the keys before it are masked out; FlashAttention's ``cache_leftpad``),
        None for 0. The kernels clamp each length to the block tables' capacity and each start to [0, length].

        Example
        -------
        >>> lens, table = torch.tensor([5, 2], dtype=torch.int32), torch.tensor([[0], [1]], dtype=torch.int32)
        >>> PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_device_seqlens(1, lens, table, 8).k_seqinfo.padding
        8
        """
        arguments.tensor("kv_seqlen", kv_seqlen, ndim=1, dtypes=(torch.int32,), layout="int32 (batch,)")
        arguments.tensor("block_tables", block_tables, ndim=2, layout="int32 (batch, max_pages)")
        if key_start is not None:
            arguments.tensor("key_start", key_start, ndim=1, dtypes=(torch.int32,), layout="int32 (batch,)")
        page_size = arguments.integer("page_size", page_size, minimum=1)
        k = _PaddedSeqLenInfo.from_device_seqlens(kv_seqlen, block_tables.shape[1] * page_size, key_start)
        return cls(_query_info(q_seqlen, kv_seqlen.shape[0]), k, block_tables, page_size, *fields)

    def validate(self, query, key):
        _validate_padded_keys(self, query)
        _validate_pages(self, query, key)
        starts = self.key_start
        if starts is not None and (starts.shape != self.k_seqinfo.seqlen.shape or starts.device != query.device):
            raise ValueError(f"attn_bias key_start must be int32 {tuple(self.k_seqinfo.seqlen.shape)} on "
                             f"{query.device}, got {tuple(starts.shape)} on {starts.device}")

    def check_values(self, key):
        lengths, starts = self.k_seqinfo.seqlen, self.key_start
        if self.block_tables.device != key.device or lengths.device != key.device:
            return  # validate() names the device mismatch
        if not checks.wanted(self.block_tables, lengths, *(() if starts is None else (starts,))):
            return
        pages = key.shape[1] // self.page_size
        checks.validate_indices(
            checks.IndexCheck("attn_bias k_seqinfo.seqlen", lengths, 0, self.k_seqinfo.padding,
                              f"block_tables hold {self.k_seqinfo.padding} keys per sequence"),
            checks.page_table_check("attn_bias block_tables", self.block_tables, lengths, self.page_size, pages,
                                    f"the key ({key.shape[1]} rows of page_size={self.page_size})"),
            *(() if starts is None else (checks.StartCheck("attn_bias key_start", starts, lengths,
                                                           "k_seqinfo.seqlen"),)))

    @property
    def key_start(self) -> torch.Tensor | None:
        return self.k_seqinfo.key_start

    def _signature_fields(self):
        starts = self.k_seqinfo.key_start
        return _packed_queries_signature(self) + (self.k_seqinfo.padding, self.k_seqinfo.seqlen.device,
                                                  *self._page_signature(), _index_signature(starts))

    def _key_rows(self):
        k = self.k_seqinfo
        return (_page_rows(self, b, first, n) for b, (first, n) in enumerate(zip(k.starts(), k.lengths())))


def _index_signature(t: torch.Tensor | None) -> tuple | None:
    """What validation reads of an optional index tensor: its shape, dtype and device (None when absent)."""
    return None if t is None else (t.shape, t.dtype, t.device)


def _page_rows(mask, b: int, start: int, end: int) -> torch.Tensor:
    """Pool rows of the logical key positions [start, end) of sequence b of a paged mask."""
    pos = torch.arange(start, end)
    return mask.block_tables[b].cpu().long()[pos // mask.page_size] * mask.page_size + pos % mask.page_size


def _materialize_paged(mask, shape, dtype, device) -> torch.Tensor:
    """xformers' convention: ``shape`` (..., Mq, B * max_pages * page_size), result columns in the pool."""
    nseq, max_pages = mask.block_tables.shape
    row = max_pages * mask.page_size
    if shape[-1] != nseq * row:
        raise ValueError(f"paged materialize takes shape (..., Mq, batch * max_pages * page_size = {nseq * row}), "
                         f"got {tuple(shape)}")
    pool = (int(mask.block_tables.max()) + 1 if mask.block_tables.numel() else 0) * mask.page_size
    return AttentionBias.materialize(mask, (*shape[:-1], pool), dtype, device)


@dataclass
class PagedBlockDiagonalCausalWithOffsetPaddedKeysMask(PagedBlockDiagonalPaddedKeysMask):
    """Paged decode, causal (queries are each sequence's last tokens)."""

    KIND: ClassVar[str] = PAGED_CAUSAL
    _CAUSAL: ClassVar[str] = BOTTOM_RIGHT
    _UNPAGED_TYPE: ClassVar[type] = BlockDiagonalCausalWithOffsetPaddedKeysMask


@dataclass
class PagedBlockDiagonalCausalLocalPaddedKeysMask(PagedBlockDiagonalPaddedKeysMask):
    """Paged decode, causal, local (MSLK's): ``BlockDiagonalCausalLocalAttentionPaddedKeysMask`` on pages."""

    _window_size: int = 0
    KIND: ClassVar[str] = PAGED_CAUSAL
    _CAUSAL: ClassVar[str] = BOTTOM_RIGHT
    _UNPAGED_TYPE: ClassVar[type] = BlockDiagonalCausalLocalAttentionPaddedKeysMask

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_window("window_size", self._window_size, 1)

    @property
    def window_left(self) -> int:
        return _window_of(self._window_size)

    @classmethod
    def from_seqlens_local(cls, q_seqlen, kv_seqlen, block_tables, page_size, window_size, *, device=None):
        base = PagedBlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen, kv_seqlen, block_tables, page_size,
                                                             device=device)
        return cls(base.q_seqinfo, base.k_seqinfo, block_tables, page_size, window_size)


#: the paged mask ``make_paged`` builds for each padded-keys mask
_PAGED_TWIN = {BlockDiagonalPaddedKeysMask: PagedBlockDiagonalPaddedKeysMask,
               BlockDiagonalCausalWithOffsetPaddedKeysMask: PagedBlockDiagonalCausalWithOffsetPaddedKeysMask,
               BlockDiagonalCausalLocalAttentionPaddedKeysMask: PagedBlockDiagonalCausalLocalPaddedKeysMask}


# ---- gappy keys masks ----------------------------------------------------------------------------------

@dataclass
class BlockDiagonalGappyKeysMask(_PackedQueriesMask):
    """Packed queries; sequence b's keys are rows [seqstart[b], seqstart[b] + seqlen[b]) of the key tensor,
    anywhere (``k_seqinfo.seqstart_py[-1]`` is the key tensor's length). Non-causal."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _GappySeqInfo
    KIND: ClassVar[str] = GAPPY_KEYS
    _CAUSAL: ClassVar[str] = ""

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqstarts: Sequence[int], kv_seqlen: Sequence[int], *,
                     device: torch.device | str | None = None):
        if len(kv_seqlen) != len(q_seqlen):
            raise ValueError(f"q_seqlen has {len(q_seqlen)} sequences but kv_seqlen has {len(kv_seqlen)}")
        return cls(_SeqLenInfo.from_seqlens(q_seqlen, device),
                   _GappySeqInfo.from_seqlens_gappy(kv_seqstarts, kv_seqlen, False, device))

    def make_paged(self, block_tables: torch.Tensor, page_size: int, notional_padding: int,
                   paged_type: type | None = None) -> "PagedBlockDiagonalGappyKeysMask":
        """Keys that live in blocks of ``notional_padding`` rows per sequence, moved to pages."""
        arguments.tensor("block_tables", block_tables, layout="int32 (batch, max_pages)")
        if notional_padding % page_size:
            raise ValueError(f"notional_padding={notional_padding} must be a multiple of page_size={page_size}")
        k = self.k_seqinfo
        starts = [s - b * notional_padding for b, s in enumerate(k.seqstart_py[:-1])]
        row = block_tables.shape[1] * page_size
        if not all(0 <= s < row for s in starts):
            raise ValueError(f"key starts {k.seqstart_py[:-1]} do not fall in blocks of {notional_padding} rows "
                             f"within {row} paged rows")
        paged_k = _GappySeqInfo.from_seqlens_gappy(starts, k.seqlen_py, True, k.seqstart.device)
        cls = paged_type or _GAPPY_PAGED_TWIN[type(self)]
        return cls(self.q_seqinfo, paged_k, block_tables, page_size)

    def validate(self, query, key):
        _validate_packed_queries(self, query)
        if len(self.k_seqinfo.seqlen_py) != len(self.q_seqinfo.seqstart_py) - 1:
            raise ValueError(f"attn_bias has {len(self.q_seqinfo.seqstart_py) - 1} query sequences but "
                             f"{len(self.k_seqinfo.seqlen_py)} key sequences")
        if key.shape[1] < self.k_seqinfo.seqstart_py[-1] or any(
                end > key.shape[1] for _, end in self.k_seqinfo.intervals()):
            raise ValueError(f"key has {key.shape[1]} rows but attn_bias reads keys up to row "
                             f"{max([self.k_seqinfo.seqstart_py[-1]] + [e for _, e in self.k_seqinfo.intervals()])}")


@dataclass
class BlockDiagonalCausalWithOffsetGappyKeysMask(BlockDiagonalGappyKeysMask):
    """Gappy keys, causal bottom-right within each sequence."""

    KIND: ClassVar[str] = GAPPY_KEYS_CAUSAL
    _CAUSAL: ClassVar[str] = BOTTOM_RIGHT


@dataclass
class PagedBlockDiagonalGappyKeysMask(_PagedMask):
    """Paged gappy keys: sequence b's keys are logical positions [seqstart[b], seqlen[b]) of its pages
    (``k_seqinfo`` in xformers' paged convention); ``materialize`` as ``PagedBlockDiagonalPaddedKeysMask``."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _GappySeqInfo
    block_tables: torch.Tensor
    page_size: int
    KIND: ClassVar[str] = PAGED_GAPPY_KEYS
    _CAUSAL: ClassVar[str] = ""
    _UNPAGED_TYPE: ClassVar[type] = BlockDiagonalGappyKeysMask

    def __post_init__(self) -> None:
        b = len(self.q_seqinfo.seqstart_py) - 1
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError(f"block_tables must be (batch={b}, max_pages), got {tuple(self.block_tables.shape)}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        cap = self.block_tables.shape[1] * self.page_size
        if any(e > cap or s < 0 for s, e in zip(self.k_seqinfo.seqstart_py, self.k_seqinfo.seqlen_py)):
            raise ValueError(f"gappy key ranges {list(zip(self.k_seqinfo.seqstart_py, self.k_seqinfo.seqlen_py))} "
                             f"exceed block_tables capacity {cap}")

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqstarts: Sequence[int], kv_seqlen: Sequence[int],
                     block_tables: torch.Tensor, page_size: int, *, device: torch.device | str | None = None):
        if not (len(q_seqlen) == len(kv_seqlen) == len(kv_seqstarts)):
            raise ValueError(f"q_seqlen ({len(q_seqlen)}), kv_seqstarts ({len(kv_seqstarts)}) and kv_seqlen "
                             f"({len(kv_seqlen)}) must have one entry per sequence")
        device = block_tables.device if device is None else device
        return cls(_SeqLenInfo.from_seqlens(q_seqlen, device),
                   _GappySeqInfo.from_seqlens_gappy(kv_seqstarts, kv_seqlen, True, device), block_tables, page_size)

    def validate(self, query, key):
        _validate_packed_queries(self, query)
        _validate_pages(self, query, key)

    def _signature_fields(self):
        return _packed_queries_signature(self) + (self.k_seqinfo.max_seqlen, *self._page_signature())

    def _key_rows(self):
        k = self.k_seqinfo
        return (_page_rows(self, b, start, end) for b, (start, end) in enumerate(zip(k.seqstart_py, k.seqlen_py)))


@dataclass
class PagedBlockDiagonalCausalWithOffsetGappyKeysMask(PagedBlockDiagonalGappyKeysMask):
    """Paged gappy keys, causal bottom-right within each sequence."""

    KIND: ClassVar[str] = PAGED_GAPPY_KEYS_CAUSAL
    _CAUSAL: ClassVar[str] = BOTTOM_RIGHT
    _UNPAGED_TYPE: ClassVar[type] = BlockDiagonalCausalWithOffsetGappyKeysMask


_GAPPY_PAGED_TWIN = {BlockDiagonalGappyKeysMask: PagedBlockDiagonalGappyKeysMask,
                     BlockDiagonalCausalWithOffsetGappyKeysMask: PagedBlockDiagonalCausalWithOffsetGappyKeysMask}


# ---- shared checks --------------------------------------------------------------------------------------

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


def _validate_pages(mask: AttentionBias, query: torch.Tensor, key: torch.Tensor) -> None:
    if key.shape[1] % mask.page_size:
        raise ValueError(f"paged key has {key.shape[1]} rows, not a multiple of page_size={mask.page_size}")
    if mask.block_tables.dtype != torch.int32 or mask.block_tables.device != query.device:
        raise ValueError(f"block_tables must be int32 on {query.device}, got "
                         f"{str(mask.block_tables.dtype).replace('torch.', '')} on {mask.block_tables.device}")


def _packed_queries_signature(mask: AttentionBias) -> tuple:
    qi = mask.q_seqinfo
    return (len(qi.seqstart_py), qi.seqstart_py[-1], qi.max_seqlen, qi.min_seqlen, qi.seqstart.device,
            mask.k_seqinfo.seqstart.device)


# ---- xformers' objects ---------------------------------------------------------------------------------

#: our mask classes by name (every concrete AttentionBias subclass above), for ``from_xformers``: plain dicts
#: torch.compile reads at trace time
MASK_CLASSES: dict[str, type[AttentionBias]] = {
    c.__name__: c for c in list(globals().values())
    if isinstance(c, type) and issubclass(c, AttentionBias) and c is not AttentionBias
    and not c.__name__.startswith("_")}
_SEQINFO = {"_SeqLenInfo": _SeqLenInfo, "_PaddedSeqLenInfo": _PaddedSeqLenInfo, "_GappySeqInfo": _GappySeqInfo}
#: each dataclass mask's fields: (name, our seqinfo class for a seqinfo field, else None)
_MASK_FIELDS = {name: tuple((f.name, _SEQINFO.get(f.type)) for f in fields(c))
                for name, c in MASK_CLASSES.items() if "__dataclass_fields__" in vars(c)}


def from_xformers(bias: object) -> AttentionBias:
    """Our mask for an xformers (or MSLK) ``attn_bias`` object of the same class name and semantics.

    The sequence-info tensors and host lists are shared, not copied, so xformers' in-place updates
    (``from_seqlens_inplace``) reach the converted mask too.

    Example
    -------
    >>> from xformers.ops import fmha                                              # doctest: +SKIP
    >>> from_xformers(fmha.attn_bias.BlockDiagonalMask.from_seqlens([3, 4]))       # doctest: +SKIP
    BlockDiagonalMask(q_seqinfo=..., k_seqinfo=..., _batch_sizes=None)
    """
    name = type(bias).__name__
    if isinstance(bias, type) and issubclass(bias, AttentionBias):
        cls = bias.__name__
        build = f"{cls}.from_seqlens(...)" if hasattr(bias, "from_seqlens") else f"{cls}()"
        raise TypeError(f"attn_bias={cls} is a mask class; pass a mask object, e.g. attn_bias={build}")
    if isinstance(bias, (str, bool, int, float)):
        raise TypeError(f"attn_bias={bias!r} is a {name}; pass a mask object from fmha_ops.attn_bias (causal: "
                        f"LowerTriangularMask() aligns the first query with the first key, "
                        f"LowerTriangularFromBottomRightMask() the last with the last), an additive bias tensor "
                        f"broadcastable to (B, Hq, Mq, Mk), or None")
    ours = MASK_CLASSES.get(name)
    if ours is None or name in ("TensorBias", "BlockDiagonalLocalAttentionFromBottomRightMask"):
        raise ValueError(f"attn_bias of type {type(bias).__module__}.{name} is not supported; supported: fmha_ops "
                         f"masks and the xformers masks {', '.join(sorted(MASK_CLASSES))}")
    if ours is LowerTriangularMaskWithTensorBias:
        return ours(bias._bias)
    if name not in _MASK_FIELDS:
        return ours()
    args = {}
    for field_name, seqinfo in _MASK_FIELDS[name]:
        if hasattr(bias, field_name):
            value = getattr(bias, field_name)
            args[field_name] = value if seqinfo is None else _seqinfo_from(value, seqinfo)
    return ours(**args)


def _seqinfo_from(x: Any, cls: type) -> _SeqLenInfo:
    """Our ``cls`` seqinfo for xformers' ``x``, sharing its tensors and host lists; fields xformers' objects
    always have but look-alikes may lack (the lengths' extremes) are derived."""
    starts = x.seqstart_py
    if cls is _SeqLenInfo:
        lens = [b - a for a, b in zip(starts, starts[1:])]
        return _SeqLenInfo(seqstart=x.seqstart, max_seqlen=getattr(x, "max_seqlen", max(lens, default=0)),
                           min_seqlen=getattr(x, "min_seqlen", min(lens, default=0)), seqstart_py=starts)
    lens = x.seqlen_py
    common = dict(seqstart=x.seqstart, seqstart_py=starts, seqlen=x.seqlen, seqlen_py=lens,
                  max_seqlen=getattr(x, "max_seqlen", max(lens, default=0)),
                  min_seqlen=getattr(x, "min_seqlen", min(lens, default=0)))
    return cls(**common, padding=x.padding) if cls is _PaddedSeqLenInfo else cls(**common)
