"""The cuDNN-frontend bf16/fp16 ops (cudnnF, cudnnB): what they declare and why they decline, the band they give
cuDNN for each mask, the graph keys, the graphs' wiring (against a fake ``cudnn`` module that records what the ops
build and bind), and the cost model beside torch's cuDNN path. None of it needs nvidia-cudnn-frontend or a GPU
(without it the ops are unavailable, naming the package: tests/test_ext_ops.py).

``gpu``: forward (out and the sink-inclusive LSE) and backward (dq, dk, dv, dsinks) against a float64 reference at
odd lengths (1, 17, 1000), GQA 8/1, GPT-OSS heads (D64, sinks, causal, a 128-key window) and DeepSeek-V3 heads (K=192,
Kv=128).
"""
import dataclasses
import sys
import types

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.inputs import make_inputs
from fmha_ops.ops import cudnn_sdpa
from fmha_ops.ops.base import AttentionBwOp
from fmha_ops.ops.cudnn_graphs import GraphCache
from fmha_ops.ops.cudnn_sdpa import (Band, CudnnSdpaBwOp, CudnnSdpaFwOp, backward_key, band, call_band,
                                     forward_key)
from fmha_ops.ops.reference import reference_attention
from fmha_ops.ops.sdpa import SdpaCudnnFwOp
from fmha_ops.testing import error_report
from registry import Arch

H200 = Arch("cuda", (9, 0), name="NVIDIA H200")
CAUSAL_BR = ab.LowerTriangularFromBottomRightMask()
GPT_OSS_WINDOW = 128


def inputs(b=1, mq=64, mk=64, hq=8, hkv=1, d=64, dv=None, dtype=torch.bfloat16, bias=None, sinks=False, grad=False,
           device="cpu", seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, mq, hq, d, generator=g)
    k = torch.randn(b, mk, hkv, d, generator=g)
    v = torch.randn(b, mk, hkv, dv or d, generator=g)
    q, k, v = (t.to(device, dtype).requires_grad_(grad) for t in (q, k, v))
    s = (torch.randn(hq, generator=g) * 2.0).to(device).requires_grad_(grad) if sinks else None
    return q, k, v, s


def problem(arch=H200, partial=False, needs_grad=False, **kw):
    q, k, v, s = inputs(**kw)
    inp = make_inputs(q, k, v, kw.get("bias"), sinks=s, is_partial=partial)
    inp.validate()
    return dataclasses.replace(inp.problem(needs_lse=partial), arch=arch, needs_grad=needs_grad)


def reasons(op, p):
    return " | ".join(op.not_supported_reasons(p))


def test_backward_gives_the_sinks_gradient_itself():
    assert CudnnSdpaBwOp.apply_bw_sinks.__func__ is not AttentionBwOp.apply_bw_sinks.__func__
    assert CudnnSdpaFwOp.SINKS and CudnnSdpaBwOp.SINKS and CudnnSdpaFwOp.PARTIAL and CudnnSdpaFwOp.WINDOW


@pytest.mark.parametrize("kw", [
    dict(bias=CAUSAL_BR, sinks=True),  # GPT-OSS full layer
    dict(bias=CAUSAL_BR.make_local_attention(GPT_OSS_WINDOW), sinks=True, mq=17, mk=1000),  # its window layer
    dict(bias=CAUSAL_BR, d=192, dv=128, hq=4, hkv=4),  # DeepSeek-V3
    dict(d=128, dv=64, dtype=torch.float16, hkv=8),
    dict(bias=ab.LowerTriangularMask(), mq=1000, mk=17, sinks=True),  # top-left: every row sees key 0
    dict(bias=ab.LocalAttentionFromBottomRightMask(5, 3), mq=17, mk=33),
    dict(bias=CAUSAL_BR, mq=1, mk=17),
    dict(d=256),
])
def test_declares_sinks_value_head_dims_windows_and_gqa(kw):
    for op in (CudnnSdpaFwOp, CudnnSdpaBwOp):
        assert reasons(op, problem(partial=True, needs_grad=True, **kw)) == "", (op.NAME, kw)


