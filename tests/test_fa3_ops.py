"""FlashAttention-3 ops on a CPU machine: availability, the build found and its flags, declarations and reasons on
an sm90 arch. Nothing here needs a FlashAttention-3 build; problems are built from real inputs and re-targeted
to the H200, so the same ``not_supported_reasons`` the selector reads are checked."""
import importlib

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.ops import fa3
from fmha_ops.ops.fa3 import FA3BwOp, FA3Build, FA3FwOp, fa3_package_reason, find_build
from tests.test_ext_ops import B200, F8, H200, problem, reasons

#: the build flags the fa3-fwd 0.0.3 wheel ships (its fa3_fwd_config.CONFIG)
FA3_FWD_FLAGS = {"FLASHATTENTION_DISABLE_BACKWARD": True, "FLASHATTENTION_DISABLE_PAGEDKV": True,
                 "FLASHATTENTION_DISABLE_LOCAL": True, "FLASHATTENTION_DISABLE_FP16": True,
                 "FLASHATTENTION_DISABLE_SPLIT": False, "FLASHATTENTION_DISABLE_FP8": False}


@pytest.fixture
def fa3_fwd_build(monkeypatch):
    """The ops' build as the fa3-fwd wheel declares it."""
    monkeypatch.setattr(fa3, "BUILD", FA3Build("fa3_fwd_interface", "fa3-fwd", FA3_FWD_FLAGS))


@pytest.mark.skipif(fa3_package_reason() is None, reason="a FlashAttention-3 build is installed here")
def test_fa3_unavailable_names_both_builds_and_the_extra():
    for op in (FA3FwOp, FA3BwOp):
        why = op.available()
        assert "FlashAttention-3 is not installed" in why and "fmha-ops[fa3]" in why and "hopper/" in why, why
    q = torch.randn(1, 8, 2, 16)
    verdict = next(v for v in fmha_ops.explain(q, q, q).verdicts if v.op is FA3FwOp)
    assert not verdict.ok and "FlashAttention-3" in verdict.why_not()


def test_find_build_reads_the_config_of_the_first_build_installed(tmp_path, monkeypatch):
    (tmp_path / "fa3_fwd_interface.py").write_text("raise ImportError('the CUDA extension is not imported here')\n")
    (tmp_path / "fa3_fwd_config.py").write_text(
        "CONFIG = {'build_flags': {'FLASHATTENTION_DISABLE_BACKWARD': True, 'FLASHATTENTION_DISABLE_HDIM256': True}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    build = find_build()
    if build.module == "flash_attn_interface":
        pytest.skip("upstream FlashAttention-3 is installed here and wins")
    assert build.module == "fa3_fwd_interface" and build.package == "fa3-fwd"
    assert not build.has("BACKWARD") and build.has("VARLEN") and build.max_head_dim == 192
    assert "FLASHATTENTION_DISABLE_BACKWARD" in " ".join(build.missing("BACKWARD", "a backward"))


def test_fa3_declares_sm90_bf16_fp8_gqa_varlen_decode_and_lse():
    assert reasons(FA3FwOp, problem(H200, d=128, hkv=1)) == ""
    assert reasons(FA3FwOp, problem(H200, d=256, mq=17, mk=1000, bias=ab.LowerTriangularFromBottomRightMask())) == ""
    assert reasons(FA3FwOp, problem(H200, d=128, dtype=F8, descale="head", partial=True)) == ""
    assert reasons(FA3FwOp, problem(H200, d=64, dtype=F8, descale="tensor")) == ""
    assert reasons(FA3FwOp, problem(H200, d=192, dv=128)) == "", "DeepSeek-V3's 192/128"
    assert reasons(FA3FwOp, problem(H200, d=192, dv=128, dtype=F8, descale="head")) == ""
    mask = ab.BlockDiagonalMask.from_seqlens([3, 50, 1], [7, 50, 9])
    assert reasons(FA3FwOp, problem(H200, b=1, mq=54, mk=66, bias=mask.make_causal_from_bottomright())) == ""
    decode = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([2, 2, 2], 64, [9, 64, 33])
    assert reasons(FA3FwOp, problem(H200, b=1, mq=6, mk=3 * 64, bias=decode)) == ""
    assert FA3FwOp.PARTIAL and FA3FwOp.GQA and not FA3FwOp.AUTOGRAD


@pytest.mark.parametrize("kwargs,expect", [
    (dict(d=264), "head dim K=264 not supported"),
    (dict(d=60), "head dim K=60 not supported"),
    (dict(dtype=F8, d=72, descale="head"), "fp8 head dims K=72, Kv=72 must be multiples of 16"),
    (dict(d=128, dv=64), "value head dim Kv=64 with K=128 not supported; supported: K in 129..192 with Kv in 97..128"),
    (dict(dtype=F8, d=64, dv=256, descale="head"), "value head dim Kv=256 with K=64 not supported"),
    (dict(mq=17, mk=64, bias=ab.LowerTriangularMask()), "top-left causal with Mq=17 != Mk=64"),
    (dict(p=0.1), "dropout"),
    (dict(dtype=torch.float32), "dtypes (q, k, v) float32/float32/float32 not supported"),
])
def test_fa3_reasons(kwargs, expect):
    assert expect in reasons(FA3FwOp, problem(H200, **kwargs))


def test_fa3_declines_ragged_queries_over_a_cache_and_other_archs():
    decode = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 3], 64, [9, 64])
    assert "query sequences of different lengths over a KV cache" in reasons(FA3FwOp, problem(H200, b=1, mq=4,
                                                                                               mk=128, bias=decode))
    assert not FA3FwOp.supports_arch(B200)
    assert FA3FwOp.supports_arch(H200)


def test_the_fa3_fwd_wheel_refuses_what_it_was_built_without(fa3_fwd_build):
    window = ab.LowerTriangularFromBottomRightLocalAttentionMask(128)
    assert "local attention windows not supported by this FlashAttention-3 build (fa3-fwd: " \
           "FLASHATTENTION_DISABLE_LOCAL)" in reasons(FA3FwOp, problem(H200, mq=256, mk=256, bias=window))
    assert "float16 not supported by this FlashAttention-3 build" in reasons(FA3FwOp, problem(H200,
                                                                                                dtype=torch.float16))
    paged = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 64, [9, 64]).make_paged(
        torch.arange(4, dtype=torch.int32).view(2, 2), 32)
    assert "FLASHATTENTION_DISABLE_PAGEDKV" in reasons(FA3FwOp, problem(H200, b=1, mq=2, mk=128, bias=paged))
    whole = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 64, [9, 64]).make_paged(
        torch.arange(2, dtype=torch.int32).view(2, 1), 64)
    assert reasons(FA3FwOp, problem(H200, b=1, mq=2, mk=128, bias=whole)) == "", "a contiguous cache as one page"
    assert reasons(FA3FwOp, problem(H200, d=128)) == ""
    why = FA3BwOp.available()
    assert "has no backward (FLASHATTENTION_DISABLE_BACKWARD)" in why and "fa3-fwd" in why


def test_the_backward_declares_equal_head_dims_and_no_cache_masks():
    assert reasons(FA3BwOp, problem(H200, d=128)) == ""
    assert "value head dim Kv=128 must equal K=192" in reasons(FA3BwOp, problem(H200, d=192, dv=128))
    decode = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 64, [9, 64])
    assert "attn_bias padded_keys_causal not supported" in reasons(FA3BwOp, problem(H200, b=1, mq=2, mk=128,
                                                                                     bias=decode))
