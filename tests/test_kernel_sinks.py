"""Attention sinks and value head dims of their own in the Triton kernels, against a float64 reference.

A sink (GPT-OSS) is one float32 logit per query head that joins every row's softmax denominator and has no value
row: out_i = sum_j exp(s_ij - lse_i) v_j with lse_i = log(sum_j exp(s_ij) + exp(sink_h)). Its gradient is
dsink_h = -sum_i exp(sink_h - lse_i) (dO_i . O_i). CPU: the interpreter at odd sizes in float16 (its bfloat16 dot
is wrong); ``gpu``: bfloat16 and fp8 at model sizes (GPT-OSS: head dim 64, GQA 64/8; DeepSeek-V3: K=192, Kv=128).
"""
import math

import pytest
import torch

from tests.conftest import DEVICE
from fmha_ops.ops.common import dequantize
from fmha_ops.testing import error_report

#: fp8 forward against the attention of its own dequantized inputs: P's e4m3 rounding alone (rel 2.0-2.6e-2 measured
#: on the H200 at D 64-128, sinks or not)
FP8_P_TOLERANCE = 3e-2


def reference(q, k, v, scale, causal=False, sinks=None, window_left=-1):
    """(out, lse) in float64: BMHK, GQA by head grouping, bottom-right causal, a left window, sinks (Hq,)."""
    b, mq, hq, _ = q.shape
    mk, g = k.shape[1], hq // k.shape[2]
    qf, kf, vf = q.double(), k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    s = torch.einsum("bmhd,bnhd->bhmn", qf, kf) * scale
    i = torch.arange(mq, device=q.device)[:, None] + mk - mq
    j = torch.arange(mk, device=q.device)[None, :]
    visible = torch.ones(mq, mk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= j <= i
    if window_left >= 0:
        visible &= j >= i - window_left
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(b, hq, mq, 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhmn,bnhd->bmhd", p, vf), lse


def _qkv(b, mq, mk, hq, hkv, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, mq, hq, d, generator=g)
    k = torch.randn(b, mk, hkv, d, generator=g)
    v = torch.randn(b, mk, hkv, dv, generator=g)
    sinks = torch.randn(hq, generator=g) * 2.0
    return (*(t.to(DEVICE, dtype) for t in (q, k, v)), sinks.to(DEVICE))


CPU_SHAPES = [  # (B, Mq, Mk, Hq, Hkv, D, Dv, causal)
    (2, 17, 33, 4, 2, 32, 16, True),
    (1, 5, 70, 2, 1, 48, 32, False),  # D not a power of two, Dv != D
    (1, 1, 1, 2, 2, 16, 16, False),
    (2, 3, 0, 2, 2, 16, 16, False),  # no keys: out 0, lse = the sink
]


@pytest.mark.parametrize("shape", CPU_SHAPES)
def test_forward_sinks(shape):
    from fmha_ops.kernels.triton.attention_fwd import attention_forward

    b, mq, mk, hq, hkv, d, dv, causal = shape
    q, k, v, sinks = _qkv(b, mq, mk, hq, hkv, d, dv, torch.float16)
    out, lse = attention_forward(q, k, v, scale=d ** -0.5, causal=causal, return_lse=True, sinks=sinks)
    ref, ref_lse = reference(q, k, v, d ** -0.5, causal, sinks)
    assert (out.double() - ref).abs().max().item() < 2e-3
    assert (lse.double() - ref_lse).abs().max().item() < 1e-4
    if mk == 0:
        assert torch.equal(lse, sinks[None, :, None].expand_as(lse)) and not out.any()


@pytest.mark.parametrize("shape", CPU_SHAPES[:2])
def test_backward_with_sinks(shape):
    """dq, dk, dv from the kernel given the sink-inclusive LSE; dsink from rowsum(dO * O) and the LSE."""
    from fmha_ops.kernels.triton.attention_bwd import attention_backward
    from fmha_ops.kernels.triton.attention_fwd import attention_forward
    from fmha_ops.sinks import sink_grad

    b, mq, mk, hq, hkv, d, dv, causal = shape
    q, k, v, sinks = _qkv(b, mq, mk, hq, hkv, d, dv, torch.float16, seed=1)
    out, lse = attention_forward(q, k, v, scale=d ** -0.5, causal=causal, return_lse=True, sinks=sinks)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out)
    dq, dk, dv_ = attention_backward(grad, q, k, v, out, lse, scale=d ** -0.5, causal=causal)
    leaves = [t.double().requires_grad_(True) for t in (q, k, v, sinks)]
    ref, _ = reference(*leaves[:3], d ** -0.5, causal, leaves[3])
    want = torch.autograd.grad(ref, leaves, grad.double())
    for name, got, ref_grad in zip(("dq", "dk", "dv", "dsinks"), (dq, dk, dv_, sink_grad(out, grad, lse, sinks)),
                                   want):
        rep = error_report(got, ref_grad)
        # dsinks sums rows of dO . O of both signs: the float16 output's rounding weighs more against the sum
        assert rep["rel"] < (1e-2 if name == "dsinks" else 2e-3) and rep["cos"] > 0.9999, (name, rep)


@pytest.mark.parametrize("splits,page", [(1, None), (3, None), (2, 8)])
@pytest.mark.parametrize("mq", [1, 2])
def test_decode_sinks_value_dim(splits, page, mq):
    """The decoder with sinks (single pass: its epilogue; splits: the reduce, once) and D=48, Dv=32."""
    from fmha_ops.kernels.triton.decode import paged_decode

    b, length, hq, hkv, d, dv = 3, 40, 4, 2, 48, 32
    q, k, v, sinks = _qkv(b, mq, length, hq, hkv, d, dv, torch.float16, seed=2)
    seqlens = torch.tensor([length, 17, mq], dtype=torch.int32, device=DEVICE)
    if page:
        n = length // page
        kc, vc = k.reshape(b * n, page, hkv, d), v.reshape(b * n, page, hkv, dv)
        table = torch.arange(b * n, dtype=torch.int32, device=DEVICE).reshape(b, n)
    else:
        kc, vc, table = k, v, None
    out, lse = paged_decode(q, kc, vc, seqlens, block_table=table, scale=d ** -0.5, num_splits=splits, sinks=sinks)
    assert out.shape == (b, mq, hq, dv)
    for i, n in enumerate(seqlens.tolist()):
        ref, ref_lse = reference(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], d ** -0.5, True, sinks)
        assert (out[i:i + 1].double() - ref).abs().max().item() < 2e-3
        assert (lse[i:i + 1].double() - ref_lse).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gpt-oss", "deepseek-v3"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bf16_forward_backward(model, causal):
    """bf16 on the H200 at model head dims: GPT-OSS (GQA 64/8, D64, sinks; their gradient from the backward's row
    sums), DeepSeek-V3 (K=192, Kv=128)."""
    from fmha_ops.kernels.triton.attention_bwd import attention_backward
    from fmha_ops.kernels.triton.attention_fwd import attention_forward
    from fmha_ops.sinks import sink_grad_from_delta

    b, mq, mk = 2, 1000, 1000
    hq, hkv, d, dv, with_sinks = (64, 8, 64, 64, True) if model == "gpt-oss" else (16, 16, 192, 128, False)
    q, k, v, sinks = _qkv(b, mq, mk, hq, hkv, d, dv, torch.bfloat16, seed=3)
    sinks = sinks if with_sinks else None
    out, lse = attention_forward(q, k, v, scale=d ** -0.5, causal=causal, return_lse=True, sinks=sinks)
    grad = torch.randn_like(out)
    delta = torch.empty_like(lse)
    dq, dk, dv_ = attention_backward(grad, q, k, v, out, lse, scale=d ** -0.5, causal=causal, delta=delta)
    leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    s_leaf = None if sinks is None else sinks.clone().requires_grad_(True)
    ref, _ = reference(*leaves, d ** -0.5, causal, s_leaf)
    assert error_report(out, ref)["rel"] < 1e-2
    want = torch.autograd.grad(ref, leaves + ([s_leaf] if sinks is not None else []), grad.double())
    got = [dq, dk, dv_] + ([sink_grad_from_delta(delta, lse, sinks)] if sinks is not None else [])
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert error_report(g, w)["rel"] < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "i8fp8"])
def test_gpu_quantized_forward_sinks(kind):
    """fp8 and i8fp8 forwards with sinks (the sink joins after the fp8 P, relative to the keys' own max)."""
    from fmha_ops.kernels.triton.attention_fwd import attention_forward
    from fmha_ops.quant import quantize_i8fp8, quantize_qkv_fp8

    b, m, hq, hkv, d = 2, 1000, 64, 8, 64
    q, k, v, sinks = _qkv(b, m, m, hq, hkv, d, d, torch.bfloat16, seed=4)
    if kind == "fp8":
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        out, _ = attention_forward(q8, k8, v8, scale=d ** -0.5, causal=True, q_descale=qd, k_descale=kd,
                                   v_descale=vd, sinks=sinks)
        # e4m3 q/k/v alone move the output ~4-5% at D64 (rel to the bf16 inputs' attention): compare with the
        # attention of the values the kernel reads, where only P's fp8 rounding remains
        q, k, v = (dequantize(x8, x_d, "head") for x8, x_d in ((q8, qd), (k8, kd), (v8, vd)))
        tolerance = FP8_P_TOLERANCE
    else:
        x = quantize_i8fp8(q, k, v)
        out, _ = attention_forward(x.q, x.k, x.v, scale=x.softmax_scale, causal=True, q_descale=x.q_descale,
                                   k_descale=x.k_descale, v_descale=x.v_descale, sinks=sinks)
        tolerance = 4e-2
    ref, _ = reference(q, k, v, d ** -0.5, True, sinks)
    assert error_report(out, ref)["rel"] < tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_decode_sinks(splits, fp8):
    """bf16 and fp8 (per-token scales) paged caches, GPT-OSS heads, with sinks; single pass and 8 splits."""
    from fmha_ops.kernels.triton.decode import paged_decode
    from fmha_ops.kv_cache import quantize_kv_fp8

    b, length, page, hq, hkv, d = 4, 4096, 64, 64, 8, 64
    q, k, v, sinks = _qkv(b, 1, length, hq, hkv, d, d, torch.bfloat16, seed=5)
    n = length // page
    kc, vc = k.reshape(b * n, page, hkv, d), v.reshape(b * n, page, hkv, d)
    table = torch.randperm(b * n, device=DEVICE).to(torch.int32).reshape(b, n)
    ks = vs = None
    if fp8:
        kc, vc, ks, vs = quantize_kv_fp8(kc, vc, torch.float8_e4m3fn)
    seqlens = torch.tensor([length, 1, 1000, 4095], dtype=torch.int32, device=DEVICE)
    out, _ = paged_decode(q, kc, vc, seqlens, block_table=table, scale=d ** -0.5, k_scale=ks, v_scale=vs,
                          num_splits=splits, sinks=sinks)
    kd = k.reshape(b * n, page, hkv, d)[table.long()].reshape(b, length, hkv, d)
    vd = v.reshape(b * n, page, hkv, d)[table.long()].reshape(b, length, hkv, d)
    for i, m in enumerate(seqlens.tolist()):
        ref, _ = reference(q[i:i + 1], kd[i:i + 1, :m], vd[i:i + 1, :m], d ** -0.5, True, sinks)
        assert error_report(out[i:i + 1], ref)["rel"] < (4e-2 if fp8 else 1e-2)