@pytest.mark.parametrize("kw,expect", [
    (dict(d=64, dv=128), "head dims K=64 != Kv=128 not supported; cuDNN takes Kv <= K <= 128, or K=192 with Kv=128"),
    (dict(d=256, dv=128), "head dims K=256 != Kv=128 not supported"),
    (dict(d=192, dv=64), "head dims K=192 != Kv=64 not supported"),
    (dict(d=264), "head dim K=264 not supported"),
    (dict(dtype=torch.float32), "dtypes (q, k, v) float32/float32/float32 not supported"),
    (dict(mq=1, mk=17, sinks=True), "sinks with one query token not supported"),
    (dict(mq=17, mk=5, bias=CAUSAL_BR), "bottom-right causal with Mq=17 > Mk=5 not supported"),
    (dict(mq=17, mk=5, bias=ab.LocalAttentionFromBottomRightMask(3, 0)), "a local window with Mq=17 > Mk=5"),
    (dict(mk=0), "empty problems (B=1, Mq=64, Mk=0) not supported"),
    (dict(b=0), "empty problems (B=0, Mq=64, Mk=64) not supported"),
])
def test_reasons(kw, expect):
    for op in (CudnnSdpaFwOp, CudnnSdpaBwOp):
        assert expect in reasons(op, problem(**kw)), (op.NAME, reasons(op, problem(**kw)))


def test_backward_declined_under_deterministic_algorithms():
    """cuDNN's deterministic backward gave bitwise-different gradients twice running (sinks, window, H100): cudnnB
    leaves deterministic training to the ops that are."""
    p = dataclasses.replace(problem(needs_grad=True), deterministic=True)
    assert "not deterministic" in reasons(CudnnSdpaBwOp, p)
    assert "not deterministic" not in reasons(CudnnSdpaFwOp, p)


def test_declines_varlen_paged_dropout_softcap_and_tensor_biases():
    q, k, v, _ = inputs(mq=64, mk=64)
    cases = [(make_inputs(q, k, v, ab.BlockDiagonalMask.from_seqlens([30, 34])), "attn_bias block_diagonal not supported"),
             (make_inputs(q, k, v, p=0.1), "dropout (p > 0) not supported"),
             (make_inputs(q, k, v, softcap=30.0), "softcap > 0 not supported"),
             (make_inputs(q, k, v, torch.zeros(1, 8, 64, 64)), "attn_bias tensor not supported")]
    for inp, expect in cases:
        p = dataclasses.replace(inp.problem(), arch=H200)
        assert expect in reasons(CudnnSdpaFwOp, p), reasons(CudnnSdpaFwOp, p)


def _band_visible(b: Band, mq: int, mk: int) -> torch.Tensor:
    """(Mq, Mk) bool: cuDNN's band rule (the frontend's test reference), i_al - left < j <= i_al + right."""
    i = torch.arange(mq)[:, None] + (mk - mq if b.alignment == "BOTTOM_RIGHT" else 0)
    j = torch.arange(mk)[None, :]
    visible = torch.ones(mq, mk, dtype=torch.bool)
    if b.right is not None:
        visible &= j <= i + b.right
    if b.left is not None:
        visible &= j > i - b.left
    return visible


@pytest.mark.parametrize("mask", [
    None, ab.LowerTriangularMask(), CAUSAL_BR, CAUSAL_BR.make_local_attention(1), CAUSAL_BR.make_local_attention(4),
    ab.LocalAttentionFromBottomRightMask(3, 0), ab.LocalAttentionFromBottomRightMask(2, 5),
    ab.LocalAttentionFromBottomRightMask(-1, 2), ab.LocalAttentionFromBottomRightMask(4, -1),
    ab.LocalAttentionFromBottomRightMask(0, 0)])
