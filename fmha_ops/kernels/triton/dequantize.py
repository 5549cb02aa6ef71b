"""One-pass dequantization: ``out = x * scale`` for a contiguous fp8 tensor and a float32 scalar on the device,
written in a wider float dtype (one read of x, one write of out; the scale never leaves the GPU)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch

BLOCK = 4096  # elements per program
NUM_WARPS = 8


@triton.jit
def _dequantize_kernel(X, SCALE, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    scale = tl.load(SCALE)
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (x * scale).to(OUT.dtype.element_ty), mask=inside)


def dequantize(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in ``out_dtype``, same shape as ``x``.

    Parameters
    ----------
    x : torch.Tensor
        Contiguous, any shape, fp8 (or any float dtype), on a CUDA device.
    scale : torch.Tensor
        float32 with one element, on x's device.
    out_dtype : torch.dtype
        float16, bfloat16 or float32.

    Example
    -------
    >>> o = dequantize(o8, v_descale, torch.bfloat16)  # doctest: +SKIP
    """
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n = x.numel()
    if n:
        launch(_dequantize_kernel)[(cdiv(n, BLOCK),)](x, scale, out, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out
