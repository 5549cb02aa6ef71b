"""GPU checks of the FA4 and cuDNN fp8 ops against the float32 reference (H200: pytest -m gpu).

Each test skips, with the op's own reason, where flash-attn-4 / nvidia-cudnn-frontend is not installed."""
import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.ops.cudnn_fp8 import GRAPHS, CudnnFp8FwOp
from fmha_ops.ops.fa4 import FA4BwOp, FA4FwOp
from fmha_ops.quant import quantize_fp8_tensor
from fmha_ops.testing import error_report, transformer_like

pytestmark = pytest.mark.gpu
DEV = "cuda"


def needs(op):
    why = op.available()
    return pytest.mark.skipif(why is not None, reason=f"{op.NAME}: {why}")


def ref(q, k, v, bias=None, **kw):
    return fmha_ops.memory_efficient_attention(q, k, v, bias, op="torch_referenceF", output_dtype=torch.float32, **kw)


def qkv(b, mq, mk, hq, hkv, d, seed=0, dtype=torch.bfloat16):
    q, k, v = transformer_like((b, mq, hq, d), (b, mk, hkv, d), device=DEV, seed=seed)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def assert_grads_close(grads, expected, cos=0.999):
    for name, got, want in zip("qkv", grads, expected):
        rep = error_report(got, want)
        assert rep["cos"] > cos, (name, rep)


def per_tensor(q, k, v):
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8_tensor(t) for t in (q, k, v))
    return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)


# ---- FA4 ----------------------------------------------------------------------------------------------

@needs(FA4FwOp)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mq,mk,hkv,bias", [
    (1000, 1000, 8, None), (333, 333, 2, ab.LowerTriangularMask()),
    (17, 1000, 1, ab.LowerTriangularFromBottomRightMask()), (1, 1000, 8, ab.LowerTriangularFromBottomRightMask()),
    (1000, 17, 2, None)])
def test_fa4_forward_matches_reference(d, mq, mk, hkv, bias):
    q, k, v = qkv(2, mq, mk, 8, hkv, d, seed=d + mq)
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, op="fa4F")
    assert out.dtype == torch.bfloat16 and out.shape == (2, mq, 8, d)
    rep = error_report(out, ref(q, k, v, bias))
    assert rep["cos"] > 0.9999 and rep["rel"] < 1e-2, rep


@needs(FA4FwOp)
@pytest.mark.parametrize("causal", [False, True])
def test_fa4_varlen_and_lse(causal):
    mask = ab.BlockDiagonalMask.from_seqlens([17, 1000, 1, 333], [40, 1000, 7, 333], device=DEV)
    if causal:
        mask = mask.make_causal_from_bottomright()
    q, k, v = qkv(1, 1351, 1380, 8, 2, 128, seed=3)
    out, lse = fmha_ops.memory_efficient_attention_partial(q, k, v, mask, op="fa4F")
    r_out, r_lse = fmha_ops.memory_efficient_attention_partial(q, k, v, mask, op="torch_referenceF")
    rep = error_report(out, r_out)
    assert rep["cos"] > 0.9999, rep
    assert lse.shape == r_lse.shape and torch.allclose(lse, r_lse, atol=2e-2, rtol=1e-3)


@needs(FA4FwOp)
@pytest.mark.parametrize("bias", [None, ab.LowerTriangularFromBottomRightMask()])
def test_fa4_autograd_matches_reference(bias):
    q, k, v = (t.requires_grad_() for t in qkv(2, 500, 700, 8, 2, 128, seed=5))
    g = torch.randn(2, 500, 8, 128, device=DEV, dtype=torch.bfloat16)
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, op=("fa4F", "fa4B"))
    grads = torch.autograd.grad(out, (q, k, v), g)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    r = fmha_ops.memory_efficient_attention(qf, kf, vf, bias, op="torch_referenceF")
    assert_grads_close(grads, torch.autograd.grad(r, (qf, kf, vf), g.float()))


@needs(FA4BwOp)
def test_fa4_backward_serves_other_forwards_and_is_selected():
    q, k, v = (t.requires_grad_() for t in qkv(2, 4096, 4096, 16, 16, 128, seed=7))
    assert fmha_ops.explain(q, k, v, kind="bw").selected.NAME == "fa4B"
    out = fmha_ops.memory_efficient_attention(q, k, v, op=("triton_attnF", "fa4B"))
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    r_out = fmha_ops.memory_efficient_attention(q, k, v, op=("triton_attnF", "triton_attnB"))
    assert_grads_close(grads, torch.autograd.grad(r_out, (q, k, v), g))


@needs(FA4BwOp)
def test_fp8_training_backward_uses_the_selected_op():
    q, k, v = (t.requires_grad_() for t in qkv(4, 4096, 4096, 16, 4, 128, seed=9))
    out = fmha_ops.fp8_attention(q, k, v, causal=True)
    out.float().square().mean().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    picked = [op.NAME for key, op in fmha_ops.SELECTOR._memo.items() if key[0] == "bw"]
    assert "fa4B" in picked, picked


