"""FA4 and cuDNN fp8 ops on a CPU machine: availability messages, declarations and reasons per architecture,
the window mapping, the graph cache key, the dequantization kernel (interpreter) and the tune options.

Nothing here needs flash-attn-4 or nvidia-cudnn-frontend; the problems are built from real inputs and
re-targeted to an sm90 / sm100 arch, so the same ``not_supported_reasons`` the selector reads are checked."""
import contextlib
import dataclasses
import json

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.inputs import make_inputs
from fmha_ops.ops.cudnn_fp8 import CudnnFp8FwOp, graph_key
from fmha_ops.ops.cudnn_graphs import cudnn_package_reason
from fmha_ops.ops.fa4 import FA4BwOp, FA4FwOp, fa4_package_reason, window_size
from fmha_ops.quant import quantize_fp8_tensor
from fmha_ops.tune import prefill_call, tune
from registry import Arch

H200 = Arch("cuda", (9, 0), name="NVIDIA H200")
B200 = Arch("cuda", (10, 0), name="NVIDIA B200")
F8 = torch.float8_e4m3fn


def problem(arch, b=2, mq=64, mk=64, hq=4, hkv=2, d=64, dv=None, dtype=torch.bfloat16, bias=None, descale="tensor",
            p=0.0, partial=False):
    q = torch.randn(b, mq, hq, d).to(dtype)
    k = torch.randn(b, mk, hkv, d).to(dtype)
    v = torch.randn(b, mk, hkv, dv or d).to(dtype)
    kw = {}
    if dtype == F8:
        shape = {"tensor": (1,), "head": (b, hkv)}[descale]
        kw = dict(q_descale=torch.ones(shape), k_descale=torch.ones(shape), v_descale=torch.ones(shape))
    inp = make_inputs(q, k, v, bias, p=p, is_partial=partial, **kw)
    inp.validate()
    return dataclasses.replace(inp.problem(needs_lse=partial), arch=arch)


def reasons(op, p):
    return " | ".join(op.not_supported_reasons(p))


@pytest.mark.skipif(fa4_package_reason() is None, reason="flash-attn-4 is installed here")
def test_fa4_unavailable_names_the_package_and_the_extra():
    for op in (FA4FwOp, FA4BwOp):
        why = op.available()
        assert "flash-attn-4" in why and "fmha-ops[fa4]" in why, why
    q = torch.randn(1, 8, 2, 16)
    verdict = next(v for v in fmha_ops.explain(q, q, q).verdicts if v.op is FA4FwOp)
    assert not verdict.ok and "flash-attn-4" in verdict.why_not()


@pytest.mark.skipif(cudnn_package_reason() is None, reason="nvidia-cudnn-frontend is installed here")
@pytest.mark.parametrize("name", ["cudnn_fp8F", "cudnnF", "cudnnB"])
def test_cudnn_ops_unavailable_name_the_package_and_the_extra(name):
    why = fmha_ops.get_op(name).available()
    assert "nvidia-cudnn-frontend" in why and "fmha-ops[cudnn]" in why, why


def test_fa4_declares_sm90_bf16_gqa_varlen_bottom_right_and_lse():
    assert reasons(FA4FwOp, problem(H200, d=128, hkv=1)) == ""
    assert reasons(FA4FwOp, problem(H200, d=256, mq=17, mk=1000, bias=ab.LowerTriangularFromBottomRightMask())) == ""
    assert reasons(FA4FwOp, problem(H200, d=96, dtype=torch.float16, partial=True)) == ""
    mask = ab.BlockDiagonalMask.from_seqlens([3, 50, 1], [7, 50, 9])
    assert reasons(FA4FwOp, problem(H200, b=1, mq=54, mk=66, bias=mask.make_causal_from_bottomright())) == ""
    assert reasons(FA4BwOp, problem(H200, b=1, mq=54, mk=66, bias=mask)) == ""
    assert FA4FwOp.AUTOGRAD and FA4FwOp.PARTIAL and FA4FwOp.GQA and FA4FwOp.WINDOW


@pytest.mark.parametrize("kwargs,expect", [
    (dict(dtype=F8), "fp8 inputs run on FA4's sm100 path only"),
    (dict(d=264), "head dim K=264 not supported"),
    (dict(d=60), "head dim K=60 not supported"),
    (dict(dv=32), "value head dim Kv=32 must equal K=64"),
    (dict(mq=17, mk=64, bias=ab.LowerTriangularMask()), "top-left causal with Mq=17 != Mk=64"),
    (dict(p=0.1), "dropout"),
    (dict(dtype=torch.float32), "dtypes (q, k, v) float32/float32/float32 not supported"),
])
def test_fa4_sm90_reasons(kwargs, expect):
    assert expect in reasons(FA4FwOp, problem(H200, **kwargs))


