"""Error metrics and input distributions shared by kernel tests and benchmarks."""
from __future__ import annotations

import torch


def error_report(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Relative L2 error, cosine similarity, mean and max absolute error of ``out`` vs ``ref``."""
    o = out.detach().double().flatten()
    r = ref.detach().double().flatten()
    if o.numel() == 0:
        return {"rel": 0.0, "cos": 1.0, "mae": 0.0, "max": 0.0}
    diff = o - r
    rn = r.norm().item()
    return {
        "rel": diff.norm().item() / max(rn, 1e-30),
        "cos": torch.nn.functional.cosine_similarity(o, r, dim=0, eps=1e-30).item() if rn > 0 else 1.0,
        "mae": diff.abs().mean().item(),
        "max": diff.abs().max().item(),
    }


def transformer_like(shape_q, shape_kv, *, dtype=torch.bfloat16, device="cpu", seed=0, rank=4):
    """Q, K, V in BMHK layout mimicking real activations.

    Per-channel scales, a shared low-rank component between Q and K (peaked softmax),
    outlier channels in K and outlier tokens in V.
    ``shape_q`` = (B, Mq, Hq, D); ``shape_kv`` = (B, Mk, Hkv, D) (V has the same shape).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, Mq, Hq, D = shape_q
    _, Mk, Hkv, _ = shape_kv
    chan = torch.exp(torch.randn(D, generator=g) * 0.5)
    basis = torch.randn(rank, D, generator=g) * 2.0
    q = torch.randn(*shape_q, generator=g) * chan
    k = torch.randn(*shape_kv, generator=g) * chan
    q = q + torch.randn(B, Mq, Hq, rank, generator=g) @ basis
    k = k + torch.randn(B, Mk, Hkv, rank, generator=g) @ basis
    k[..., : max(1, D // 32)] += 8.0  # outlier channels shared by every key
    v = torch.randn(*shape_kv, generator=g)
    if Mk:
        idx = torch.randint(0, Mk, (max(1, Mk // 64),), generator=g)
        v[:, idx] *= 20.0  # outlier tokens
    q = q / (D ** 0.25)
    k = k / (D ** 0.25)
    return (t.to(device=device, dtype=dtype) for t in (q, k, v))
