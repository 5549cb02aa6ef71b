"""Error metrics and input distributions for checking attention outputs.

The package's tests and benchmarks use these to compare a kernel's output with a float64 reference, and user code
can use them the same way to check an op on its own shapes::

    import torch
    from fmha_ops import memory_efficient_attention
    from fmha_ops.testing import error_report, transformer_like

    q, k, v = transformer_like((2, 128, 8, 64), (2, 128, 8, 64), dtype=torch.float16, device="cuda")
    out = memory_efficient_attention(q, k, v)
    ref = memory_efficient_attention(q, k, v, op="torch_referenceF", output_dtype=torch.float32)
    err = error_report(out, ref)        # {"rel": ..., "cos": ..., "mae": ..., "max": ...}

All tensors are in the BMHK layout of :func:`fmha_ops.memory_efficient_attention`: (batch, sequence, heads, head
dim). Inputs are generated on the CPU from a seeded generator and then moved, so a seed gives the same tensors on
every device.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

__all__ = ["error_report", "normal_qkv", "transformer_like"]

#: Fraction of the head dim that :func:`transformer_like` makes outlier channels in K (at least one channel).
OUTLIER_CHANNEL_FRACTION = 1 / 32
#: Offset added to K's outlier channels: large against the unit-variance rest, as in trained models' keys.
OUTLIER_CHANNEL_OFFSET = 8.0
#: One key token in this many is an outlier token of V (at least one).
OUTLIER_TOKEN_PERIOD = 64
#: Factor V's outlier tokens are multiplied by.
OUTLIER_TOKEN_GAIN = 20.0


def error_report(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Relative L2 error, cosine similarity, mean and max absolute error of ``out`` against ``ref``.

    Parameters
    ----------
    out, ref : torch.Tensor
        Tensors of the same number of elements, any dtype and device; compared flattened, in float64.

    Returns
    -------
    dict
        ``rel`` = ||out - ref|| / ||ref||, ``cos`` = cosine similarity, ``mae`` = mean |out - ref|,
        ``max`` = max |out - ref|. Empty tensors give ``{"rel": 0, "cos": 1, "mae": 0, "max": 0}``; a zero ``ref``
        gives ``cos`` = 1 and ``rel`` = ||out|| / 1e-30 (so any non-zero output fails a tolerance).

    Examples
    --------
    >>> ref = torch.tensor([1.0, 2.0, 2.0])
    >>> round(error_report(ref * 1.01, ref)["rel"], 6)
    0.01
    """
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


def normal_qkv(shape_q: Sequence[int], shape_kv: Sequence[int], *, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu", seed: int = 0) -> Iterator[torch.Tensor]:
    """Q, K, V with independent standard-normal entries.

    Parameters
    ----------
    shape_q : (B, Mq, Hq, D)
    shape_kv : (B, Mk, Hkv, D)
        Shape of K; V has the same shape.
    dtype, device
        Of the returned tensors (generated in float32 on the CPU, then converted).
    seed : int
        Seed of the CPU generator.

    Returns
    -------
    generator of three tensors q, k, v (unpack it: ``q, k, v = normal_qkv(...)``).

    Examples
    --------
    >>> q, k, v = normal_qkv((1, 4, 2, 8), (1, 6, 1, 8), dtype=torch.float32)
    >>> tuple(k.shape)
    (1, 6, 1, 8)
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    tensors = (torch.randn(*shape_q, generator=g), torch.randn(*shape_kv, generator=g),
               torch.randn(*shape_kv, generator=g))
    return (t.to(device=device, dtype=dtype) for t in tensors)


def transformer_like(shape_q: Sequence[int], shape_kv: Sequence[int], *, dtype: torch.dtype = torch.bfloat16,
                     device: str | torch.device = "cpu", seed: int = 0, rank: int = 4) -> Iterator[torch.Tensor]:
    """Q, K, V mimicking real activations, the harder case for quantized kernels.

    Per-channel scales (log-normal, sigma 0.5); a shared rank-``rank`` component between Q and K, so the softmax
    is peaked; outlier channels in K (every key offset by ``OUTLIER_CHANNEL_OFFSET`` in the first ``D / 32``
    channels); outlier tokens in V (one key in ``OUTLIER_TOKEN_PERIOD`` scaled by ``OUTLIER_TOKEN_GAIN``). Q and
    K are divided by ``D ** 0.25`` so the default softmax scale sees scores of order one.

    Parameters
    ----------
    shape_q, shape_kv, dtype, device, seed
        As in :func:`normal_qkv`; ``Mk`` may be 0.
    rank : int
        Rank of the component Q and K share.

    Returns
    -------
    generator of three tensors q, k, v (unpack it: ``q, k, v = transformer_like(...)``).

    Examples
    --------
    >>> q, k, v = transformer_like((2, 17, 4, 64), (2, 33, 2, 64), dtype=torch.float32)
    >>> bool(k[..., :2].mean() > k[..., 2:].mean())  # the outlier channels
    True
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
    k[..., : max(1, int(D * OUTLIER_CHANNEL_FRACTION))] += OUTLIER_CHANNEL_OFFSET
    v = torch.randn(*shape_kv, generator=g)
    if Mk:
        idx = torch.randint(0, Mk, (max(1, Mk // OUTLIER_TOKEN_PERIOD),), generator=g)
        v[:, idx] *= OUTLIER_TOKEN_GAIN
    q = q / (D ** 0.25)
    k = k / (D ** 0.25)
    return (t.to(device=device, dtype=dtype) for t in (q, k, v))
