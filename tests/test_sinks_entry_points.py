"""``sinks=`` through every public entry point with the Triton kernels forced (the interpreter on the CPU, float16),
against the float64 reference; the value head dim of its own (Kv=32 != K=48) wherever the entry point takes one.

Entry points: memory_efficient_attention_forward, memory_efficient_attention_forward_requires_grad +
memory_efficient_attention_backward, flash_attn_func, flash_attn_varlen_func, the fp8 / int8+fp8 forward
(memory_efficient_attention on quantized q/k/v), fp8_attention / i8fp8_attention. (memory_efficient_attention,
memory_efficient_attention_partial, and flash_attn_with_kvcache / plan_kvcache on bf16 and fp8 paged caches:
tests/test_sinks_api.py.) Each also checks that the sinks matter: the output is far from the reference without
them.
"""
import pytest
import torch

import fmha_ops
from fmha_ops import LowerTriangularFromBottomRightMask
from fmha_ops.testing import error_report
from tests.conftest import DEVICE
from tests.test_kernel_sinks import reference
from tests.test_sinks_api import _inputs

TOLERANCE = 2e-3  # float16 Triton against float64: measured rel 2.4e-4
QUANTIZED_COS = 0.995  # fp8 / int8 inputs against the unquantized float64 reference: measured cos >= 0.998


def _check(out, q, k, v, sinks, tolerance=TOLERANCE, window_left=-1):
    """out within ``tolerance`` (relative) of the float64 reference with the sinks, and far from it without them."""
    want, _ = reference(q, k, v, q.shape[-1] ** -0.5, True, sinks, window_left)
    without, _ = reference(q, k, v, q.shape[-1] ** -0.5, True, None, window_left)
    rep = error_report(out, want)
    assert rep["rel"] < tolerance, rep
    assert error_report(out, without)["rel"] > 10 * rep["rel"]


def test_forward():
    q, k, v, sinks = _inputs()
    out = fmha_ops.memory_efficient_attention_forward(q, k, v, LowerTriangularFromBottomRightMask(),
                                                      op="triton_attnF", sinks=sinks)
    assert out.shape[-1] == v.shape[-1]
    _check(out, q, k, v, sinks)


def test_forward_requires_grad_and_backward():
    """The low-level pair on the Triton forward and backward: the LSE holds the sinks; dq / dk / dv as autograd's."""
    q, k, v, sinks = _inputs()
    mask = LowerTriangularFromBottomRightMask()
    out, lse = fmha_ops.memory_efficient_attention_forward_requires_grad(q, k, v, mask, op="triton_attnF",
                                                                         sinks=sinks)
    _check(out, q, k, v, sinks)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    got = fmha_ops.memory_efficient_attention_backward(grad, out, lse, q, k, v, mask, op="triton_attnB", sinks=sinks)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref, ref_lse = reference(*leaves, q.shape[-1] ** -0.5, True, sinks)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3
    for name, g, w in zip("qkv", got, torch.autograd.grad(ref, leaves, grad.double())):
        rep = error_report(g, w)
        assert rep["rel"] < 3e-3 and rep["cos"] > 0.9999, (name, rep)


@pytest.mark.parametrize("window", [None, 6])
def test_flash_attn_func(window):
    q, k, v, sinks = _inputs(b=1, mq=20, mk=20)
    window_size = (-1, -1) if window is None else (window, 0)
    with fmha_ops.use_ops("triton_attnF"):
        out = fmha_ops.flash_attn_func(q, k, v, causal=True, window_size=window_size, sinks=sinks)
    _check(out, q, k, v, sinks, window_left=-1 if window is None else window)


def test_flash_attn_varlen_func():
    q, k, v, sinks = _inputs(b=1, mq=20, mk=20)
    cu = torch.tensor([0, 1, 7, 20], dtype=torch.int32, device=DEVICE)
    with fmha_ops.use_ops("triton_attnF"):
        packed = fmha_ops.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 13, 13, causal=True, sinks=sinks)
    assert packed.shape == (20, q.shape[2], v.shape[3])
    for a, b in ((0, 1), (1, 7), (7, 20)):
        _check(packed[None, a:b], q[:, a:b], k[:, a:b], v[:, a:b], sinks)


@pytest.mark.parametrize("kind", ["fp8", "i8fp8"])
def test_quantized_forward(kind):
    """The fp8 (q/k/v) and int8 q/k + fp8 v forward kernels with sinks, on quantized inputs (Kv != K)."""
    from fmha_ops.quant import quantize_i8fp8, quantize_qkv_fp8

    q, k, v, sinks = _inputs(mq=33, mk=33)
    mask = LowerTriangularFromBottomRightMask()
    if kind == "fp8":
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        out = fmha_ops.memory_efficient_attention(q8, k8, v8, mask, q_descale=qd, k_descale=kd, v_descale=vd,
                                                  op="triton_fp8F", sinks=sinks, output_dtype=torch.float16)
    else:
        x = quantize_i8fp8(q, k, v, qk_granularity="tensor", v_granularity="tensor")
        out = fmha_ops.memory_efficient_attention(x.q, x.k, x.v, mask, q_descale=x.q_descale, k_descale=x.k_descale,
                                                  v_descale=x.v_descale, scale=x.softmax_scale, op="triton_i8fp8F",
                                                  sinks=sinks, output_dtype=torch.float16)
    assert out.shape[-1] == v.shape[-1]
    want, _ = reference(q, k, v, q.shape[-1] ** -0.5, True, sinks)
    without, _ = reference(q, k, v, q.shape[-1] ** -0.5, True, None)
    assert error_report(out, want)["cos"] > QUANTIZED_COS
    assert error_report(out, without)["rel"] > 2 * error_report(out, want)["rel"]


@pytest.mark.parametrize("fn, op", [("fp8_attention", "triton_fp8F"), ("i8fp8_attention", "triton_i8fp8F")])
def test_quantize_inside_attention(fn, op):
    """fp8_attention / i8fp8_attention with their Triton forward forced (Kv=32 != K=48): output, the sinks' gradient
    and v's, in v's head dim."""
    q, k, v, sinks = _inputs(b=1, mq=33, mk=33, grad=True)
    out = getattr(fmha_ops, fn)(q, k, v, causal=True, op=op, sinks=sinks)
    out.float().square().sum().backward()
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, sinks)]
    ref, _ = reference(*leaves[:3], q.shape[-1] ** -0.5, True, leaves[3])
    ref.square().sum().backward()
    assert out.shape[-1] == v.shape[-1] and error_report(out, ref)["cos"] > QUANTIZED_COS
    assert error_report(sinks.grad, leaves[3].grad)["cos"] > 0.99
    assert error_report(v.grad, leaves[2].grad)["cos"] > 0.99
