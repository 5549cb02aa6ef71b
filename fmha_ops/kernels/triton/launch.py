"""Kernel launches without Triton's per-call argument binding, and host TMA descriptors built once.

``JITFunction.run`` specializes every argument on every launch before it looks the compiled kernel up.
``CachedKernel`` keys each launch on the arguments themselves - ints by value, tensors by (dtype, CUDA or not,
16-byte alignment), host TMA descriptors by (dtype, CUDA or not, block shape), constexprs and launch options by
value, keywords alike, and the current device - which determines every specialization Triton makes. After the
first launch of a key it calls the compiled kernel's C launcher directly, with the arguments it would get from
Triton's launcher: CUDA tensors as their device addresses (Triton's launcher would look each one up with a driver
call), host descriptors as their encoded ``CUtensorMap`` and sizes, cached per (address, shape, strides) so an
unchanged tensor is not encoded again, scratch allocated as Triton does, the current stream. Launch hooks, when a
profiler has registered any, take Triton's own launch path (an empty hook chain still costs a launch-metadata dict
and two Python calls from the C launcher). Interpreted kernels (``TRITON_INTERPRET=1``) always take Triton's own
path. Host time per launch: bench/diagnostics/launch_overhead.py.

Bound launches: ``launch(kernel).bind(grid, **constexprs_and_options)`` is for a plan's repeated launches of one
grid: the key is checked against the first call's (one generated comparison) instead of rebuilt (``BoundLaunch``).

Host descriptors: ``host_descriptor(tensor, shape, strides, block_shape)`` is a plain record (no checks, no
encoding); the launch validates and encodes it as ``triton.tools.tensor_descriptor.TensorDescriptor`` would, once
per distinct (kernel parameter, address, shape, strides). Triton's own ``TensorDescriptor`` is accepted too.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
from triton import knobs
from triton.runtime import _allocation
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

_Tensor = torch.Tensor
_MAX_ENTRIES = 4096  # distinct launch keys kept per kernel (ints are keyed by value: varying sizes add keys)
_MAX_DESCRIPTORS = 256  # encoded descriptors kept per descriptor parameter of a launch key


class HostDescriptor(NamedTuple):
    """A host TMA descriptor before encoding: ``base`` seen as ``shape`` with ``strides`` (last stride 1),
    loading ``block_shape`` tiles (zero padding) into shared memory of ``layout`` (a Gluon ``NVMMASharedLayout``
    for a ``@gluon.jit`` kernel's descriptor parameter; None for a ``@triton.jit`` kernel's). Build it with
    ``host_descriptor``."""

    base: torch.Tensor
    shape: tuple
    strides: tuple
    block_shape: tuple
    layout: Any = None


def host_descriptor(base: torch.Tensor, shape, strides, block_shape, layout=None) -> HostDescriptor:
    """A host TMA descriptor over ``base`` for ``launch(kernel)[grid](...)``, where a kernel parameter takes a
    ``TensorDescriptor``. ``shape``, ``strides`` (elements, last one 1) and ``block_shape`` are int sequences of
    one rank; ``layout``: the shared layout of a Gluon kernel's descriptor (None for Triton kernels). The launch
    checks them as ``TensorDescriptor`` does (16-byte aligned base and strides, positive sizes, a power-of-two
    block) the first time it meets them.

    Example: ``host_descriptor(x, x.shape, x.stride(), (64, 64))`` for a contiguous 2-D ``x``.
    """
    return HostDescriptor(base, tuple(shape), tuple(strides), tuple(block_shape), layout)


def _triton_descriptor(d: HostDescriptor):
    """The validated ``TensorDescriptor`` of ``d``, Gluon's where ``d`` has a layout (raises AssertionError as
    Triton does on a bad one)."""
    if d.layout is None:
        return TensorDescriptor(d.base, list(d.shape), list(d.strides), list(d.block_shape))
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    return GluonDescriptor(d.base, list(d.shape), list(d.strides), list(d.block_shape), d.layout)


#: argument types keyed by (type, value), as ``_spec`` keys them (checked inline before calling it)
_BY_VALUE = frozenset({float, bool, str, type(None)})
#: argument types a ``BoundLaunch`` checks by type and value (any other non-tensor argument: the keyed path)
_SCALARS = _BY_VALUE | {int}


def _spec(a):
    """The part of one argument that Triton's specialization (and the argument's encoding) depends on."""
    tp = type(a)
    if tp is int or a is None:
        return a  # ints by value: covers == 1 (constexpr), % 16 == 0 and the int32 / int64 choice
    if tp is _Tensor or isinstance(a, _Tensor):
        return a.dtype, a.is_cuda, a.data_ptr() & 15 == 0
    if tp is HostDescriptor:
        base = a.base
        return tp, base.dtype, base.is_cuda, a.block_shape, a.layout
    if tp is TensorDescriptor:
        return tp, a.base.dtype, a.base.is_cuda, tuple(a.block_shape), a.padding
    return tp, a  # floats, bools (kept apart from equal ints) and constexpr values


def _for_triton(a):
    """An argument as Triton's own launch takes it (host descriptors as ``TensorDescriptor``)."""
    return _triton_descriptor(a) if type(a) is HostDescriptor else a


