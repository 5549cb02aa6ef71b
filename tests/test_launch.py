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
from fmha_ops.kernels.triton.launch import CachedKernel, _spec, cdiv, next_pow2
from tests.conftest import HAS_CUDA


def _kernel_py(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):
    pass


class _Compiled:
    """Stands in for triton's CompiledKernel: records what a cached launch passes, by which path."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *args):
        assert (stream, function, metadata) == ("stream", "function", "metadata")
        assert launch_metadata is enter_hook is exit_hook is None
        self.launches.append(((g0, g1, g2), args))

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("hooked", grid, args))


class _Recorder:
    def __init__(self):
        self.calls = 0
        self.kernels = []

    def __call__(self, *args, grid, warmup, **kwargs):
        self.calls += 1
        self.kernels.append(_Compiled())
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
    assert _spec(x) == (torch.float32, True)
    assert _spec(x[1:]) == (torch.float32, False)  # 4-byte offset: not 16-byte aligned
    assert _spec(x.to(torch.float16)) != _spec(x)
    d = TensorDescriptor(x.view(8, 8), [8, 8], [8, 1], [4, 8])
    assert _spec(d) == (TensorDescriptor, torch.float32, (4, 8))


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
