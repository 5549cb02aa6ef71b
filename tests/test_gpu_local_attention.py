"""GPU: local windows, tensor biases (with their gradient) and softcap through every op that declares them,
against a float64 reference on the same (rounded) inputs; and that the selector picks such an op."""
from __future__ import annotations

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.dispatch import REGISTRY
from fmha_ops.inputs import make_inputs
from fmha_ops.ops.reference import reference_attention
from fmha_ops.testing import error_report, transformer_like

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}  # max rel L2 error vs float64

MASKS = {
    "local_br": lambda mq, mk: ab.LocalAttentionFromBottomRightMask(window_left=37, window_right=5),
    "causal_local": lambda mq, mk: ab.LowerTriangularFromBottomRightMask().make_local_attention(64),
    "causal_br": lambda mq, mk: ab.LowerTriangularFromBottomRightMask(),
    "tensor": lambda mq, mk: torch.randn(2, 8, mq, mk, device=DEV),
    "causal_tensor": lambda mq, mk: ab.LowerTriangularMask().add_bias(torch.randn(2, 8, mq, mk, device=DEV)),
    "varlen_local": lambda mq, mk: ab.BlockDiagonalMask.from_seqlens([mq], [mk], device=DEV).make_local_attention_from_bottomright(50),
}


def _ops_declaring(inp):
    p = make_inputs(*inp).problem() if isinstance(inp, tuple) else inp.problem()
    return [op for op in REGISTRY.ops("fw") if op.available() is None and op.supports_arch(p.arch)
            and not op.not_supported_reasons(p)]


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mq,mk", [(200, 200), (77, 333)])
def test_windows_and_biases_on_every_declaring_op(mask, dtype, mq, mk):
    q, k, v = transformer_like((2, mq, 8, 64), (2, mk, 8, 64), dtype=dtype, device=DEV, seed=mq + mk)
    bias = MASKS[mask](mq, mk)
    if mask == "varlen_local":
        q, k, v = (t[:1] for t in (q, k, v))
    if isinstance(bias, torch.Tensor):
        bias = bias[: q.shape[0]]
    inp = make_inputs(q, k, v, bias)
    ref, _ = reference_attention(inp, torch.float64)
    ops = _ops_declaring(inp)
    assert ops, "no op declares this call"
    for op in ops:
        out = fmha_ops.memory_efficient_attention(q, k, v, bias, op=op)
        assert error_report(out, ref)["rel"] < TOL[dtype], (op.NAME, error_report(out, ref))
    chosen = fmha_ops.explain(q, k, v, bias).selected
    assert chosen is not None and chosen.NAME != "torch_referenceF" or mask == "varlen_local", chosen


@pytest.mark.parametrize("op", ["sdpa_efficientF", "sdpa_mathF"])
def test_tensor_bias_gradient_on_gpu(op):
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(2, m, 4, 32, device=DEV, generator=g, dtype=torch.float16).requires_grad_() for m in (65, 97, 97))
    bias = torch.randn(2, 4, 65, 97, device=DEV, generator=g, dtype=torch.float16).requires_grad_()
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, op=op)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), go)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref, _ = reference_attention(make_inputs(*leaves[:3], leaves[3]), torch.float64)
    ref_grads = torch.autograd.grad(ref, leaves, go.double())
    for name, got, want in zip("q k v bias".split(), grads, ref_grads):
        assert error_report(got, want)["rel"] < 1e-2, (op, name, error_report(got, want))


def test_softcap_on_gpu_runs_where_declared():
    q, k, v = transformer_like((2, 128, 8, 64), (2, 128, 8, 64), dtype=torch.bfloat16, device=DEV)
    inp = make_inputs(q, k, v, ab.LowerTriangularFromBottomRightMask(), softcap=30.0)
    ref, _ = reference_attention(inp, torch.float64)
    out = fmha_ops.memory_efficient_attention(q, k, v, ab.LowerTriangularFromBottomRightMask(), softcap=30.0)
    assert error_report(out, ref)["rel"] < TOL[torch.bfloat16]