def test_fa4_top_left_varlen_causal_is_declined_with_the_alternative_named():
    mask = ab.BlockDiagonalCausalMask.from_seqlens([3, 50], [3, 50])
    assert "attn_bias block_diagonal_causal not supported" in reasons(FA4FwOp, problem(H200, b=1, mq=53, mk=53,
                                                                                         bias=mask))


def test_fa4_sm100_head_dims_and_fp8():
    assert reasons(FA4FwOp, problem(B200, dtype=F8, d=128, descale="head")) == ""
    assert reasons(FA4FwOp, problem(B200, dtype=F8, d=128, descale="tensor")) == ""
    assert reasons(FA4FwOp, problem(B200, d=256)) == ""
    assert "head dim K=192 not supported on sm100" in reasons(FA4FwOp, problem(B200, d=192))
    assert "fp8 with head dim K=256" in reasons(FA4FwOp, problem(B200, dtype=F8, d=256))


@pytest.mark.parametrize("kind,left,right,expect", [
    (ab.NONE, -1, -1, (False, (None, None))),
    (ab.NONE, 64, 0, (False, (64, 0))),
    (ab.NONE, -1, 5, (False, (None, 5))),
    (ab.CAUSAL_BR, -1, -1, (True, (None, None))),
    (ab.CAUSAL_BR, 128, -1, (True, (128, None))),
    (ab.CAUSAL, 128, 7, (True, (128, None))),  # a causal kind's right bound is 0 whatever the window says
    (ab.BLOCK_DIAGONAL_CAUSAL_BR, 3, -1, (True, (3, None))),
])
def test_fa4_window_mapping(kind, left, right, expect):
    assert window_size(kind, left, right) == expect


def test_cudnn_fp8_declares_per_tensor_fp8_with_gqa_and_lse():
    assert reasons(CudnnFp8FwOp, problem(H200, dtype=F8, d=128, hkv=1, partial=True)) == ""
    assert reasons(CudnnFp8FwOp, problem(H200, dtype=F8, d=256, bias=ab.LowerTriangularMask(), mq=17, mk=100)) == ""
    assert reasons(CudnnFp8FwOp, problem(H200, dtype=F8, bias=ab.LowerTriangularFromBottomRightMask())) == ""


@pytest.mark.parametrize("arch,kwargs,expect", [
    (H200, dict(dtype=F8, descale="head"), "q_descale kind 'head' not supported; supported: tensor"),
    (H200, dict(dtype=F8, mq=17, bias=ab.LowerTriangularFromBottomRightMask()),
     "bottom-right causal with Mq=17 != Mk=64 not supported on Hopper"),
    (H200, dict(dtype=F8, d=24), "head dim K=24 not supported"),
    (H200, dict(dtype=F8, dv=32), "value head dim Kv=32 must equal K=64"),
    (H200, dict(dtype=torch.bfloat16), "dtypes (q, k, v) bfloat16/bfloat16/bfloat16 not supported"),
    (B200, dict(dtype=F8, d=256), "head dim K=256 not supported on Blackwell"),
    (H200, dict(dtype=F8, mq=1), "query length 1 < 2 not supported"),
])
def test_cudnn_fp8_reasons(arch, kwargs, expect):
    assert expect in reasons(CudnnFp8FwOp, problem(arch, **kwargs))


def test_cudnn_fp8_declines_varlen_and_bottom_right_is_fine_on_blackwell():
    mask = ab.BlockDiagonalMask.from_seqlens([30, 34])
    assert "attn_bias block_diagonal not supported" in reasons(CudnnFp8FwOp, problem(H200, b=1, mq=64, dtype=F8,
                                                                                       bias=mask))
    assert reasons(CudnnFp8FwOp, problem(B200, dtype=F8, mq=17, bias=ab.LowerTriangularFromBottomRightMask())) == ""