@pytest.mark.parametrize("mq,mk", [(7, 7), (3, 11), (1, 9)])
def test_band_shows_cudnn_exactly_the_keys_our_mask_allows(mask, mq, mk):
    q, k, v, _ = inputs(mq=mq, mk=mk, hq=1, d=8)
    b = call_band(make_inputs(q, k, v, mask))
    want = torch.ones(mq, mk, dtype=torch.bool) if mask is None else mask.materialize((mq, mk)) == 0
    assert torch.equal(_band_visible(b, mq, mk), want), (b, mask)


def test_band_keywords():
    fake = types.SimpleNamespace(diagonal_alignment=types.SimpleNamespace(TOP_LEFT="tl", BOTTOM_RIGHT="br"))
    assert band(ab.NONE, 64, 64, -1, -1).kwargs(fake) == {}
    assert band(ab.CAUSAL, 16, 64, -1, 7).kwargs(fake) == dict(diagonal_alignment="tl", diagonal_band_right_bound=0)
    assert band(ab.CAUSAL_BR, 16, 64, 127, -1).kwargs(fake) == dict(
        diagonal_alignment="br", diagonal_band_right_bound=0, diagonal_band_left_bound=128)
    assert band(ab.NONE, 16, 64, 3, -1) == Band("BOTTOM_RIGHT", 4, 64)


@pytest.mark.parametrize("kind,window", [(ab.CAUSAL_BR, -1), (ab.CAUSAL_BR, 127), (ab.NONE, 3)])
def test_band_at_equal_lengths_is_top_left_as_torch_cudnn_path(kind, window):
    """At Mq == Mk bottom-right and top-left bands show the same keys; cuDNN gets TOP_LEFT, the alignment of torch's
    cuDNN path, whose backward skips the hidden tiles (under BOTTOM_RIGHT the backward is rated at the square)."""
    assert band(kind, 64, 64, window, -1).alignment == "TOP_LEFT"
    assert band(kind, 63, 64, window, -1).alignment == "BOTTOM_RIGHT"


def test_graph_keys_separate_what_a_graph_depends_on():
    q, k, v, s = inputs(mq=32, mk=32, hq=4, hkv=2, d=16, sinks=True)
    base = make_inputs(q, k, v, CAUSAL_BR, sinks=s)
    assert forward_key(base, True) == forward_key(make_inputs(q.clone(), k, v, CAUSAL_BR, sinks=s.clone()), True)
    others = [make_inputs(q, k, v, CAUSAL_BR),
              make_inputs(q, k, v, CAUSAL_BR.make_local_attention(8), sinks=s),
              make_inputs(q[:, :16], k, v, CAUSAL_BR, sinks=s),
              make_inputs(q, k, v, CAUSAL_BR, sinks=s, scale=0.5),
              make_inputs(q.half(), k.half(), v.half(), CAUSAL_BR, sinks=s),
              make_inputs(torch.cat([q, q], 2)[:, :, :4], k, v, CAUSAL_BR, sinks=s),
              make_inputs(q, k, v[..., :8], CAUSAL_BR, sinks=s)]
    keys = {forward_key(base, True), forward_key(base, False)} | {forward_key(i, True) for i in others}
    assert len(keys) == len(others) + 2
    assert backward_key(base) == forward_key(base, True)
    # at Mq == Mk bottom-right causal is top-left causal: one graph
    assert forward_key(base, True) == forward_key(make_inputs(q, k, v, ab.LowerTriangularMask(), sinks=s), True)


# ---- the graphs' wiring, against a fake frontend ------------------------------------------------------------------

class _FakeTensor:
    def __init__(self, name, dim=None, stride=None):
        self.name, self.dim, self.stride, self.output = name, dim, stride, False

    def set_output(self, flag):
        self.output = flag
        return self

    def set_dim(self, dim):
        self.dim = dim
        return self

    def set_stride(self, stride):
        self.stride = stride
        return self

    def set_data_type(self, data_type):
        return self


