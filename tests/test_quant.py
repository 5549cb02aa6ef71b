"""fmha_ops.quant: fp8 (FA3 convention) and i8fp8 (SageAttention-like) quantization helpers."""
import pytest
import torch

from fmha_ops.quant import (
    K_SCALE_BLOCK,
    Q_SCALE_BLOCK,
    quantize_fp8,
    quantize_i8fp8,
    quantize_qkv_fp8,
    random_hadamard,
)
from fmha_ops.testing import transformer_like


def _attn(q, k, v, scale):
    B, M, H, D = q.shape
    G = H // k.shape[2]
    s = torch.einsum("bmhd,bnhd->bhmn", q.double(), k.double().repeat_interleave(G, 2)) * scale
    return torch.einsum("bhmn,bnhd->bmhd", s.softmax(-1), v.double().repeat_interleave(G, 2))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_quantize_fp8_grouped_descale(dtype):
    x = torch.randn(2, 33, 8, 64) * torch.tensor([1.0, 3.0, 0.1, 10.0]).repeat_interleave(2)[None, None, :, None]
    x8, d = quantize_fp8(x, dtype, num_kv_heads=4)
    assert x8.dtype == dtype and d.shape == (2, 4) and d.dtype == torch.float32
    fmax = torch.finfo(dtype).max
    ref_amax = x.reshape(2, 33, 4, 2, 64).abs().amax(dim=(1, 3, 4))
    torch.testing.assert_close(d, ref_amax / fmax)
    deq = x8.float() * d.repeat_interleave(2, 1)[:, None, :, None]
    # e4m3: 3 mantissa bits -> relative rounding error <= 2**-4 for normal numbers
    big = x.abs() > d.repeat_interleave(2, 1)[:, None, :, None] * 2 ** -6
    assert ((deq - x).abs()[big] <= x.abs()[big] * 2 ** -4 + 1e-12).all()
    assert deq.abs().max() <= x.abs().max() * (1 + 1e-6)


def test_quantize_fp8_all_zero_group():
    x = torch.randn(1, 5, 2, 16)
    x[:, :, 1] = 0
    x8, d = quantize_fp8(x)
    assert d[0, 1].item() == 1.0 and torch.isfinite(d).all()
    assert (x8[:, :, 1].float() == 0).all()


def test_quantize_qkv_fp8_shapes():
    q, k, v = torch.randn(2, 9, 8, 32), torch.randn(2, 11, 2, 32), torch.randn(2, 11, 2, 16)
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
    assert (q8.shape, k8.shape, v8.shape) == (q.shape, k.shape, v.shape)
    assert qd.shape == kd.shape == vd.shape == (2, 2)


def _dequant_blocks(x8, d, block):
    s = d.repeat_interleave(block, 2)[:, :, : x8.shape[1]].permute(0, 2, 1)[..., None]
    return x8.float() * s


