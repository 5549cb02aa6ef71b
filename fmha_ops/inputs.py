"""``Inputs``: one attention call's arguments; ``make_inputs``, the keyword constructor the public API uses.

Layout: BMHK. query (B, Mq, Hq, K), key (B, Mk, Hkv, K), value (B, Mk, Hkv, Kv), Hq % Hkv == 0
(GQA/MQA: query head h uses kv head h // (Hq // Hkv)). ``make_inputs`` also takes BMGHK (B, M, G, H, K)
and BMK (B, M, K), folds them to BMHK and keeps an ``OutputLayout`` that unfolds the results. Masks are
in ``attn_bias``. Every tensor is contiguous in its last dim, except that value may instead be
keys-contiguous (stride 1 along the sequence, other strides multiples of 16 bytes): a (B, Mk, Hkv, Kv)
view of a (B, Hkv, Kv, L >= Mk) tensor, the K-major operand fp8 PV products read (ops declare
V_KEYS_CONTIGUOUS).

Quantized inputs carry float32 descales; out = attention(q * q_descale, k * k_descale, v * v_descale).
Descale kinds (``Problem.descales`` holds one per role):
  "none"    no descale (float inputs only)
  "tensor"  one value (numel 1)
  "head"    (B, Hkv): per batch and kv head (FA3 convention; q's descale is indexed by its kv head);
            with a varlen (BlockDiagonal) mask (num_sequences, Hkv)
  "block"   q: (B, Hq, cdiv(Mq, Q_SCALE_BLOCK)), k: (B, Hkv, cdiv(Mk, K_SCALE_BLOCK)) (i8fp8 per-block
            grids; both 128, see fmha_ops.quant)
  "channel" v only: (B, Hkv, Kv)
  "token"   k/v only: key.shape[:-1], one per cached token and kv head (fp8 KV cache); with a paged mask
            also (num_pages, page_size, Hkv), the page pool's own layout

Validation (``fmha_ops.validation``) and the ``Problem`` run once per ``signature()``: a repeated call
through ``run_forward`` costs the signature and the selector's dict lookup (the public functions' launch plans,
``fmha_ops.call``, skip even that).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from . import attn_bias as ab
from .dtypes import FLOAT_DTYPES
from .fp8_backward import fp8_dequantized_backward_enabled
from .problem import Problem
from .validation import TMA_ALIGNMENT, check_values, problem, validate, value_layout


class Signature(NamedTuple):
    """Hashable key of everything validation and selection depend on (the selector's memo key)."""

    needs_grad: bool  # autograd needs this call's gradients
    dtypes: tuple  # (q, k, v)
    shapes: tuple  # (q, k, v)
    devices: tuple  # (q, k, v)
    last_strides: tuple  # (q, k) stride of the head dim
    value_layout: Any  # validation.value_layout
    bias: Any  # AttentionBias.signature() or None
    misaligned: int  # the data pointers' and strides' bits below TMA_ALIGNMENT (16 bytes, alignment_bits)
    descales: tuple | None  # (dtype, shape, device) or None per role; None when no descale is given
    p: float
    scale: float | None
    output_dtype: torch.dtype | None
    is_partial: bool
    quantize_kv: bool
    deterministic: bool
    capturing: bool  # a CUDA graph capture is in progress
    fp8_backward: bool
    softcap: float
    sinks: Any  # (dtype, shape, device) of the sinks, or None
    needs_lse: bool  # the caller needs the LSE (``make_problem``'s ``needs_lse``), whatever ``is_partial`` says


class OutputLayout(NamedTuple):
    """Undo ``make_inputs``'s folding of the user's layout on the outputs (BMHK is the identity).

    A named tuple of constants, so that torch.compile can rebuild it where it has no source (a dataclass
    field's default)."""

    shape5: tuple[int, ...] | None = None  # (B, Mq, G, H) of a BMGHK call
    bmk: bool = False  # a BMK call (one head)

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        """out (B, Mq, Hq, Kv) -> the user's layout (BMGHK: (B, Mq, G, H, Kv); BMK: (B, Mq, Kv))."""
        if self.shape5 is not None:
            b, m, g, h = self.shape5
            return out.view(b, m, g, h, out.shape[-1])
        return out[:, :, 0] if self.bmk else out

    def lse(self, lse: torch.Tensor) -> torch.Tensor:
        """lse (B, Hq, Mq) -> the user's layout (BMGHK: (B, G, H, Mq); BMK: (B, Mq))."""
        if self.shape5 is not None:
            b, _, g, h = self.shape5
            return lse.view(b, g, h, lse.shape[-1])
        return lse[:, 0] if self.bmk else lse


BMHK = OutputLayout()
_new_tuple = tuple.__new__  # a NamedTuple built without its Python-level __new__ (the hot path)
_Tensor = torch.Tensor
_deterministic = torch._C._get_deterministic_algorithms  # torch.are_deterministic_algorithms_enabled, one frame less
_grad_enabled = torch.is_grad_enabled


@dataclass
class Inputs:
    """One call. Tensors are BMHK; see the module docstring for descale shapes. ``layout`` maps results
    back to the caller's layout (``make_inputs`` sets it)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_bias: ab.AttentionBias | None = None
    p: float = 0.0
    scale: float | None = None
    output_dtype: torch.dtype | None = None
    is_partial: bool = False
    q_descale: torch.Tensor | None = None
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    quantize_kv_to_fp8: bool = False
    layout: OutputLayout = field(default=BMHK, repr=False, compare=False)
    softcap: float = 0.0  # > 0: scores become softcap * tanh(scale * q.k / softcap) (Gemma 2 / FA3); 0 = off
    sinks: torch.Tensor | None = None  # float32 (Hq,) attention sinks (fmha_ops.sinks), or None

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.query.shape[-1])

    @property
    def bias_kind(self) -> str:
        return ab.NONE if self.attn_bias is None else self.attn_bias.KIND

    @property
    def out_dtype(self) -> torch.dtype:
        if self.output_dtype is not None:
            return self.output_dtype
        return self.query.dtype if self.query.dtype in FLOAT_DTYPES else torch.bfloat16

    def needs_grad(self) -> bool:
        """Autograd needs this call's gradients (w.r.t. query, key, value or a tensor attn_bias)."""
        return torch.is_grad_enabled() and (
            self.query.requires_grad or self.key.requires_grad or self.value.requires_grad or self.bias_needs_grad()
            or (self.sinks is not None and self.sinks.requires_grad))

    def bias_needs_grad(self) -> bool:
        """The mask carries a tensor bias that autograd differentiates."""
        bias = None if self.attn_bias is None else self.attn_bias.tensor_bias
        return bias is not None and bias.requires_grad and torch.is_grad_enabled()

    def signature(self, needs_lse: bool = False) -> Signature:
        """The memo key of this call (``Signature``) when the caller asks for the LSE or not (``needs_lse``, as it
        passes ``validation.make_problem``: an op without an LSE is chosen only where none is needed)."""
        q, k, v = self.query, self.key, self.value
        bias = self.attn_bias
        qd, kd, vd, sinks = self.q_descale, self.k_descale, self.v_descale, self.sinks
        return _new_tuple(Signature, (
            _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
                bias is not None and bias.tensor_bias is not None and bias.tensor_bias.requires_grad)
                or (isinstance(sinks, _Tensor) and sinks.requires_grad)),
            (q.dtype, k.dtype, v.dtype), (q.shape, k.shape, v.shape), (q.device, k.device, v.device),
            (q.stride()[-1], k.stride()[-1]), "last" if v.stride()[-1] == 1 else value_layout(v),
            None if bias is None else bias.signature(),
            (alignment_bits(q) | alignment_bits(k) | alignment_bits(v)) & (TMA_ALIGNMENT - 1),
            None if qd is None and kd is None and vd is None else
            (_tensor_signature(qd), _tensor_signature(kd), _tensor_signature(vd)),
            self.p, self.scale, self.output_dtype, self.is_partial, self.quantize_kv_to_fp8,
            _deterministic(), q.is_cuda and torch.cuda.is_current_stream_capturing(),
            fp8_dequantized_backward_enabled(), self.softcap, _tensor_signature(sinks), needs_lse))

    def validate(self) -> None:
        """Raise ValueError naming the argument, the value and what is supported (``fmha_ops.validation``)."""
        validate(self)

    def problem(self, needs_lse: bool = False) -> Problem:
        """The ``Problem`` of this call (validate first; ``validation.problem``)."""
        return problem(self, needs_lse)


