"""CachedKernel (fmha_ops/kernels/triton/launch.py): a repeated launch skips Triton's binding but must launch
exactly what Triton would. CPU: the keying logic against a stand-in compiled kernel. GPU: real kernels, cached
launches bitwise equal to Triton's own, a new key per specialization change, CUDA-graph capture."""
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from fmha_ops.kernels.triton import launch as launch_mod
from fmha_ops.kernels.triton.launch import CachedKernel, HostDescriptor, _spec, cdiv, host_descriptor, next_pow2
from tests.conftest import HAS_CUDA


def _kernel_py(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):
    pass


_SIGNATURE = {"X": "*fp32", "Y": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr", "FLAG": "constexpr"}


class _Launcher:
    """Stands in for Triton 3.6's CudaLauncher: ``launch`` wraps the C launcher in a closure, as its descriptor
    handling does."""

    launch_cooperative_grid, launch_pdl, num_ctas = False, False, 1
    global_scratch_size = global_scratch_align = profile_scratch_size = profile_scratch_align = 0

    def __init__(self, record):
        def launcher(gx, gy, gz, stream, function, coop, pdl, scratch, profile, metadata, launch_metadata,
                     enter_hook, exit_hook, *args):
            assert (stream, function, metadata) == ("stream", "function", "metadata")
            assert launch_metadata is enter_hook is exit_hook is scratch is profile is None
            record(((gx, gy, gz), args))

        def inner(*args):
            return launcher(*args)

        self.launch = inner


class _Compiled:
    """Stands in for triton's CompiledKernel: records what a cached launch passes, by which path."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, signature, tensordesc_meta=None):
        self.launches = []
        self.run = _Launcher(self.launches.append)
        self.src = SimpleNamespace(signature=signature)
        self.metadata = SimpleNamespace(tensordesc_meta=tensordesc_meta)

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("hooked", grid, args))


class _Recorder:
    def __init__(self, signature=_SIGNATURE, tensordesc_meta=None):
        self.calls = 0
        self.kernels = []
        self.signature, self.tensordesc_meta = signature, tensordesc_meta

    def __call__(self, *args, grid, warmup, **kwargs):
        self.calls += 1
        self.kernels.append(_Compiled(self.signature, self.tensordesc_meta))
        return self.kernels[-1]


@pytest.fixture
def fake(monkeypatch):
    fn = JITFunction(_kernel_py)
    rec = _Recorder()
    monkeypatch.setattr(fn, "run", rec)
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: "stream")
    monkeypatch.setattr(launch_mod, "driver", SimpleNamespace(active=active))
    return CachedKernel(fn), rec


def test_spec_separates_what_triton_specializes():
    x = torch.zeros(64, dtype=torch.float32)
    assert _spec(16) != _spec(17) and _spec(1) != _spec(2)
    assert _spec(True) != _spec(1) and _spec(1.0) != _spec(1)
    assert _spec(x) == (torch.float32, False, True)
    assert _spec(x[1:]) == (torch.float32, False, False)  # 4-byte offset: not 16-byte aligned
    assert _spec(x.to(torch.float16)) != _spec(x)
    d = TensorDescriptor(x.view(8, 8), [8, 8], [8, 1], [4, 8])
    assert _spec(d) == (TensorDescriptor, torch.float32, False, (4, 8), "zero")
    h = host_descriptor(x.view(8, 8), (8, 8), (8, 1), (4, 8))
    assert _spec(h) == (HostDescriptor, torch.float32, False, (4, 8), None)
    assert _spec(host_descriptor(x.view(8, 8), (8, 8), (8, 1), (8, 8))) != _spec(h)


def test_gluon_host_descriptor_keys_and_builds_with_its_layout():
    """A Gluon kernel's descriptor carries its shared layout: part of the launch key, and Triton's encoding gets
    Gluon's ``TensorDescriptor`` (which takes the layout)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from fmha_ops.kernels.triton.launch import _triton_descriptor

    x = torch.zeros(8, 8)
    plain = host_descriptor(x, (8, 8), (8, 1), (4, 8))
    layouts = [gl.NVMMASharedLayout.get_default_for([4, 8], gl.float32),
               gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=32, rank=2)]
    gluon = [host_descriptor(x, (8, 8), (8, 1), (4, 8), layout) for layout in layouts]
    assert len({_spec(plain), *map(_spec, gluon)}) == 3
    built = _triton_descriptor(gluon[0])
    assert isinstance(built, GluonDescriptor) and built.layout == layouts[0] and built.block_shape == [4, 8]