class _FakeGraph:
    """Records the tensors and the sdpa / sdpa_backward keywords; ``execute`` fills the bound outputs with 1s."""

    def __init__(self, log, **kw):
        self.log = log

    def tensor(self, name, dim, stride, data_type):
        return _FakeTensor(name, dim, stride)

    def sdpa(self, **kw):
        self.log["sdpa"] = kw
        return _FakeTensor("o"), _FakeTensor("stats")

    def sdpa_backward(self, **kw):
        self.log["sdpa_backward"] = kw
        return _FakeTensor("dq"), _FakeTensor("dk"), _FakeTensor("dv")

    def validate(self):
        pass

    build_operation_graph = check_support = build_plans = validate

    def create_execution_plans(self, modes):
        pass

    def get_workspace_size(self):
        return 0

    def execute(self, pack, workspace, handle):
        self.log["pack"] = {t.name: value for t, value in pack.items()}
        for t, value in pack.items():
            if t.output or t.name == "dsink":
                value.fill_(1.0)


@pytest.fixture
def fake_cudnn(monkeypatch):
    import contextlib

    from fmha_ops.ops import cudnn_graphs

    log = {}

    class NotSupported(Exception):
        pass

    fake = types.SimpleNamespace(
        pygraph=lambda **kw: _FakeGraph(log, **kw), create_handle=lambda: "handle", destroy_handle=lambda h: None,
        data_type=types.SimpleNamespace(BFLOAT16="bf16", HALF="f16", FLOAT="f32"),
        diagonal_alignment=types.SimpleNamespace(TOP_LEFT="tl", BOTTOM_RIGHT="br"),
        heur_mode=types.SimpleNamespace(A="a", FALLBACK="fallback"), cudnnGraphNotSupportedError=NotSupported,
        set_stream=lambda handle, stream: None)
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(cudnn_graphs.atexit, "register", lambda fn: None)
    monkeypatch.setattr(cudnn_graphs.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cudnn_graphs.torch.cuda, "current_stream",
                        lambda device: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(cudnn_sdpa, "FORWARD_GRAPHS", GraphCache("test", forward_key, cudnn_sdpa.ForwardGraph))
    monkeypatch.setattr(cudnn_sdpa, "BACKWARD_GRAPHS", GraphCache("test", backward_key, cudnn_sdpa.BackwardGraph))
    return log


def test_forward_graph_binds_sinks_band_and_lse(fake_cudnn):
    q, k, v, s = inputs(b=2, mq=17, mk=40, hq=4, hkv=2, d=24, dv=16, sinks=True)
    inp = make_inputs(q, k, v, CAUSAL_BR.make_local_attention(8), sinks=s, scale=0.3)
    out, lse = CudnnSdpaFwOp.apply(inp, True)
    kw = fake_cudnn["sdpa"]
    assert kw["attn_scale"] == 0.3 and kw["generate_stats"] is True and kw["sink_token"].dim == [1, 4, 1, 1]
    assert (kw["diagonal_alignment"], kw["diagonal_band_left_bound"], kw["diagonal_band_right_bound"]) == ("br", 8, 0)
    assert kw["q"].dim == [2, 4, 17, 24] and kw["v"].dim == [2, 2, 40, 16]
    pack = fake_cudnn["pack"]
    assert set(pack) == {"q", "k", "v", "sink", "o", "stats"} and torch.equal(pack["sink"], s)
    assert out.shape == (2, 17, 4, 16) and out.dtype == torch.bfloat16 and lse.shape == (2, 4, 17)
    assert bool((out == 1).all()) and bool((lse == 1).all())
    q2, s2 = q.clone(), s.clone()
    CudnnSdpaFwOp.launcher(inp, True)(q2, k, v, inp.attn_bias, None, None, None, s2)  # the same graph, new tensors
    assert fake_cudnn["pack"]["q"] is q2 and torch.equal(fake_cudnn["pack"]["sink"], s2)
    assert len(cudnn_sdpa.FORWARD_GRAPHS) == 1
    out32, none = CudnnSdpaFwOp.apply(make_inputs(q, k, v, output_dtype=torch.float32), False)
    assert none is None and out32.dtype == torch.float32 and "sink_token" not in fake_cudnn["sdpa"]
    assert "diagonal_alignment" not in fake_cudnn["sdpa"] and len(cudnn_sdpa.FORWARD_GRAPHS) == 2


def test_backward_graph_returns_dsink_token_as_the_sinks_gradient(fake_cudnn):
    q, k, v, s = inputs(b=2, mq=17, mk=17, hq=4, hkv=1, d=192, dv=128, sinks=True)
    inp = make_inputs(q, k, v, CAUSAL_BR, sinks=s)
    out = torch.randn(2, 17, 4, 128).to(torch.bfloat16)
    grad = torch.randn(2, 17, 4, 128).transpose(1, 2).contiguous().transpose(1, 2)  # float32, not contiguous
    lse = torch.randn(2, 17, 4).transpose(1, 2)  # (B, Hq, Mq), not contiguous
    dq, dk, dv, dsinks = CudnnSdpaBwOp.apply_bw_sinks(inp, out, lse, grad)
    kw, pack = fake_cudnn["sdpa_backward"], fake_cudnn["pack"]
    assert kw["dSink_token"].dim == [1, 4, 1, 1] and "use_deterministic_algorithm" not in kw
    assert kw["diagonal_band_right_bound"] == 0 and "diagonal_band_left_bound" not in kw
    assert pack["dO"].dtype == torch.bfloat16 and pack["dO"].is_contiguous() and pack["stats"].is_contiguous()
    assert torch.equal(pack["stats"], lse) and torch.equal(pack["sink"], s)
    assert (dq.shape, dk.shape, dv.shape, dsinks.shape) == (q.shape, k.shape, v.shape, (4,))
    assert dq.dtype == torch.bfloat16 and dsinks.dtype == torch.float32 and bool((dsinks == 1).all())
    assert len(CudnnSdpaBwOp.apply_bw(inp, out, lse, grad)) == 3


def test_a_graph_cudnn_cannot_plan_raises_not_implemented(fake_cudnn, monkeypatch):
    def refuse(self):
        raise sys.modules["cudnn"].cudnnGraphNotSupportedError("no engine\nmore")
    monkeypatch.setattr(_FakeGraph, "check_support", refuse)
    q, k, v, _ = inputs(mq=17, mk=17, hq=2, hkv=2, d=16)
    with pytest.raises(NotImplementedError, match="cuDNN has no test plan for q .*: no engine$"):
        CudnnSdpaFwOp.apply(make_inputs(q, k, v), False)


# ---- cost model ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128, 256])
def test_plain_calls_stay_with_torch_cudnn_path(d, monkeypatch):
    """Where torch's SDPA cuDNN path runs the call, these ops estimate no less device time and rank below it on a
    tie, and their host time is larger: they are chosen only where they add a capability (sinks, Kv != K,
    windows)."""
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)  # the GPU machines' cuDNN
    p = problem(b=4, mq=4096, mk=4096, hq=16, hkv=16, d=d, bias=ab.LowerTriangularMask(), needs_grad=True)
    assert SdpaCudnnFwOp.not_supported_reasons(p) == []
    assert CudnnSdpaFwOp.estimate(p) >= SdpaCudnnFwOp.estimate(p)
    assert CudnnSdpaBwOp.estimate(p) >= SdpaCudnnFwOp.backward_estimate(p) * 0.999
    assert CudnnSdpaFwOp.PRIORITY < SdpaCudnnFwOp.PRIORITY and CudnnSdpaFwOp.HOST_US > SdpaCudnnFwOp.HOST_US