class _DirectLaunch:
    """One compiled kernel's C launcher with the argument conversions Triton's Python launcher would make.

    ``kinds`` has one entry per kernel parameter: "tensor" (a CUDA tensor: passed as its address), "desc" (a host
    descriptor: expanded to Triton's encoded form through a per-parameter cache), or None (passed unchanged)."""

    __slots__ = ("kernel", "c_launch", "function", "metadata", "cooperative", "pdl", "num_ctas", "scratch",
                 "profile_scratch", "kinds", "bind")

    def __init__(self, kernel, c_launch, kinds: list, descriptor_meta: list) -> None:
        run = kernel.run
        self.kernel, self.c_launch = kernel, c_launch
        self.function, self.metadata = kernel.function, kernel.packed_metadata
        self.cooperative, self.pdl, self.num_ctas = run.launch_cooperative_grid, run.launch_pdl, run.num_ctas
        self.scratch = (run.global_scratch_size, run.global_scratch_align)
        self.profile_scratch = (run.profile_scratch_size, run.profile_scratch_align)
        self.kinds = tuple(kinds)
        self.bind = _binder(kinds, descriptor_meta)

    def __call__(self, grid: tuple, stream, args: tuple) -> None:
        gx, gy, gz = grid
        scratch = profile = None
        if self.scratch[0] > 0:
            scratch = _allocation._allocator.get()(gx * gy * gz * self.num_ctas * self.scratch[0], self.scratch[1],
                                                   stream)
        if self.profile_scratch[0] > 0:
            profile = _allocation._profile_allocator.get()(
                gx * gy * gz * self.num_ctas * self.profile_scratch[0], self.profile_scratch[1], stream)
        self.c_launch(gx, gy, gz, stream, self.function, self.cooperative, self.pdl, scratch, profile,
                      self.metadata, None, None, None, *self.bind(args))

    @classmethod
    def of(cls, kernel, args: tuple) -> "_DirectLaunch | None":
        """The direct launch of ``kernel`` for arguments shaped like ``args`` (one per kernel parameter), or None
        when the kernel's launcher is not Triton 3.6's CUDA launcher as this module knows it."""
        run = getattr(kernel, "run", None)
        c_launch = None if run is None else _c_launcher(run)
        signature = getattr(getattr(kernel, "src", None), "signature", None)
        if c_launch is None or not isinstance(signature, dict) or len(signature) != len(args):
            return None
        desc_positions = [i for i, ty in enumerate(signature.values()) if isinstance(ty, str)
                          and ty.startswith("tensordesc")]
        meta = getattr(kernel.metadata, "tensordesc_meta", None) or [None] * len(desc_positions)
        if len(meta) != len(desc_positions):
            return None
        kinds, descriptor_meta = [], []
        for i, (ty, a) in enumerate(zip(signature.values(), args)):
            if i in desc_positions:
                kinds.append("desc")
                descriptor_meta.append(meta[desc_positions.index(i)])
            elif isinstance(ty, str) and ty.startswith("*") and isinstance(a, torch.Tensor) and a.is_cuda:
                kinds.append("tensor")
            else:
                kinds.append(None)
        return cls(kernel, c_launch, kinds, descriptor_meta)


