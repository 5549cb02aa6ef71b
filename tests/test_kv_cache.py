"""KV-cache helpers (torch) and the kv_append kernel."""
from __future__ import annotations

import pytest
import torch

from fmha_ops.kv_cache import (build_fp8_paged_cache, dense_from_paged, dequantize_fp8, keys_contiguous,
                               paged_from_dense, quantize_fp8, quantize_kv_fp8)
from tests.conftest import DEVICE, HAS_CUDA


def test_quantize_fp8_per_token():
    x = torch.randn(3, 5, 2, 64) * torch.logspace(-3, 3, 5)[None, :, None, None]
    x[0, 0, 0] = 0.0
    x8, s = quantize_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn and s.shape == x.shape[:-1]
    assert s[0, 0, 0] == 1.0 and (x8[0, 0, 0].float() == 0).all()
    assert torch.equal(x8.float().abs().amax(-1)[s != 1.0], torch.full_like(s[s != 1.0], 448.0))
    err = (dequantize_fp8(x8, s) - x).abs() / x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert err.max() <= 2.0 ** -4 * 1.01  # e4m3: 3 mantissa bits, half-ulp relative to the row max at most
    k8, v8, ks, vs = quantize_kv_fp8(x, -x, torch.float8_e4m3fnuz)
    assert k8.dtype == torch.float8_e4m3fnuz and torch.equal(ks, vs)
    assert k8.float().abs().max() == 240.0


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_paged_round_trip(page_size):
    g = torch.Generator().manual_seed(page_size)
    k = torch.randn(3, 37, 2, 8, generator=g)
    s = torch.randn(3, 37, 2, generator=g)
    per_seq = -(-37 // page_size)
    (kp, sp), bt = paged_from_dense([k, s], page_size, num_pages=3 * per_seq + 4, generator=g)
    assert bt.shape == (3, per_seq) and bt.dtype == torch.int32 and bt.unique().numel() == 3 * per_seq
    assert kp.shape == (3 * per_seq + 4, page_size, 2, 8) and sp.shape == kp.shape[:3]
    assert torch.equal(dense_from_paged(kp, bt, 37), k) and torch.equal(dense_from_paged(sp, bt, 37), s)


def test_build_fp8_paged_cache():
    k, v = torch.randn(2, 50, 2, 16, dtype=torch.bfloat16), torch.randn(2, 50, 2, 16, dtype=torch.bfloat16)
    kc, vc, ks, vs, bt = build_fp8_paged_cache(k, v, 16)
    k8, v8, ks0, vs0 = quantize_kv_fp8(k, v)
    assert kc.dtype == torch.float8_e4m3fn and kc.shape == (8, 16, 2, 16)
    assert torch.equal(dense_from_paged(kc.view(torch.uint8), bt, 50), k8.view(torch.uint8))
    assert torch.equal(dense_from_paged(vs, bt, 50), vs0)
    # scales with each head's slots contiguous (the layout the sm90 decoder reads 4 per copy), dense and paged
    assert ks0.stride() == (100, 1, 50) and ks.shape == (8, 16, 2) and ks.stride() == (32, 1, 16)


def _append_case(paged, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    B, MNEW, H, D, P = 3, 3, 2, 32, 8
    before = torch.tensor([14, 0, 5], dtype=torch.int32)
    kn = (torch.randn(B, MNEW, H, D, generator=g) * 4).to(torch.float16)
    vn = torch.randn(B, MNEW, H, D, generator=g).to(torch.float16)
    vn[1, 0, 1] = 0.0  # an all-zero row gets scale 1
    store = torch.uint8 if dtype.itemsize == 1 else dtype
    if paged:
        bt = torch.randperm(B * 4, generator=g)[: B * 3].view(B, 3).to(torch.int32)
        shape = (B * 4, P)
    else:
        bt = None
        shape = (B, 24)
    kc = torch.randint(0, 100, (*shape, H, D), generator=g).to(store)
    vc = torch.randint(0, 100, (*shape, H, D), generator=g).to(store)
    ks, vs = torch.rand(*shape, H, generator=g), torch.rand(*shape, H, generator=g)
    return kn, vn, kc, vc, ks, vs, before, bt


def _dense(x, bt, L):
    return x[:, :L] if bt is None else dense_from_paged(x, bt, L)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype,scales", [(torch.float16, None), (torch.float8_e4m3fn, "tokens"),
                                          (torch.float8_e4m3fn, "keys")])
