"""fp8 q/k with one descale per block of tokens (``quantize_qkv_fp8(..., qk_granularity="block")``).

CPU: the quantizer's shapes and error at odd lengths, the Triton kernel in the interpreter against a float64
reference of the dequantized inputs (``pv_fp8=False``: the interpreter rounds fp32 -> fp8 casts wrongly), the
public API's route and the ops that refuse per-block descales. GPU: the production kernel (fp8 P) on
transformer-like inputs against float32 attention of the unquantized inputs.
"""
import dataclasses

import pytest
import torch

import fmha_ops
from fmha_ops.inputs import make_inputs
from fmha_ops.quant import K_SCALE_BLOCK, Q_SCALE_BLOCK, dequantize_blocks, quantize_qkv_fp8
from fmha_ops.testing import error_report, transformer_like
from registry import Arch
from tests.conftest import DEVICE
from tests.test_kernel_attention_fwd import _tiles, reference

FP8 = torch.float8_e4m3fn
H200 = Arch("cuda", (9, 0), name="NVIDIA H200")
SHAPES = [(1, 1, 1, 2, 2), (1, 17, 17, 2, 1), (2, 150, 260, 4, 2), (1, 129, 1, 3, 1)]  # B, Mq, Mk, Hq, Hkv


def _qkv(B, Mq, Mk, Hq, Hkv, D=32, seed=0, device=DEVICE):
    return transformer_like((B, Mq, Hq, D), (B, Mk, Hkv, D), dtype=torch.float32, device=device, seed=seed)


@pytest.mark.parametrize("B,Mq,Mk,Hq,Hkv", SHAPES)
def test_block_quantizer_shapes_and_error(B, Mq, Mk, Hq, Hkv):
    q, k, v = _qkv(B, Mq, Mk, Hq, Hkv, device="cpu")
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v, qk_granularity="block")
    assert (q8.dtype, k8.dtype, v8.dtype) == (FP8, FP8, FP8) and q8.shape == q.shape and k8.shape == k.shape
    assert qd.shape == (B, Hq, -(-Mq // Q_SCALE_BLOCK)) and kd.shape == (B, Hkv, -(-Mk // K_SCALE_BLOCK))
    assert vd.shape == (B, Hkv) and qd.dtype == kd.dtype == torch.float32 and qd.is_contiguous()
    for x, x8, d, blk in ((q, q8, qd, Q_SCALE_BLOCK), (k, k8, kd, K_SCALE_BLOCK)):
        back = dequantize_blocks(x8, d, blk)
        assert ((back - x).abs() <= x.abs() * 2 ** -4 + d.max() * 2 ** -9).all()  # e4m3: 3 mantissa bits


def test_block_quantizer_rejects_unknown_granularity():
    q, k, v = _qkv(1, 4, 4, 1, 1, device="cpu")
    with pytest.raises(ValueError, match=r"qk_granularity must be one of 'head', 'block'; got 'token'"):
        quantize_qkv_fp8(q, k, v, qk_granularity="token")


@pytest.mark.parametrize("B,Mq,Mk,Hq,Hkv", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_block_descales_match_dequantized_reference(B, Mq, Mk, Hq, Hkv, causal):
    from fmha_ops.kernels.triton.attention_fwd import attention_forward

    q, k, v = _qkv(B, Mq, Mk, Hq, Hkv, seed=Mq)
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v, qk_granularity="block")
    o, lse = attention_forward(q8, k8, v8, scale=32 ** -0.5, causal=causal, q_descale=qd, k_descale=kd,
                               v_descale=vd, return_lse=True, pv_fp8=False, config=_tiles(64, 64))
    dq, dk = (dequantize_blocks(x8, d, blk) for x8, d, blk in ((q8, qd, Q_SCALE_BLOCK), (k8, kd, K_SCALE_BLOCK)))
    dv = v8.float() * vd[:, None, :, None]
    ref, ref_lse = reference(dq, dk, dv, 32 ** -0.5, causal)
    err = error_report(o, ref)
    assert err["rel"] < 6e-3, err
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[fin], ref_lse[fin], atol=1e-3), (lse, ref_lse)


def test_api_takes_block_descales_in_triton_fp8():
    q, k, v = _qkv(2, 150, 260, 4, 2, seed=5)
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v, qk_granularity="block")
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    out = fmha_ops.memory_efficient_attention(q8, k8, v8, op="triton_fp8F", **kw)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 150, 4, 32)
    assert error_report(out, reference(q, k, v, 32 ** -0.5)[0])["cos"] > 0.99


@pytest.mark.parametrize("op", ["gluon_fp8F", "gluon_ws_fp8F", "cudnn_fp8F"])
def test_ops_without_block_descales_refuse_with_the_reason(op):
    q, k, v = _qkv(1, 130, 130, 2, 2, seed=1, device="cpu")
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v, qk_granularity="block")
    inp = make_inputs(q8, k8, v8, None, q_descale=qd, k_descale=kd, v_descale=vd)
    inp.validate()
    prob = dataclasses.replace(inp.problem(needs_lse=False), arch=H200)
    why = " | ".join(fmha_ops.get_op(op).not_supported_reasons(prob))
    assert "q_descale kind 'block' not supported" in why and "k_descale kind 'block' not supported" in why, why


@pytest.mark.gpu
@pytest.mark.parametrize("B,Mq,Mk,Hq,Hkv", [(1, 1, 1, 2, 2), (1, 17, 17, 2, 1), (2, 1000, 1000, 16, 4),
                                            (1, 4097, 4097, 8, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_block_descales_accurate(B, Mq, Mk, Hq, Hkv, causal):
    q, k, v = transformer_like((B, Mq, Hq, 128), (B, Mk, Hkv, 128), device="cuda", seed=Mq)
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v, qk_granularity="block")
    bias = fmha_ops.LowerTriangularFromBottomRightMask() if causal else None
    out = fmha_ops.memory_efficient_attention(q8, k8, v8, bias, q_descale=qd, k_descale=kd, v_descale=vd)
    dq, dk = (dequantize_blocks(x8, d, blk) for x8, d, blk in ((q8, qd, Q_SCALE_BLOCK), (k8, kd, K_SCALE_BLOCK)))
    ref = reference(dq, dk, v8.float() * vd[:, None, :, None], 128 ** -0.5, causal)[0]
    err = error_report(out, ref)
    assert err["rel"] < 5e-2 and err["cos"] > 0.998, err
