"""Does a Hadamard rotation of q/k, or clipping their int8 ranges, make i8fp8 attention more accurate?

Neither is kept: this script is the measurement behind that. The question is about the quantization, not the kernel,
so this runs in float64 torch (any machine): q/k go through ``quantize_i8fp8`` (smooth-K, int8 per block of
128 tokens), optionally rotated first by an orthonormal Hadamard matrix (q H (k H)^T = q k^T) or clipped to a
per-(block, head) quantile of |x|; attention of the dequantized q/k against an unquantized v (isolating the
QK^T error) and against fp8 v (the whole path, P unquantized), each vs float64 attention of the originals.
Inputs: normal, and the transformer-like distribution with 8 outlier tokens (x6) in q and k.

    PYTHONPATH=$PWD python bench/diagnostics/i8fp8_rotation_clipping.py [--n 2048]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch

from bench import common
from fmha_ops.quant import K_SCALE_BLOCK, Q_SCALE_BLOCK, quantize_i8fp8
from fmha_ops.testing import error_report, transformer_like


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def clip_blocks(x: torch.Tensor, block: int, quantile: float) -> torch.Tensor:
    B, M, H, D = x.shape
    xb = x.reshape(B, M // block, block, H, D)
    t = xb.abs().permute(0, 1, 3, 2, 4).reshape(B, M // block, H, -1).quantile(quantile, dim=-1)[:, :, None, :, None]
    return torch.maximum(torch.minimum(xb, t), -t).reshape(B, M, H, D)


def attention(q, k, v):
    s = torch.einsum("bmhd,bnhd->bhmn", q.double(), k.double()) * q.shape[-1] ** -0.5
    return torch.einsum("bhmn,bnhd->bmhd", s.softmax(-1), v.double())


def dequantized(x8, descale, block):
    return x8.double() * descale.repeat_interleave(block, 2)[:, :, : x8.shape[1]].transpose(1, 2)[..., None].double()


def variant(q, k, v, name):
    if name == "hadamard":
        h = hadamard(q.shape[-1]).to(q.dtype)
        q, k = q @ h, k @ h
    elif name.startswith("clip"):
        quantile = float(name[4:]) / 100
        q, k = clip_blocks(q, Q_SCALE_BLOCK, quantile), clip_blocks(k - k.mean(1, keepdim=True), K_SCALE_BLOCK, quantile)
    r = quantize_i8fp8(q, k, v, scale=1.0)
    qd, kd = dequantized(r.q, r.q_descale, Q_SCALE_BLOCK), dequantized(r.k, r.k_descale, K_SCALE_BLOCK)
    return attention(qd, kd, v), attention(qd, kd, r.v.double() * r.v_descale[:, None].double())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    B, M, H, D = 1, args.n, 4, 128
    rows = []
    for dist in ("normal", "transformer-like"):
        for seed in (0, 1):
            if dist == "normal":
                g = torch.Generator().manual_seed(seed)
                q, k, v = (torch.randn(B, M, H, D, generator=g) for _ in range(3))
            else:
                q, k, v = transformer_like((B, M, H, D), (B, M, H, D), dtype=torch.float32, seed=seed)
                idx = torch.randint(0, M, (8,), generator=torch.Generator().manual_seed(seed))
                q[:, idx] *= 6
                k[:, idx] *= 6
            ref = attention(q, k, v)
            for name in ("plain", "hadamard", "clip99.9", "clip99"):
                qk_only, whole = variant(q, k, v, name)
                a, b = error_report(qk_only.float(), ref.float()), error_report(whole.float(), ref.float())
                rows.append({"inputs": dist, "seed": seed, "variant": name, "qk_rel": a["rel"], "qk_cos": a["cos"],
                             "rel": b["rel"], "cos": b["cos"], "mae": b["mae"], "max": b["max"]})
    common.print_table(rows, ("inputs", "seed", "variant", "qk_rel", "qk_cos", "rel", "cos", "mae", "max"))
    common.write_json(common.out_dir(args.out), "i8fp8_rotation_clipping", rows)


if __name__ == "__main__":
    main()