def test_backward_beats_the_triton_backward_model_at_gpt_oss_heads():
    p = problem(b=1, mq=8192, mk=8192, hq=64, hkv=8, d=64, bias=CAUSAL_BR, sinks=True, needs_grad=True)
    assert CudnnSdpaBwOp.estimate(p) < fmha_ops.get_op("triton_attnB").estimate(p)


H100 = Arch("cuda", (9, 0), name="NVIDIA H100 80GB HBM3")


#: GPT-OSS training calls (1x8192, 64 / 8 heads of D64, causal at Mq == Mk, H100, forward + backward, ms;
#: bench/diagnostics/cudnn_band_cost.py): (window, sinks) -> (cudnnF + cudnnB, the Triton pair)
GPT_OSS_TRAINING_MS = {(None, False): (4.57, 6.07), (None, True): (5.36, 6.16), (128, False): (0.72, 0.74),
                       (128, True): (1.53, 0.79)}


@pytest.mark.parametrize("arch", [H100, H200])
@pytest.mark.parametrize("window, sinks", list(GPT_OSS_TRAINING_MS))
def test_gpt_oss_training_ranks_cudnn_and_the_triton_pair_as_measured(arch, window, sinks):
    """cuDNN's pair (TOP_LEFT band at Mq == Mk: it skips the causal and the window's tiles; sinks add a pass of
    their own) against the Triton pair, ranked as the H100 measured them (``GPT_OSS_TRAINING_MS``), each model
    within 2x of its measurement."""
    bias = CAUSAL_BR if window is None else CAUSAL_BR.make_local_attention(window)
    p = problem(arch=arch, b=1, mq=8192, mk=8192, hq=64, hkv=8, d=64, bias=bias, sinks=sinks, needs_grad=True)
    triton = fmha_ops.get_op("triton_attnF").estimate(p) + fmha_ops.get_op("triton_attnB").estimate(p)
    cudnn = CudnnSdpaFwOp.estimate(p) + CudnnSdpaBwOp.estimate(p)
    measured_cudnn, measured_triton = GPT_OSS_TRAINING_MS[window, sinks]
    assert (cudnn < triton) == (measured_cudnn < measured_triton), (cudnn, triton)
    if arch is H100:
        for model, measured in ((cudnn, measured_cudnn), (triton, measured_triton)):
            assert 0.5 < model * 1e3 / measured < 2.0, (model, measured)