WINDOW_MASKS = pytest.mark.skipif(not hasattr(ab, "LocalAttentionFromBottomRightMask"),
                                  reason="this fmha_ops has no local-attention masks")


@needs(FA4FwOp)
@WINDOW_MASKS
@pytest.mark.parametrize("mq,mk,make_mask", [
    (1000, 1000, lambda: ab.LowerTriangularFromBottomRightMask().make_local_attention(128)),
    (300, 1000, lambda: ab.LocalAttentionFromBottomRightMask(window_left=64, window_right=17)),
    (1000, 1000, lambda: ab.LocalAttentionFromBottomRightMask(window_left=-1, window_right=5))])
def test_fa4_local_windows_forward_and_backward(mq, mk, make_mask):
    bias = make_mask()
    q, k, v = (t.requires_grad_() for t in qkv(2, mq, mk, 8, 2, 128, seed=13))
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, op=("fa4F", "fa4B"))
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    r = fmha_ops.memory_efficient_attention(qf, kf, vf, bias, op="torch_referenceF")
    assert error_report(out, r)["cos"] > 0.9999
    g = torch.randn_like(out)
    assert_grads_close(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(r, (qf, kf, vf), g.float()))


@needs(FA4FwOp)
@WINDOW_MASKS
def test_fa4_softcap_forward_and_backward():
    bias = ab.LowerTriangularFromBottomRightMask()
    q, k, v = (t.requires_grad_() for t in qkv(2, 700, 700, 8, 4, 128, seed=15))
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, op=("fa4F", "fa4B"), softcap=5.0)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    r = fmha_ops.memory_efficient_attention(qf, kf, vf, bias, op="torch_referenceF", softcap=5.0)
    assert error_report(out, r)["cos"] > 0.9999
    g = torch.randn_like(out)
    assert_grads_close(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(r, (qf, kf, vf), g.float()))


@needs(FA4FwOp)
def test_fa4_forward_captures_in_a_cuda_graph():
    q, k, v = qkv(2, 256, 256, 8, 8, 128, seed=11)
    expect = fmha_ops.memory_efficient_attention(q, k, v, op="fa4F")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fmha_ops.memory_efficient_attention(q, k, v, op="fa4F")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)


# ---- cuDNN fp8 -----------------------------------------------------------------------------------------

@needs(CudnnFp8FwOp)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mq,mk,hkv,bias", [
    (1000, 1000, 4, None), (1000, 1000, 16, ab.LowerTriangularFromBottomRightMask()),
    (17, 1000, 4, ab.LowerTriangularMask()), (2, 333, 1, None)])
def test_cudnn_fp8_matches_reference(d, mq, mk, hkv, bias):
    (q8, k8, v8), kw = per_tensor(*qkv(2, mq, mk, 16, hkv, d, seed=d + mq))
    out = fmha_ops.memory_efficient_attention(q8, k8, v8, bias, op="cudnn_fp8F", **kw)
    assert out.dtype == torch.bfloat16 and out.shape == (2, mq, 16, d)
    rep = error_report(out, ref(q8, k8, v8, bias, **kw))
    assert rep["cos"] > 0.997 and rep["rel"] < 8e-2, rep


@needs(CudnnFp8FwOp)
def test_cudnn_fp8_lse_graph_cache_and_selection():
    (q8, k8, v8), kw = per_tensor(*qkv(2, 1024, 1024, 16, 4, 128, seed=1))
    out, lse = fmha_ops.memory_efficient_attention_partial(q8, k8, v8, op="cudnn_fp8F", **kw)
    _, r_lse = fmha_ops.memory_efficient_attention_partial(q8, k8, v8, op="torch_referenceF", **kw)
    assert torch.allclose(lse, r_lse, atol=5e-2, rtol=1e-2)
    built = len(GRAPHS)
    fmha_ops.memory_efficient_attention(q8, k8, v8, op="cudnn_fp8F", **kw)
    fmha_ops.memory_efficient_attention(q8, k8, v8, op="cudnn_fp8F", **kw)
    assert len(GRAPHS) == built + 1  # one graph for the non-LSE signature, reused by the second call
    head = dict(kw, q_descale=kw["q_descale"].expand(2, 4).contiguous())
    reasons = fmha_ops.explain(q8, k8, v8, op="cudnn_fp8F", **head).verdicts[0].reasons
    assert any("q_descale kind 'head'" in r for r in reasons), reasons


# ---- cuDNN head dims above 128 ------------------------------------------------------------------------

@pytest.mark.parametrize("d", [160, 192, 256])
@pytest.mark.parametrize("mq,mk,hkv,bias", [
    (1000, 1000, 8, None), (333, 333, 2, ab.LowerTriangularMask()), (17, 700, 4, None)])