def test_repeat_launch_reuses_the_compiled_kernel_with_constexprs_appended(fake):
    ck, rec = fake
    x, y = torch.zeros(64), torch.zeros(64)
    ck[(4,)](x, y, 64, 0.5, BLOCK=32, num_warps=4)
    ck[(4,)](torch.ones(64), y, 64, 0.5, BLOCK=32, num_warps=4)
    assert rec.calls == 1
    grid, args = rec.kernels[0].launches[0]
    assert grid == (4, 1, 1)
    assert args[2:] == (64, 0.5, 32, True)  # BLOCK, then FLAG's default, in parameter order
    assert torch.equal(args[0], torch.ones(64))  # this launch's tensors, not the first one's


def test_registered_launch_hooks_take_tritons_launch_path(fake):
    ck, rec = fake
    x, y = torch.zeros(64), torch.zeros(64)
    ck[(2, 3)](x, y, 64, 0.5, BLOCK=32)
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        ck[(2, 3)](x, y, 64, 0.5, BLOCK=32)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    ck[(2, 3)](x, y, 64, 0.5, BLOCK=32)
    launches = rec.kernels[0].launches
    assert [entry[0] for entry in launches] == ["hooked", (2, 3, 1)]
    assert launches[0][1] == (2, 3, 1)


@pytest.mark.parametrize("change", ["int_value", "alignment", "dtype", "constexpr", "option"])
def test_any_specialization_change_goes_back_through_triton(fake, change):
    ck, rec = fake
    x, y = torch.zeros(64), torch.zeros(64)
    ck[(1,)](x, y, 32, 0.5, BLOCK=32, num_warps=4)
    args, kw = [x, y, 32, 0.5], dict(BLOCK=32, num_warps=4)
    if change == "int_value":
        args[2] = 33
    elif change == "alignment":
        args[0] = x[1:]
    elif change == "dtype":
        args[1] = y.double()
    elif change == "constexpr":
        kw["BLOCK"] = 64
    else:
        kw["num_warps"] = 8
    ck[(1,)](*args, **kw)
    assert rec.calls == 2 and not rec.kernels[0].launches


def test_runtime_arguments_by_keyword_are_keyed_and_passed_in_order(fake):
    ck, rec = fake
    x, y = torch.zeros(64), torch.zeros(64)
    ck[(1,)](x, y, n=64, scale=0.5, BLOCK=32)
    ck[(1,)](x, y, scale=0.25, n=64, BLOCK=32)  # another order of the same keywords: a new key
    ck[(1,)](x, y, scale=0.25, n=64, BLOCK=32)
    assert rec.calls == 2
    assert rec.kernels[1].launches[0][1][2:] == (64, 0.25, 32, True)
    ck[(1,)](x, y, scale=0.25, n=65, BLOCK=32)  # an int by keyword is keyed by value
    assert rec.calls == 3


def test_interpreted_kernels_take_tritons_path():
    ck = CachedKernel(object())
    assert not ck._compiled


def test_host_int_helpers_match_triton():
    for n in [*range(0, 300), 2**20, 2**20 + 1, 2**33 + 5]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 128):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)


