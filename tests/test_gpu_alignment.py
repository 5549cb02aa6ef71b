"""GPU: calls some kernels cannot address (head dims off 16-byte vectors, sliced BMK layouts with odd row
strides or start addresses, tensor biases with odd strides, empty sequences) through the public API, on every
op that declares them and on the selector's pick, against a float64 reference. Each op's kernels are waited for
before the next, so a fault (a sticky CUDA error) fails the case that caused it, naming the op.
``python -m tests.test_gpu_alignment`` runs each op on each layout in its own process instead (a fault there
cannot spread to the next op).

"""
from __future__ import annotations

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.dispatch import REGISTRY
from fmha_ops.inputs import make_inputs
from fmha_ops.ops.reference import reference_attention
from fmha_ops.testing import error_report, normal_qkv

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}  # max rel L2 error vs float64


def _declaring_ops(q, k, v, bias):
    p = make_inputs(q, k, v, bias).problem()
    return [op for op in REGISTRY.ops("fw") if op.available() is None and op.supports_arch(p.arch)
            and not op.not_supported_reasons(p)]


def check_every_op(q, k, v, bias=None, dtype=torch.float16, bmk=False):
    """Each declaring op and the default selection agree with the float64 reference (BMK: q/k/v 3-D)."""
    as4 = (lambda t: t.unsqueeze(2)) if bmk else (lambda t: t)
    ref, _ = reference_attention(make_inputs(as4(q), as4(k), as4(v), bias), torch.float64)
    names = []
    torch.cuda.synchronize()  # a fault before the ops (the reference, the inputs) is not charged to the first op
    for op in _declaring_ops(as4(q), as4(k), as4(v), bias) + [None]:
        name = op.NAME if op else f"default ({fmha_ops.explain(q, k, v, bias).selected.NAME})"
        try:
            out = fmha_ops.memory_efficient_attention(q, k, v, bias, op=op)
            torch.cuda.synchronize()
        except torch.AcceleratorError as e:  # a fault of this op's kernels (sticky: later calls fail too)
            raise AssertionError(f"{name} faulted on q {tuple(q.shape)} strides {q.stride()}, k strides {k.stride()}, "
                                 f"v strides {v.stride()}: {str(e).splitlines()[0]}") from e
        out = as4(out)
        assert out.shape == ref.shape, (op, out.shape, ref.shape)
        if ref.numel():
            assert error_report(out, ref)["rel"] < TOL[dtype], (op and op.NAME, error_report(out, ref))
        names.append(name)
    assert fmha_ops.explain(q, k, v, bias).selected is not None
    return names


@pytest.mark.parametrize("d, dv", [(8, 8), (36, 36), (32, 36), (80, 80), (24, 40), (72, 264)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask", ["none", "causal_br", "varlen"])
def test_odd_head_dims(d, dv, dtype, mask):
    q, k, _ = normal_qkv((3, 256, 2, d), (3, 128, 2, d), dtype=dtype, device=DEV, seed=d)
    v = torch.randn(3, 128, 2, dv, device=DEV, dtype=dtype)
    bias = {"none": None, "causal_br": ab.LowerTriangularFromBottomRightMask(),
            "varlen": ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens([100, 56, 100], [40, 60, 28],
                                                                             device=DEV)}[mask]
    if mask == "varlen":
        q, k, v = (t.reshape(1, -1, *t.shape[2:])[:, :n] for t, n in ((q, 256), (k, 128), (v, 128)))
    check_every_op(q, k, v, bias, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_dim, pad, start", [(64, 4, 0), (64, 0, 1), (32, 2, 0), (128, 8, 3)])
def test_sliced_bmk_layouts(dtype, k_dim, pad, start):
    """q / k / v sliced from one (B, M, start + 3K + pad) tensor: rows (start + 3K + pad) elements apart, q
    starting ``start`` elements in."""
    packed = torch.randn(2, 200, start + 3 * k_dim + pad, device=DEV, dtype=dtype)
    q, k, v = (packed[..., start + i * k_dim: start + (i + 1) * k_dim] for i in range(3))
    for bias in (None, ab.LowerTriangularMask()):
        check_every_op(q, k, v, bias, dtype, bmk=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_tensor_bias_with_odd_strides(dtype, causal):
    """A (B, H, Mq, Mk) bias sliced from rows of Mk + 3 and a head-broadcast (stride 0) bias."""
    q, k, v = normal_qkv((2, 131, 4, 64), (2, 131, 4, 64), dtype=dtype, device=DEV, seed=7)
    wide = torch.randn(2, 4, 131, 131 + 3, device=DEV, dtype=dtype)
    for tensor in (wide[..., :131], wide[:, :1, :, 1:132].expand(2, 4, 131, 131)):
        bias = ab.LowerTriangularMask().add_bias(tensor) if causal else tensor
        check_every_op(q, k, v, bias, dtype)


@pytest.mark.parametrize("b, mq, mk", [(0, 32, 32), (1, 0, 32), (1, 32, 0), (2, 0, 0)])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_empty_sequences(b, mq, mk, mask):
    q = torch.randn(b, mq, 2, 64, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(b, mk, 2, 64, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    check_every_op(q, k, v, ab.LowerTriangularMask() if mask == "causal" and mq == mk else None, torch.bfloat16)


def test_varlen_with_empty_sequences():
    bias = ab.BlockDiagonalMask.from_seqlens([0, 17, 5], [9, 0, 33], device=DEV)
    q = torch.randn(1, 22, 2, 64, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 42, 2, 64, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    check_every_op(q, k, v, bias, torch.bfloat16)
