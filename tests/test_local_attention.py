"""Local attention windows, softcap and tensor biases, against an independent float64 implementation:
dense boolean masks built by plain loops from each mask's parameters (xformers' definitions), never
through ``AttentionBias.segments``. Also the low-level xformers API, the new mask constructors and
transforms, and FA3's ``window_size`` / ``softcap``."""
from __future__ import annotations

import math

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.testing import error_report

F64 = torch.float64
DEVICE = "cpu"


def rnd(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def visible(i, j, nq, nk, causal: str, left: int, right: int) -> bool:
    """xformers' rule for one (query, key) pair of a sequence with nq queries and nk keys."""
    aligned = i if causal == "tl" else i + nk - nq
    ok = True
    if causal:
        ok = j <= aligned
    if left >= 0:
        ok = ok and j >= aligned - left
    if right >= 0:
        ok = ok and j <= aligned + right
    return ok


def dense_mask(nq, nk, causal, left, right) -> torch.Tensor:
    return torch.tensor([[visible(i, j, nq, nk, causal, left, right) for j in range(nk)] for i in range(nq)],
                        dtype=torch.bool).reshape(nq, nk)


def naive(q, k, v, allowed, scale=None, softcap=0.0, bias=None):
    """float64 attention; q (B, Mq, Hq, K), k / v (B, Mk, Hkv, *); allowed (Mq, Mk) bool; bias (B, Hq, Mq, Mk)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double()
    s = s.masked_fill(~allowed, -math.inf)
    mx = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)))
    den = e.sum(-1, keepdim=True)
    return torch.einsum("bhqk,bkhd->bqhd", e / torch.where(den > 0, den, torch.ones_like(den)), v)


def assert_close(out, ref, tol=3e-6):
    r = error_report(out, ref)
    assert out.shape == ref.shape and torch.isfinite(out).all() and r["rel"] < tol, r


DENSE = [  # (mask, causal alignment, window_left, window_right)
    (lambda: ab.LocalAttentionFromBottomRightMask(window_left=2, window_right=1), "", 2, 1),
    (lambda: ab.LocalAttentionFromBottomRightMask(window_left=0, window_right=0), "", 0, 0),
    (lambda: ab.LocalAttentionFromBottomRightMask(window_left=-1, window_right=3), "", -1, 3),
    (lambda: ab.LowerTriangularFromBottomRightMask().make_local_attention(3), "br", 2, -1),
    (lambda: ab.LowerTriangularFromBottomRightLocalAttentionMask(1), "br", 0, -1),
]


@pytest.mark.parametrize("make,causal,left,right", DENSE)
@pytest.mark.parametrize("mq,mk", [(1, 1), (7, 7), (5, 17), (17, 5)])
def test_dense_local_masks(make, causal, left, right, mq, mk):
    mask = make()
    assert (mask.window_left, mask.window_right) == (left, right)
    want = dense_mask(mq, mk, causal, left, right)
    assert torch.equal(mask.materialize((mq, mk)) == 0, want)
    g = torch.Generator().manual_seed(mq * 31 + mk)
    q, k, v = rnd(2, mq, 4, 16, gen=g), rnd(2, mk, 2, 16, gen=g), rnd(2, mk, 2, 16, gen=g)
    ref = naive(q, k, v, want)
    for op in ("torch_referenceF", "sdpa_mathF"):
        assert_close(fmha_ops.memory_efficient_attention(q, k, v, mask, op=op), ref)
    p = fmha_ops.make_inputs(q, k, v, mask).problem()
    assert (p.window_left, p.window_right, p.windowed) == (left, right, left >= 0 or right >= 0)


def _varlen(q_lens, k_lens, causal, left, right) -> torch.Tensor:
    m = torch.zeros(sum(q_lens), sum(k_lens), dtype=torch.bool)
    q0 = k0 = 0
    for nq, nk in zip(q_lens, k_lens):
        m[q0:q0 + nq, k0:k0 + nk] = dense_mask(nq, nk, causal, left, right)
        q0, k0 = q0 + nq, k0 + nk
    return m


@pytest.mark.parametrize("kind", ["tl", "br", "none"])
def test_varlen_local_masks(kind):
    q_lens, k_lens = [3, 1, 9, 4], [5, 2, 9, 12]
    base = ab.BlockDiagonalMask.from_seqlens(q_lens, k_lens)
    if kind == "tl":
        mask, left, right = base.make_local_attention(3), 2, -1
        assert type(mask) is ab.BlockDiagonalCausalLocalAttentionMask and mask.KIND == ab.BLOCK_DIAGONAL_CAUSAL
    elif kind == "br":
        mask, left, right = base.make_local_attention_from_bottomright(4), 3, -1
        assert mask.KIND == ab.BLOCK_DIAGONAL_CAUSAL_BR
    else:
        mask, left, right = ab.BlockDiagonalLocalAttentionFromBottomRightMask(base.q_seqinfo, base.k_seqinfo, None,
                                                                               1, 2), 1, 2
    want = _varlen(q_lens, k_lens, "" if kind == "none" else kind, left, right)
    assert torch.equal(mask.materialize((sum(q_lens), sum(k_lens))) == 0, want)
    g = torch.Generator().manual_seed(3)
    q, k, v = rnd(1, sum(q_lens), 2, 8, gen=g), rnd(1, sum(k_lens), 1, 8, gen=g), rnd(1, sum(k_lens), 1, 8, gen=g)
    assert_close(fmha_ops.memory_efficient_attention(q, k, v, mask), naive(q, k, v, want))


def test_varlen_local_mask_refuses_unreachable_queries():
    with pytest.raises(ValueError, match="window_size must be an int >= 1, got 0"):
        ab.BlockDiagonalMask.from_seqlens([2]).make_local_attention(0)
    with pytest.raises(ValueError, match="sequence 0 has 6 queries and 2 keys: with window_size=3"):
        ab.BlockDiagonalMask.from_seqlens([6], [2]).make_local_attention(3)
    with pytest.raises(ValueError, match="window_left must be an int >= -1, got -2"):
        ab.LocalAttentionFromBottomRightMask(-2, 0)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("local", ["causal", "window"])
def test_padded_and_paged_local_masks(paged, local):
    q_lens, k_lens, pad = [1, 2, 3], [5, 8, 0], 8
    if local == "causal":
        mask = ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask.from_seqlens_local(q_lens, pad, k_lens, 3)
        causal, left, right = "br", 2, -1
    else:
        mask = ab.BlockDiagonalPaddedKeysMask.from_seqlens(q_lens, pad, k_lens).make_local_attention(1, 1)
        causal, left, right = "", 1, 1
    want = torch.zeros(sum(q_lens), 3 * pad, dtype=torch.bool)
    q0 = 0
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        want[q0:q0 + nq, b * pad:b * pad + nk] = dense_mask(nq, nk, causal, left, right)
        q0 += nq
    g = torch.Generator().manual_seed(5)
    q, k, v = rnd(1, sum(q_lens), 2, 16, gen=g), rnd(1, 3 * pad, 2, 16, gen=g), rnd(1, 3 * pad, 2, 16, gen=g)
    ref = naive(q, k, v, want)
    if paged:
        if local == "window":
            with pytest.raises(ValueError, match="has no paged form"):
                mask.make_paged(torch.zeros(3, 2, dtype=torch.int32), 4)
            return
        table = torch.tensor([[5, 0], [2, 4], [1, 3]], dtype=torch.int32)
        mask = mask.make_paged(table, 4)
        assert type(mask) is ab.PagedBlockDiagonalCausalLocalPaddedKeysMask and mask.window_left == 2
        pool_k, pool_v = torch.zeros(1, 24, 2, 16), torch.zeros(1, 24, 2, 16)
        for b in range(3):
            for p in range(2):
                rows = slice(b * pad + 4 * p, b * pad + 4 * p + 4)
                pool_k[0, 4 * table[b, p]:4 * table[b, p] + 4], pool_v[0, 4 * table[b, p]:4 * table[b, p] + 4] = \
                    k[0, rows], v[0, rows]
        k, v = pool_k, pool_v
    assert_close(fmha_ops.memory_efficient_attention(q, k, v, mask), ref)


def test_softcap_reference_and_refusals():
    g = torch.Generator().manual_seed(7)
    q, k, v = rnd(2, 9, 4, 32, gen=g) * 3, rnd(2, 11, 2, 32, gen=g) * 3, rnd(2, 11, 2, 32, gen=g)
    ref = naive(q, k, v, dense_mask(9, 11, "br", -1, -1), softcap=2.5)
    out = fmha_ops.memory_efficient_attention(q, k, v, ab.LowerTriangularFromBottomRightMask(), softcap=2.5)
    assert_close(out, ref)
    assert error_report(fmha_ops.memory_efficient_attention(q, k, v, ab.LowerTriangularFromBottomRightMask()),
                        ref)["rel"] > 1e-3  # the cap changes the result: the test can fail
    inp = fmha_ops.make_inputs(q, k, v, softcap=2.5)
    assert inp.problem().softcap and "softcap" in inp.problem().bucket()
    with pytest.raises(ValueError, match=r"softcap > 0 not supported; only softcap=0"):
        fmha_ops.memory_efficient_attention(q, k, v, op="sdpa_mathF", softcap=2.5)
    with pytest.raises(ValueError, match=r"softcap must be a finite float >= 0"):
        fmha_ops.memory_efficient_attention(q, k, v, softcap=-1.0)


def test_window_refused_by_ops_without_windows():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"local attention window \(window_left=2, window_right=1\) not supported"):
        fmha_ops.memory_efficient_attention(q, q, q, ab.LocalAttentionFromBottomRightMask(2, 1), op="sdpa_flashF")


@pytest.mark.parametrize("form", ["tensor", "causal_tensor", "add_bias", "bmk", "bmghk"])
def test_tensor_bias_and_its_gradient(form):
    g = torch.Generator().manual_seed(11)
    b, mq, mk, hq = 2, 6, 9, 4
    q, k, v = (rnd(b, m, hq, 16, gen=g).requires_grad_() for m in (mq, mk, mk))
    bias = (rnd(b, hq, mq, mk, gen=g) * 2).requires_grad_()
    allowed = dense_mask(mq, mk, "tl" if form in ("causal_tensor", "add_bias") else "", -1, -1)
    attn_bias = {"tensor": bias, "causal_tensor": ab.LowerTriangularMaskWithTensorBias(bias),
                 "add_bias": ab.LowerTriangularMask().add_bias(bias)}.get(form, bias)
    if form == "bmk":  # (B * H, M, K) with a (B * H, Mq, Mk) bias
        qq, kk, vv = (t.transpose(1, 2).reshape(b * hq, -1, 16) for t in (q, k, v))
        out = fmha_ops.memory_efficient_attention(qq, kk, vv, bias.reshape(b * hq, mq, mk))
        out = out.reshape(b, hq, mq, 16).transpose(1, 2)
    elif form == "bmghk":
        qq, kk, vv = (t.reshape(b, t.shape[1], 2, 2, 16) for t in (q, k, v))
        out = fmha_ops.memory_efficient_attention(qq, kk, vv, bias.reshape(b, 2, 2, mq, mk)).reshape(b, mq, hq, 16)
    else:
        out = fmha_ops.memory_efficient_attention(q, k, v, attn_bias)
    ref = naive(q, k, v, allowed, bias=bias)
    assert_close(out, ref)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), go)
    ref_grads = torch.autograd.grad(ref, (q, k, v, bias), go.double())
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, tol=2e-5)


def test_tensor_bias_refused_where_it_cannot_run():
    q = torch.randn(1, 8, 2, 16)
    bias = torch.randn(1, 2, 8, 8, requires_grad=True)
    with pytest.raises(ValueError, match="attn_bias tensor not supported"):
        fmha_ops.memory_efficient_attention(q, q, q, bias, op="sdpa_flashF")
    with pytest.raises(ValueError, match=r"has shape \(3, 8\); it must be broadcastable"):
        fmha_ops.memory_efficient_attention(q, q, q, torch.zeros(3, 8))


def test_lowlevel_forward_backward_match_autograd():
    g = torch.Generator().manual_seed(13)
    q, k, v = (rnd(2, m, 4, 16, gen=g).requires_grad_() for m in (7, 10, 10))
    mask = ab.LowerTriangularFromBottomRightMask().make_local_attention(4)
    out, lse = fmha_ops.memory_efficient_attention_forward_requires_grad(q, k, v, mask)
    assert out.shape == (2, 7, 4, 16) and lse.shape == (2, 4, 7) and not out.requires_grad
    go = torch.randn_like(out)
    dq, dk, dv = fmha_ops.memory_efficient_attention_backward(go, out, lse, q, k, v, mask)
    ref = naive(q, k, v, dense_mask(7, 10, "br", 3, -1))
    for got, want in zip((dq, dk, dv), torch.autograd.grad(ref, (q, k, v), go.double())):
        assert_close(got, want, tol=2e-5)
    q3, k3, v3 = (t.detach()[:, :, 0] for t in (q, k, v))  # BMK
    o3, l3 = fmha_ops.memory_efficient_attention_forward_requires_grad(q3, k3, v3)
    assert o3.shape == (2, 7, 16) and l3.shape == (2, 1, 7)
    assert [t.shape for t in fmha_ops.memory_efficient_attention_backward(torch.ones_like(o3), o3, l3, q3, k3, v3)] \
        == [q3.shape, k3.shape, v3.shape]
    with pytest.raises(ValueError, match=r"lse has shape \(2, 7\); expected \(2, 4, 7\)"):
        fmha_ops.memory_efficient_attention_backward(go, out, lse[:, 0], q, k, v, mask)


@pytest.mark.parametrize("fn", ["partial", "forward_requires_grad", "backward"])
def test_lowlevel_api_refuses_dropout(fn):
    q = torch.randn(1, 4, 1, 8)
    call = {"partial": lambda: fmha_ops.memory_efficient_attention_partial(q, q, q, p=0.1),
            "forward_requires_grad": lambda: fmha_ops.memory_efficient_attention_forward_requires_grad(q, q, q, p=0.1),
            "backward": lambda: fmha_ops.memory_efficient_attention_backward(q, q, torch.zeros(1, 1, 4), q, q, q,
                                                                             p=0.1)}[fn]
    with pytest.raises(NotImplementedError, match="does not support dropout"):
        call()


def test_seqinfo_fields_in_xformers_order_and_inplace_updates():
    info = ab._SeqLenInfo(torch.tensor([0, 2, 5], dtype=torch.int32), 3, 2, [0, 2, 5])  # xformers' positional order
    assert info.seqstart_py == [0, 2, 5] and info.max_seqlen == 3 and list(info.intervals()) == [(0, 2), (2, 5)]
    info.from_seqlens_inplace([1, 3])
    assert info.seqstart_py == [0, 1, 4] and info.seqstart.tolist() == [0, 1, 4]
    with pytest.raises(ValueError, match="in-place update needs 2 lengths <= max_seqlen=3"):
        info.from_seqlens_inplace([4, 1])
    padded = ab._PaddedSeqLenInfo.from_seqlens_padded([2, 3, 2], 4)
    assert (padded.seqstart_py, padded.max_seqlen, padded.min_seqlen, padded.seqlen_py, padded.padding) == \
        ([0, 4, 8, 12], 3, 2, [2, 3, 2], 4)
    assert list(padded.intervals()) == [(0, 2), (4, 7), (8, 10)] and padded.seqstart.tolist() == [0, 4, 8, 12]
    padded.from_seqlens_padded_inplace([1, 0, 3])
    assert padded.seqlen.tolist() == [1, 0, 3] and padded.seqlen_py == [1, 0, 3]
    with pytest.raises(NotImplementedError, match="from_seqlens_padded"):
        ab._PaddedSeqLenInfo.from_seqlens([1])
    dev = ab._PaddedSeqLenInfo.from_device_seqlens(torch.tensor([3, 1], dtype=torch.int32), 4)
    assert dev.seqlen_py is None and dev.lengths() == [3, 1] and dev.seqstart.tolist() == [0, 4, 8]


def test_tensor_lists_split_and_transforms():
    g = torch.Generator().manual_seed(17)
    xs = [rnd(1, 3, 2, 8, gen=g), rnd(2, 5, 2, 8, gen=g), rnd(1, 1, 2, 8, gen=g)]
    mask, x = ab.BlockDiagonalMask.from_tensor_list(xs)
    assert x.shape == (1, 14, 2, 8) and mask.q_seqinfo.seqlens == [3, 5, 5, 1] and mask._batch_sizes == [1, 2, 1]
    assert all(torch.equal(a, b) for a, b in zip(mask.split(x), xs))
    causal = mask.make_causal()
    assert causal._batch_sizes == [1, 2, 1] and [t.shape for t in causal.split_queries(x)] == [t.shape for t in xs]
    ks = [rnd(1, 4, 2, 8, gen=g), rnd(2, 2, 2, 8, gen=g), rnd(1, 6, 2, 8, gen=g)]
    m2, q, k, v = ab.BlockDiagonalMask.from_tensor_lists_qkv(xs, ks, ks)
    assert m2.k_seqinfo.seqlens == [4, 2, 2, 6] and torch.equal(k, v) and q.shape[1] == 14
    assert all(torch.equal(a, b) for a, b in zip(m2.split_kv(k), ks))
    with pytest.raises(ValueError, match="split needs queries and keys packed alike"):
        m2.split(q)
    with pytest.raises(ValueError, match="cannot be split: expected"):
        mask.split(x[:, :5])
    assert ab.LowerTriangularMask(device="cpu").to("meta").KIND == ab.CAUSAL
    assert type(m2.make_local_attention(5).to("meta")) is ab.BlockDiagonalCausalLocalAttentionMask


def test_paged_from_seqlens_and_padded_extra_rows():
    table = torch.tensor([[1, 2], [0, 3]], dtype=torch.int32)
    m = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 2], [5, 8], table, 4)
    assert m.k_seqinfo.padding == 8 and m.k_seqinfo.seqlen.tolist() == [5, 8]
    got = m.materialize((3, 16)) == 0  # xformers' shape: 2 sequences x 8 keys in, 4 pages x 4 columns out
    assert got.shape == (3, 16) and got[0].nonzero().flatten().tolist() == [4, 5, 6, 7, 8]
    padded = ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 4, [2, 3])
    g = torch.Generator().manual_seed(19)
    q, k, v = rnd(1, 2, 1, 8, gen=g), rnd(1, 11, 1, 8, gen=g), rnd(1, 11, 1, 8, gen=g)  # 3 rows past 2 x 4
    want = torch.zeros(2, 11, dtype=torch.bool)
    want[0, :2], want[1, 4:7] = True, True
    assert_close(fmha_ops.memory_efficient_attention(q, k, v, padded), naive(q, k, v, want))


@pytest.mark.parametrize("causal", [False, True])
def test_gappy_masks(causal):
    q_lens, starts, k_lens = [2, 1, 3], [1, 9, 4, 14], [4, 0, 5]
    cls = ab.BlockDiagonalCausalWithOffsetGappyKeysMask if causal else ab.BlockDiagonalGappyKeysMask
    mask = cls.from_seqlens(q_lens, starts, k_lens)
    want = torch.zeros(6, 14, dtype=torch.bool)
    q0 = 0
    for nq, s, nk in zip(q_lens, starts, k_lens):
        want[q0:q0 + nq, s:s + nk] = dense_mask(nq, nk, "br" if causal else "", -1, -1)
        q0 += nq
    assert torch.equal(mask.materialize((6, 14)) == 0, want)
    g = torch.Generator().manual_seed(23)
    q, k, v = rnd(1, 6, 2, 8, gen=g), rnd(1, 14, 2, 8, gen=g), rnd(1, 14, 2, 8, gen=g)
    ref = naive(q, k, v, want)
    assert_close(fmha_ops.memory_efficient_attention(q, k, v, mask), ref)
    # the paged twin: each sequence's keys in blocks of 8 rows, two pages of 4 per sequence
    blocks = ab.BlockDiagonalGappyKeysMask.from_seqlens(q_lens, [1, 8 + 2, 16 + 3, 24], k_lens)
    table = torch.tensor([[4, 1], [0, 5], [2, 3]], dtype=torch.int32)
    paged = blocks.make_paged(table, 4, notional_padding=8)
    assert type(paged) is ab.PagedBlockDiagonalGappyKeysMask and paged.k_seqinfo.seqstart_py == [1, 2, 3, -1]
    direct = ab.PagedBlockDiagonalGappyKeysMask.from_seqlens(q_lens, [1, 2, 3], k_lens, table, 4)
    assert direct.k_seqinfo.seqlen_py == paged.k_seqinfo.seqlen_py == [5, 2, 8]
    assert torch.equal(paged.materialize((6, 24)), direct.materialize((6, 24)))


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_window_and_softcap(causal):
    g = torch.Generator().manual_seed(29)
    q, k, v = rnd(2, 7, 4, 16, gen=g), rnd(2, 12, 2, 16, gen=g), rnd(2, 12, 2, 16, gen=g)
    left, right = 3, 2
    out = fmha_ops.flash_attn_func(q, k, v, causal=causal, window_size=(left, right), softcap=4.0)
    want = dense_mask(7, 12, "br" if causal else "", left, -1 if causal else right)
    assert_close(out, naive(q, k, v, want, softcap=4.0))
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    qv, kv, vv = q[0], k[0], v[0]
    out = fmha_ops.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 4, 7, causal=causal, window_size=(left, right))
    want = _varlen([3, 4], [5, 7], "br" if causal else "", left, -1 if causal else right)
    assert_close(out[None], naive(qv[None], kv[None], vv[None], want))
    with pytest.raises(ValueError, match="window_size must be a pair of ints"):
        fmha_ops.flash_attn_func(q, k, v, window_size=3)


def test_flash_attn_with_kvcache_causal_window():
    g = torch.Generator().manual_seed(31)
    q = rnd(2, 2, 4, 16, gen=g)
    kc, vc = rnd(2, 10, 2, 16, gen=g), rnd(2, 10, 2, 16, gen=g)
    lens = torch.tensor([10, 6], dtype=torch.int32)
    out = fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, window_size=(2, 0))
    for b, n in enumerate(lens.tolist()):
        want = dense_mask(2, n, "br", 2, -1)
        assert_close(out[b:b + 1], naive(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], want))
    with pytest.raises(NotImplementedError, match="causal=False is not implemented by flash_attn_with_kvcache"):
        fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=(2, 1))


@pytest.mark.parametrize("case", ["window_sdpa", "tensor_bias", "softcap_reference"])
def test_compiled_calls_keep_windows_biases_and_softcap(case):
    g = torch.Generator().manual_seed(37)
    q, k, v = rnd(1, 6, 2, 16, gen=g), rnd(1, 9, 2, 16, gen=g), rnd(1, 9, 2, 16, gen=g)
    bias = rnd(1, 2, 6, 9, gen=g)
    call = {
        "window_sdpa": lambda q, k, v: fmha_ops.memory_efficient_attention(
            q, k, v, ab.LocalAttentionFromBottomRightMask(1, 2), op="sdpa_mathF"),
        "tensor_bias": lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, bias, op="torch_referenceF"),
        "softcap_reference": lambda q, k, v: fmha_ops.memory_efficient_attention(
            q, k, v, ab.LowerTriangularFromBottomRightMask(), softcap=1.5),
    }[case]
    torch._dynamo.reset()
    got = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v)
    assert_close(got, call(q, k, v).double(), tol=1e-6)
