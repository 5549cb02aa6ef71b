"""Validation of one call's ``Inputs``: tensors, dtypes, descales, scalars; the mask checks itself; then the call's
``Problem``.

Every error is a ValueError / TypeError naming the argument, the value and what is supported. ``make_problem``
(``validate``, then ``problem``) runs once per call signature (the selector's memo), so none of this is on the
repeated-call path; ``check_values`` runs on every call and reads host-resident values (device-resident ones in
check mode).

Example
-------
>>> problem = make_problem(make_inputs(q, k, v, LowerTriangularMask()), needs_lse=False)  # doctest: +SKIP
>>> problem.causal  # doctest: +SKIP
True
"""
from __future__ import annotations

from typing import Any

import torch

from registry import current_arch

from . import attn_bias as ab
from . import arguments, checks
from .dtypes import FLOAT_DTYPES, FP8_DTYPES, dtype_name
from .fp8_backward import fp8_dequantized_backward_enabled
from .problem import Problem
from .quant import K_SCALE_BLOCK, Q_SCALE_BLOCK

Inputs = Any  # an fmha_ops.inputs.Inputs (this module sits below it and does not import it)

_DESCALE_ROLES = ("q_descale", "k_descale", "v_descale")
#: bytes a TMA descriptor or a 16-byte vector load needs its start address and its non-unit strides to be a
#: multiple of
TMA_ALIGNMENT = 16


def make_problem(inp: Inputs, needs_lse: bool) -> Problem:
    """Validate ``inp`` and build its ``Problem`` (what the selector runs on a memo miss)."""
    validate(inp)
    return problem(inp, needs_lse)


def problem(inp: Inputs, needs_lse: bool = False) -> Problem:
    """The ``Problem`` of a validated call."""
    q, k, v = inp.query, inp.key, inp.value
    return Problem(
        arch=current_arch(q.device), deterministic=torch.are_deterministic_algorithms_enabled(),
        graph_capture=q.is_cuda and torch.cuda.is_current_stream_capturing(),
        fp8_backward=fp8_dequantized_backward_enabled(), misaligned=misaligned_operands(q, k, v),
        **problem_fields(inp, needs_lse))


def problem_fields(inp: Inputs, needs_lse: bool = False) -> dict:
    """The ``Problem`` fields read from the call's tensors and mask alone (all but ``arch``, ``deterministic``,
    ``graph_capture``, ``fp8_backward`` and ``misaligned``, which come from the process and the data pointers): what
    ``torch.compile`` traces."""
    q, k, v = inp.query, inp.key, inp.value
    bias = inp.attn_bias
    descales = descale_kinds(inp)
    dims = ab.dense_dims(q, k) if bias is None else bias.dims(q, k)
    return dict(
        q_dtype=q.dtype, k_dtype=k.dtype, v_dtype=v.dtype, out_dtype=inp.out_dtype,
        batch=dims.batch, seqlen_q=dims.seqlen_q, seqlen_k=dims.seqlen_k, total_q=q.shape[0] * q.shape[1],
        heads_q=q.shape[2], heads_kv=k.shape[2], head_dim=q.shape[3], head_dim_v=v.shape[3], bias=inp.bias_kind,
        q_uniform=dims.q_uniform, page_size=dims.page_size, descales=descales,
        quantize_kv=inp.quantize_kv_to_fp8, dropout=inp.p > 0.0, needs_lse=needs_lse or inp.is_partial,
        needs_grad=inp.needs_grad(), v_keys_contiguous=value_layout(v) == "keys",
        window_left=bias.window_left if bias is not None else -1,
        window_right=bias.window_right if bias is not None else -1,
        softcap=inp.softcap > 0.0, bias_grad=inp.bias_needs_grad(), sinks=inp.sinks is not None,
        key_start=bias is not None and bias.key_start is not None,
        negative_scale=inp.scale is not None and inp.scale < 0.0)


