"""CPU tests of the FlyDSL decode host logic (packing, paged layout, splits, reduce maths)."""
import math
import sys

import pytest
import torch

from fmha_ops.kernels.flydsl import host
from fmha_ops.testing import error_report, transformer_like


def _dense_attention(q, k, v, seqlens, scale):
    """float64 (out, lse) of every query row over the first seqlens[b] keys (GQA by repeat)."""
    B, Mq, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = torch.zeros(B, Mq, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Mq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(seqlens[b])
        if n == 0:
            continue
        kb = k[b, :n].double().repeat_interleave(G, dim=1)
        vb = v[b, :n].double().repeat_interleave(G, dim=1)
        s = torch.einsum("mhd,nhd->hmn", q[b].double(), kb) * scale
        lse[b] = torch.logsumexp(s, -1)
        out[b] = torch.einsum("hmn,nhd->mhd", torch.softmax(s, -1), vb)
    return out, lse


def _case(B, Mq, Hq, Hkv, D, seqlens, page_size, dist, seed=0):
    L = max(max(seqlens), 1)
    if dist == "normal":
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(B, Mq, Hq, D, generator=g)
        k = torch.randn(B, L, Hkv, D, generator=g)
        v = torch.randn(B, L, Hkv, D, generator=g)
    else:
        q, k, v = transformer_like((B, Mq, Hq, D), (B, L, Hkv, D), dtype=torch.float32, seed=seed)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    kc, vc, bt = host.dense_to_paged(k, v, sl, page_size, shuffle=True, generator=torch.Generator().manual_seed(seed),
                                     spare_pages=2)
    return q, k, v, sl, kc, vc, bt


def test_host_does_not_import_flydsl():
    assert "flydsl" not in sys.modules or "fmha_ops.kernels.flydsl.decode" in sys.modules
    import fmha_ops.kernels.flydsl  # noqa: F401
    import fmha_ops.kernels.flydsl.launcher  # noqa: F401
    assert "fmha_ops.kernels.flydsl.decode" not in sys.modules


def test_available_gives_reason_here():
    reason = host.available()
    if torch.version.hip is None:
        assert isinstance(reason, str) and reason


@pytest.mark.parametrize("page_size", [1, 16, 48])
def test_dense_to_paged_roundtrip(page_size):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(3, 70, 2, 8, generator=g)
    v = torch.randn(3, 70, 2, 8, generator=g)
    sl = torch.tensor([70, 0, 17], dtype=torch.int32)
    kc, vc, bt = host.dense_to_paged(k, v, sl, page_size, shuffle=True, generator=g)
    assert bt.dtype == torch.int32 and bt.shape == (3, -(-70 // page_size))
    used = [int(bt[b, p]) for b in range(3) for p in range(-(-int(sl[b]) // page_size))]
    assert len(set(used)) == len(used) == kc.shape[0]  # every page owned once
    for b in range(3):
        n = int(sl[b])
        assert torch.equal(host.paged_to_dense(kc, bt[b:b + 1], n)[0], k[b, :n])
        assert torch.equal(host.paged_to_dense(vc, bt[b:b + 1], n)[0], v[b, :n])


@pytest.mark.parametrize("seqlen", [0, 1, 15, 16, 17, 1000, 4099])
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
def test_split_bounds_partition(seqlen, splits):
    covered = []
    for s in range(splits):
        lo, hi = host.split_bounds(seqlen, splits, s)
        assert lo % 16 == 0 and lo <= hi
        covered.extend(range(lo, hi))
    assert covered == list(range(seqlen))


def test_choose_num_splits():
    assert host.choose_num_splits(128, 8, 4, 1024) == 1  # enough workgroups already
    s = host.choose_num_splits(1, 8, 4, 131072)
    assert 1 < s <= host.MAX_SPLITS
    assert host.choose_num_splits(1, 8, 4, 300) == 1  # too few keys to split
    for B, L in [(1, 4096), (8, 32768), (2, 100)]:
        s = host.choose_num_splits(B, 8, 4, L)
        assert s == 1 or L // s >= 256


@pytest.mark.parametrize("dist", ["normal", "transformer"])
@pytest.mark.parametrize("B,Mq,Hq,Hkv,seqlens,page_size", [
    (2, 1, 8, 2, [17, 1], 16),
    (3, 3, 4, 4, [0, 33, 100], 32),
    (1, 2, 6, 1, [1000], 64),
])
def test_reference_matches_dense(dist, B, Mq, Hq, Hkv, seqlens, page_size):
    D = 128
    q, k, v, sl, kc, vc, bt = _case(B, Mq, Hq, Hkv, D, seqlens, page_size, dist)
    scale = 1 / math.sqrt(D)
    ref_o, ref_l = _dense_attention(q, k, v, sl, scale)
    out, lse = host.decode_reference(q, kc, vc, bt, sl)
    e = error_report(out, ref_o)
    assert e["rel"] < 1e-12 and e["max"] < 1e-10, e
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l))
    fin = torch.isfinite(ref_l)
    assert (lse[fin] - ref_l[fin]).abs().max() < 1e-10


@pytest.mark.parametrize("dist", ["normal", "transformer"])
@pytest.mark.parametrize("splits", [2, 3, 5, 16])
def test_split_partials_reduce_to_full(dist, splits):
    D = 128
    q, k, v, sl, kc, vc, bt = _case(3, 2, 8, 2, D, [0, 49, 1000], 16, dist, seed=splits)
    full_o, full_l = host.decode_reference(q, kc, vc, bt, sl)
    po, pl = host.decode_reference(q, kc, vc, bt, sl, num_splits=splits)
    if splits >= 3:
        assert torch.isneginf(pl[1, -1]).all()  # 49 keys leave the last split empty
    out, lse = host.reduce_reference(po, pl)
    e = error_report(out, full_o)
    assert e["rel"] < 1e-12, e
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # empty sequence: out 0
    assert torch.isneginf(lse[0]).all()  # and lse -inf
    assert (lse[1:] - full_l[1:]).abs().max() < 1e-10
    # float32 partials (what the kernel stores) reduce within float32 accuracy
    out32, _ = host.reduce_reference(po.float(), pl.float())
    e32 = error_report(out32, full_o)
    assert e32["rel"] < 1e-6 and e32["cos"] > 1 - 1e-10, e32


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_per_token_reference(fp8):
    D = 128
    q, k, v, sl, kc, vc, bt = _case(2, 1, 8, 2, D, [17, 300], 16, "transformer")
    k8, ks = host.quantize_per_token(kc, fp8)
    v8, vs = host.quantize_per_token(vc, fp8)
    assert ks.shape == kc.shape[:3] and ks.dtype == torch.float32
    deq = k8.double() * ks.double().unsqueeze(-1)
    e_q = error_report(deq, kc)
    assert e_q["rel"] < 0.05, e_q  # e4m3: 3 mantissa bits
    out, _ = host.decode_reference(q, k8, v8, bt, sl, k_scale=ks, v_scale=vs)
    out_deq, _ = host.decode_reference(q, deq, v8.double() * vs.double().unsqueeze(-1), bt, sl)
    assert error_report(out, out_deq)["rel"] < 1e-12
    ref, _ = _dense_attention(q, k, v, sl, 1 / math.sqrt(D))
    e = error_report(out, ref)
    assert e["rel"] < 0.1 and e["cos"] > 0.99, e


def _emulate_offsets(args, q, kc, bt, out, lse, split_out):
    """Re-derive element addresses the way decode.py does from the packed arguments."""
    (qf, kf, vf, ksf, vsf, btf, slf, of, lf, q_sb, q_sm, q_sh, kv_sp, kv_ss, kv_sh, sc_sp, sc_ss, sc_sh, bt_sb,
     o_sb, o_ss, o_sm, o_sh, l_sb, l_ss, l_sh, l_sm, B, Mq, G, Hkv, page_size, S, scale) = args
    g = torch.Generator().manual_seed(3)
    D = q.shape[-1]
    for _ in range(20):
        b = int(torch.randint(B, (1,), generator=g))
        m = int(torch.randint(Mq, (1,), generator=g))
        hkv = int(torch.randint(Hkv, (1,), generator=g))
        hq = hkv * G + int(torch.randint(G, (1,), generator=g))
        d = int(torch.randint(D, (1,), generator=g))
        assert qf[b * q_sb + m * q_sm + hq * q_sh + d] == q[b, m, hq, d]
        p = int(torch.randint(bt.shape[1], (1,), generator=g))
        page = int(btf[b * bt_sb + p])
        assert page == int(bt[b, p])
        slot = int(torch.randint(page_size, (1,), generator=g))
        assert kf[page * kv_sp + slot * kv_ss + hkv * kv_sh + d] == kc[page, slot, hkv, d]
        s = int(torch.randint(S, (1,), generator=g))
        o_idx = b * o_sb + s * o_ss + m * o_sm + hq * o_sh + d
        l_idx = b * l_sb + s * l_ss + hq * l_sh + m * l_sm
        if split_out:
            assert of[o_idx].data_ptr() == out[b, s, m, hq, d].data_ptr()
            assert lf[l_idx].data_ptr() == lse[b, s, hq, m].data_ptr()
        else:
            assert of[o_idx].data_ptr() == out[b, m, hq, d].data_ptr()
            assert lf[l_idx].data_ptr() == lse[b, hq, m].data_ptr()


@pytest.mark.parametrize("split", [False, True])
def test_decode_args_packing(split):
    D = 128
    q_full = torch.randn(2, 3, 8, 2 * D, dtype=torch.bfloat16)
    q = q_full[..., D:]  # non-contiguous q
    kc = torch.randn(5, 16, 2, D, dtype=torch.bfloat16)
    bt = torch.randint(0, 5, (2, 4), dtype=torch.int32)
    sl = torch.tensor([17, 64], dtype=torch.int32)
    S = 4 if split else 1
    if split:
        out, lse = torch.empty(2, S, 3, 8, D), torch.empty(2, S, 8, 3)
    else:
        out, lse = torch.empty(2, 3, 8, D, dtype=torch.bfloat16), torch.empty(2, 8, 3)
    args, consts = host.decode_args(q, kc, kc, bt, sl, out, lse, num_splits=S)
    assert consts == (D, True, False, split)
    assert all(t.dim() == 1 for t in args[:9])
    assert args[0].data_ptr() == q.data_ptr() and args[-1] == pytest.approx(1 / math.sqrt(D))
    _emulate_offsets(args, q, kc, bt, out, lse, split)


def test_reduce_args_packing():
    po, pl = torch.randn(2, 3, 1, 4, 128), torch.randn(2, 3, 4, 1)
    out, lse = torch.empty(2, 1, 4, 128, dtype=torch.float16), torch.empty(2, 4, 1)
    args, consts = host.reduce_args(po, pl, out, lse)
    assert consts == (128, False)
    assert args[4:8] == po.stride()[:4] and args[8:12] == pl.stride() and args[-4:] == (2, 1, 4, 3)


def test_kernel_configs_cover_every_launch():
    names = {host.config_name(c) for c in host.kernel_configs()}
    assert len(names) == 20
    for d in host.HEAD_DIMS:
        for dt in ("f16", "bf16"):
            assert f"reduce_d{d}_{dt}" in names
            for kv in (dt, "fp8"):
                for mode in ("single", "split"):
                    assert f"decode_d{d}_q{dt}_kv{kv}_{mode}" in names