def _c_launcher(run):
    """The C ``launch`` function behind Triton 3.6's ``CudaLauncher`` (under its descriptor-expanding wrapper), or
    None."""
    launch = getattr(run, "launch", None)
    if launch is None or not all(hasattr(run, a) for a in (
            "launch_cooperative_grid", "launch_pdl", "num_ctas", "global_scratch_size", "global_scratch_align",
            "profile_scratch_size", "profile_scratch_align")):
        return None
    if getattr(launch, "__closure__", None):  # wrap_handle_tensordesc's ``inner`` holds the C launcher
        cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in launch.__closure__)))
        launch = cells.get("launcher")
    return launch if callable(launch) else None


def _binder(kinds: list, descriptor_meta: list):
    """``bind(args) -> tuple``: the C launcher's kernel arguments for one launch (see ``_DirectLaunch``)."""
    encoders = [_descriptor_encoder(meta) for meta in descriptor_meta]
    parts, names = [], {}
    desc = 0
    for i, kind in enumerate(kinds):
        if kind == "tensor":
            parts.append(f"a[{i}].data_ptr()")
        elif kind == "desc":
            names[f"d{desc}"] = encoders[desc]
            parts.append(f"*d{desc}(a[{i}])")
            desc += 1
        else:
            parts.append(f"a[{i}]")
    source = f"def bind(a):\n    return ({', '.join(parts)}{',' if parts else ''})\n"
    exec(compile(source, "<fmha_ops.launch binder>", "exec"), names)
    return names["bind"]


def _encode_descriptor(d: TensorDescriptor, meta) -> list:
    """Triton's launcher arguments for descriptor ``d`` of a parameter with ``tensordesc_meta`` entry ``meta``:
    [CUtensorMap, *shape, *strides], or (no meta: the kernel takes the pieces) [base, *shape, *strides, nan padding,
    *shape, *strides]."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return make_tensordesc_arg(d, meta)


def _descriptor_encoder(meta):
    """``encode(descriptor) -> list``: ``_encode_descriptor`` for one descriptor parameter, cached per (address,
    shape, strides) when the result holds no tensor (the launch key fixes dtype, block shape and padding)."""
    cache: dict = {}

    def encode(d):
        shape, strides = tuple(d.shape), tuple(d.strides)
        key = (d.base.data_ptr(), shape, strides)
        hit = cache.get(key)
        if hit is not None:
            return hit
        full = _triton_descriptor(d) if type(d) is HostDescriptor else d
        encoded = _encode_descriptor(full, meta)
        if meta is not None:  # [CUtensorMap, *shape, *strides]: no reference to the tensor, safe to keep
            if len(cache) >= _MAX_DESCRIPTORS:
                cache.clear()
            cache[key] = encoded
        return encoded

    return encode


def _launch_key(device, args: tuple, kwargs: dict) -> tuple:
    """``CachedKernel``'s key of one launch on ``device`` (see the module docstring)."""
    return (device, tuple([a if (tp := type(a)) is int else (tp, a) if tp in _BY_VALUE else _spec(a) for a in args]),
            tuple(kwargs),
            tuple([v if (tp := type(v)) is int else (tp, v) if tp in _BY_VALUE else _spec(v) for v in kwargs.values()]))


