"""Kernel launches without Triton's per-call argument binding.

``JITFunction.run`` specializes every argument on every launch before it looks the compiled kernel up.
``CachedKernel`` keys each launch on the arguments themselves - ints by value, tensors by (dtype, 16-byte
alignment), host TMA descriptors by (dtype, block shape), constexprs and launch options by value, keywords
alike, and the current device - which determines every specialization Triton makes, and after the first
launch of a key calls the compiled kernel directly (``CompiledKernel[grid]``: the current stream, scratch
allocation as in a normal launch; Triton's launch hooks, when a profiler has registered any, else none: an
empty hook chain still costs a launch-metadata dict and two Python calls from the C launcher). Interpreted
kernels (``TRITON_INTERPRET=1``) always take Triton's own path. Host time per launch:
bench/diagnostics/launch_overhead.py.
"""
from __future__ import annotations

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

_MAX_ENTRIES = 4096  # distinct launch keys kept per kernel (ints are keyed by value: varying sizes add keys)


def _spec(a):
    """The part of one argument that Triton's specialization depends on."""
    tp = type(a)
    if tp is int or a is None:
        return a  # ints by value: covers == 1 (constexpr), % 16 == 0 and the int32 / int64 choice
    if tp is TensorDescriptor:
        return tp, a.base.dtype, tuple(a.block_shape)
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    return tp, a  # floats, bools (kept apart from equal ints) and constexpr values


class CachedKernel:
    """``launch(kernel)[grid](*args, **constexprs_and_options)`` launches like ``kernel[grid](...)``.

    Arguments as Triton's own call takes them (runtime values, constexprs and launch options, positional or
    by keyword); ``grid`` is a tuple of 1 to 3 ints."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = isinstance(fn, JITFunction)  # an InterpretedFunction under TRITON_INTERPRET=1
        self._cache: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        if not self._compiled:
            return self.fn[grid](*args, **kwargs)
        device = driver.active.get_current_device()
        key = (device, tuple([a if type(a) is int else _spec(a) for a in args]),
               tuple(kwargs), tuple([v if type(v) is int else _spec(v) for v in kwargs.values()]))
        hit = self._cache.get(key)
        if hit is not None:  # the kernel's remaining parameters, in order, from this call's keywords
            kernel, rest = hit
            full = (*args, *[kwargs[n] if n in kwargs else d for n, d in rest])
            hooks = knobs.runtime
            if hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:  # a profiler listens: Triton's path
                kernel[(*grid, 1, 1)[:3]](*full)
            else:  # no launch metadata, no empty hook chains called from the C launcher
                g = (*grid, 1, 1)
                kernel.run(g[0], g[1], g[2], driver.active.get_current_stream(device), kernel.function,
                           kernel.packed_metadata, None, None, None, *full)
            return kernel
        kernel = self.fn[grid](*args, **kwargs)
        rest = tuple((p.name, p.default) for p in self.fn.params[len(args):])
        if len(self._cache) >= _MAX_ENTRIES:
            self._cache.clear()
        self._cache[key] = (kernel, rest)
        return kernel


def cdiv(a: int, b: int) -> int:
    """Ceil division of host ints for launch geometry (``triton.cdiv`` costs ~1 us per call on the H200 host:
    it unwraps constexprs)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n for n >= 1 (0 for 0), as ``triton.next_power_of_2`` without its overhead."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_KERNELS: dict = {}


def launch(fn) -> CachedKernel:
    """The ``CachedKernel`` of a ``@triton.jit`` or ``@gluon.jit`` kernel (one per kernel)."""
    k = _KERNELS.get(fn)
    if k is None:
        k = _KERNELS[fn] = CachedKernel(fn)
    return k