def validate(inp: Inputs) -> None:
    """Raise ValueError naming the argument, the value and what is supported."""
    q, k, v = inp.query, inp.key, inp.value
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D BMHK (batch, seqlen, heads, headdim), got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but query is on {q.device}; all inputs must share a device")
        if t is not v and t.shape[-1] and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got stride {t.stride(-1)}")
    if value_layout(v) not in ("last", "keys"):
        raise ValueError(f"value must be contiguous in its last dim (stride 1), or keys-contiguous (stride 1 "
                         f"along the sequence dim 1, other strides multiples of 16 bytes); got strides {v.stride()}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"key {tuple(k.shape)} and value {tuple(v.shape)} must agree in (batch, seqlen, heads)")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"query batch {q.shape[0]} != key batch {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"query head dim {q.shape[3]} != key head dim {k.shape[3]}")
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) (GQA/MQA)")
    if q.shape[3] == 0 or v.shape[3] == 0:
        raise ValueError(f"query/key head dim K={q.shape[3]} and value head dim Kv={v.shape[3]} must be >= 1")
    _validate_dtypes(inp)
    if inp.output_dtype == torch.float8_e4m3fn:
        _validate_fp8_output(inp)
    if inp.sinks is not None:
        validate_sinks(inp.sinks, q.shape[2], q.device)
    _validate_descales(inp)
    if inp.attn_bias is not None:
        inp.attn_bias.validate(q, k)
    # the scalars last: each is one argument's own check
    if not (0.0 <= arguments.real("p", inp.p) < 1.0):
        raise ValueError(f"p (dropout) must be in [0, 1), got {inp.p}")
    if inp.scale is not None:
        arguments.finite_float("scale", inp.scale)
    arguments.finite_float("softcap", inp.softcap)
    if inp.softcap < 0.0:
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {inp.softcap}")
    if inp.output_dtype is not None:
        arguments.dtype("output_dtype", inp.output_dtype, FLOAT_DTYPES + (torch.float8_e4m3fn,))
    arguments.flag("quantize_kv_to_fp8", inp.quantize_kv_to_fp8)


def validate_sinks(sinks, heads_q: int, device: torch.device) -> None:
    """Raise TypeError / ValueError unless ``sinks`` is a float32 tensor of shape (heads_q,) on ``device``."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a float32 tensor of shape (num_query_heads,) = ({heads_q},), got "
                        f"{type(sinks).__name__}")
    if sinks.dtype != torch.float32:
        raise ValueError(f"sinks must be float32 (one logit per query head), got {sinks.dtype}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}; expected ({heads_q},), one per query head")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {device}")


def _validate_fp8_output(inp) -> None:
    """``output_dtype=float8_e4m3fn`` (the fp8 output option) needs an fp8 e4m3fn value: the output is then in the
    value's fp8 units, its descale ``v_descale`` (attention averages value rows, so it cannot saturate)."""
    if inp.value.dtype != torch.float8_e4m3fn:
        raise ValueError(f"output_dtype=float8_e4m3fn needs an fp8 e4m3fn value (the output is in the value's "
                         f"fp8 units, descale v_descale); got value dtype {dtype_name(inp.value.dtype)}")
    if not isinstance(inp.v_descale, torch.Tensor) or inp.v_descale.numel() != 1:
        shape = None if not isinstance(inp.v_descale, torch.Tensor) else tuple(inp.v_descale.shape)
        raise ValueError(f"output_dtype=float8_e4m3fn needs a per-tensor v_descale (numel 1: the output's own "
                         f"descale); got v_descale of shape {shape}")


def _validate_dtypes(inp: Inputs) -> None:
    q, k, v = inp.query.dtype, inp.key.dtype, inp.value.dtype
    combo = f"query/key/value dtypes {dtype_name(q)}/{dtype_name(k)}/{dtype_name(v)}"
    supported = ("supported: all float16, all bfloat16, all float32; all fp8 e4m3 (with descales); "
                 "int8 query/key + fp8 value (i8fp8, with descales); float16/bfloat16 query with an "
                 "fp8 KV cache (per-token or per-head descales)")
    if q in FLOAT_DTYPES:
        ok = (k == q and v == q) or (q != torch.float32 and k in FP8_DTYPES and v == k)
    elif q in FP8_DTYPES:
        ok = k == q and v == q
    elif q == torch.int8:
        ok = k == torch.int8 and v in FP8_DTYPES
    else:
        ok = False
    if not ok:
        raise ValueError(f"{combo} not supported; {supported}")
    descales = (inp.q_descale, inp.k_descale, inp.v_descale)
    if q not in FLOAT_DTYPES:
        for role, d in zip(_DESCALE_ROLES, descales):
            if d is None:
                raise ValueError(f"{role} is required when query is {dtype_name(q)} (float32 descales; pass "
                                 f"torch.ones(1) for unit scales)")
    if q in FLOAT_DTYPES and k in FP8_DTYPES and (inp.k_descale is None or inp.v_descale is None):
        raise ValueError(f"k_descale and v_descale are required for a {dtype_name(k)} KV cache")
    if q in FLOAT_DTYPES and k == q and any(d is not None for d in descales):
        given = "/".join(r for r, d in zip(_DESCALE_ROLES, descales) if d is not None)
        raise ValueError(f"{given}: descales are only for quantized inputs; query/key/value are {dtype_name(q)}")
    if q in FLOAT_DTYPES and k in FP8_DTYPES and inp.q_descale is not None:
        raise ValueError(f"q_descale is not taken with a {dtype_name(q)} query (an fp8 KV cache takes k_descale "
                         f"and v_descale only)")
    if inp.quantize_kv_to_fp8 and not (q in (torch.float16, torch.bfloat16) and k == q):
        raise ValueError(f"quantize_kv_to_fp8=True needs float16/bfloat16 query, key and value; got {combo}")