class CachedKernel:
    """``launch(kernel)[grid](*args, **constexprs_and_options)`` launches like ``kernel[grid](...)``.

    Arguments as Triton's own call takes them (runtime values, constexprs and launch options, positional or
    by keyword; ``HostDescriptor`` where the kernel takes a tensor descriptor); ``grid`` is a tuple of 1 to 3
    ints."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = isinstance(fn, JITFunction)  # an InterpretedFunction under TRITON_INTERPRET=1
        self._cache: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def bind(self, grid, **constexprs_and_options) -> "BoundLaunch":
        """``bound(*args)`` launches like ``self[grid](*args, **constexprs_and_options)`` (``BoundLaunch``)."""
        return BoundLaunch(self, tuple(grid), constexprs_and_options)

    def _launch(self, grid, args, kwargs):
        if not self._compiled:
            return self.fn[grid](*[_for_triton(a) for a in args],
                                 **{n: _for_triton(v) for n, v in kwargs.items()})
        device = driver.active.get_current_device()
        key = _launch_key(device, args, kwargs)
        hit = self._cache.get(key)
        if hit is not None:
            kernel, rest, direct = hit
            full = (*args, *[kwargs[n] if n in kwargs else d for n, d in rest])
            hooks = knobs.runtime
            g = (*grid, 1, 1)[:3]
            if direct is None or hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:
                kernel[g](*[_for_triton(a) for a in full])  # a profiler listens, or no direct launch: Triton's
            else:
                direct(g, driver.active.get_current_stream(device), full)
            return kernel
        kernel = self.fn[grid](*[_for_triton(a) for a in args], **{n: _for_triton(v) for n, v in kwargs.items()})
        if kernel is None:  # a jit_cache_hook (e.g. torch.compile's) took the compile over: nothing to cache
            return None
        rest = tuple((p.name, p.default) for p in self.fn.params[len(args):])
        full = (*args, *[kwargs[n] if n in kwargs else d for n, d in rest])
        if len(self._cache) >= _MAX_ENTRIES:
            self._cache.clear()
        self._cache[key] = (kernel, rest, _DirectLaunch.of(kernel, full))
        return kernel


class BoundLaunch:
    """One kernel's launches at one grid with fixed constexprs and launch options (``CachedKernel.bind``):
    ``bound(*args)`` takes every runtime argument positionally, as ``kernel[grid](*args, **fixed)`` would, and
    returns what ``CachedKernel`` returns (the compiled kernel, or None).

    The first call launches through ``CachedKernel`` and generates, for the specialization of its arguments, one
    function for the calls after it: it checks what the launch key holds - each tensor's exact type, dtype, CUDA or
    not and 16-byte alignment (the pointer divisibility Triton specializes on), every other argument's type and
    value (ints equal to 1 or divisible by 16, the int32 / int64 choice, floats, None), no launch hook registered,
    the bound device current - and then calls the compiled kernel's C launcher with the tensors' addresses and the
    other arguments as given. A call that differs in any of them takes ``CachedKernel``'s keyed path, which
    launches the binary of its own specialization, so a bound launch never runs a binary compiled for other
    arguments. Kernels with descriptor arguments, interpreted kernels and compiles taken over by a hook always take
    the keyed path.

    Example
    -------
    >>> bound = launch(kernel).bind((programs,), BLOCK=64, num_warps=4)  # doctest: +SKIP
    >>> bound(x, y, n)  # doctest: +SKIP
    """

    __slots__ = ("kernel", "grid", "fixed", "_run")

    def __init__(self, kernel: CachedKernel, grid: tuple, fixed: dict) -> None:
        self.kernel, self.grid, self.fixed = kernel, grid, fixed
        self._run = self._first

    def __call__(self, *args):
        return self._run(*args)

    def _keyed(self, args: tuple):
        return self.kernel._launch(self.grid, args, self.fixed)

    def _first(self, *args):
        compiled = self._keyed(args)
        if compiled is not None and self.kernel._compiled:
            device = driver.active.get_current_device()
            entry = self.kernel._cache.get(_launch_key(device, args, self.fixed))
            if (entry is not None and entry[2] is not None and "desc" not in entry[2].kinds
                    and all(type(a) is _Tensor or type(a) in _SCALARS for a in args)
                    and not any(isinstance(v, _Tensor) for v in self.fixed.values())):
                self._run = _bound_launch(entry, device, (*self.grid, 1, 1)[:3], args, self.fixed, self._keyed)
        return compiled


def _bound_launch(entry: tuple, device, grid: tuple, args: tuple, fixed: dict, keyed):
    """``BoundLaunch``'s generated launch for the specialization of ``args`` with the keywords ``fixed`` (a launch
    already made with them: ``entry`` is its ``CachedKernel`` entry, ``grid`` three ints); ``keyed(args)`` launches
    any call it does not take."""
    kernel, rest, direct = entry
    names = [f"a{i}" for i in range(len(args))]
    checks, launch_args, aligned, unaligned = [], [], [], []
    scalars = [i for i, a in enumerate(args) if type(a) is not _Tensor]
    env = {"_Tensor": _Tensor, "_hooks": knobs.runtime, "_device": driver.active.get_current_device,
           "_stream": driver.active.get_current_stream, "_DEV": device, "_keyed": keyed, "_kernel": kernel,
           "_S": tuple(args[i] for i in scalars), "_TYPES": tuple(type(args[i]) for i in scalars),
           "_TAIL": tuple(fixed[n] if n in fixed else d for n, d in rest), "_G": grid, "_direct": direct,
           "_c_launch": direct.c_launch, "_function": direct.function, "_meta": direct.metadata,
           "_coop": direct.cooperative, "_pdl": direct.pdl}
    for i, (a, x, kind) in enumerate(zip(args, names, direct.kinds)):
        if type(a) is not _Tensor:
            launch_args.append(x)
            continue
        env[f"_d{i}"] = a.dtype
        checks.append(f"type({x}) is _Tensor and {x}.dtype is _d{i} and {'' if a.is_cuda else 'not '}{x}.is_cuda")
        (aligned if a.data_ptr() & 15 == 0 else unaligned).append(f"p{i}")
        launch_args.append(f"p{i}" if kind == "tensor" else x)
    scalar_tuple = f"({''.join(names[i] + ', ' for i in scalars)})"
    checks += [f"(s := {scalar_tuple}) == _S and tuple(map(type, s)) == _TYPES",
               "not _hooks.launch_enter_hook.calls and not _hooks.launch_exit_hook.calls and _device() == _DEV"]
    pointers = [f"p{i} = {x}.data_ptr()" for i, x in enumerate(names) if type(args[i]) is _Tensor]
    alignment = [f"not ({' | '.join(aligned)}) & 15"] if aligned else []
    alignment += [f"{p} & 15" for p in unaligned]
    if direct.scratch[0] > 0 or direct.profile_scratch[0] > 0:  # scratch allocated per launch, as Triton does
        call = f"_direct(_G, _stream(_DEV), ({''.join(x + ', ' for x in names)}*_TAIL))"
    else:
        call = (f"_c_launch(*_G, _stream(_DEV), _function, _coop, _pdl, None, "
                f"None, _meta, None, None, None, {''.join(x + ', ' for x in launch_args)}*_TAIL)")
    source = (f"def run({', '.join(names)}):\n"
              f"    if {' and '.join(checks)}:\n"
              + "".join(f"        {line}\n" for line in pointers)
              + f"        if {' and '.join(alignment) or 'True'}:\n"
              f"            {call}\n"
              f"            return _kernel\n"
              f"    return _keyed(({''.join(x + ', ' for x in names)}))\n")
    exec(compile(source, "<fmha_ops.launch bound launch>", "exec"), env)  # noqa: S102 - our own generated code
    return env["run"]


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


@triton.constexpr_function
def pow2_width(n):
    """Inside a kernel: the tile width for a head dim ``n`` (a constexpr), the smallest power of two >= n."""
    return triton.next_power_of_2(n)