def test_sdpa_cudnn_large_head_dims_forward_and_backward_match_reference(d, mq, mk, hkv, bias):
    q, k, v = (t.requires_grad_() for t in qkv(2, mq, mk, 8, hkv, d, seed=d + mq))
    report = fmha_ops.explain(q, k, v, bias, op="sdpa_cudnnF")
    if report.selected is None:
        pytest.skip(f"sdpa_cudnnF declines: {report.verdicts[0].why_not()}")
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, op="sdpa_cudnnF")
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    r = fmha_ops.memory_efficient_attention(qf, kf, vf, bias, op="torch_referenceF")
    rep = error_report(out, r)
    assert rep["cos"] > 0.9999 and rep["rel"] < 1e-2, rep
    g = torch.randn_like(out)
    assert_grads_close(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(r, (qf, kf, vf), g.float()))


@needs(CudnnFp8FwOp)
@pytest.mark.parametrize("d", [160, 192])
def test_cudnn_fp8_large_head_dims_match_reference(d):
    (q8, k8, v8), kw = per_tensor(*qkv(2, 1000, 1000, 16, 4, d, seed=d))
    out = fmha_ops.memory_efficient_attention(q8, k8, v8, ab.LowerTriangularMask(), op="cudnn_fp8F", **kw)
    rep = error_report(out, ref(q8, k8, v8, ab.LowerTriangularMask(), **kw))
    assert rep["cos"] > 0.997 and rep["rel"] < 8e-2, rep


@needs(CudnnFp8FwOp)
@pytest.mark.parametrize("bias", [None, ab.LowerTriangularMask()])
def test_cudnn_fp8_output_option_is_the_bf16_output_in_v_units(bias):
    (q8, k8, v8), kw = per_tensor(*qkv(2, 1000, 1000, 16, 4, 128, seed=21))
    o8 = fmha_ops.memory_efficient_attention(q8, k8, v8, bias, op="cudnn_fp8F", output_dtype=torch.float8_e4m3fn,
                                             **kw)
    assert o8.dtype == torch.float8_e4m3fn
    out = fmha_ops.memory_efficient_attention(q8, k8, v8, bias, op="cudnn_fp8F", **kw)
    torch.testing.assert_close(o8.float() * kw["v_descale"], out.float(), rtol=1e-2, atol=1e-2)
    reference = ref(q8, k8, v8, bias, **kw)
    rep = error_report(o8.float() * kw["v_descale"], reference)
    assert rep["cos"] > 0.997, rep
    selected = fmha_ops.memory_efficient_attention(q8, k8, v8, bias, output_dtype=torch.float8_e4m3fn, **kw)
    assert selected.dtype == torch.float8_e4m3fn
    rep = error_report(selected.float() * kw["v_descale"], reference)
    assert rep["cos"] > 0.997, (fmha_ops.explain(q8, k8, v8, bias, output_dtype=torch.float8_e4m3fn, **kw), rep)


@needs(FA4BwOp)
def test_fp8_training_step_with_fa4_backward_captures_in_a_cuda_graph():
    q, k, v = (t.requires_grad_() for t in qkv(4, 1024, 1024, 8, 8, 64, seed=23))
    g = torch.randn(4, 1024, 8, 64, device=DEV, dtype=torch.bfloat16)

    def step():
        out = fmha_ops.fp8_attention(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), g)

    expect = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(grads, expect):  # FA4 accumulates dQ with atomics: equal up to summation order
        assert error_report(got, want)["cos"] > 0.99999
    picked = {op.NAME for key, op in fmha_ops.SELECTOR._memo.items() if key[0] == "bw"}
    assert "fa4B" in picked, picked


QUIET_SCRIPT = """
import torch, fmha_ops
from fmha_ops.quant import quantize_fp8_tensor
q, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for d in (64, 128):  # two FA4 configurations, each compiled (and warning) on its first call
    a, b, c = (t.repeat(1, 1, 1, d // 64) for t in (q, k, v))
    fmha_ops.memory_efficient_attention(a, b, c, fmha_ops.LowerTriangularMask(), op="fa4F")
(q8, qd), (k8, kd), (v8, vd) = (quantize_fp8_tensor(t) for t in (q, k, v))
fmha_ops.memory_efficient_attention(q8, k8, v8, op="cudnn_fp8F", q_descale=qd, k_descale=kd, v_descale=vd)
torch.cuda.synchronize()
print("ran")
"""


@needs(FA4FwOp)
@needs(CudnnFp8FwOp)
def test_a_process_using_fa4_and_cudnn_fp8_prints_nothing_of_theirs():
    """A user's process that compiles FA4 configurations and builds cuDNN fp8 graphs through our API ends with neither
    the CuTe DSL's aux_data UserWarning nor cudnn-frontend's nanobind "leaked" lines on its stderr."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", QUIET_SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-3000:]
    assert "JitArgument" not in done.stderr and "leaked" not in done.stderr, done.stderr[-3000:]
