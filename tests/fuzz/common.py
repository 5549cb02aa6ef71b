"""Helpers the case modules share: inputs, argument perturbations, result checks."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch


F8 = torch.float8_e4m3fn
#: normalized max error allowed against the float64 reference, by the dtype the call computes in
TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2, F8: 0.2, torch.int8: 0.2}

# How the user's argument may be named in a message (flash_attn_* names q/k/v what the xformers API
# names query/key/value; either is clear).
ALIASES = {"q": ("q", "query"), "k": ("k", "key"), "v": ("v", "value"),
           "query": ("query", "q"), "key": ("key", "k"), "value": ("value", "v")}


def names(*args: str) -> tuple[str, ...]:
    out: list[str] = []
    for a in args:
        out.extend(ALIASES.get(a, (a,)))
    return tuple(dict.fromkeys(out))


def rnd(*shape: int, dtype: torch.dtype = torch.float16, scale: float = 1.0) -> torch.Tensor:
    """Random normal values (never zeros) as ``dtype``; int8 in [-100, 100]."""
    x = torch.randn(*shape, dtype=torch.float64) * scale
    if dtype == torch.int8:
        return (x * 40).round().clamp(-100, 100).to(torch.int8)
    return x.to(dtype)


def fp8_head(x: torch.Tensor, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 values of x (B, M, H, D) and a float32 (B, hkv) descale (FA3 convention)."""
    b, m, h, d = x.shape
    amax = x.double().reshape(b, m, hkv, h // hkv, d).abs().amax(dim=(1, 3, 4)).clamp_min(1e-6)
    descale = (amax / torch.finfo(F8).max).float()
    x8 = (x.double() / descale.double().repeat_interleave(h // hkv, 1)[:, None, :, None]).to(F8)
    return x8, descale


def deq_head(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """float64 x8 (B, M, H, D) * descale (B, Hkv), or times a numel-1 descale."""
    if descale.numel() == 1:
        return x8.double() * descale.double().reshape(())
    h = x8.shape[2]
    return x8.double() * descale.double().repeat_interleave(h // descale.shape[1], 1)[:, None, :, None]


def mismatch(out: Any, ref: torch.Tensor, dtype: torch.dtype | None, tol: float, what: str = "out") -> str | None:
    """None when ``out`` is a tensor of ref's shape (and ``dtype``) within ``tol`` of ref (normalized max
    error, NaN where ref is finite counts as wrong), else what differs."""
    if not isinstance(out, torch.Tensor):
        return f"{what} is a {type(out).__name__}, not a tensor"
    if tuple(out.shape) != tuple(ref.shape):
        return f"{what} shape {tuple(out.shape)} != expected {tuple(ref.shape)}"
    if dtype is not None and out.dtype != dtype:
        return f"{what} dtype {out.dtype} != expected {dtype}"
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    same_inf = (o == r) | (torch.isnan(o) & torch.isnan(r))
    if not bool(same_inf[~torch.isfinite(r)].all()):
        return f"{what}: non-finite reference entries differ"
    fin = torch.isfinite(r)
    if not bool(torch.isfinite(o[fin]).all()):
        return f"{what}: NaN/Inf where the reference is finite"
    if not fin.any():
        return None
    err = (o[fin] - r[fin]).abs().max().item() / max(1.0, r[fin].abs().max().item())
    return None if err <= tol else f"{what}: normalized max error {err:.3g} > {tol:g}"


def first(*msgs: str | None) -> str | None:
    return next((m for m in msgs if m), None)


# ---- argument perturbations ---------------------------------------------------------------------------
# Each returns (label, transform) pairs; a transform maps the valid value to the bad one.

def tensor_kind_errors(required: bool = True) -> list[tuple[str, Callable[[Any], Any]]]:
    """Not a tensor of the right kind: every tensor argument gets these."""
    out = [
        ("list", lambda t: t.tolist() if t.dtype not in (F8, torch.float8_e4m3fnuz) else t.float().tolist()),
        ("float", lambda t: 1.5),
        ("str", lambda t: "x"),
        ("ndim+1", lambda t: t[None]),
        ("ndim-1", lambda t: t[0] if t.shape[0] else t.reshape(t.shape[1:])),
        ("float64", lambda t: t.double()),
        ("int32", lambda t: t.float().round().int()),
        ("bool", lambda t: t != 0),
        ("complex64", lambda t: t.float().to(torch.complex64)),
        ("meta", lambda t: t.to("meta")),
    ]
    if required:
        out.append(("None", lambda t: None))
    return out


def strided_last(t: torch.Tensor) -> torch.Tensor:
    """The same values with stride 2 in the last dim."""
    return torch.stack([t, t], dim=-1).flatten(-2)[..., ::2]


def grow(t: torch.Tensor, dim: int, by: int = 1) -> torch.Tensor:
    """t with ``by`` more (random) entries along ``dim`` (fewer when by < 0)."""
    if by < 0:
        return t.narrow(dim, 0, t.shape[dim] + by)
    extra = list(t.shape)
    extra[dim] = by
    return torch.cat([t, rnd(*extra, dtype=torch.float32).to(t.dtype)], dim)


BAD_FLOATS = [("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("str", "0.5"), ("list", [0.5]),
              ("complex", 1 + 1j), ("tensor2", torch.tensor([0.5, 0.5]))]
BAD_DTYPES = [("int32", torch.int32), ("float64", torch.float64), ("bool", torch.bool), ("str", "float16"),
              ("int", 5), ("fp8", F8)]
BAD_OPS = [("list", ["torch_referenceF"]), ("int", 3), ("unknown", "no_such_op"), ("tuple1", ("torch_referenceF",)),
           ("tuple3", ("torch_referenceF", None, None)), ("object", object()), ("dict", {"fw": "torch_referenceF"})]


Change = Callable[[dict], dict]  # keyword arguments of a valid call -> the perturbed ones


def set_args(**values: Any) -> Change:
    """A change that sets arguments."""
    return lambda kw: {**kw, **values}


def edit_arg(name: str, f: Callable[[Any], Any]) -> Change:
    """A change that replaces argument ``name`` by ``f`` of it."""
    return lambda kw: {**kw, name: f(kw[name])}


def call_body(fn: Callable, make: Callable[[], dict], change: Change | None = None,
              check: Callable[[dict, Any], str | None] | None = None):
    """A Case body calling ``fn(**change(make()))``; ``check(kw, result)`` judges an accepted call (None: any
    acceptance is wrong)."""
    def body():
        kw = make() if change is None else change(make())
        res = fn(**kw)
        return res, (None if check is None else (lambda r: check(kw, r)))
    return body
