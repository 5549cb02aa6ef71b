"""Softmax scales of 0 and below and zero descales give the float32 reference's result in every op that takes them
(the Triton kernels through the interpreter on the CPU); a negative descale is refused naming the argument."""
from __future__ import annotations

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.testing import error_report, normal_qkv

F8 = torch.float8_e4m3fn
MASKS = {"none": None, "causal": ab.LowerTriangularMask(),
         "bottom-right causal": ab.LowerTriangularFromBottomRightMask()}


def _reference(q, k, v, mask, **kw):
    return fmha_ops.memory_efficient_attention_partial(q, k, v, mask, op="torch_referenceF", **kw)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("scale", [0.0, -0.7, 1e-30])
def test_any_finite_scale_matches_the_reference(mask, scale):
    q, k, v = normal_qkv((2, 17, 4, 16), (2, 23, 2, 16), dtype=torch.float16, seed=3)
    bias = MASKS[mask]
    out, lse = fmha_ops.memory_efficient_attention_partial(q, k, v, bias, scale=scale, output_dtype=torch.float16)
    ref, ref_lse = _reference(q.float(), k.float(), v.float(), bias, scale=scale, output_dtype=torch.float32)
    assert not out.isnan().any() and not lse.isnan().any()
    assert error_report(out.float(), ref)["rel"] < 2e-3
    seen = ref_lse > -torch.inf
    assert torch.equal(lse == -torch.inf, ~seen) and (lse[seen] - ref_lse[seen]).abs().max() < 1e-3


@pytest.mark.parametrize("scale", [0.0, 0.3])
def test_triton_attention_takes_a_zero_scale(scale):
    q, k, v = normal_qkv((1, 17, 2, 16), (1, 23, 2, 16), dtype=torch.float16, seed=4)
    bias = ab.LowerTriangularFromBottomRightMask()
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, scale=scale, op="triton_attnF")
    ref = fmha_ops.memory_efficient_attention(q.float(), k.float(), v.float(), bias, scale=scale,
                                              op="torch_referenceF")
    assert error_report(out.float(), ref)["rel"] < 2e-3


def test_kernels_declare_no_negative_scale_and_the_selector_finds_one_that_does():
    q, k, v = normal_qkv((1, 8, 2, 16), (1, 8, 2, 16), dtype=torch.float16, seed=5)
    report = fmha_ops.explain(q, k, v, ab.LowerTriangularMask(), scale=-0.5)
    assert report.selected is not None and report.selected.NEGATIVE_SCALE
    with pytest.raises(ValueError, match="softmax scale below 0 not supported"):
        fmha_ops.memory_efficient_attention(q, k, v, scale=-0.5, op="triton_attnF")


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("zero", ["q", "k", "both"])
def test_zero_descales_match_the_reference(mask, zero):
    """An all-zero block or token quantizes to descale 0: its scores are 0, never NaN."""
    q, k, v = (t.to(F8) for t in normal_qkv((1, 17, 2, 16), (1, 23, 2, 16), seed=6))
    one, nil = torch.ones(1), torch.zeros(1)
    qd, kd = (nil if zero in ("q", "both") else one), (nil if zero in ("k", "both") else one)
    bias = MASKS[mask]
    out, lse = fmha_ops.memory_efficient_attention_partial(q, k, v, bias, q_descale=qd, k_descale=kd, v_descale=one,
                                                          op="triton_fp8F")
    ref, ref_lse = _reference(q, k, v, bias, q_descale=qd, k_descale=kd, v_descale=one)
    assert not out.isnan().any()
    assert error_report(out.float(), ref.float())["rel"] < 1e-5
    seen = ref_lse > -torch.inf
    assert (lse[seen] - ref_lse[seen]).abs().max() < 1e-5


@pytest.mark.parametrize("role", ["q_descale", "k_descale", "v_descale"])
def test_a_negative_descale_is_refused_naming_it(role):
    q, k, v = (t.to(F8) for t in normal_qkv((1, 8, 2, 16), (1, 8, 2, 16), seed=7))
    descales = {r: torch.ones(1) for r in ("q_descale", "k_descale", "v_descale")}
    descales[role] = torch.tensor([-0.5])
    for _ in range(2):  # host descales are read on every call, planned or not
        with pytest.raises(ValueError, match=rf"{role} must be >= 0 .* entry 0 is -0.5"):
            fmha_ops.memory_efficient_attention(q, k, v, **descales)
        descales_ok = dict(descales, **{role: torch.ones(1)})
        fmha_ops.memory_efficient_attention(q, k, v, **descales_ok)
