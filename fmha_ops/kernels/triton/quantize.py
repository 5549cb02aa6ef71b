"""Fused one-pass quantization of BMHK attention inputs to int8 / fp8 (the training path's q, k, v).

One program quantizes ``BLOCK`` rows of one head: it reads x (bf16/fp16/fp32) once and writes the
quantized rows and their descale, so quantization costs one read and one narrow write per element
(the torch version in ``fmha_ops.quant`` makes several full-precision passes).

* per block: descale = amax(block) / qmax over ``BLOCK`` rows x D, written to (B, H, cdiv(M, BLOCK));
* per channel: descale given as (B, H, D) (computed over the whole sequence beforehand), only applied.

Optionally ``mean`` (B, H, D) is subtracted from every row first (smooth-K: a per-query-row constant in
the logits), and optionally the dequantized rows (quantized value * descale / scale, in x's dtype and
units) are written too: the values the quantized forward actually attended to, for the backward pass.
int8 rounds half away from zero; fp8 saturates to the format's max and rounds to nearest even.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_kernel(
    X, XQ, XD, DS, MEAN,
    stride_xb, stride_xm, stride_xh,
    stride_qb, stride_qm, stride_qh,
    stride_db, stride_dh, stride_mb, stride_mh,
    M, H, scale, inv_scale, qmax,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    PER_CHANNEL: tl.constexpr, SUB_MEAN: tl.constexpr, INT8: tl.constexpr, DEQUANT: tl.constexpr,
):
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < M)[:, None] & (cols < D)[None, :]
    offs_q = b.to(tl.int64) * stride_qb + rows.to(tl.int64)[:, None] * stride_qm + h * stride_qh + cols[None, :]
    x = tl.load(X + b.to(tl.int64) * stride_xb + rows.to(tl.int64)[:, None] * stride_xm + h * stride_xh
                + cols[None, :], mask=ok, other=0.0).to(tl.float32) * scale
    if SUB_MEAN:
        mu = tl.load(MEAN + b * stride_mb + h * stride_mh + cols, mask=cols < D, other=0.0)
        x = tl.where(ok, x - mu[None, :], 0.0)
    if PER_CHANNEL:
        ds = tl.load(DS + b * stride_db + h * stride_dh + cols, mask=cols < D, other=1.0)
        y = x / ds[None, :]
    else:
        amax = tl.max(tl.max(tl.abs(x), 1), 0)
        ds = tl.where(amax > 0.0, amax / qmax, 1.0)
        tl.store(DS + b * stride_db + h * stride_dh + blk, ds)
        y = x / ds
    y = tl.minimum(tl.maximum(y, -qmax), qmax)
    if INT8:
        y = y + tl.where(y >= 0.0, 0.5, -0.5)  # the int8 cast truncates toward zero
    yq = y.to(XQ.dtype.element_ty)
    tl.store(XQ + offs_q, yq, mask=ok)
    if DEQUANT:
        if PER_CHANNEL:
            xd = yq.to(tl.float32) * (ds * inv_scale)[None, :]
        else:
            xd = yq.to(tl.float32) * (ds * inv_scale)
        tl.store(XD + offs_q, xd.to(XD.dtype.element_ty), mask=ok)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, *, block: int = 128, scale: float = 1.0,
                  channel_descale: torch.Tensor | None = None, mean: torch.Tensor | None = None,
                  dequant: bool = False):
    """Quantize x (B, M, H, D) (x * ``scale``, minus ``mean``) to ``dtype`` (int8 or an fp8) in one pass.

    Per block of ``block`` rows and head unless ``channel_descale`` (B, H, D) float32 is given.
    ``mean``: float32 (B, H, D). Returns (xq (B, M, H, D) contiguous, descale (B, H, cdiv(M, block)) or
    ``channel_descale``, and with ``dequant`` xq * descale / scale (B, M, H, D) in x's dtype (0 where
``scale`` is 0), else None).
    """
    B, M, H, D = x.shape
    assert x.stride(-1) == 1, "x's last dim must be contiguous"
    qmax = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    nb = triton.cdiv(M, block)
    xq = torch.empty((B, M, H, D), dtype=dtype, device=x.device)
    ds = channel_descale if channel_descale is not None else torch.empty((B, H, nb), dtype=torch.float32,
                                                                         device=x.device)
    xd = torch.empty((B, M, H, D), dtype=x.dtype, device=x.device) if dequant else None
    m_arg = mean if mean is not None else ds
    if xq.numel():
        _quantize_kernel[(nb, B * H)](
            x, xq, xd if xd is not None else xq, ds, m_arg,
            x.stride(0), x.stride(1), x.stride(2), xq.stride(0), xq.stride(1), xq.stride(2),
            ds.stride(0), ds.stride(1), m_arg.stride(0), m_arg.stride(1),
            M, H, scale, 1.0 / scale if scale else 0.0, qmax,
            D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK=block,
            PER_CHANNEL=channel_descale is not None, SUB_MEAN=mean is not None,
            INT8=dtype == torch.int8, DEQUANT=dequant, num_warps=8 if D > 128 else 4,
        )
    return xq, ds, xd