@pytest.mark.parametrize("M", [1, 100, 300])
def test_i8fp8_block_descales_and_error(M):
    q, k, v = transformer_like((2, M, 4, 64), (2, M + 7, 2, 64), dtype=torch.float32)
    x = quantize_i8fp8(q, k, v, smooth_k=False)
    assert x.q.dtype == torch.int8 and x.k.dtype == torch.int8 and x.v.dtype == torch.float8_e4m3fn
    assert x.q_descale.shape == (2, 4, -(-M // Q_SCALE_BLOCK))
    assert x.k_descale.shape == (2, 2, -(-(M + 7) // K_SCALE_BLOCK))
    assert x.v_descale.shape == (2, 2, 64) and x.softmax_scale == 1.0
    dq = _dequant_blocks(x.q, x.q_descale, Q_SCALE_BLOCK)
    dk = _dequant_blocks(x.k, x.k_descale, K_SCALE_BLOCK)
    # round-to-nearest int8: error at most half a step; the softmax scale is folded into q
    step_q = x.q_descale.repeat_interleave(Q_SCALE_BLOCK, 2)[:, :, :M].permute(0, 2, 1)[..., None]
    assert ((dq - q * 64 ** -0.5).abs() <= step_q / 2 + 1e-6).all()
    step_k = x.k_descale.repeat_interleave(K_SCALE_BLOCK, 2)[:, :, : M + 7].permute(0, 2, 1)[..., None]
    assert ((dk - k).abs() <= step_k / 2 + 1e-6).all()
    dv = x.v.float() * x.v_descale[:, None]
    assert ((dv - v).abs() <= v.abs() * 2 ** -4 + x.v_descale[:, None] * 2 ** -9).all()


def test_i8fp8_smooth_k_keeps_softmax_and_improves_error():
    """Smooth-K pays off when keys share a large offset (SageAttention's observation): here 10x the spread."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 256, 4, 64, generator=g) for _ in range(3))
    k = k + 10.0 * torch.randn(1, 1, 4, 64, generator=g)
    ref = _attn(q, k, v, 64 ** -0.5)
    km = k.mean(dim=1, keepdim=True)
    torch.testing.assert_close(_attn(q, k - km, v, 64 ** -0.5), ref, atol=2e-5, rtol=1e-4)  # shift invariant per row
    errs = {}
    for smooth in (False, True):
        x = quantize_i8fp8(q, k, v, smooth_k=smooth, qk_granularity="head")
        dq = x.q.float() * x.q_descale[:, None, :, None]
        dk = x.k.float() * x.k_descale[:, None, :, None]
        errs[smooth] = (_attn(dq, dk, v, 1.0) - ref).norm() / ref.norm()
    assert errs[True] < errs[False], errs


@pytest.mark.parametrize("gran,vgran", [("head", "tensor"), ("tensor", "channel")])
def test_i8fp8_granularities(gran, vgran):
    q, k, v = torch.randn(2, 40, 8, 32), torch.randn(2, 40, 2, 32), torch.randn(2, 40, 2, 32)
    x = quantize_i8fp8(q, k, v, qk_granularity=gran, v_granularity=vgran, scale=0.3)
    if gran == "head":
        assert x.q_descale.shape == (2, 2) and x.k_descale.shape == (2, 2)
    else:
        assert x.q_descale.numel() == 1 and x.k_descale.numel() == 1
    assert x.v_descale.numel() == 1 if vgran == "tensor" else x.v_descale.shape == (2, 2, 32)
    with pytest.raises(ValueError):
        quantize_i8fp8(q, k, v, qk_granularity="row")


@pytest.mark.parametrize("d", [1, 64, 128, 256])
def test_random_hadamard_is_orthogonal_and_seeded(d):
    r = random_hadamard(d, seed=3)
    assert r.shape == (d, d) and r.dtype == torch.float32
    assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)
    assert torch.equal(r, random_hadamard(d, seed=3))
    if d > 1:
        assert not torch.equal(r, random_hadamard(d, seed=4))
        assert r.abs().unique().numel() == 1  # every entry +-1/sqrt(d): energy spread over all channels
    with pytest.raises(ValueError, match="power of two"):
        random_hadamard(96)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_qkv_fp8_rotation_keeps_attention_and_cuts_outlier_error(dtype):
    """q and k rotated by one orthogonal matrix: the same attention (output and logits), and on inputs with two
    outlier channels the logits' quantization error drops (the outliers no longer dominate every product)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 256, s, 64, generator=g) for s in (4, 2, 2))
    q[..., :2] *= 30
    k[..., :2] *= 30
    q, k, v = (t.to(dtype) for t in (q, k, v))
    logits = torch.einsum("bmhd,bnhd->bhmn", q.double(), k.double().repeat_interleave(2, 2))
    err, out_err = {}, {}
    ref = _attn(q, k, v, 0.05)
    for rotated in (False, True):
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v, rotation=random_hadamard(64, 1) if rotated else None)
        dq = q8.float() * qd.repeat_interleave(2, 1)[:, None, :, None]
        dk = k8.float() * kd[:, None, :, None]
        s8 = torch.einsum("bmhd,bnhd->bhmn", dq.double(), dk.double().repeat_interleave(2, 2))
        err[rotated] = ((s8 - logits).norm() / logits.norm()).item()
        out = _attn(dq, dk, v8.float() * vd[:, None, :, None], 0.05)
        out_err[rotated] = ((out - ref).norm() / ref.norm()).item()
    assert err[True] < 0.3 * err[False] and err[True] < 0.02, err
    assert out_err[True] < 0.5 * out_err[False], out_err
    with pytest.raises(ValueError, match="rotation"):
        quantize_qkv_fp8(q, k, v, rotation=torch.eye(32))