def make_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: Any = None, *,
                p: float = 0.0, scale: float | None = None, output_dtype: torch.dtype | None = None,
                is_partial: bool = False, q_descale: torch.Tensor | None = None,
                k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                quantize_kv_to_fp8: bool = False, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> Inputs:
    """The ``Inputs`` of one call, as the public functions take it.

    Parameters
    ----------
    query, key, value : torch.Tensor
        BMHK (B, M, H, K); or BMGHK (B, M, G, H, K) with key / value expanded over H for MQA/GQA (stride 0
        or one head: a single kv head per group is kept); or BMK (B, M, K), one head.
    attn_bias : AttentionBias, an xformers mask object, a tensor, or None
        xformers masks are converted to ours (``attn_bias.from_xformers``); a tensor is an additive bias
        (``attn_bias.TensorBias``) broadcastable to (B, Hq, Mq, Mk) (BMGHK: (B, G, H, Mq, Mk); BMK: (B, Mq, Mk)).
    p, scale, output_dtype, q_descale, k_descale, v_descale, quantize_kv_to_fp8, softcap, sinks
        As ``memory_efficient_attention`` takes them. ``is_partial``: the call returns its LSE.

    Returns
    -------
    Inputs
        BMHK tensors; ``.layout`` maps outputs back to the caller's layout. Descale and mask index values are
        checked here on every call (host tensors always, device tensors in check mode); the rest is validated by ``Inputs.validate``,
        once per signature.

    Example
    -------
    >>> inp = make_inputs(q, k, v, LowerTriangularMask(), scale=0.125)
    >>> inp.problem().causal
    True
    """
    layout = BMHK
    if not (isinstance(query, _Tensor) and isinstance(key, _Tensor) and isinstance(value, _Tensor)):
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    descaled = q_descale is not None or k_descale is not None or v_descale is not None
    if descaled:
        for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
            if d is not None and not isinstance(d, torch.Tensor):
                raise TypeError(f"{name} must be a float32 tensor (numel 1 for one scale; see fmha_ops.inputs for "
                                f"the per-head / block / token shapes), got {type(d).__name__} {d!r}"[:300])
    if sinks is not None and not isinstance(sinks, _Tensor):
        raise TypeError(f"sinks must be a float32 tensor of shape (num_query_heads,), got {type(sinks).__name__}")
    ndim = query.ndim
    if ndim == 4 and key.ndim == 4 and value.ndim == 4:
        pass
    elif ndim == 5:
        if key.ndim != 5 or value.ndim != 5:
            raise ValueError(f"query is 5-D (BMGHK) but key is {key.ndim}-D and value {value.ndim}-D")
        b, m, g, h, _ = query.shape
        for name, t in (("key", key), ("value", value)):
            if t.shape[2] != g or t.shape[3] != h:
                raise ValueError(f"{name} {tuple(t.shape)} must have query's groups G={g} and heads H={h} "
                                 f"(BMGHK; expand key/value over H for MQA/GQA), query is {tuple(query.shape)}")
        layout = OutputLayout((b, m, g, h))
        query = query.reshape(b, m, g * h, query.shape[-1])
        if _expanded_over_heads(key) and _expanded_over_heads(value):  # MQA/GQA: one kv head per group
            key, value = key[:, :, :, 0], value[:, :, :, 0]
        else:
            key, value = key.flatten(2, 3), value.flatten(2, 3)
    elif ndim == 3:
        if key.ndim != 3 or value.ndim != 3:
            raise ValueError(f"query is 3-D (BMK) but key is {key.ndim}-D and value {value.ndim}-D")
        layout = OutputLayout(bmk=True)
        query, key, value = query[:, :, None], key[:, :, None], value[:, :, None]
    else:
        name, t = next((n, t) for n, t in (("query", query), ("key", key), ("value", value)) if t.ndim != 4)
        raise ValueError(f"{name} must be 4-D BMHK (batch, seqlen, heads, headdim), got shape {tuple(t.shape)}")
    if attn_bias is not None:
        if isinstance(attn_bias, _Tensor):
            attn_bias = ab.TensorBias(attn_bias)
        elif not isinstance(attn_bias, ab.AttentionBias):
            attn_bias = ab.from_xformers(attn_bias)
        if attn_bias.tensor_bias is not None and layout is not BMHK:
            attn_bias = _fold_tensor_bias(attn_bias, layout)
    inp = Inputs(query, key, value, attn_bias, p, scale, output_dtype, is_partial, q_descale, k_descale, v_descale,
                 quantize_kv_to_fp8, layout, softcap, sinks)
    if descaled or (attn_bias is not None and checks_values(type(attn_bias))):
        check_values(inp)
    return inp


