"""Bad arguments raise ValueError / TypeError / NotImplementedError naming the argument (helpers, merge,
explain, op=), and the declarations refuse what their backends refuse (SDPA, availability order).
The fuzz (tests/test_fuzz.py) covers the same ground broadly; these pin each fix."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fmha_ops
from fmha_ops import kv_cache, quant
from fmha_ops.inputs import Inputs
from registry import Arch, Op
from registry.op import _available

SM90 = Arch("cuda", (9, 0), name="NVIDIA H200")


def qkv(b=2, mq=5, mk=7, hq=4, hkv=2, d=16, dtype=torch.float32):
    return (torch.randn(b, mq, hq, d).to(dtype), torch.randn(b, mk, hkv, d).to(dtype),
            torch.randn(b, mk, hkv, d).to(dtype))


def reference(q, k, v, scale, causal_top_left=False):
    s = torch.einsum("bmhd,bnhd->bhmn", q.double(), k.double().repeat_interleave(q.shape[2] // k.shape[2], 2)) * scale
    if causal_top_left:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("bhmn,bnhd->bmhd", s.softmax(-1), v.double().repeat_interleave(q.shape[2] // k.shape[2], 2))


# ---- explain, op= -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["zz", "", 3, None])
def test_explain_rejects_unknown_kind(kind):
    with pytest.raises(ValueError, match=r"kind must be one of 'fw', 'bw'; got"):
        fmha_ops.explain(*qkv(), kind=kind)


@pytest.mark.parametrize("op", [["torch_referenceF"], {"fw": "torch_referenceF"}])
def test_unhashable_op_is_a_clear_error(op):
    with pytest.raises(ValueError, match=r"op=.* is not an op class, op name or \(FwOp, BwOp\) tuple"):
        fmha_ops.memory_efficient_attention(*qkv(), op=op)


def test_availability_names_the_hardware_before_the_package():
    class GfxOnly(Op):
        NAME = "gfx_onlyF"
        ARCHS = ("rocm:gfx942,gfx950",)
        REQUIRES = ("fmha_ops_no_such_module_xyz",)

    reason = _available(GfxOnly)
    if torch.cuda.is_available():
        assert reason.startswith("needs rocm:gfx942,gfx950")
    else:
        assert reason == "needs a GPU (rocm:gfx942,gfx950); none here"


# ---- merge_attentions -------------------------------------------------------------------------------------

def parts(dtype=torch.float32):
    return torch.randn(3, 2, 5, 4, 16).to(dtype), torch.randn(3, 2, 4, 5)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_merge_rejects_nan_and_plus_inf_lse(bad):
    attn, lse = parts()
    lse[1, 0, 2, 3] = bad
    with pytest.raises(ValueError, match="lse_split must be finite or -inf"):
        fmha_ops.merge_attentions(attn, lse)


def test_merge_rejects_integer_parts_and_output_dtype():
    attn, lse = parts()
    with pytest.raises(ValueError, match="attn_split has dtype int32"):
        fmha_ops.merge_attentions((attn * 10).int(), lse)
    with pytest.raises(ValueError, match="output_dtype=int32 not supported"):
        fmha_ops.merge_attentions(attn, lse, output_dtype=torch.int32)
    with pytest.raises(TypeError, match="attn_split must be a tensor or a non-empty list"):
        fmha_ops.merge_attentions([], [])


def test_merge_keeps_minus_inf_parts():
    attn, lse = parts()
    lse[0] = -math.inf
    out, merged = fmha_ops.merge_attentions(attn, lse)
    want, _ = fmha_ops.merge_attentions(attn[1:], lse[1:])
    torch.testing.assert_close(out, want)
    assert torch.isfinite(merged).all()


# ---- quant and kv_cache helpers ----------------------------------------------------------------------------

def test_quant_helpers_name_their_arguments():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of k heads \(3\)"):
        quant.quantize_qkv_fp8(q, torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2))
    with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide the 4 heads"):
        quant.quantize_fp8(q, num_kv_heads=3)
    with pytest.raises(ValueError, match="block must be >= 1, got 0"):
        quant.quantize_blocks(q, 0)
    with pytest.raises(ValueError, match="dtype=float16 not supported"):
        quant.quantize_fp8(q, torch.float16)
    with pytest.raises(ValueError, match="scale must be a finite float, got nan"):
        quant.quantize_i8fp8(q, k, v, scale=math.nan)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quant.quantize_fp8(q.tolist())
    d = quant.fp8_channel_descale(v, torch.float8_e4m3fn)
    d[0, 0, 0] = math.nan
    with pytest.raises(ValueError, match=r"descale must be finite; entry \(0, 0, 0\) is nan"):
        quant.quantize_fp8_channels(v, d, torch.float8_e4m3fn)


def test_kv_cache_helpers_name_their_arguments():
    x = torch.randn(2, 6, 2, 16)
    with pytest.raises(ValueError, match="page_size must be an int >= 1, got 0"):
        kv_cache.paged_from_dense([x], 0)
    with pytest.raises(ValueError, match="num_pages=3 cannot hold 2 sequences of 6 keys"):
        kv_cache.paged_from_dense([x], 4, num_pages=3)
    with pytest.raises(ValueError, match="tensors must be a non-empty list"):
        kv_cache.paged_from_dense(x, 4)
    (pages,), table = kv_cache.paged_from_dense([x], 4, num_pages=5)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 5 is outside \[0, 4\]: pages has 5 pages"):
        kv_cache.dense_from_paged(pages, torch.tensor([[0, 5]], dtype=torch.int32), 6)
    with pytest.raises(ValueError, match="length must be <= 8, got 9"):
        kv_cache.dense_from_paged(pages, table, 9)
    torch.testing.assert_close(kv_cache.dense_from_paged(pages, table, 6), x)


# ---- SDPA declarations and the reference op ---------------------------------------------------------------

@pytest.mark.parametrize("scale", [0.0, -0.7])
@pytest.mark.parametrize("op", ["sdpa_flashF", "sdpa_mathF"])
def test_sdpa_causal_non_positive_scale(op, scale):
    q, k, v = qkv(mq=6, mk=6)
    out = fmha_ops.memory_efficient_attention(q, k, v, fmha_ops.LowerTriangularMask(), scale=scale, op=op)
    torch.testing.assert_close(out.double(), reference(q, k, v, scale, causal_top_left=True), atol=1e-5, rtol=1e-5)


def test_cpu_flash_does_not_claim_dropout():
    report = fmha_ops.explain(*qkv(), p=0.3)
    flash = next(v for v in report.verdicts if v.op.NAME == "sdpa_flashF")
    assert "dropout (p > 0) not supported by the CPU flash kernel" in flash.why_not()
    assert fmha_ops.memory_efficient_attention(*qkv(), p=0.3).shape == (2, 5, 4, 16)


def test_cudnn_declaration_refuses_key_length_one():
    q, k, v = qkv(b=3, mq=1000, mk=1, hq=8, hkv=4, d=64, dtype=torch.bfloat16)
    problem = dataclasses.replace(Inputs(q, k, v).problem(), arch=SM90)
    reasons = fmha_ops.get_op("sdpa_cudnnF").not_supported_reasons(problem)
    assert any("key length >= 2" in r for r in reasons), reasons
    ok = dataclasses.replace(problem, seqlen_k=2)
    assert fmha_ops.get_op("sdpa_cudnnF").not_supported_reasons(ok) == []


def test_reference_batch_zero_and_empty_query_backward():
    q, k, v = qkv(b=0)
    assert fmha_ops.memory_efficient_attention(q, k, v, op="torch_referenceF").shape == (0, 5, 4, 16)
    out, lse = fmha_ops.memory_efficient_attention_partial(q, k, v, op="torch_referenceF")
    assert out.shape == (0, 5, 4, 16) and lse.shape == (0, 4, 5)
    q, k, v = (t.requires_grad_(True) for t in qkv(mq=0))
    fmha_ops.memory_efficient_attention(q, k, v, op="torch_referenceF").sum().backward()
    assert k.grad is not None and torch.equal(k.grad, torch.zeros_like(k))


# ---- attention entry points -------------------------------------------------------------------------------

def test_partial_refuses_inputs_that_require_grad():
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="returns no gradients, but query requires_grad=True"):
        fmha_ops.memory_efficient_attention_partial(q.requires_grad_(True), k, v)
    with torch.no_grad():
        out, lse = fmha_ops.memory_efficient_attention_partial(q, k, v)
    assert out.shape == (2, 5, 4, 16) and lse.shape == (2, 4, 5)


def test_bmghk_key_groups_must_match_the_query():
    q = torch.randn(2, 5, 2, 2, 16)
    k = torch.randn(2, 7, 1, 1, 16).expand(2, 7, 1, 2, 16)
    with pytest.raises(ValueError, match=r"key \(2, 7, 1, 2, 16\) must have query's groups G=2 and heads H=2"):
        fmha_ops.memory_efficient_attention(q, k, k)


def test_descales_type_and_host_values():
    q, k, v = qkv()
    q8, k8, v8, qd, kd, vd = quant.quantize_qkv_fp8(q, k, v)
    with pytest.raises(TypeError, match="q_descale must be a float32 tensor"):
        fmha_ops.memory_efficient_attention(q8, k8, v8, q_descale=0.5, k_descale=kd, v_descale=vd)
    bad = kd.clone()
    bad[1, 0] = math.nan
    with pytest.raises(ValueError, match=r"k_descale must be finite; entry \(1, 0\) is nan"):
        fmha_ops.memory_efficient_attention(q8, k8, v8, q_descale=qd, k_descale=bad, v_descale=vd)
    with pytest.raises(ValueError, match=r"q_descale/k_descale: descales are only for quantized inputs"):
        fmha_ops.memory_efficient_attention(q, k, v, q_descale=qd, k_descale=kd)


def test_scalar_arguments_are_type_checked():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="scale must be a float, got '1'"):
        fmha_ops.memory_efficient_attention(q, k, v, scale="1")
    with pytest.raises(TypeError, match=r"p must be a float, got \[0.1\]"):
        fmha_ops.memory_efficient_attention(q, k, v, p=[0.1])
    with pytest.raises(TypeError, match="quantize_kv_to_fp8 must be a bool"):
        fmha_ops.memory_efficient_attention(q.half(), k.half(), v.half(), quantize_kv_to_fp8="yes")
    with pytest.raises(ValueError, match="softmax_scale must be a finite float, got nan"):
        fmha_ops.fp8_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), softmax_scale=math.nan)


@pytest.mark.parametrize("cu", [[0, 4, 3, 7], [2, 3, 3, 7], [0, 3, 3, 6], [0, 3, 3, 4007]])
def test_varlen_cu_seqlens_are_checked_on_the_host(cu):
    q, k, v = torch.randn(7, 4, 16), torch.randn(13, 2, 16), torch.randn(13, 2, 16)
    cu_k = torch.tensor([0, 5, 7, 13], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"cu_seqlens_q must start at 0, never decrease and end at q's 7 tokens; "
                                         rf"got \[{', '.join(map(str, cu))}\]"):
        fmha_ops.flash_attn_varlen_func(q, k, v, torch.tensor(cu, dtype=torch.int32), cu_k, 4, 6)
    with pytest.raises(ValueError, match=r"max_seqlen_q=3 is smaller than the longest sequence in cu_seqlens_q \(4\)"):
        fmha_ops.flash_attn_varlen_func(q, k, v, torch.tensor([0, 3, 3, 7], dtype=torch.int32), cu_k, 3, 6)


def test_flash_attn_lse_keeps_float32_output_and_gradients():
    q, k, v = (t.requires_grad_(True) for t in qkv())
    out, lse = fmha_ops.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and not lse.requires_grad
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_paged_mask_block_table_checked_on_the_host():
    bias = fmha_ops.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 8, [6, 3]).make_paged(
        torch.tensor([[3, 5], [0, 4]], dtype=torch.int32), 4)
    q, k = torch.randn(1, 2, 4, 16, dtype=torch.float16), torch.randn(1, 20, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"attn_bias block_tables\[0, 1\] = 5 is outside \[0, 4\]"):
        fmha_ops.memory_efficient_attention(q, k, k, bias)


def test_mask_constructors_check_lengths():
    with pytest.raises(TypeError, match=r"q_seqlen\[1\] must be an int, got 0.5"):
        fmha_ops.BlockDiagonalMask.from_seqlens([2, 0.5])
    with pytest.raises(ValueError, match=r"kv_seqlen\[1\] must be >= 0, got -1"):
        fmha_ops.BlockDiagonalMask.from_seqlens([2, 3], [4, -1])
    with pytest.raises(TypeError, match="block_tables must be a torch.Tensor"):
        fmha_ops.BlockDiagonalPaddedKeysMask.from_seqlens([1], 8, [5]).make_paged([[0, 1]], 4)
