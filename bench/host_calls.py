"""The hit path's Python work per call of ``bench/host_time.py``'s GPU rows, counted on the CPU.

A repeated public call with one signature runs the same Python on a CPU as on a GPU once its op is chosen; only
the final launch differs. So each row here forces the op the H100 selects (``SELECTOR.select`` answers it) and
swaps that op's kernel for a stub returning preallocated outputs (the aten function of ``sdpa_cudnnF``, FA3's C++
forward, the decode launcher, the merge kernel), then counts, for one call after warm-up, the Python functions
entered and the C functions called (``sys.setprofile``), for ``ours`` (the public call) and ``direct`` (the stubbed
launch with the same arguments, as host_time.py calls it). Device descales and indices are CPU tensors here: the
miss path, which alone tells them apart, is told they are on a device (``call._plannable``,
``kvcache_call._plannable`` answer as on a GPU). CPU tensors skip the CUDA-only key items (address bits, the
capture flag): 7 C calls per call fewer than on a GPU, on both sides alike where direct reads none.

    PYTHONPATH=$PWD python bench/host_calls.py [--iters 2000] [--rounds 7] [--calls] [--pieces cpu|cuda]

prints per row: Python calls and C calls per call of ours and direct, and microseconds per call of each (median
of ``--rounds`` rounds of ``--iters`` back-to-back calls, one thread); ``--calls`` lists ours' functions by count.
``--pieces DEVICE`` times instead the C-level pieces a hit path pays per call on that device's tensors (key
items, the CUDA capture flag, a view, an output allocation, a plan finder): on a GPU host these set the
overhead that call counts cannot show.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
from typing import Callable, Iterator
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fmha_ops  # noqa: E402
from fmha_ops import attn_bias as ab  # noqa: E402
from fmha_ops import call as call_layer  # noqa: E402
from fmha_ops import kvcache_call  # noqa: E402
from fmha_ops.dispatch import REGISTRY, SELECTOR  # noqa: E402
from fmha_ops.inputs import make_inputs  # noqa: E402
from fmha_ops.testing import normal_qkv  # noqa: E402

GPU_SHAPE = (1, 128, 1, 64)  # host_time.py's: B, M, H, D
KV_SHAPE = (4, 512, 8, 2, 128, 64)  # host_time.py's decode: B, cache length, Hq, Hkv, D, page size

Call = Callable[[], object]


@contextlib.contextmanager
def forced(name: str, planned_descales: bool = True) -> Iterator[type]:
    """``SELECTOR.select`` answers the forward op ``name`` for every call; descales / index tensors count as on a
    device (``planned_descales``: the plan path a GPU call takes). Yields the op class."""
    op = REGISTRY.get(name)
    select = SELECTOR.select

    def choose(key, make_problem, kind="fw", forced_op=None, measure=None):
        return op if kind == "fw" else select(key, make_problem, kind, forced_op, measure)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(SELECTOR, "select", choose))
        if planned_descales:
            stack.enter_context(mock.patch.object(call_layer.checks, "checks_enabled", lambda: False))
            real = call_layer._plannable
            stack.enter_context(mock.patch.object(call_layer, "_plannable", lambda inp: _on_device(real, inp)))
        fmha_ops.SELECTOR.clear()
        try:
            yield op
        finally:
            fmha_ops.SELECTOR.clear()


def _on_device(real, inp) -> bool:
    """``call._plannable`` as a GPU call's: descales on the device (here CPU tensors stand for them)."""
    with mock.patch.object(torch.Tensor, "device", property(lambda t: torch.device("meta"))):
        return real(inp)


def _stub_sdpa(op, out_bhmk: torch.Tensor):
    """``op.kernel`` returning a stub of the aten function: the preallocated (B, Hq, Mq, Kv) output."""
    real = op.kernel.__func__

    def kernel(cls, inp, causal, scale):
        found = real(cls, inp, causal, scale)
        return found._replace(fn=lambda q, k, v, *a, **kw: (out_bhmk,))
    return mock.patch.object(op, "kernel", classmethod(kernel))