@triton.jit
def _axpy_kernel(X, Y, OUT, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(OUT + offs, a * tl.load(X + offs, mask=m) + tl.load(Y + offs, mask=m), mask=m)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_cached_launch_equals_triton_and_respecializes():
    ck = CachedKernel(_axpy_kernel)
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4096 + 8, device="cuda", generator=g)
    y = torch.randn(4096 + 8, device="cuda", generator=g)
    for n, off in ((4096, 0), (4096, 0), (1000, 0), (4096, 1), (4096, 1), (17, 3)):
        x = base[off:off + n]
        out, ref = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
        k1 = ck[(triton.cdiv(n, 256),)](x, y, out, n, 1.5, BLOCK=256)
        _axpy_kernel[(triton.cdiv(n, 256),)](x, y, ref, n, 1.5, BLOCK=256)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(ref, 1.5 * x + y[:n], rtol=1e-6, atol=1e-6)
        assert k1 is not None
    assert len(ck._cache) == 4  # (4096, aligned), (1000, aligned), (4096, misaligned), (17, misaligned)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_cached_launch_captures_in_a_graph():
    ck = CachedKernel(_axpy_kernel)
    x, y = torch.randn(512, device="cuda"), torch.randn(512, device="cuda")
    out = torch.empty(512, device="cuda")
    ck[(2,)](x, y, out, 512, 2.0, BLOCK=256)  # first launch compiles outside the capture
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            ck[(2,)](x, y, out, 512, 2.0, BLOCK=256)
    out.fill_(float("nan"))
    x.copy_(torch.randn(512, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 2.0 * x + y, rtol=1e-6, atol=1e-6)


def _desc_kernel_py(D, n, BLOCK: tl.constexpr):
    pass


@pytest.fixture
def fake_desc(monkeypatch):
    """A fake kernel taking one tensor descriptor, with descriptor metadata (the encoded CUtensorMap path);
    ``encoded`` lists every descriptor the launches encode."""
    fn = JITFunction(_desc_kernel_py)
    rec = _Recorder({"D": "tensordesc<fp32[4, 8]>", "n": "i32", "BLOCK": "constexpr"}, [{"swizzle": 0}])
    monkeypatch.setattr(fn, "run", rec)
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: "stream")
    monkeypatch.setattr(launch_mod, "driver", SimpleNamespace(active=active))
    encoded = []

    def encode(d, meta):
        assert isinstance(d, TensorDescriptor) and meta == {"swizzle": 0}
        encoded.append((d.base.data_ptr(), tuple(d.shape), tuple(d.strides)))
        return [("tensormap", *encoded[-1]), *d.shape, *d.strides]

    monkeypatch.setattr(launch_mod, "_encode_descriptor", encode)
    return CachedKernel(fn), rec, encoded


def test_descriptors_are_encoded_once_per_address_shape_and_strides(fake_desc):
    """A cached descriptor is reused only for the same address, shape and strides: any change re-encodes, and
    each launch passes the encoding of its own tensor (never a stale one)."""
    ck, rec, encoded = fake_desc
    x, y = torch.zeros(64, 32), torch.zeros(64, 32)

    def run(t, shape, strides):
        ck[(1,)](host_descriptor(t, shape, strides, (4, 8)), 7, BLOCK=4)
        return rec.kernels[0].launches[-1][1]

    ck[(1,)](host_descriptor(x, (64, 32), (32, 1), (4, 8)), 7, BLOCK=4)  # first launch: Triton's path
    assert rec.calls == 1 and not encoded
    calls = [(x, (64, 32), (32, 1)), (x, (64, 32), (32, 1)), (y, (64, 32), (32, 1)), (x, (32, 32), (32, 1)),
             (x, (32, 32), (64, 1)), (x[16:], (48, 32), (32, 1)), (x, (64, 32), (32, 1))]
    for t, shape, strides in calls:
        args = run(t, shape, strides)
        assert args == (("tensormap", t.data_ptr(), shape, strides), *shape, *strides, 7, 4)
    assert rec.calls == 1  # one compiled kernel: the launch key holds no address or size of a descriptor
    assert encoded == [(x.data_ptr(), (64, 32), (32, 1)), (y.data_ptr(), (64, 32), (32, 1)),
                       (x.data_ptr(), (32, 32), (32, 1)), (x.data_ptr(), (32, 32), (64, 1)),
                       (x[16:].data_ptr(), (48, 32), (32, 1))]


def test_descriptor_block_or_dtype_change_is_a_new_launch_key(fake_desc):
    ck, rec, _ = fake_desc
    x = torch.zeros(64, 32)
    ck[(1,)](host_descriptor(x, (64, 32), (32, 1), (4, 8)), 7, BLOCK=4)
    ck[(1,)](host_descriptor(x, (64, 32), (32, 1), (8, 8)), 7, BLOCK=4)
    ck[(1,)](host_descriptor(x.half(), (64, 32), (32, 1), (4, 8)), 7, BLOCK=4)
    assert rec.calls == 3


def test_host_descriptors_reach_triton_as_tensor_descriptors(fake_desc):
    """The first launch (and the interpreter) get Triton's own validated TensorDescriptor."""
    ck, rec, _ = fake_desc
    seen = []
    rec_call = rec.__call__

    def spy(*args, grid, warmup, **kwargs):
        seen.append(args[0])
        return rec_call(*args, grid=grid, warmup=warmup, **kwargs)

    ck.fn.run = spy
    x = torch.zeros(64, 32)
    ck[(1,)](host_descriptor(x, (64, 32), (32, 1), (4, 8)), 7, BLOCK=4)
    assert type(seen[0]) is TensorDescriptor and seen[0].shape == [64, 32] and seen[0].block_shape == [4, 8]
    with pytest.raises(AssertionError, match="16-byte aligned"):
        ck[(1,)](host_descriptor(x.view(-1)[1:65].view(8, 8), (8, 8), (8, 1), (4, 8)), 7, BLOCK=4)


