"""What a call leaves allocated: a tensor a call caches for later calls, made on a first call inside a CUDA graph
capture or a ``torch.compile(mode="reduce-overhead")`` recording, would live in the graph's memory pool (cudagraph
trees then refuse the recording), so the call-path tests check that no call keeps a tensor it allocates."""
from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Allocations(TorchDispatchMode):
    """Weak references to every tensor an aten op returns while active (``torch.tensor`` of host values, which
    dispatches as ``lift_fresh``, is the caller's input, not an allocation of the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[weakref.ref, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.aten.lift_fresh.default:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.made.append((weakref.ref(t), str(func)))
        return out


def kept_tensors(call) -> list[str]:
    """The aten ops whose results outlive ``call()`` once its result is dropped.

    Example: ``kept_tensors(lambda: torch.ones(3) + 1)`` -> ``[]``.
    """
    mode = _Allocations()
    with mode:
        result = call()
    del result
    gc.collect()
    return [op for ref, op in mode.made if ref() is not None]