def test_cudnn_graph_key_separates_what_a_graph_depends_on():
    q = torch.randn(1, 32, 2, 16).to(F8)
    one = torch.ones(1)

    def key(bias=None, scale=None, lse=False, k=q):
        inp = make_inputs(q, k, k, bias, scale=scale, q_descale=one, k_descale=one, v_descale=one)
        return graph_key(inp, lse)

    base = key()
    assert base == key()
    assert len({base, key(ab.LowerTriangularMask()), key(scale=0.5), key(lse=True), key(k=q[:, :17])}) == 5
    assert key(ab.LowerTriangularMask()) == key(ab.LowerTriangularFromBottomRightMask())  # Mq == Mk: one mask


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_dequantize_kernel_matches_torch(out_dtype):
    from fmha_ops.kernels.triton.dequantize import dequantize

    x = (torch.randn(3, 17, 5, 24) * 40).to(F8)
    scale = torch.tensor([0.37])
    out = dequantize(x, scale, out_dtype)
    assert out.dtype == out_dtype and out.shape == x.shape
    torch.testing.assert_close(out, (x.float() * 0.37).to(out_dtype), rtol=1e-3, atol=0)
    assert dequantize(x[:0], scale, out_dtype).shape == (0, 17, 5, 24)


def test_quantize_fp8_tensor_round_trips_and_is_the_tensor_kind():
    x = torch.randn(2, 33, 3, 16) * 5
    xq, descale = quantize_fp8_tensor(x)
    assert xq.dtype == F8 and xq.shape == x.shape and descale.shape == (1,)
    assert (xq.float() * descale).sub(x).abs().max() <= x.abs().max() * 2 ** -4
    call = prefill_call(1, 64, 4, 2, 32, False, "fp8_tensor", "cpu")
    assert call.problem().descales == ("tensor",) * 3


def test_tune_measures_only_named_ops_and_merges_into_a_table(tmp_path):
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"device": "cpu", "versions": {}, "timings": {"kept_op": {"b": 1.0}},
                                "calibration": {"kept_op": 2.0}}))
    out = tmp_path / "cpu.json"
    tune(str(out), quick=True, device="cpu", ops=frozenset({"torch_referenceF"}), merge=str(base))
    data = json.loads(out.read_text())
    assert set(data["timings"]) == {"kept_op", "torch_referenceF"}
    assert data["calibration"]["kept_op"] == 2.0 and "torch_referenceF" in data["calibration"]


@pytest.mark.skipif("softcap" not in {f.name for f in dataclasses.fields(fmha_ops.Problem)},
                    reason="this fmha_ops has no Problem.softcap")
def test_fa4_declares_softcap_except_the_sm100_backward_at_head_dim_256():
    p = dataclasses.replace(problem(H200, d=256), softcap=True)
    assert FA4FwOp.SOFTCAP and reasons(FA4BwOp, p) == ""
    blackwell = dataclasses.replace(p, arch=B200)
    assert "softcap with head dim 256" in reasons(FA4BwOp, blackwell)
    assert "softcap" in reasons(CudnnFp8FwOp, dataclasses.replace(problem(H200, dtype=F8), softcap=True))


@pytest.mark.parametrize("version,arch,d,expect", [
    (91900, H200, 256, ""), (91900, H200, 192, ""), (91200, H200, 256, "takes head dims <= 128"),
    (91900, B200, 256, "takes head dims <= 128"), (92300, B200, 256, ""), (91900, H200, 264, "head dim K=264")])
def test_sdpa_cudnn_head_dims_above_128_follow_the_cudnn_version_and_arch(monkeypatch, version, arch, d, expect):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: version)
    got = reasons(fmha_ops.get_op("sdpa_cudnnF"), problem(arch, d=d))
    assert (expect in got) if expect else got == "", got


def test_extras_install_what_the_ops_check_for():
    tomllib = pytest.importorskip("tomllib")
    import os
    import re

    from fmha_ops.ops.cudnn_graphs import MIN_FRONTEND
    from fmha_ops.ops.fa4 import FA4_VERSION

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for name in ("fa4", "fa4-cu12"):
        (req,) = [r for r in extras[name] if r.startswith("flash-attn-4")]
        assert req.endswith(f"=={FA4_VERSION}"), req
    assert extras["fa4"][0].startswith("flash-attn-4[cu13]")  # the CuTe DSL runtime of CUDA 13 torch builds
    (req,) = [r for r in extras["cudnn"] if r.startswith("nvidia-cudnn-frontend")]
    assert tuple(int(x) for x in re.search(r">=(\d+)\.(\d+)", req).groups()) == MIN_FRONTEND
    assert fa4_package_reason() is None or "fmha-ops[fa4]" in fa4_package_reason()
    assert cudnn_package_reason() is None or "fmha-ops[cudnn]" in cudnn_package_reason()


