"""Fused one-pass quantization of BMHK attention inputs to int8 / fp8 (the training path's q, k, v).

One program quantizes ``BLOCK`` rows of one head: it reads x (bf16/fp16/fp32) once and writes the
quantized rows and their descale, so quantization costs one read and one narrow write per element
(the torch version in ``fmha_ops.quant`` makes several full-precision passes).

* per block: descale = amax(block) / qmax over ``BLOCK`` rows x D, written to (B, H, cdiv(M, BLOCK));
* per channel: descale given as (B, H, D) (computed over the whole sequence beforehand), only applied.

Optional extras, both per head group (``GROUP`` heads share one row of ``mean``, as q heads share a
kv head under GQA):
* ``mean`` (B, Hg, D) subtracted from every row (smooth-K: a per-query-row constant in the logits);
* ``dot`` (B, Hg, D): writes ``rowdot[b, h, m] = sum_d x'[m, d] * dot[b, h // GROUP, d]``, x' = x * scale,
  the logit offset smooth-K removed, which turns the kernel's LSE back into the unsmoothed one.
int8 rounds half away from zero; fp8 saturates to the format's max and rounds to nearest even.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_kernel(
    X, XQ, DS, MEAN, DOT, ROWDOT,
    stride_xb, stride_xm, stride_xh,
    stride_qb, stride_qm, stride_qh,
    stride_db, stride_dh, stride_mb, stride_mh, stride_tb, stride_th, stride_rb, stride_rh,
    M, H, GROUP, scale, qmax,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    PER_CHANNEL: tl.constexpr, SUB_MEAN: tl.constexpr, ROW_DOT: tl.constexpr, INT8: tl.constexpr,
):
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hg = h // GROUP
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < M)[:, None] & (cols < D)[None, :]
    x = tl.load(X + b.to(tl.int64) * stride_xb + rows.to(tl.int64)[:, None] * stride_xm + h * stride_xh
                + cols[None, :], mask=ok, other=0.0).to(tl.float32) * scale
    if ROW_DOT:
        t = tl.load(DOT + b * stride_tb + hg * stride_th + cols, mask=cols < D, other=0.0)
        tl.store(ROWDOT + b * stride_rb + h * stride_rh + rows, tl.sum(x * t[None, :], 1), mask=rows < M)
    if SUB_MEAN:
        mu = tl.load(MEAN + b * stride_mb + hg * stride_mh + cols, mask=cols < D, other=0.0)
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
    tl.store(XQ + b.to(tl.int64) * stride_qb + rows.to(tl.int64)[:, None] * stride_qm + h * stride_qh + cols[None, :],
             y.to(XQ.dtype.element_ty), mask=ok)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, *, block: int = 128, scale: float = 1.0,
                  channel_descale: torch.Tensor | None = None, mean: torch.Tensor | None = None,
                  dot: torch.Tensor | None = None):
    """Quantize x (B, M, H, D) (x * ``scale``, minus ``mean``) to ``dtype`` (int8 or an fp8) in one pass.

    Per block of ``block`` rows and head unless ``channel_descale`` (B, H, D) float32 is given.
    ``mean`` / ``dot``: float32 (B, Hg, D) with H % Hg == 0 (see the module docstring).
    Returns (xq (B, M, H, D) contiguous, descale (B, H, cdiv(M, block)) or ``channel_descale``,
    rowdot (B, H, M) float32 or None).
    """
    B, M, H, D = x.shape
    assert x.stride(-1) == 1, "x's last dim must be contiguous"
    qmax = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    nb = triton.cdiv(M, block)
    xq = torch.empty((B, M, H, D), dtype=dtype, device=x.device)
    ds = channel_descale if channel_descale is not None else torch.empty((B, H, nb), dtype=torch.float32,
                                                                         device=x.device)
    rowdot = torch.empty((B, H, M), dtype=torch.float32, device=x.device) if dot is not None else None
    group_src = mean if mean is not None else dot
    group = H // group_src.shape[1] if group_src is not None else 1
    m_arg = mean if mean is not None else ds
    t_arg = dot if dot is not None else ds
    if xq.numel():
        _quantize_kernel[(nb, B * H)](
            x, xq, ds, m_arg, t_arg, rowdot if rowdot is not None else ds,
            x.stride(0), x.stride(1), x.stride(2), xq.stride(0), xq.stride(1), xq.stride(2),
            ds.stride(0), ds.stride(1), m_arg.stride(0), m_arg.stride(1), t_arg.stride(0), t_arg.stride(1),
            rowdot.stride(0) if rowdot is not None else 0, rowdot.stride(1) if rowdot is not None else 0,
            M, H, group, scale, qmax,
            D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK=block,
            PER_CHANNEL=channel_descale is not None, SUB_MEAN=mean is not None, ROW_DOT=dot is not None,
            INT8=dtype == torch.int8, num_warps=8 if D > 128 else 4,
        )
    elif rowdot is not None:
        rowdot.zero_()
    return xq, ds, rowdot