@triton.jit
def _desc_copy_kernel(X, OUT, stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    tile = X.load([pid * BLOCK_M, 0])
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    tl.store(OUT + rows[:, None] * stride_o + cols[None, :], tile)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_cached_descriptors_follow_pointer_stride_and_shape_changes():
    """Cached launches with host descriptors read the tensor of each call: new tensors, a strided view of the
    same storage, fewer rows (the descriptor zero-fills past the shape), and in-place updates of a cached one."""
    ck = CachedKernel(_desc_copy_kernel)
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(256, 32, device="cuda", generator=g)
    other = torch.randn(256, 32, device="cuda", generator=g)
    wide = torch.randn(256, 64, device="cuda", generator=g)
    cases = [(base, 256), (base, 256), (other, 256), (wide[:, :32], 256), (base, 100), (base[64:], 192)]
    for src, rows in cases:
        out = torch.full((256, 32), float("nan"), device="cuda")
        d = host_descriptor(src, (rows, 32), (src.stride(0), 1), (32, 32))
        ck[(256 // 32,)](d, out, out.stride(0), BLOCK_M=32, BLOCK_N=32)
        want = torch.zeros(256, 32, device="cuda")
        want[:rows] = src[:rows]
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    base.mul_(2.0)  # the same address, shape and strides: the cached encoding, the new values
    out = torch.empty(256, 32, device="cuda")
    ck[(8,)](host_descriptor(base, (256, 32), (32, 1), (32, 32)), out, out.stride(0), BLOCK_M=32, BLOCK_N=32)
    torch.testing.assert_close(out, base, rtol=0, atol=0)
    assert len(ck._cache) == 1
    assert ck._cache[next(iter(ck._cache))][2] is not None  # launched directly, not through Triton's launcher


def test_a_launch_that_triton_hands_to_a_compile_hook_is_not_cached(fake):
    """Triton's run returns None when a jit_cache_hook (torch.compile installs some) takes the compile: the
    launch returns None like Triton's, caches nothing, and the next launch asks Triton again."""
    ck, rec = fake
    x, y = torch.zeros(64), torch.zeros(64)
    real = rec.__call__
    ck.fn.run = lambda *args, grid, warmup, **kwargs: None
    assert ck[(1,)](x, y, 64, 0.5, BLOCK=32) is None and not ck._cache
    ck.fn.run = real
    assert ck[(1,)](x, y, 64, 0.5, BLOCK=32) is rec.kernels[0] and len(ck._cache) == 1


# ---- BoundLaunch: a plan's repeated launches check the launch key instead of rebuilding it ----------------------

@pytest.fixture
def keyed_calls(fake, monkeypatch):
    """(CachedKernel, recorder, list of the argument tuples that took ``CachedKernel``'s keyed path)."""
    ck, rec = fake
    seen = []
    real = ck._launch

    def spy(grid, args, kwargs):
        seen.append(args)
        return real(grid, args, kwargs)

    monkeypatch.setattr(ck, "_launch", spy)
    return ck, rec, seen


def test_bound_launch_repeats_skip_the_keyed_path_and_pass_each_calls_arguments(keyed_calls):
    ck, rec, keyed = keyed_calls
    bound = ck.bind((4, 2), BLOCK=32, num_warps=4)
    x, y = torch.zeros(64), torch.zeros(64)
    assert bound(x, y, 64, 0.5) is rec.kernels[0]  # first call: compiled through the keyed path
    others = [(torch.ones(64), torch.zeros(64)) for _ in range(3)]
    for a, b in others:
        assert bound(a, b, 64, 0.5) is rec.kernels[0]
    assert rec.calls == 1 and len(keyed) == 1
    launches = rec.kernels[0].launches
    assert len(launches) == 3 and all(grid == (4, 2, 1) for grid, _ in launches)
    for (a, b), (_, args) in zip(others, launches):
        assert args[0] is a and args[1] is b and args[2:] == (64, 0.5, 32, True)  # constexprs, FLAG's default


def _native(a):
    """Triton's own specialization of one runtime argument (what picks the compiled binary)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, a, False, True, True)


_INTS = (0, 1, 2, 15, 16, 17, 32, -16, 2**31 - 16, 2**31, 2**31 + 16, -2**31, -2**31 - 16)


@pytest.mark.parametrize("bound_n", _INTS)
def test_bound_launch_never_reuses_a_binary_for_an_int_triton_specializes_differently(keyed_calls, bound_n):
    """Every int whose Triton specialization (== 1 constexpr, divisible by 16, int32 / int64) differs from the
    bound one goes back through the keyed path; so do a bool or a float of the same value."""
    ck, rec, keyed = keyed_calls
    x, y = torch.zeros(64), torch.zeros(64)
    bound = ck.bind((1,), BLOCK=32)
    bound(x, y, bound_n, 0.5)
    for n in (*_INTS, True, False, float(bound_n)):
        before = len(keyed)
        bound(x, y, n, 0.5)
        direct = len(keyed) == before
        if direct:
            assert type(n) is int and _native(n) == _native(bound_n), n
        else:
            assert n != bound_n or type(n) is not int, n


@pytest.mark.parametrize("change", ["misaligned", "aligned", "dtype", "float", "none", "subclass", "device", "hook"])
def test_bound_launch_any_key_change_goes_back_through_the_keyed_path(keyed_calls, monkeypatch, change):
    ck, rec, keyed = keyed_calls
    base = torch.zeros(80)
    x, y = (base[1:65], torch.zeros(64)) if change == "aligned" else (base[:64], torch.zeros(64))
    current = [0]
    monkeypatch.setattr(launch_mod.driver.active, "get_current_device", lambda: current[0])
    bound = ck.bind((1,), BLOCK=32)
    bound(x, y, 64, 0.5)
    args = [x, y, 64, 0.5]
    if change == "misaligned":
        args[0] = base[1:65]
    elif change == "aligned":
        args[0] = base[:64]
    elif change == "dtype":
        args[1] = y.double()
    elif change == "float":
        args[3] = 0.25
    elif change == "none":
        args[3] = None
    elif change == "subclass":  # the same specialization: the keyed path launches the same binary
        args[1] = torch.nn.Parameter(y)
    elif change == "device":
        current[0] = 1
    if change == "hook":
        hook = lambda metadata: None  # noqa: E731
        triton.knobs.runtime.launch_enter_hook.add(hook)
        try:
            bound(*args)
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(hook)
    else:
        bound(*args)
    assert len(keyed) == 2
    launched = {"hook": ["hooked"], "subclass": [(1, 1, 1)]}.get(change, [])
    assert [entry[0] for entry in rec.kernels[0].launches] == launched
    if _native(args[0]) != _native(x) or args[1].dtype != y.dtype:
        assert rec.calls == 2  # a binary of its own


def test_bound_launch_of_an_interpreted_kernel_always_takes_tritons_path():
    calls = []

    class Interpreted:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    bound = CachedKernel(Interpreted()).bind((2,), BLOCK=8)
    bound(1, 2)
    bound(1, 2)
    assert calls == [((2,), (1, 2), {"BLOCK": 8})] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_bound_launch_equals_triton_through_respecializations_and_a_graph():
    """A bound launch computes what Triton's does for aligned and misaligned views and other sizes (those through
    the keyed path), and its direct launches capture in a CUDA graph."""
    ck = CachedKernel(_axpy_kernel)
    bound = ck.bind((16,), BLOCK=256)
    g = torch.Generator(device="cuda").manual_seed(0)
    base, y = torch.randn(4096 + 8, device="cuda", generator=g), torch.randn(4096 + 8, device="cuda", generator=g)
    for n, off in ((4096, 0), (4096, 0), (4096, 1), (4000, 0), (4096, 4), (4096, 0)):
        x = base[off:off + n]
        out = torch.full((n,), float("nan"), device="cuda")
        bound(x, y, out, n, 1.5)
        torch.testing.assert_close(out, 1.5 * x + y[:n], rtol=1e-6, atol=1e-6)
    x, out = base[:4096], torch.empty(4096, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            bound(x, y, out, 4096, 1.5)  # the bound specialization: its direct launch is captured
    out.fill_(float("nan"))
    x.copy_(torch.randn(4096, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 1.5 * x + y[:4096], rtol=1e-6, atol=1e-6)
