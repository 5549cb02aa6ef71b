"""Our ops as xformers op classes (fmha_ops.xformers_ops): xformers' own API running them, on the CPU.

Gradients through xformers' autograd (its ``memory_efficient_attention`` with our (FwOp, BwOp)) and its low-level
``memory_efficient_attention_forward_requires_grad`` / ``_backward`` against fmha_ops' own autograd, a dense
tensor bias's gradient included (plain and broadcast, BMHK and BMK).
"""
import warnings

import pytest
import torch

import fmha_ops

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # xformers warns that its C++ extension does not load on a CPU torch
    xops = pytest.importorskip("xformers.ops")
from fmha_ops import xformers_ops  # noqa: E402

OURS = (xformers_ops.FwOp, xformers_ops.BwOp)


def _leaves(*shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_(True) for s in shapes]


def _grads(fn, tensors, grad_out):
    for t in tensors:
        t.grad = None
    (fn() * grad_out).sum().backward()
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("bias_shape", [(2, 3, 17, 29), (1, 3, 1, 29), (2, 1, 17, 1)])
def test_tensor_bias_gradient_through_xformers_matches_ours(bias_shape):
    q, k, v = _leaves((2, 17, 3, 16), (2, 29, 3, 16), (2, 29, 3, 16), seed=0)
    (bias,) = _leaves(bias_shape, seed=1)
    grad_out = torch.randn(2, 17, 3, 16, generator=torch.Generator().manual_seed(2))
    full = (2, 3, 17, 29)
    ours = _grads(lambda: fmha_ops.memory_efficient_attention(q, k, v, bias.expand(full)), [q, k, v, bias], grad_out)
    theirs = _grads(lambda: xops.memory_efficient_attention(q, k, v, bias.expand(full), op=OURS), [q, k, v, bias],
                    grad_out)
    for name, a, b in zip("qkvb", ours, theirs):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(b, a, atol=2e-5, rtol=2e-5, msg=name)


def test_tensor_bias_gradient_bmk():
    q, k, v = _leaves((4, 9, 8), (4, 12, 8), (4, 12, 8), seed=3)
    (bias,) = _leaves((4, 9, 12), seed=4)
    grad_out = torch.randn(4, 9, 8, generator=torch.Generator().manual_seed(5))
    ours = _grads(lambda: fmha_ops.memory_efficient_attention(q, k, v, bias[:, None]), [bias], grad_out)
    theirs = _grads(lambda: xops.memory_efficient_attention(q, k, v, bias, op=OURS), [bias], grad_out)
    torch.testing.assert_close(theirs[0], ours[0], atol=2e-5, rtol=2e-5)


def test_lowlevel_forward_requires_grad_and_backward_with_our_ops():
    q, k, v = _leaves((2, 13, 2, 16), (2, 13, 2, 16), (2, 13, 2, 16), seed=6)
    mask = xops.LowerTriangularMask()
    grad_out = torch.randn(2, 13, 2, 16, generator=torch.Generator().manual_seed(7))
    out, lse = xops.memory_efficient_attention_forward_requires_grad(q, k, v, mask, op=OURS[0])
    assert not out.requires_grad  # an op's apply returns plain tensors (xformers' contract)
    dq, dk, dv = xops.memory_efficient_attention_backward(grad_out, out, lse, q, k, v, mask, op=OURS[1])
    expect = _grads(lambda: fmha_ops.memory_efficient_attention(q, k, v, fmha_ops.LowerTriangularMask()), [q, k, v],
                    grad_out)
    for name, a, b in zip("qkv", expect, (dq, dk, dv)):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=2e-5, msg=name)


def test_refusals_about_xformers_own_build_are_not_ours(monkeypatch):
    """xformers refuses CUDA inputs when its C++/CUDA extension did not load; our op classes need none of it."""
    base = xops.fmha.common.AttentionFwOpBase
    own = base.not_supported_reasons.__func__
    monkeypatch.setattr(base, "not_supported_reasons", classmethod(
        lambda cls, d: own(cls, d) + [xformers_ops._XFORMERS_NO_CUDA_BUILD_REASON]))
    q = torch.randn(1, 8, 2, 16)
    assert xformers_ops.FwOp.not_supported_reasons(xops.fmha.Inputs(q, q, q)) == []
    assert xops.fmha.cutlass.FwOp.not_supported_reasons(xops.fmha.Inputs(q, q, q)) != []
