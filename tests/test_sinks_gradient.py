"""The sinks' gradient from the Triton backward's own row sums (delta = rowsum(dO * O), written by its preprocess
kernel; ``sinks.sink_grad_from_delta``) against float64 autograd of the reference, on each path that pairs a forward
with triton_attnB: the kernel, ``memory_efficient_attention`` (causal, windows, rows without keys, varlen),
``fp8_attention`` / ``i8fp8_attention`` and ``torch.compile``. ``sink_grad`` (float32 copies of out and dO) is made to
raise there, so a path that still takes it fails; backward ops without row sums of their own still take it.
CPU: the interpreter in float16 at odd sizes; ``gpu``: bf16 at GPT-OSS heads.
"""
import math
import sys

import pytest
import torch

import fmha_ops
from fmha_ops import LowerTriangularFromBottomRightMask, memory_efficient_attention
from fmha_ops.attn_bias import BlockDiagonalCausalFromBottomRightMask
from fmha_ops.sinks import sink_grad, sink_grad_from_delta
from fmha_ops.testing import error_report
from tests.conftest import DEVICE
from tests.test_kernel_sinks import reference
from tests.test_sinks_api import TRITON_PAIR, _inputs

#: float16 Triton against float64 (dsinks sums rows of dO . O of both signs: the output's rounding weighs more)
GRAD_TOLERANCE = {"dq": 3e-3, "dk": 3e-3, "dv": 3e-3, "dsinks": 1e-2}


def forbid_sink_grad(monkeypatch) -> None:
    """``sink_grad`` raises wherever a module of fmha_ops holds it."""
    def refuse(*args, **kwargs):
        raise AssertionError("sink_grad called: the sinks' gradient did not come from the backward's row sums")
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "fmha_ops" and getattr(module, "sink_grad", None) is sink_grad:
            monkeypatch.setattr(module, "sink_grad", refuse)