def _sdpa_rows(q, k, v) -> dict[str, tuple[Call, Call, list]]:
    rows = {}
    causal = ab.LowerTriangularMask()
    br = ab.LowerTriangularFromBottomRightMask()
    out = torch.empty(q.shape, dtype=q.dtype).transpose(1, 2)
    with forced("sdpa_cudnnF") as op:
        stubs = [_stub_sdpa(op, out)]

        def direct_of(inp):
            with stubs[0]:
                fn, args, kwargs, _ = op.kernel(inp, True, inp.scale)
            qt, kt, vt = (t.transpose(1, 2) for t in (inp.query, inp.key, inp.value))
            return lambda: fn(qt, kt, vt, *args, **kwargs)

        rows["memory_efficient_attention causal -> sdpa_cudnnF"] = (
            lambda: fmha_ops.memory_efficient_attention(q, k, v, causal), direct_of(make_inputs(q, k, v, causal)),
            ["sdpa_cudnnF", stubs])
        rows["memory_efficient_attention_forward -> sdpa_cudnnF"] = (
            lambda: fmha_ops.memory_efficient_attention_forward(q, k, v, causal),
            direct_of(make_inputs(q, k, v, causal)), ["sdpa_cudnnF", stubs])
        rows["flash_attn_func causal -> sdpa_cudnnF"] = (
            lambda: fmha_ops.flash_attn_func(q, k, v, causal=True), direct_of(make_inputs(q, k, v, br)),
            ["sdpa_cudnnF", stubs])
        rows["memory_efficient_attention op=sdpa_cudnnF"] = (
            lambda: fmha_ops.memory_efficient_attention(q, k, v, causal, op="sdpa_cudnnF"),
            direct_of(make_inputs(q, k, v, causal)), ["sdpa_cudnnF", stubs])
    return rows


def _stub_fa3(out: torch.Tensor, lse: torch.Tensor):
    from fmha_ops.ops import fa3

    def fwd(**kwargs):
        return out, lse
    return mock.patch.object(fa3, "forward_kernel", lambda: fwd)