def _fold_tensor_bias(bias: ab.AttentionBias, layout: OutputLayout) -> ab.AttentionBias:
    """A BMGHK (B, G, H, Mq, Mk) or BMK (B, Mq, Mk) tensor bias in BMHK's (B, Hq, Mq, Mk)."""
    t = bias.tensor_bias
    if layout.bmk and t.ndim == 3:
        t = t[:, None]
    elif layout.shape5 is not None and t.ndim == 5:
        t = t.flatten(1, 2)
    return type(bias)(t)


def checks_values(mask_type: type) -> bool:
    """Whether masks of this type check index values per call (their own ``check_values``). A class attribute
    compare, no memo: a module-level dict read here would be a guard of every compiled graph (recompiling it
    whenever an eager call of a new mask type added an entry)."""
    return mask_type.check_values is not ab.AttentionBias.check_values


def _expanded_over_heads(t: torch.Tensor) -> bool:
    return t.shape[3] == 1 or t.stride(3) == 0


def _tensor_signature(t: torch.Tensor | None) -> Any:
    """An optional tensor argument's part of the memo key: None, (dtype, shape, device), or the type of anything
    else (which validation rejects on the memo miss, so no selection is ever stored under it)."""
    if t is None:
        return None
    return (t.dtype, t.shape, t.device) if isinstance(t, _Tensor) else type(t)


def alignment_bits(t: torch.Tensor) -> int:
    """The start address OR every stride in bytes of ``t``: its bits below ``validation.TMA_ALIGNMENT`` are a memo
    key as fine as ``validation.tma_misaligned`` (which ignores unit strides and dims of length 1).

    Example
    -------
    >>> alignment_bits(torch.empty(2, 8, 1, 36, dtype=torch.float16)[..., :32]) % 16  # rows 72 bytes apart: 8 | 2
    10
    """
    bits = t.data_ptr()
    for stride in t.stride():
        bits |= stride * t.element_size()
    return bits
