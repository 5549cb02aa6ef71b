"""Quantization helpers for the fp8 and i8fp8 attention paths (pure torch).

Conventions (DESIGN.md): tensors are BMHK, ``(batch, seq, heads, head_dim)``; descales are float32 and
dequantize as ``x ≈ x_q.float() * descale`` (broadcast over the dims the descale does not have).

* fp8 (FA3): one descale per ``(batch, kv_head)``; q's descale covers the group of q heads that share
  a kv head, so the kernel indexes it by the kv head.
* i8fp8 (SageAttention-like): int8 q/k per block of ``Q_SCALE_BLOCK`` / ``K_SCALE_BLOCK`` tokens
  (per head), per head or per tensor; smooth-K subtracts K's mean over the sequence first (a constant
  per query row in the logits, so softmax is unchanged); the softmax scale is folded into q's descale.
  V is fp8 per channel ``(batch, kv_head, head_dim)`` or per tensor.
* incoherent processing (FA3): ``quantize_qkv_fp8(..., rotation=random_hadamard(D))`` rotates q and k by one
  orthogonal matrix before quantizing (q k^T, so the output and the LSE, are unchanged), spreading channel
  outliers over all channels.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import arguments

# Tokens per int8 descale along the sequence for per-block i8fp8 quantization. SageAttention uses 128 / 64;
# K blocks of 128 (a multiple of the kernel's BLOCK_N) give one k descale per tile: a scalar FMA per score
# instead of a per-column scale vector (2 more FP32 ops per score: i8fp8 ran at 0.86x fp8 at D128 with 64, 0.94-1.0x
# with 128).
Q_SCALE_BLOCK = 128
K_SCALE_BLOCK = 128
INT8_MAX = 127.0  # symmetric int8 range [-127, 127]: -128 unused, so negation never overflows

__all__ = [
    "K_SCALE_BLOCK",
    "Q_SCALE_BLOCK",
    "I8FP8Inputs",
    "fp8_channel_descale",
    "quantize_blocks",
    "quantize_fp8",
    "quantize_fp8_channels",
    "quantize_i8fp8",
    "quantize_qkv_fp8",
    "random_hadamard",
]

_FLOAT_INPUTS = arguments.FLOATS + (torch.float64,)
_BMHK = "(batch, seqlen, heads, headdim)"


def _safe_descale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """amax / qmax, with 1 where the group is all zeros (so dequantization never divides by 0)."""
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, num_kv_heads: int | None = None):
    """Quantize ``x`` (B, M, H, D) to fp8 with a float32 descale of shape (B, Hkv).

    ``num_kv_heads`` (default H) groups the H heads into Hkv groups of H // Hkv consecutive heads (use it
    for q under GQA/MQA); the amax is taken over the sequence, the group and the head dim.
    Returns ``(x_fp8, descale)`` with ``x ≈ x_fp8.float() * descale[:, None, :, None]`` per group.
    """
    arguments.tensor("x", x, ndim=4, dtypes=_FLOAT_INPUTS, layout=_BMHK)
    arguments.dtype("dtype", dtype, arguments.FP8)
    B, M, H, D = x.shape
    hkv = H if num_kv_heads is None else arguments.integer("num_kv_heads", num_kv_heads, minimum=1)
    if H % hkv:
        raise ValueError(f"num_kv_heads={hkv} must divide the {H} heads of x {tuple(x.shape)}")
    fmax = torch.finfo(dtype).max
    xf = x.float().reshape(B, M, hkv, H // hkv, D)
    descale = _safe_descale(xf.abs().amax(dim=(1, 3, 4)), fmax)
    xq = (xf / descale[:, None, :, None, None]).clamp(-fmax, fmax).to(dtype)
    return xq.reshape(B, M, H, D), descale


def random_hadamard(head_dim: int, seed: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """A random orthogonal rotation for incoherent processing: (D, D) float32 ``diag(s) H / sqrt(D)``, H the
    Sylvester Hadamard matrix, s random signs drawn from ``seed``; ``head_dim`` a power of two.

    >>> r = random_hadamard(64, seed=1)
    >>> bool(torch.allclose(r @ r.T, torch.eye(64), atol=1e-6))
    True
    """
    d = arguments.integer("head_dim", head_dim, minimum=1)
    if d & (d - 1):
        raise ValueError(f"head_dim={d}: a Hadamard rotation needs a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)) * 2.0 - 1.0
    return (signs[:, None] * h * d ** -0.5).to(device)


def _rotated(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x @ rotation over the head dim, in x's dtype when it is 16-bit (the product rounds to 8 mantissa bits,
    far below fp8's 3) and float32 otherwise."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return x @ rotation.to(x.dtype)
    return x.float() @ rotation.float()


def quantize_qkv_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                     *, rotation: torch.Tensor | None = None, qk_granularity: str = "head"):
    """fp8 q, k, v with float32 descales: ``(q8, k8, v8, q_descale, k_descale, v_descale)``.

    q (B, Mq, Hq, D), k (B, Mk, Hkv, D), v (B, Mk, Hkv, Dv) float, Hq % Hkv == 0; the fp8 tensors keep those
    shapes. v's descale is (B, Hkv). ``qk_granularity``:

    * ``"head"`` (FA3 convention): q_descale and k_descale (B, Hkv), q's per kv head (its group of q heads);
    * ``"block"``: one descale per (batch, head, block of tokens), q_descale (B, Hq, cdiv(Mq, Q_SCALE_BLOCK)),
      k_descale (B, Hkv, cdiv(Mk, K_SCALE_BLOCK)), contiguous; taken by the Triton fp8 kernel (``triton_fp8F``)
      only, not with varlen masks.

    e4m3 is a floating-point format: a finer scale changes its rounding error only where values would fall
    into its subnormal range, so ``"block"`` costs the kernel little and buys little accuracy on typical
    activations (bench/diagnostics/fp8_error_budget.py).
    ``rotation``: an orthogonal (D, D) matrix (``random_hadamard(D)``) applied to q and k before quantizing;
    attention of the returned tensors is that of the unrotated ones (q R (k R)^T = q k^T), with less
    quantization error where a few channels hold outliers.

    >>> q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(torch.randn(1, 4, 2, 16), torch.randn(1, 6, 1, 16),
    ...                                           torch.randn(1, 6, 1, 16))
    >>> qd.shape
    torch.Size([1, 1])
    >>> q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(torch.randn(1, 200, 2, 16), torch.randn(1, 300, 1, 16),
    ...                                           torch.randn(1, 300, 1, 16), qk_granularity="block")
    >>> tuple(qd.shape), tuple(kd.shape), tuple(vd.shape)
    ((1, 2, 2), (1, 1, 3), (1, 1))
    """
    arguments.bmhk_qkv(q, k, v)
    arguments.choice("qk_granularity", qk_granularity, ("head", "block"))
    hkv = k.shape[2]
    if rotation is not None:
        d = q.shape[-1]
        arguments.tensor("rotation", rotation, ndim=2, dtypes=_FLOAT_INPUTS)
        if tuple(rotation.shape) != (d, d):
            raise ValueError(f"rotation has shape {tuple(rotation.shape)}; it must be (D, D) = {(d, d)}")
        rotation = rotation.to(q.device)
        q, k = _rotated(q, rotation), _rotated(k, rotation)
    if qk_granularity == "block":
        arguments.dtype("dtype", dtype, arguments.FP8)
        q8, qd = quantize_blocks(q, Q_SCALE_BLOCK, dtype)
        k8, kd = quantize_blocks(k, K_SCALE_BLOCK, dtype)
    else:
        q8, qd = quantize_fp8(q, dtype, num_kv_heads=hkv)
        k8, kd = quantize_fp8(k, dtype)
    v8, vd = quantize_fp8(v, dtype)
    return q8, k8, v8, qd, kd, vd


def quantize_fp8_tensor(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """Per-tensor fp8 quantization of ``x`` (any shape): ``(x_fp8, descale)``, descale float32 of shape (1,)
    with ``x ~ x_fp8.float() * descale`` (the "tensor" descale kind cuDNN's fp8 attention takes)."""
    xq, descale = quantize_fp8(x.reshape(1, -1, 1, x.shape[-1]), dtype)
    return xq.view(x.shape), descale.reshape(1)


class I8FP8Inputs(NamedTuple):
    """Inputs for the i8fp8 kernel: out = softmax(softmax_scale * (q*q_descale)(k*k_descale)^T)(v*v_descale)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    softmax_scale: float


def quantize_blocks(x: torch.Tensor, block: int, dtype: torch.dtype = torch.int8):
    """Per-(batch, head, block of ``block`` tokens) quantization of x (B, M, H, D) to int8 or fp8.

    Returns (xq (B, M, H, D), descale float32 (B, H, cdiv(M, block))); descale = amax / qmax (1 for an
    all-zero block); int8 rounds half away from zero, as the fused kernel (kernels/triton/quantize.py) does.
    """
    arguments.tensor("x", x, ndim=4, dtypes=_FLOAT_INPUTS, layout=_BMHK)
    block = arguments.integer("block", block, minimum=1)
    arguments.dtype("dtype", dtype, (torch.int8,) + arguments.FP8)
    B, M, H, D = x.shape
    nb = -(-M // block)
    qmax = INT8_MAX if dtype == torch.int8 else torch.finfo(dtype).max
    xp = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, nb * block - M)).reshape(B, nb, block, H, D)
    descale = _safe_descale(xp.abs().amax(dim=(2, 4)), qmax)  # (B, nb, H)
    y = (xp / descale[:, :, None, :, None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = (y + torch.where(y >= 0, 0.5, -0.5)).trunc()
    return y.to(dtype).reshape(B, nb * block, H, D)[:, :M], descale.permute(0, 2, 1).contiguous()


def dequantize_blocks(xq: torch.Tensor, descale: torch.Tensor, block: int) -> torch.Tensor:
    """float32 values of ``quantize_blocks``' output: xq (B, M, H, D) * descale (B, H, cdiv(M, block))."""
    arguments.tensor("xq", xq, ndim=4, dtypes=(torch.int8,) + arguments.FP8, layout=_BMHK)
    arguments.tensor("descale", descale, ndim=3, dtypes=(torch.float32,), layout="(batch, heads, blocks)")
    block = arguments.integer("block", block, minimum=1)
    B, M, H, _ = xq.shape
    arguments.shape("descale", descale, (B, H, -(-M // block)), f"for xq {tuple(xq.shape)} and block={block}")
    arguments.same_device("descale", descale, "xq", xq)
    return xq.float() * descale.repeat_interleave(block, 2)[:, :, :M].transpose(1, 2)[..., None]


def _int8_grouped(x: torch.Tensor, groups: int | None):
    """int8 with one descale per (batch, group of heads) (shape (B, groups)) or per tensor (groups None)."""
    B, M, H, D = x.shape
    if groups is None:
        descale = _safe_descale(x.abs().amax().reshape(1), INT8_MAX)
        return torch.round(x / descale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), descale
    xg = x.reshape(B, M, groups, H // groups, D)
    descale = _safe_descale(xg.abs().amax(dim=(1, 3, 4)), INT8_MAX)
    xq = torch.round(xg / descale[:, None, :, None, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return xq.reshape(B, M, H, D), descale


def fp8_channel_descale(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 (B, H, D) descale of v (B, M, H, D) per channel over the sequence: amax / fp8 max (1 where all
    zero, and for an empty sequence)."""
    arguments.tensor("v", v, ndim=4, dtypes=_FLOAT_INPUTS, layout=_BMHK)
    arguments.dtype("dtype", dtype, arguments.FP8)
    B, M, H, D = v.shape
    if not M:
        return torch.ones((B, H, D), dtype=torch.float32, device=v.device)
    amax = torch.linalg.vector_norm(v, float("inf"), dim=1, dtype=torch.float32)
    return _safe_descale(amax, torch.finfo(dtype).max)


def quantize_fp8_channels(v: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """v (B, M, H, D) / descale (B, H, D), saturated, as ``dtype`` (fp8)."""
    arguments.tensor("v", v, ndim=4, dtypes=_FLOAT_INPUTS, layout=_BMHK)
    arguments.tensor("descale", descale, ndim=3, dtypes=(torch.float32,), layout="(batch, heads, headdim)")
    arguments.dtype("dtype", dtype, arguments.FP8)
    arguments.shape("descale", descale, (v.shape[0], v.shape[2], v.shape[3]), f"for v {tuple(v.shape)}")
    arguments.same_device("descale", descale, "v", v)
    arguments.host_finite("descale", descale)
    fmax = torch.finfo(dtype).max
    return (v.float() / descale[:, None]).clamp(-fmax, fmax).to(dtype)


def quantize_i8fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                   smooth_k: bool = True, qk_granularity: str = "block", v_granularity: str = "channel",
                   fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> I8FP8Inputs:
    """Quantize bf16/fp16/fp32 q (B, Mq, Hq, D), k (B, Mk, Hkv, D), v (B, Mk, Hkv, Dv) for the i8fp8 kernel.

    ``scale`` (default D**-0.5) is folded into q's descale, so the returned ``softmax_scale`` is 1.0.
    qk_granularity: "block" (q: (B, Hq, cdiv(Mq, Q_SCALE_BLOCK)), k: (B, Hkv, cdiv(Mk, K_SCALE_BLOCK))),
    "head" ((B, Hkv) for both; q's amax over the q heads sharing a kv head) or "tensor" (numel 1).
    v_granularity: "channel" ((B, Hkv, Dv)) or "tensor" (numel 1).
    """
    arguments.bmhk_qkv(q, k, v)
    if scale is not None:
        scale = arguments.finite_float("scale", scale)
    smooth_k = arguments.flag("smooth_k", smooth_k)
    arguments.choice("qk_granularity", qk_granularity, ("block", "head", "tensor"))
    arguments.choice("v_granularity", v_granularity, ("channel", "tensor"))
    arguments.dtype("fp8_dtype", fp8_dtype, arguments.FP8)
    D = q.shape[-1]
    hkv = k.shape[2]
    qf = q.float() * (D ** -0.5 if scale is None else scale)
    kf = k.float()
    if smooth_k and kf.shape[1] > 0:
        kf = kf - kf.mean(dim=1, keepdim=True)
    if qk_granularity == "block":
        q8, qd = quantize_blocks(qf, Q_SCALE_BLOCK)
        k8, kd = quantize_blocks(kf, K_SCALE_BLOCK)
    else:
        groups = hkv if qk_granularity == "head" else None
        q8, qd = _int8_grouped(qf, groups)
        k8, kd = _int8_grouped(kf, groups)
    if v_granularity == "channel":
        vd = fp8_channel_descale(v, fp8_dtype)  # (B, Hkv, Dv)
        v8 = quantize_fp8_channels(v, vd, fp8_dtype)
    else:
        fmax = torch.finfo(fp8_dtype).max
        vf = v.float()
        vd = _safe_descale(vf.abs().amax().reshape(1), fmax)
        v8 = (vf / vd).clamp(-fmax, fmax).to(fp8_dtype)
    return I8FP8Inputs(q8, k8, v8, qd, kd, vd, 1.0)
