"""xformers' local-attention masks and softcap through the public API on the Triton ops (``triton_attnF`` forward,
``triton_attnB`` backward; the interpreter on a CPU), against a float64 reference built from the mask's own
``materialize()``: softmax(c * tanh(scale q.k / c) + bias) v, rows without a visible key 0."""
import pytest
import torch

import fmha_ops
import tests.test_kernel_attention_bwd  # noqa: F401  (patches the interpreter's loop bounds / bf16 dot)
from fmha_ops import attn_bias as ab
from fmha_ops.testing import error_report
from tests.conftest import DEVICE

DTYPE = torch.float16 if DEVICE == "cpu" else torch.bfloat16
TOL = 4e-3 if DEVICE == "cpu" else 2e-2
SEQ_Q, SEQ_K = [7, 30, 1, 25], [12, 30, 9, 25]


def _masks():
    """name -> (mask, packed): each xformers local form, plus a varlen one (packed: batch 1)."""
    return {
        "causal_br_local": (ab.LowerTriangularFromBottomRightMask().make_local_attention(6), False),
        "local_br": (ab.LocalAttentionFromBottomRightMask(window_left=5, window_right=3), False),
        "local_br_right0": (ab.LocalAttentionFromBottomRightMask(window_left=0, window_right=0), False),
        "varlen_causal_local": (ab.BlockDiagonalCausalMask.from_seqlens(SEQ_Q, SEQ_K).make_local_attention(4),
                                True),
        "varlen_causal_br_local": (ab.BlockDiagonalMask.from_seqlens(SEQ_Q, SEQ_K)
                                   .make_local_attention_from_bottomright(8), True),
    }


def _reference(q, k, v, mask, scale, softcap):
    """float64 reference from ``mask.materialize`` (B, Hq, Mq, Mk), GQA by head grouping."""
    g = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.double().cpu() for t in (q, k, v))
    s = torch.einsum("bmhd,bnhd->bhmn", qf, kf.repeat_interleave(g, 2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s + mask.materialize((q.shape[0], q.shape[2], q.shape[1], k.shape[1]), torch.float64)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhmn,bnhd->bmhd", p, vf.repeat_interleave(g, 2))


def _inputs(name, packed, seed):
    g = torch.Generator().manual_seed(seed)
    B, Mq, Mk = (1, sum(SEQ_Q), sum(SEQ_K)) if packed else (2, 37, 45 if "br" in name else 37)
    shapes = ((B, Mq, 4, 32), (B, Mk, 2, 32), (B, Mk, 2, 32))
    return [(torch.randn(*s, generator=g) * 1.5).to(DEVICE, DTYPE) for s in shapes]


@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("name", sorted(_masks()))
def test_local_masks_forward(name, softcap):
    mask, packed = _masks()[name]
    q, k, v = _inputs(name, packed, seed=len(name))
    scale = 0.25
    out = fmha_ops.memory_efficient_attention(q, k, v, mask, scale=scale, op="triton_attnF", softcap=softcap)
    ref = _reference(q, k, v, mask, scale, softcap)
    err = error_report(out.cpu(), ref)
    assert err["rel"] < TOL, err


@pytest.mark.parametrize("name", ["causal_br_local", "local_br", "varlen_causal_local"])
def test_local_masks_backward(name):
    mask, packed = _masks()[name]
    q, k, v = (t.requires_grad_() for t in _inputs(name, packed, seed=3))
    softcap, scale = 3.0, 0.25
    out = fmha_ops.memory_efficient_attention(q, k, v, mask, scale=scale, op=("triton_attnF", "triton_attnB"),
                                              softcap=softcap)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go)
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(_reference(*leaves, mask, scale, softcap), leaves, go.double().cpu())
    for label, got, want in zip("qkv", grads, ref_grads):
        err = error_report(got.cpu(), want)
        assert err["rel"] < 2 * TOL, (label, err)


def test_window_routes_to_a_triton_op():
    """With only our ops and the reference to choose from, a windowed call lands on a Triton forward."""
    mask, _ = _masks()["causal_br_local"]
    q, k, v = _inputs("causal_br_local", False, seed=0)
    names = [v.op.NAME for v in fmha_ops.explain(q, k, v, mask).verdicts if not v.why_not()]
    assert "triton_attnF" in names, names
