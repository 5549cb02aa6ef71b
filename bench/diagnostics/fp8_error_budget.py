"""Where the fp8 forward's error comes from on transformer-like inputs: each quantization alone, then together.

    python bench/diagnostics/fp8_error_budget.py [--n 2048] [--heads 4] [--dim 128]

Emulates the fp8 kernels' arithmetic in float64 on any machine: q / k / v cast to e4m3fn with a per-(batch, head)
amax scale (the FA3 descales; or per block of 64 / 128 tokens, per token / per channel, or after a random Hadamard
rotation of q and k), P
scaled by 2**8 and cast to e4m3fn before P V, the row sum from the unquantized P (as the kernels keep it).
Prints the cosine similarity and the mean absolute error of each variant against the float64 reference.
e4m3 is a floating-point format (3 mantissa bits at every scale): a finer scale changes its rounding only
where values would be subnormal, so per-block and per-token q/k scales move the error by noise, while int8
q/k (i8fp8), whose error is relative to the scale, gains from them.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from fmha_ops.testing import transformer_like  # noqa: E402

F8 = torch.float8_e4m3fn
F8_MAX = 448.0
#: P is scaled by 2**P_SHIFT before its e4m3 cast (kernels/softmax.py p_shift)
P_SHIFT = 8


def quantize(t: torch.Tensor, dims) -> torch.Tensor:
    """``t`` rounded through e4m3fn with an amax scale over ``dims`` (the others keep their own scale)."""
    scale = t.abs().amax(dim=dims, keepdim=True).clamp_min(1e-30) / F8_MAX
    return (t / scale).to(F8).to(t.dtype) * scale


def quantize_blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    """``t`` (B, H, N, D) rounded through e4m3fn with one amax scale per (batch, head, block of ``block`` tokens)."""
    b, h, n, d = t.shape
    nb = -(-n // block)
    padded = torch.nn.functional.pad(t, (0, 0, 0, nb * block - n)).reshape(b, h, nb, block, d)
    return quantize(padded, (-2, -1)).reshape(b, h, nb * block, d)[:, :, :n]


def attention(q, k, v, p_fp8: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v on (B, H, N, D), P optionally rounded through e4m3fn as the kernels do."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.exp(s - s.amax(-1, keepdim=True))
    row_sum = p.sum(-1, keepdim=True)
    if p_fp8:
        p = (p * 2 ** P_SHIFT).to(F8).to(p.dtype) / 2 ** P_SHIFT
    return (p @ v) / row_sum


def hadamard(n: int, seed: int = 1) -> torch.Tensor:
    """A random orthogonal Hadamard matrix (random signs times the Sylvester Hadamard), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.where(torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.5, -1.0, 1.0)
    return signs.double()[:, None] * h / math.sqrt(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    shape = (1, args.n, args.heads, args.dim)
    q, k, v = (t.double().transpose(1, 2) for t in transformer_like(shape, shape, dtype=torch.float32, seed=7))
    ref = attention(q, k, v, False)
    head, token, channel = (-2, -1), -1, -2
    rot = hadamard(args.dim)
    variants = {
        "q, k per head": lambda: attention(quantize(q, head), quantize(k, head), v, False),
        "v per head": lambda: attention(q, k, quantize(v, head), False),
        "P (2**8, e4m3)": lambda: attention(q, k, v, True),
        "all (the fp8 kernels)": lambda: attention(quantize(q, head), quantize(k, head), quantize(v, head), True),
        "q, k per block of 128": lambda: attention(quantize_blocks(q, 128), quantize_blocks(k, 128), v, False),
        "q, k per block of 64": lambda: attention(quantize_blocks(q, 64), quantize_blocks(k, 64), v, False),
        "q, k per token": lambda: attention(quantize(q, token), quantize(k, token), v, False),
        "q, k rotated (Hadamard)": lambda: attention(quantize(q @ rot, head), quantize(k @ rot, head), v, False),
        "v per channel": lambda: attention(q, k, quantize(v, channel), False),
        "all, q/k per block of 128": lambda: attention(quantize_blocks(q, 128), quantize_blocks(k, 128),
                                                       quantize(v, head), True),
        "all, q/k per block of 64": lambda: attention(quantize_blocks(q, 64), quantize_blocks(k, 64),
                                                      quantize(v, head), True),
        "all, q/k per token": lambda: attention(quantize(q, token), quantize(k, token), quantize(v, head), True),
        "all, q/k rotated (Hadamard)": lambda: attention(quantize(q @ rot, head), quantize(k @ rot, head),
                                                         quantize(v, head), True),
        "all, q/k per token, v per channel": lambda: attention(quantize(q, token), quantize(k, token),
                                                               quantize(v, channel), True),
    }
    print(f"transformer_like {shape}, float64 emulation: cos / MAE against the float64 reference")
    for name, run in variants.items():
        out = run()
        cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
        print(f"{name:36s} cos {cos:.6f}  mae {(out - ref).abs().mean().item():.3e}", flush=True)


if __name__ == "__main__":
    main()