def test_kv_append(paged, dtype, scales):
    """New rows land at cache_seqlens; fp8 rows quantized per token, scales written through their strides
    (token-major or each head's slots contiguous, the builders' layout)."""
    from fmha_ops.kernels.triton.kv_append import kv_append

    kn, vn, kc, vc, ks, vs, before, bt = _append_case(paged, dtype, seed=int(paged))
    fp8 = dtype.itemsize == 1
    exp = [t.clone() for t in (kc, vc, ks, vs)]
    dev = [t.to(DEVICE) for t in (kn, vn, kc, vc, ks, vs, before)]
    if scales == "keys":
        dev[4], dev[5] = keys_contiguous(dev[4]), keys_contiguous(dev[5])
    if fp8:
        dev[2], dev[3] = dev[2].view(dtype), dev[3].view(dtype)
    kv_append(*dev[:4], dev[6], block_table=None if bt is None else bt.to(DEVICE),
              k_scale=dev[4] if fp8 else None, v_scale=dev[5] if fp8 else None)
    got = [dev[2].view(kc.dtype).cpu(), dev[3].view(vc.dtype).cpu(), dev[4].cpu(), dev[5].cpu()]
    # expected: the same tensors with the new rows written at before[b] + t
    L = 24
    dense_exp = [_dense(t, bt, L).clone() for t in exp]
    k_new, v_new, ks_new, vs_new = quantize_kv_fp8(kn, vn) if fp8 else (kn, vn, None, None)
    for b in range(3):
        sl = slice(int(before[b]), int(before[b]) + 3)
        dense_exp[0][b, sl] = k_new[b].view(torch.uint8) if fp8 else k_new[b]
        dense_exp[1][b, sl] = v_new[b].view(torch.uint8) if fp8 else v_new[b]
        if fp8:
            dense_exp[2][b, sl], dense_exp[3][b, sl] = ks_new[b], vs_new[b]
    dense_got = [_dense(t, bt, L) for t in got]
    assert torch.equal(dense_got[2], dense_exp[2]) and torch.equal(dense_got[3], dense_exp[3])
    if fp8:
        assert dense_got[3][1, int(before[1]), 1] == 1.0
    for g, e in zip(dense_got[:2], dense_exp[:2]):
        if fp8:
            g, e = g.view(dtype).float(), e.view(dtype).float()
            bad = g != e
            if not HAS_CUDA:
                # interpreter bug: an fp32 -> fp8 cast that rounds up into the next binade (126.8 -> 128)
                # yields half the value (64); allow exactly that, nothing else
                assert ((2 * g[bad] == e[bad]) & (torch.frexp(e[bad]).mantissa.abs() == 0.5)).all()
                bad = bad & ~(2 * g == e)
            assert not bad.any()
        else:
            assert torch.equal(g, e)
    if bt is not None:  # pages outside the block table untouched
        unused = sorted(set(range(kc.shape[0])) - set(bt.flatten().tolist()))
        assert torch.equal(got[0][unused], exp[0][unused])


def test_kvcache_fp8_scales_reach_the_kernel_as_views(monkeypatch):
    """flash_attn_with_kvcache passes the per-token scales of build_fp8_paged_cache (each head's slots contiguous)
    to the decode kernel as they are: same storage, same strides, no copy; the result matches the reference op."""
    import fmha_ops
    from fmha_ops.kernels.triton import decode
    from fmha_ops.ops import triton_decode  # noqa: F401  (registers the op)

    g = torch.Generator().manual_seed(4)
    k = torch.randn(3, 40, 2, 32, generator=g).half()
    v = torch.randn(3, 40, 2, 32, generator=g).half()
    q = torch.randn(3, 1, 4, 32, generator=g).half()
    kc, vc, ks, vs, table = build_fp8_paged_cache(k, v, 16, num_pages=12, generator=g)
    kc, vc, ks, vs, table = (t.to(DEVICE) for t in (kc, vc, ks, vs, table))
    lens = torch.tensor([40, 3, 17], dtype=torch.int32, device=DEVICE)
    seen = {}
    real = decode.paged_decode

    def spy(*args, **kw):
        seen.update(k_scale=kw["k_scale"], v_scale=kw["v_scale"])
        return real(*args, **kw)

    monkeypatch.setattr(decode, "paged_decode", spy)
    call = dict(cache_seqlens=lens, page_table=table, k_descale=ks, v_descale=vs, causal=True)
    with fmha_ops.use_ops("triton_splitKF"):
        out = fmha_ops.flash_attn_with_kvcache(q.to(DEVICE), kc, vc, **call)
    for got, given in ((seen["k_scale"], ks), (seen["v_scale"], vs)):
        assert got.data_ptr() == given.data_ptr() and got.stride() == given.stride() and got.shape == given.shape
    with fmha_ops.use_ops("torch_referenceF"):
        ref = fmha_ops.flash_attn_with_kvcache(q.to(DEVICE), kc, vc, **call)
    assert (out.float() - ref.float()).abs().max() < 2e-3