def test_backward_under_a_bottom_right_band_is_rated_at_the_square():
    """Bottom-right causal with Mq < Mk reaches cuDNN as a BOTTOM_RIGHT band, under which its backward was measured
    at ~2x torch's top-left path (8.52 against 4.73 ms forward + backward, H100): rated at the unmasked work. The
    same lengths top-left causal (and bottom-right at Mq == Mk, passed as TOP_LEFT) keep the causal half."""
    kw = dict(b=1, mq=6144, mk=8192, hq=64, hkv=8, d=64, needs_grad=True)
    br, tl = problem(bias=CAUSAL_BR, **kw), problem(bias=ab.LowerTriangularMask(), **kw)
    assert CudnnSdpaBwOp.estimate(br) > 1.8 * CudnnSdpaBwOp.estimate(tl)
    square = problem(bias=CAUSAL_BR, **{**kw, "mq": 8192})
    assert CudnnSdpaBwOp.estimate(square) == CudnnSdpaBwOp.estimate(dataclasses.replace(square, bias=ab.CAUSAL))


# ---- GPU: against the float64 reference ---------------------------------------------------------------------------

def reference(q, k, v, mask, sinks):
    """(out, lse) of ``reference_attention`` in float64 on float32 copies of the inputs (leaves of their own where
    the inputs require grad, so autograd through it gives the reference gradients): (out, lse, leaves)."""
    leaves = [None if t is None else t.detach().float().requires_grad_(t.requires_grad) for t in (q, k, v, sinks)]
    out, lse = reference_attention(make_inputs(*leaves[:3], mask, sinks=leaves[3]), torch.float64)
    return out, lse, leaves


