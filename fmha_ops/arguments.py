"""Argument checks for the public functions: each raises TypeError / ValueError naming the argument,
the value it got and what is accepted, and returns the (normalized) value.

Example::

    from fmha_ops import arguments
    x = arguments.tensor("x", x, ndim=4, dtypes=arguments.FLOATS)   # (B, M, H, D) float
    block = arguments.integer("block", block, minimum=1)
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Collection

import numpy as np
import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def tensor(name: str, x: Any, *, ndim: int | Collection[int] | None = None,
           dtypes: Collection[torch.dtype] | None = None, layout: str = "") -> torch.Tensor:
    """``x`` as a tensor with ``ndim`` dims (an int or a set) and one of ``dtypes``.
    ``layout`` names the dims in the message (e.g. "(B, M, H, D)")."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' ' + layout if layout else ''}, got {type(x).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.ndim not in allowed:
            want = " or ".join(f"{n}-D" for n in allowed)
            raise ValueError(f"{name} must be {want}{' ' + layout if layout else ''}, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {_dtype_name(x.dtype)}; supported: "
                         f"{', '.join(map(_dtype_name, dtypes))}")
    return x


def same_device(name: str, x: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if x.device != other.device:
        raise ValueError(f"{name} is on {x.device} but {other_name} is on {other.device}; pass both on one device")


def shape(name: str, x: torch.Tensor, want: tuple[int, ...], what: str = "") -> None:
    """Raise unless ``x.shape == want`` (``what`` says where the expected shape comes from)."""
    if tuple(x.shape) != tuple(want):
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {tuple(want)}{' ' + what if what else ''}")


def integer(name: str, v: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``v`` as a Python int (bool is not an int here) within [minimum, maximum]."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {v!r} ({type(v).__name__})")
    v = int(v)
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {v}")
    return v


def real(name: str, v: Any) -> float:
    """``v`` (an int or float, not a bool or tensor) as a float."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a float, got {v!r} ({type(v).__name__})")
    return float(v)


def finite_float(name: str, v: Any) -> float:
    """``v`` (an int or float, not a bool or tensor) as a finite float."""
    v = real(name, v)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite float, got {v}")
    return v


def flag(name: str, v: Any) -> bool:
    """``v`` as a bool (a Python or numpy bool, not a truthy string or number)."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {v!r} ({type(v).__name__})")
    return bool(v)


def choice(name: str, v: Any, allowed: Collection[Any]) -> Any:
    """``v`` if it is one of ``allowed`` (same type and equal)."""
    if not any(type(v) is type(a) and v == a for a in allowed):
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {v!r}")
    return v


def dtype(name: str, v: Any, allowed: Collection[torch.dtype]) -> torch.dtype:
    if not isinstance(v, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype ({', '.join(map(_dtype_name, allowed))}), got {v!r}")
    if v not in allowed:
        raise ValueError(f"{name}={_dtype_name(v)} not supported; supported: {', '.join(map(_dtype_name, allowed))}")
    return v


def scale_and_causal(softmax_scale: Any, causal: Any) -> None:
    """FA3's ``softmax_scale`` (None, or a finite float) and ``causal`` (a bool)."""
    if softmax_scale is not None:
        finite_float("softmax_scale", softmax_scale)
    flag("causal", causal)


def window(window_size: Any, causal: bool) -> tuple[int, int]:
    """FA3's ``window_size`` as (left, right), -1 = unbounded (any negative value is); with ``causal`` right is -1
    (the causal mask bounds it)."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    left, right = max(left, -1), max(right, -1)
    return left, (-1 if causal else right)


def require_finite(name: str, x: torch.Tensor) -> None:
    """Raise ValueError naming the first NaN / Inf entry of ``x`` (reads ``x``: a sync for device tensors)."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} must be finite; entry {idx if len(idx) > 1 else idx[0]} is {x[idx].item()}")


def require_nonnegative(name: str, x: torch.Tensor) -> None:
    """Raise ValueError naming the first entry of ``x`` below 0 (reads ``x``: a sync for device tensors)."""
    bad = x < 0
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} must be >= 0 (a descale multiplies quantized values back to theirs); entry "
                         f"{idx if len(idx) > 1 else idx[0]} is {x[idx].item()}")


def host_finite(name: str, x: torch.Tensor) -> None:
    """``require_finite`` for a host-resident float tensor (device tensors are not read: no sync)."""
    if x.device.type == "cpu" and x.is_floating_point() and x.numel() and not torch.compiler.is_compiling():
        require_finite(name, x)


def bmhk_qkv(q: Any, k: Any, v: Any, names: tuple[str, str, str] = ("q", "k", "v"),
             dtypes: Collection[torch.dtype] = FLOATS + (torch.float64,)) -> None:
    """q (B, Mq, Hq, D), k (B, Mk, Hkv, D), v (B, Mk, Hkv, Dv) float tensors on one device, Hq % Hkv == 0."""
    qn, kn, vn = names
    for n, t in zip(names, (q, k, v)):
        tensor(n, t, ndim=4, dtypes=dtypes, layout="(batch, seqlen, heads, headdim)")
    same_device(kn, k, qn, q)
    same_device(vn, v, qn, q)
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{kn} {tuple(k.shape)} and {vn} {tuple(v.shape)} must agree in (batch, seqlen, heads)")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{qn} {tuple(q.shape)} and {kn} {tuple(k.shape)} must agree in batch and head dim")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"{qn} heads ({q.shape[2]}) must be a multiple of {kn} heads ({k.shape[2]})")
    if q.shape[3] == 0 or v.shape[3] == 0:
        raise ValueError(f"{qn}/{kn} head dim ({q.shape[3]}) and {vn} head dim ({v.shape[3]}) must be >= 1")