def _reference_grads(q, k, v, sinks, grad, window_left=-1):
    """float64 autograd of the bottom-right causal reference: (dq, dk, dv, dsinks)."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, sinks)]
    ref, _ = reference(*leaves[:3], q.shape[-1] ** -0.5, True, leaves[3], window_left)
    return torch.autograd.grad(ref, leaves, grad.double())


def _assert_close(got, want):
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        rep = error_report(g, w)
        assert rep["rel"] < GRAD_TOLERANCE[name] and rep["cos"] > 0.9999, (name, rep)


def test_sink_grad_from_delta_is_sink_grad_and_skips_rows_without_lse():
    """The formula on its own: sink_grad's value from the row sums, in float64; rows whose lse is -inf (no key and
    a sink of -inf) or NaN contribute 0, not NaN."""
    g = torch.Generator().manual_seed(0)
    out, grad = torch.randn(2, 5, 3, 8, generator=g), torch.randn(2, 5, 3, 8, generator=g)
    lse, sinks = torch.randn(2, 3, 5, generator=g), torch.randn(3, generator=g)
    delta = (out.double() * grad.double()).sum(-1).transpose(1, 2)
    want = -(torch.exp(sinks.double()[None, :, None] - lse.double()) * delta).sum((0, 2))
    assert torch.allclose(sink_grad(out, grad, lse, sinks).double(), want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(sink_grad_from_delta(delta.float(), lse, sinks).double(), want, rtol=1e-5, atol=1e-6)
    lse[0, 1, 2], lse[1, 0, 4] = -math.inf, math.nan
    sinks[1] = -math.inf
    got = sink_grad_from_delta(delta.float(), lse, sinks)
    assert torch.isfinite(got).all() and got[1] == 0.0


KERNEL_SHAPES = [  # (B, Mq, Mk, Hq, Hkv, D, Dv, causal, window_left)
    (1, 17, 17, 4, 1, 32, 16, True, -1),  # odd length, GQA 4/1
    (2, 17, 5, 4, 2, 16, 32, True, -1),  # bottom-right causal, Mq > Mk: 12 rows per sequence see no key
    (1, 17, 33, 2, 2, 48, 48, True, 6),  # a window
    (1, 1, 1, 2, 2, 16, 16, False, -1),
    (2, 3, 0, 2, 2, 16, 16, False, -1),  # no keys: out 0, lse = the sink, dsinks 0
]


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_kernel_row_sums_give_the_sinks_gradient(shape):
    """attention_backward(delta=) writes rowsum(dO * O) in float32 for every row; the sinks' gradient from it
    matches float64 autograd."""
    from fmha_ops.kernels.triton.attention_bwd import attention_backward
    from fmha_ops.kernels.triton.attention_fwd import attention_forward

    b, mq, mk, hq, hkv, d, dv, causal, window = shape
    q, k, v, sinks = _inputs(b=b, mq=mq, mk=mk, hq=hq, hkv=hkv, d=d, dv=dv, seed=11)
    args = dict(scale=d ** -0.5, causal=causal, window_left=window)
    out, lse = attention_forward(q, k, v, return_lse=True, sinks=sinks, **args)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(12)).to(out)
    delta = torch.full_like(lse, math.nan)
    attention_backward(grad, q, k, v, out, lse, delta=delta, **args)
    want_delta = (grad.double() * out.double()).sum(-1).transpose(1, 2)
    assert torch.allclose(delta.double(), want_delta, rtol=1e-5, atol=1e-5)
    dsinks = sink_grad_from_delta(delta, lse, sinks)
    leaves = [t.double().requires_grad_(True) for t in (q, k, v, sinks)]
    ref, _ = reference(*leaves[:3], args["scale"], causal, leaves[3], window)
    want = torch.autograd.grad(ref, leaves[3], grad.double(), allow_unused=True)[0]
    if mk == 0:
        assert not dsinks.any() and (want is None or not want.any())
    else:
        rep = error_report(dsinks, want)
        assert rep["rel"] < GRAD_TOLERANCE["dsinks"] and rep["cos"] > 0.9999, rep


@pytest.mark.parametrize("case", ["odd", "rows_without_keys", "window", "single_row"])
def test_triton_pair_gives_the_sinks_gradient_from_its_row_sums(case, monkeypatch):
    """memory_efficient_attention on (triton_attnF, triton_attnB): dq, dk, dv and dsinks against float64 autograd,
    without sink_grad."""
    forbid_sink_grad(monkeypatch)
    shape = {"odd": dict(b=1, mq=17, mk=17), "rows_without_keys": dict(b=2, mq=17, mk=5),
             "window": dict(b=1, mq=17, mk=33), "single_row": dict(b=1, mq=1, mk=1)}[case]
    q, k, v, sinks = _inputs(**shape, seed=13, grad=True)
    mask, window_left = LowerTriangularFromBottomRightMask(), -1
    if case == "window":
        mask, window_left = mask.make_local_attention(5), 4  # keys (i - 5, i]
    out = memory_efficient_attention(q, k, v, mask, op=TRITON_PAIR, sinks=sinks)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(14)).to(out)
    _assert_close(torch.autograd.grad(out, (q, k, v, sinks), grad),
                  _reference_grads(q, k, v, sinks, grad, window_left))


def test_varlen_sinks_gradient_sums_every_sequence(monkeypatch):
    """Packed sequences (lengths 1, 7, 12; bottom-right causal per sequence): dsinks sums the rows of all."""
    forbid_sink_grad(monkeypatch)
    lengths = [1, 7, 12]
    q, k, v, sinks = _inputs(b=1, mq=sum(lengths), mk=sum(lengths), seed=15, grad=True)
    mask = BlockDiagonalCausalFromBottomRightMask.from_seqlens(lengths, device=DEVICE)
    out = memory_efficient_attention(q, k, v, mask, op=TRITON_PAIR, sinks=sinks)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(16)).to(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, sinks)]
    starts = [0, 1, 8, 20]
    ref = torch.cat([reference(*(t[:, a:e] for t in leaves[:3]), q.shape[-1] ** -0.5, True, leaves[3])[0]
                     for a, e in zip(starts, starts[1:])], 1)
    _assert_close(got, torch.autograd.grad(ref, leaves, grad.double()))


@pytest.mark.parametrize("fn, fw", [("fp8_attention", "triton_fp8F"), ("i8fp8_attention", "triton_i8fp8F")])
def test_quantized_training_takes_the_row_sums(fn, fw, monkeypatch):
    """fp8_attention / i8fp8_attention with triton_attnB as their backward: the sinks' gradient without sink_grad
    (the straight-through gradient of quantized inputs: cosine against the unquantized float64 reference)."""
    forbid_sink_grad(monkeypatch)
    q, k, v, sinks = _inputs(b=1, mq=33, mk=33, d=32, dv=32, seed=17, grad=True)
    with fmha_ops.use_ops(fw, "triton_attnB"):
        out = getattr(fmha_ops, fn)(q, k, v, causal=True, sinks=sinks)
        out.float().square().sum().backward()
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, sinks)]
    ref, _ = reference(*leaves[:3], q.shape[-1] ** -0.5, True, leaves[3])
    ref.square().sum().backward()
    assert error_report(sinks.grad, leaves[3].grad)["cos"] > 0.99


def test_compiled_triton_pair_takes_the_row_sums(monkeypatch):
    """Under torch.compile the fmha_ops::attention_backward custom op returns the sinks' gradient: as eager's."""
    forbid_sink_grad(monkeypatch)
    q, k, v, sinks = _inputs(b=1, mq=9, mk=9, hq=4, hkv=2, d=16, dv=16, seed=18, grad=True)

    def fn(q, k, v, s):
        return memory_efficient_attention(q, k, v, LowerTriangularFromBottomRightMask(), sinks=s, op=TRITON_PAIR)
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, sinks)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(19)).to(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    _assert_close(got, _reference_grads(q, k, v, sinks, grad))
    eager = torch.autograd.grad(fn(q, k, v, sinks), (q, k, v, sinks), grad)
    assert all(torch.equal(g, e) for g, e in zip(got, eager))


def test_backward_without_row_sums_takes_sink_grad(monkeypatch):
    """A backward op that exposes no row sums (the reference) gives the sinks' gradient through sink_grad, and
    only when the sinks require one."""
    q, k, v, sinks = _inputs(b=1, mq=9, mk=9, seed=20, grad=True)
    mask, pair = LowerTriangularFromBottomRightMask(), ("triton_attnF", "torch_referenceB")
    frozen = sinks.detach()
    forbid_sink_grad(monkeypatch)
    torch.autograd.grad(memory_efficient_attention(q, k, v, mask, op=pair, sinks=frozen).sum(), (q,))
    with pytest.raises(AssertionError, match="sink_grad called"):
        torch.autograd.grad(memory_efficient_attention(q, k, v, mask, op=pair, sinks=sinks).sum(), (q, sinks))


@pytest.mark.gpu
@pytest.mark.parametrize("fn, window", [("memory_efficient_attention", None), ("memory_efficient_attention", 128),
                                        ("fp8_attention", None)])
def test_gpu_sinks_gradient_from_row_sums(fn, window, monkeypatch):
    """GPT-OSS heads (64 / 8 of dim 64, bf16, causal, full or a 128-key window) at 1x2048 through the Triton pair
    (fp8_attention: triton_fp8F with triton_attnB), sink_grad forbidden: dsinks against the float32 reference."""
    forbid_sink_grad(monkeypatch)
    q, k, v, sinks = _inputs(b=1, mq=2048, mk=2048, hq=64, hkv=8, d=64, dv=64, dtype=torch.bfloat16, seed=21,
                             grad=True)
    mask = LowerTriangularFromBottomRightMask()
    mask = mask if window is None else mask.make_local_attention(window)
    with fmha_ops.use_ops(*(("triton_fp8F", "triton_attnB") if fn == "fp8_attention" else TRITON_PAIR)):
        out = (fmha_ops.fp8_attention(q, k, v, causal=True, sinks=sinks) if fn == "fp8_attention"
               else memory_efficient_attention(q, k, v, mask, sinks=sinks))
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, sinks, grad)[0]
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v, sinks)]
    ref = memory_efficient_attention(*leaves[:3], mask, sinks=leaves[3], op="torch_referenceF")
    want = torch.autograd.grad(ref, leaves[3], grad.float())[0]
    rep = error_report(got, want)
    # fp8: the straight-through gradient of quantized inputs against the unquantized reference
    assert rep["cos"] > 0.99 if fn == "fp8_attention" else rep["rel"] < 2e-2, rep