def _fa3_rows(q, k, v) -> dict[str, tuple[Call, Call, list]]:
    b, m, h, _ = q.shape
    rows = {}
    with forced("fa3F") as op:
        stubs = [_stub_fa3(torch.empty(q.shape, dtype=q.dtype), torch.empty((b, h, m)))]
        cu = torch.tensor([0, m // 2, m], dtype=torch.int32)
        packed = [t[0] for t in (q, k, v)]
        varlen = ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens([m // 2, m - m // 2])
        vinp = make_inputs(q, k, v, varlen)
        rows["flash_attn_varlen_func causal -> fa3F"] = (
            lambda: fmha_ops.flash_attn_varlen_func(*packed, cu, cu, m, m, causal=True),
            lambda: op.apply(vinp, False), ["fa3F", stubs])
        f8 = torch.float8_e4m3fn
        q8, k8, v8 = (t.to(f8) for t in (q, k, v))
        one = torch.ones(1)
        br = ab.LowerTriangularFromBottomRightMask()
        finp = make_inputs(q8, k8, v8, br, q_descale=one, k_descale=one, v_descale=one)
        rows["flash_attn_func fp8 + descales -> fa3F"] = (
            lambda: fmha_ops.flash_attn_func(q8, k8, v8, causal=True, q_descale=one, k_descale=one, v_descale=one),
            lambda: op.apply(finp, False), ["fa3F", stubs])
    return rows


def _merge_rows(q, k, v) -> dict[str, tuple[Call, Call, list]]:
    from fmha_ops import api

    parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, s], v[:, s]) for s in (slice(0, 64), slice(64, None))]
    outs, lses = [o for o, _ in parts], [lse for _, lse in parts]
    merged = (torch.empty_like(outs[0]), torch.empty_like(lses[0]))

    def merge_parts(outs, lses, out_dtype, write_lse=True):
        return merged

    on_device = mock.patch.object(torch.Tensor, "is_cuda", property(lambda t: True))
    stubs = [mock.patch.object(api, "_merge_kernel", lambda: merge_parts), on_device]
    return {"merge_attentions (2 parts) -> triton merge": (
        lambda: fmha_ops.merge_attentions(outs, lses), lambda: merge_parts(outs, lses, outs[0].dtype, True),
        [None, stubs])}


def _kvcache_rows() -> dict[str, tuple[Call, Call, list]]:
    from fmha_ops.flash_attn_interface import flash_attn_with_kvcache
    from fmha_ops.kv_cache import build_fp8_paged_cache, paged_from_dense

    b, length, hq, hkv, d, page = KV_SHAPE
    q, k, v = normal_qkv((b, 1, hq, d), (b, length, hkv, d), dtype=torch.bfloat16)
    (kc, vc), table = paged_from_dense([k, v], page)
    k8, v8, ks, vs, table8 = build_fp8_paged_cache(k, v, page)
    lens = torch.full((b,), length - 8, dtype=torch.int32)
    out = torch.empty(q.shape, dtype=q.dtype)

    def launch(q, k_cache, v_cache, k_scale, v_scale, seqlens, table, out, lse, seqlen_offset=0, sinks=None,
               key_start=None):
        return None

    rows = {}
    for label, name, kcache, vcache, tab, kd, vd in (
            ("flash_attn_with_kvcache paged decode -> triton_decoderF", "triton_decoderF", kc, vc, table, None, None),
            ("flash_attn_with_kvcache fp8 cache -> gluon_fp8_decodeF", "gluon_fp8_decodeF", k8, v8, table8, ks, vs)):
        op = REGISTRY.get(name)
        stubs = [mock.patch.object(op, "decode_launcher", classmethod(lambda cls, *a, **kw: launch)),
                 mock.patch.object(kvcache_call.checks, "wanted", lambda *t: False)]

        def ours(kcache=kcache, vcache=vcache, tab=tab, kd=kd, vd=vd):
            return flash_attn_with_kvcache(q, kcache, vcache, cache_seqlens=lens, page_table=tab, k_descale=kd,
                                           v_descale=vd, causal=True)

        def direct(kcache=kcache, vcache=vcache, tab=tab, kd=kd, vd=vd):
            launch(q, kcache, vcache, kd, vd, lens, tab, out, None)  # no LSE, as ours: the same bound decoder
        rows[label] = (ours, direct, [name, stubs])
    return rows


def rows() -> dict[str, tuple[Call, Call, list]]:
    """label -> (ours, direct, [forced op name or None, the stubs to enter around both])."""
    q, k, v = normal_qkv(GPU_SHAPE, GPU_SHAPE, dtype=torch.bfloat16)
    return {**_sdpa_rows(q, k, v), **_fa3_rows(q, k, v), **_merge_rows(q, k, v), **_kvcache_rows()}


@contextlib.contextmanager
def installed(spec: list) -> Iterator[None]:
    """The row's op forced and its stubs entered."""
    name, stubs = spec
    with contextlib.ExitStack() as stack:
        if name is not None:
            stack.enter_context(forced(name))
        for stub in stubs:
            stack.enter_context(stub)
        yield


def counted(fn: Call, warmup: int = 3) -> tuple[int, int, collections.Counter]:
    """(Python calls, C calls, Python calls by function) of one call of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    names: collections.Counter = collections.Counter()
    c_calls = 0

    def profile(frame, event, arg):
        nonlocal c_calls
        if event == "call":
            code = frame.f_code
            names[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
        elif event == "c_call":
            c_calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sum(names.values()), c_calls, names


def host_us(fn: Call, iters: int) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def pieces(device: str, iters: int) -> dict[str, float]:
    """Microseconds per call of the C-level pieces every hit path pays beside its Python (what call counts do not
    show), on ``device``'s tensors: one tensor's key items, the capture flag (CUDA), a view, an output allocation
    (``empty_like``, which the plans use, and ``empty`` of a known shape, dtype and device: on the CPU 0.6 against
    1.7 us), and memory_efficient_attention's plan finder (3 tensors and a mask)."""
    from fmha_ops import api
    from fmha_ops.plans import _capturing

    q, k, v = normal_qkv(GPU_SHAPE, GPU_SHAPE, dtype=torch.bfloat16, device=device)
    shape, dtype = q.shape, q.dtype
    mask = ab.LowerTriangularMask()
    calls = {
        "tensor key items (shape, dtype, device, stride, requires_grad)":
            lambda: (q.shape, q.dtype, q.device, q.stride(), q.requires_grad),
        "data_ptr() & 15": lambda: q.data_ptr() & 15,
        "transpose(1, 2)": lambda: q.transpose(1, 2),
        "[None]": lambda: q[None],
        "empty_like": lambda: torch.empty_like(q),
        "empty(shape, dtype=, device=)": lambda: torch.empty(shape, dtype=dtype, device=q.device),
        "memory_efficient_attention's plan finder": lambda: api._FIND_MEA(
            q, k, v, mask, 0.0, None, None, None, None, None, None, False, 0.0, None),
    }
    if device == "cuda":
        calls["capture flag"] = _capturing
    return {name: statistics.median(host_us(fn, iters) for _ in range(5)) for name, fn in calls.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", action="store_true", help="list ours' Python functions by count per row")
    p.add_argument("--pieces", choices=("cpu", "cuda"), help="time the C-level pieces of a hit path on this device's "
                   "tensors instead")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.pieces:
        for name, us in pieces(args.pieces, args.iters).items():
            print(f"{us:8.3f} us  {name}")
        return
    print(f"{'row':58s} {'py ours':>7s} {'py dir':>6s} {'C ours':>6s} {'C dir':>6s} {'us ours':>8s} {'us dir':>7s}")
    for label, (ours, direct, spec) in rows().items():
        with installed(spec):
            py_o, c_o, names = counted(ours)
            py_d, c_d, _ = counted(direct)
            times = {"o": [], "d": []}
            for _ in range(args.rounds):
                times["o"].append(host_us(ours, args.iters))
                times["d"].append(host_us(direct, args.iters))
        us_o, us_d = statistics.median(times["o"]), statistics.median(times["d"])
        print(f"{label:58s} {py_o:7d} {py_d:6d} {c_o:6d} {c_d:6d} {us_o:8.2f} {us_d:7.2f}", flush=True)
        if args.calls:
            for name, n in names.most_common():
                print(f"      {n:3d}  {name}")


if __name__ == "__main__":
    main()