def _validate_descales(inp: Inputs) -> None:
    kinds = descale_kinds(inp)  # raises on bad shapes
    for role, d in zip(_DESCALE_ROLES, (inp.q_descale, inp.k_descale, inp.v_descale)):
        if d is None:
            continue
        if d.dtype != torch.float32:
            raise ValueError(f"{role} must be float32, got {dtype_name(d.dtype)}")
        if d.device != inp.query.device:
            raise ValueError(f"{role} is on {d.device} but query is on {inp.query.device}")
    if inp.bias_kind in ab.DECODE_KINDS and "head" in kinds:
        raise ValueError(f"per-(batch, head) descales are not supported with {type(inp.attn_bias).__name__} "
                         f"(queries packed in batch 1); pass per-token k/v descales of shape key.shape[:3]")
    if kinds[1] == "token" and inp.query.dtype not in FLOAT_DTYPES:
        raise ValueError("per-token k/v descales are only for a float16/bfloat16 query with an fp8 KV cache")


def check_values(inp: Inputs) -> None:
    """Per-call checks of values the signature does not hold: descales must be finite and >= 0
    (``check_descale_values``), and masks check their index tables. Host-resident tensors always; device-resident
    ones only in check mode (``fmha_ops.checks``: one host sync), never during a CUDA graph capture or a
    torch.compile trace."""
    if torch.compiler.is_compiling():
        return
    check_descale_values(*zip(_DESCALE_ROLES, (inp.q_descale, inp.k_descale, inp.v_descale)))
    if inp.attn_bias is not None:
        inp.attn_bias.check_values(inp.key)


def check_descale_values(*descales: tuple[str, torch.Tensor | None]) -> None:
    """Raise ValueError naming the first descale, of ``(argument name, tensor or None)`` pairs, with an entry that
    is not finite or below 0 (0: an all-zero block or token). Host-resident descales always; device-resident ones
    only in check mode (one host sync for all of them), never in a CUDA graph capture or a torch.compile trace."""
    if torch.compiler.is_compiling():
        return
    descales = [(role, d) for role, d in descales if d is not None]
    if descales and not all(d.device.type == "cpu" for _, d in descales) and not checks.device_checks_wanted():
        descales = [(role, d) for role, d in descales if d.device.type == "cpu"]  # device ones: in check mode only
    if descales:  # one read back for all of them
        ok = [bool(f) for f in torch.stack([(torch.isfinite(d) & (d >= 0)).all() for _, d in descales]).tolist()]
        for (role, d), good in zip(descales, ok):
            if not good:
                arguments.require_finite(role, d)
                arguments.require_nonnegative(role, d)