GPU_CASES = {  # name: (B, Mq, Mk, Hq, Hkv, K, Kv, mask, sinks)
    "gpt_oss_full_17": (2, 17, 17, 8, 1, 64, 64, CAUSAL_BR, True),
    "gpt_oss_window_1000": (1, 1000, 1000, 8, 1, 64, 64, CAUSAL_BR.make_local_attention(GPT_OSS_WINDOW), True),
    "gpt_oss_window_17_of_1000": (2, 17, 1000, 8, 1, 64, 64, CAUSAL_BR.make_local_attention(GPT_OSS_WINDOW), True),
    "top_left_1000_of_17": (1, 1000, 17, 8, 1, 64, 64, ab.LowerTriangularMask(), True),
    "one_token": (2, 1, 1000, 8, 1, 64, 64, CAUSAL_BR, False),
    "deepseek_1000": (1, 1000, 1000, 8, 8, 192, 128, CAUSAL_BR, False),
    "deepseek_17_sinks": (2, 17, 17, 8, 1, 192, 128, None, True),
    "band_17_of_33": (1, 17, 33, 8, 8, 128, 64, ab.LocalAttentionFromBottomRightMask(5, 3), True),
    "left_window_only_1000": (1, 1000, 1000, 8, 2, 64, 64, ab.LocalAttentionFromBottomRightMask(64, -1), False),
}
#: bf16 against float64: out and grads within these (relative Frobenius error, cosine)
OUT_REL, GRAD_REL, DSINKS_REL, MIN_COS = 1e-2, 2e-2, 3e-2, 0.9995


def _gpu_inputs(case, grad):
    b, mq, mk, hq, hkv, d, dv, mask, sinks = GPU_CASES[case]
    q, k, v, s = inputs(b=b, mq=mq, mk=mk, hq=hq, hkv=hkv, d=d, dv=dv, sinks=sinks, grad=grad, device="cuda",
                        seed=len(case))
    return q, k, v, s, mask


def _needs_ops():
    why = CudnnSdpaFwOp.available()
    return pytest.mark.skipif(why is not None, reason=f"cudnnF: {why}")


@pytest.mark.gpu
@_needs_ops()
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_forward_and_lse_match_reference(case):
    q, k, v, s, mask = _gpu_inputs(case, grad=False)
    inp = make_inputs(q, k, v, mask, sinks=s, is_partial=True)
    inp.validate()
    assert CudnnSdpaFwOp.not_supported_reasons(inp.problem(needs_lse=True)) == []
    out, lse = CudnnSdpaFwOp.apply(inp, True)
    want, want_lse, _ = reference(q, k, v, mask, s)
    rep = error_report(out, want)
    assert rep["rel"] < OUT_REL and rep["cos"] > MIN_COS, rep
    assert (lse.double() - want_lse).abs().max().item() < 1e-2


@pytest.mark.gpu
@_needs_ops()
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("forward", ["cudnnF", "triton_attnF"])
def test_backward_matches_reference(case, forward):
    """dq, dk, dv and dsinks of (forward, cudnnB) through memory_efficient_attention against float64 autograd;
    with triton_attnF the LSE (the sink included) comes from another op."""
    q, k, v, s, mask = _gpu_inputs(case, grad=True)
    out = fmha_ops.memory_efficient_attention(q, k, v, mask, op=(forward, "cudnnB"), sinks=s)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [t for t in (q, k, v, s) if t is not None], grad)
    want_out, _, leaves = reference(q, k, v, mask, s)
    want = torch.autograd.grad(want_out, [t for t in leaves if t is not None], grad.double())
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        rep = error_report(g, w)
        assert rep["rel"] < (DSINKS_REL if name == "dsinks" else GRAD_REL) and rep["cos"] > MIN_COS, (name, rep)


@pytest.mark.gpu
@_needs_ops()
def test_selector_takes_cudnn_backward_for_value_dim_but_not_plain_calls():
    """K=192 / Kv=128 with sinks takes cudnnB; a plain call stays off cudnnF (torch's cuDNN path or a faster op runs
    it)."""
    q, k, v, s, mask = _gpu_inputs("deepseek_1000", grad=True)
    assert fmha_ops.explain(q, k, v, mask, sinks=s, kind="bw").selected.NAME == "cudnnB"
    q, k, v, _ = inputs(b=4, mq=4096, mk=4096, hq=16, hkv=16, d=128, device="cuda")
    assert fmha_ops.explain(q, k, v, ab.LowerTriangularMask()).selected.NAME != "cudnnF"
