"""Host-side helpers shared by the attention forward launchers (Triton and Gluon): descale arguments and the
scratch allocator that device-made TMA descriptors need."""
from __future__ import annotations

import torch
import triton
from triton.runtime import _allocation

_ONES: dict = {}


def _ones(device: torch.device) -> torch.Tensor:
    """A cached float32 one on ``device``: the descale of an absent descale argument."""
    t = _ONES.get(device)
    if t is None:
        t = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def descale_args(t, device, B, H, name):
    """(tensor, stride_b, stride_h) for a per-tensor or per-(batch, head) float32 descale ``t`` (None: 1).

    Example: ``descale_args(torch.ones(2, 4), "cuda", 2, 4, "k_descale")`` -> (t, 4, 1).
    """
    if t is None:
        return _ones(device), 0, 0
    assert t.dtype == torch.float32, f"{name} must be float32"
    if t.numel() == 1:
        return t.reshape(1), 0, 0
    assert t.shape == (B, H), f"{name} must have numel 1 or shape {(B, H)}, got {tuple(t.shape)}"
    return t, t.stride(0), t.stride(1)


def scratch(size: int, align: int, stream) -> torch.Tensor:
    """Triton's global scratch allocator signature: ``size`` bytes on the current CUDA device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Device-side TMA descriptors need a global scratch allocator (128 B per descriptor). Triton keeps it in a
    ContextVar, so each thread (the autograd engine's, a data loader's) starts without one: set ours where none
    is set; an allocator the caller set is kept."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(scratch)