def descale_kinds(inp: Inputs) -> tuple[str, str, str]:
    """The (q, k, v) descale kinds (see ``fmha_ops.inputs``); raises ValueError on a shape that is none of them."""
    q, k, v = inp.query, inp.key, inp.value
    b, mq, hq, _ = q.shape
    mk, hkv = k.shape[1], k.shape[2]
    sequences = inp.attn_bias.dims(q, k).batch if inp.bias_kind in ab.VARLEN_KINDS else b
    head = (sequences, hkv)
    # per token: shaped like the key without its head dim; with a paged mask also like the page pool
    # (num_pages, page_size, Hkv), so an fp8 cache's scales pass through in their own layout
    k_token, v_token = {"token": tuple(k.shape[:3])}, {"token": tuple(v.shape[:3])}
    if inp.bias_kind in ab.PAGED_KINDS and inp.attn_bias.page_size and mk % inp.attn_bias.page_size == 0:
        pages = (mk // inp.attn_bias.page_size, inp.attn_bias.page_size, hkv)
        k_token["token (pages)"], v_token["token (pages)"] = pages, pages
    shapes = {
        "q_descale": (inp.q_descale, {"head": head, "block": (b, hq, -(-mq // Q_SCALE_BLOCK))}),
        # a float query's k_descale is per token before per block (i8fp8 only) where both shapes agree
        "k_descale": (inp.k_descale, {"head": head, **k_token, "block": (b, hkv, -(-mk // K_SCALE_BLOCK))}
                      if q.dtype in FLOAT_DTYPES else
                      {"head": head, "block": (b, hkv, -(-mk // K_SCALE_BLOCK)), **k_token}),
        "v_descale": (inp.v_descale, {"head": head, "channel": (b, hkv, v.shape[3]), **v_token}),
    }
    kinds = []
    for role, (t, allowed) in shapes.items():
        if t is None:
            kinds.append("none")
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{role} must be a float32 tensor, got {type(t).__name__}")
        shape = tuple(t.shape)
        # an exact shape first: a per-token scale of a one-slot, one-head cache has numel 1 too
        kind = next((kind for kind, want in allowed.items() if shape == want), None)
        if kind is not None:
            kinds.append(kind.split(" ")[0])
        elif t.numel() == 1:
            kinds.append("tensor")
        else:
            listed = ", ".join(f"{kind} {want}" for kind, want in allowed.items())
            raise ValueError(f"{role} has shape {shape}; supported: a scalar (numel 1), {listed}")
    return tuple(kinds)  # type: ignore[return-value]


def value_layout(v: torch.Tensor) -> Any:
    """"last" (contiguous in the head dim), "keys" (keys-contiguous, see ``fmha_ops.inputs``), or the
    strides of a layout that is neither."""
    if v.shape[-1] == 0 or v.stride(-1) == 1:
        return "last"
    if (v.stride(1) == 1 or v.shape[1] <= 1) and all(
            v.stride(d) * v.element_size() % TMA_ALIGNMENT == 0 for d in (0, 2, 3)):
        return "keys"
    return v.stride()


#: the BMHK dims' names in what ``misalignment`` says
_BMHK_DIMS = ("batch", "sequence", "head", "head-dim")


def misalignment(t: torch.Tensor) -> str | None:
    """What keeps a kernel that needs 16-byte (``TMA_ALIGNMENT``) operands from reading the BMHK tensor ``t`` as
    stored: its start address, or the first stride (in bytes) of a dim longer than 1, other than a unit stride, that
    is not a multiple of 16 bytes; None for an empty tensor or one that is aligned.

    Example
    -------
    >>> misalignment(torch.randn(2, 200, 1, 196, dtype=torch.float16)[..., :64])
    'sequence stride 196 elements (392 bytes)'
    """
    if not t.numel():
        return None
    if t.data_ptr() % TMA_ALIGNMENT:
        return f"start address {t.data_ptr() % TMA_ALIGNMENT} bytes past a {TMA_ALIGNMENT}-byte boundary"
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride != 1 and size > 1 and stride * t.element_size() % TMA_ALIGNMENT:
            name = _BMHK_DIMS[dim] if t.dim() == len(_BMHK_DIMS) else f"dim {dim}"
            return f"{name} stride {stride} elements ({stride * t.element_size()} bytes)"
    return None


def misaligned_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[str, ...]:
    """One phrase per input that breaks the 16-byte rule (``misalignment``), naming the input and the value, e.g.
    ``('query sequence stride 196 elements (392 bytes)',)``; empty when all are aligned. The call signature holds
    the bits this depends on (``inputs.alignment_bits``)."""
    return tuple(f"{name} {why}" for name, t in (("query", q), ("key", k), ("value", v))
                 if (why := misalignment(t)) is not None)


def tma_misaligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[str, ...]:
    """Names of the inputs ``misalignment`` finds a reason in.

    Example
    -------
    >>> q = torch.randn(2, 64, 4, 36, dtype=torch.float16)[..., :32]  # heads 72 bytes apart
    >>> k = v = torch.randn(2, 64, 4, 32, dtype=torch.float16)
    >>> tma_misaligned(q, k, v)
    ('query',)
    """
    return tuple(name for name, t in (("query", q), ("key", k), ("value", v)) if misalignment(t) is not None)