def test_fp8_output_is_in_the_values_units_and_declared_by_the_ops_that_write_it():
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8_tensor(torch.randn(2, 40, 4, 32) * s) for s in (1.0, 2.0, 3.0))
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    o8 = fmha_ops.memory_efficient_attention(q8, k8, v8, ab.LowerTriangularMask(), output_dtype=F8, **kw)
    want = fmha_ops.memory_efficient_attention(q8, k8, v8, ab.LowerTriangularMask(), output_dtype=torch.float32, **kw)
    assert o8.dtype == F8 and o8.shape == want.shape
    err = (o8.float() * vd - want).abs()
    assert float(err.max()) <= float(want.abs().max()) * 2 ** -3  # one fp8 rounding of |o| <= max|v|
    assert reasons(CudnnFp8FwOp, problem(H200, dtype=F8, partial=True)) == ""
    q = torch.randn(2, 64, 4, 64).to(F8)
    one = torch.ones(1)
    inp = make_inputs(q, q, q, None, q_descale=one, k_descale=one, v_descale=one, output_dtype=F8)
    inp.validate()
    p8 = dataclasses.replace(inp.problem(), arch=H200)
    assert reasons(CudnnFp8FwOp, p8) == ""
    assert "output dtype float8_e4m3fn not supported" in reasons(fmha_ops.get_op("triton_fp8F"), p8)


def test_fp8_output_needs_fp8_values():
    x = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="output_dtype=float8_e4m3fn needs an fp8 e4m3fn value"):
        fmha_ops.memory_efficient_attention(x, x, x, output_dtype=F8)
    with pytest.raises(ValueError, match="output_dtype=int8 not supported"):
        fmha_ops.memory_efficient_attention(x, x, x, output_dtype=torch.int8)


@pytest.fixture
def fake_fa4(monkeypatch):
    """``flash_attn.cute`` stand-ins whose calls warn as FA4 4.0.0b36's compile does (and once more, otherwise)."""
    import sys
    import types
    import warnings

    compile_msg = "Argument aux_data (position 17) cannot be converted to a JitArgument of type AuxData; runs as is"

    def call(q, *args, **kwargs):
        warnings.warn(compile_msg, UserWarning)
        warnings.warn("another FA4 warning", UserWarning)
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def bwd(q, k, v, *args, **kwargs):
        warnings.warn(compile_msg, UserWarning)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    cute = types.ModuleType("flash_attn.cute")
    interface = types.ModuleType("flash_attn.cute.interface")
    cute.flash_attn_func = cute.flash_attn_varlen_func = interface._flash_attn_fwd = call
    interface._flash_attn_bwd = bwd
    cute.interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    return call


def test_fa4_compile_warning_is_silenced_for_our_calls_only(fake_fa4):
    """The CuTe DSL compile warning is filtered inside our FA4 calls (forward, backward), not for FA4 called directly,
    and no filter is left behind; FA4's other warnings pass."""
    import warnings

    q = torch.randn(1, 8, 2, 16).to(torch.bfloat16)
    inp = make_inputs(q, q, q, None)
    inp.validate()
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        FA4FwOp.apply(inp, True)
        FA4BwOp.apply_bw(inp, q, torch.zeros(1, 2, 8), q)
    assert [str(w.message) for w in seen] == ["another FA4 warning"]
    assert warnings.filters == before
    with warnings.catch_warnings(record=True) as direct:
        warnings.simplefilter("always")
        fake_fa4(q)
    assert "cannot be converted to a JitArgument" in str(direct[0].message)


def test_cudnn_graphs_and_handles_are_released_at_exit(monkeypatch):
    """The graph cache registers its release with atexit on its first handle, and release drops every graph and
    destroys every handle (graphs alive at interpreter exit make cudnn-frontend's nanobind print "leaked" lines)."""
    import sys
    import types

    from fmha_ops.ops import cudnn_graphs

    destroyed, registered = [], []
    fake = types.SimpleNamespace(create_handle=lambda: "handle", destroy_handle=destroyed.append)
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(cudnn_graphs.atexit, "register", registered.append)
    monkeypatch.setattr(cudnn_graphs.torch.cuda, "device", lambda device: contextlib.nullcontext())
    cache = cudnn_graphs.GraphCache("test", lambda inp, needs_lse: needs_lse,
                                    lambda cudnn, handle, inp, needs_lse: ("graph", handle))
    q = torch.zeros(1, 4, 2, 16)
    inp = types.SimpleNamespace(query=q)
    assert cache.get(inp, False) == (("graph", "handle"), fake)
    cache.get(inp, True)
    assert registered == [cache.release] and len(cache) == 2
    registered[0]()
    assert len(cache) == 0 and destroyed == ["handle"] and cache._handles == {}
