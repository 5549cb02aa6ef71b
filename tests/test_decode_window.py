"""Local windows and softcap in the paged decoders, against float64 references.

Kernel level: ``paged_decode(window_left=, softcap=)`` against ``test_kernel_decode.reference`` (odd lengths, empty
sequences, partial pages, GQA, several queries, splits, fp8 KV), and a cache whose values left of every window are
NaN: a tile the kernel read there would turn the output NaN. Op level: the decode masks' local forms and
``flash_attn_with_kvcache(window_size=, softcap=)`` on the decode ops against the mask's ``materialize()``. CPU runs
use the Triton interpreter at tiny sizes (fp16: its bf16 dot is wrong); the ``gpu`` tests take real sizes.
"""
from __future__ import annotations

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.kv_cache import paged_from_dense
from fmha_ops.testing import error_report
from tests.conftest import DEVICE, HAS_CUDA
from tests.test_kernel_decode import FP16_REL, GPU_REL, _gluon_runs, check, check_gluon, make_case, reference, run

DTYPE = torch.float16 if DEVICE == "cpu" else torch.bfloat16
DECODE_OPS = ("triton_decoderF", "triton_splitKF")


@pytest.mark.parametrize("page_size", [None, 3, 16])
@pytest.mark.parametrize("window_left", [0, 5, 40])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_window(page_size, window_left, num_splits):
    q, kw, k, v = make_case(4, 1, 4, 2, 32, [70, 0, 1, 17], page_size=page_size, seed=window_left + 1)
    check(q, kw, k, v, rel=FP16_REL, num_splits=num_splits, window_left=window_left, block_n=16)


@pytest.mark.parametrize("MQ,G", [(3, 2), (5, 1), (2, 4)])
def test_window_several_queries_gqa(MQ, G):
    """Each query row has its own window (position seqlen - Mq + i); the splits cover the first query's."""
    q, kw, k, v = make_case(3, MQ, 2 * G, 2, 16, [MQ, 50, 33], page_size=16, seed=MQ * G)
    for splits in (1, 2):
        check(q, kw, k, v, rel=FP16_REL, num_splits=splits, window_left=7, block_n=16)


@pytest.mark.parametrize("softcap", [0.5, 4.0])
@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn])
def test_softcap(softcap, fp8):
    q, kw, k, v = make_case(3, 2, 4, 2, 32, [40, 1, 77], page_size=16, fp8=fp8, seed=7)
    q = q * 3  # scores well past the cap
    for splits in (1, 3):
        check(q, kw, k, v, rel=FP16_REL, num_splits=splits, softcap=softcap)


def test_window_and_softcap_fp8():
    q, kw, k, v = make_case(3, 1, 8, 2, 32, [65, 17, 2], page_size=None, fp8=torch.float8_e4m3fn, seed=2)
    check(q, kw, k, v, rel=FP16_REL, num_splits=2, window_left=9, softcap=2.0, block_n=16)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_tiles_left_of_the_window_are_not_read(page_size, num_splits):
    """Values of the keys in 16-key tiles wholly left of every query's window are NaN; any read of them
    would reach the output (0 * NaN in P @ V)."""
    g = torch.Generator().manual_seed(3)
    B, MQ, HQ, HKV, D, L, W = 2, 2, 4, 2, 16, 96, 20
    lens = [96, 61]
    q = torch.randn(B, MQ, HQ, D, generator=g).to(DTYPE)
    k = torch.randn(B, L, HKV, D, generator=g).to(DTYPE)
    v = torch.randn(B, L, HKV, D, generator=g).to(DTYPE)
    poisoned = v.clone()
    for b, n in enumerate(lens):
        poisoned[b, :max(n - MQ - W, 0) // 16 * 16] = float("nan")
    assert poisoned.isnan().any()
    if page_size is None:
        (kc, vc), bt = (k, poisoned), None
    else:
        (kc, vc), bt = paged_from_dense([k, poisoned], page_size, generator=g)
    kw = dict(k_cache=kc.to(DEVICE), v_cache=vc.to(DEVICE), seqlens=torch.tensor(lens, dtype=torch.int32).to(DEVICE),
              scale=D ** -0.5, block_table=None if bt is None else bt.to(DEVICE))
    out, lse = run(q.to(DEVICE), kw, num_splits=num_splits, window_left=W, block_n=16)
    ref, ref_lse = reference(q, k, v, torch.tensor(lens), D ** -0.5, window_left=W)
    assert not out.isnan().any()
    assert error_report(out.cpu(), ref)["rel"] < FP16_REL
    assert (lse.cpu().double() - ref_lse).abs().max() < 1e-3


def test_kernel_refuses_bad_window_and_softcap():
    from fmha_ops.kernels.triton.decode import paged_decode

    q, kw, _, _ = make_case(1, 1, 2, 1, 16, [4])
    with pytest.raises(ValueError, match="window_left=-2"):
        paged_decode(q, **kw, window_left=-2)
    with pytest.raises(ValueError, match="softcap=-1.0"):
        paged_decode(q, **kw, softcap=-1.0)


# ---- ops and the public API ------------------------------------------------------------------------------

def test_decode_ops_declare_windows_and_softcap():
    from fmha_ops.ops.triton_decode import TritonDecoderFwOp, TritonSplitKFwOp

    for op in (TritonDecoderFwOp, TritonSplitKFwOp):
        assert op.WINDOW and op.SOFTCAP


def _mask_reference(q, k, v, mask, scale, softcap):
    """float64 softmax(c * tanh(scale q.k / c) + mask) v from ``mask.materialize`` over the key (pool) rows."""
    g = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.double().cpu() for t in (q, k, v))
    s = torch.einsum("bmhd,bnhd->bhmn", qf, kf.repeat_interleave(g, 2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    if isinstance(mask, ab.PagedBlockDiagonalPaddedKeysMask):
        shape = shape[:3] + (mask.block_tables.numel() * mask.page_size,)
    bias = mask.materialize(shape, torch.float64)
    s = s + bias[..., :k.shape[1]]
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhmn,bnhd->bmhd", p, vf.repeat_interleave(g, 2))


def _decode_masks(mq: int, page: int = 8):
    """name -> (mask, key rows): each decode mask's local form over 4 sequences of odd lengths."""
    lens, padding = [mq, 17, 1 + mq, 30], 32
    q_lens = [mq] * 4
    table = torch.randperm(4 * padding // page, generator=torch.Generator().manual_seed(1)).int().view(4, -1)
    return {
        "padded_causal_local": (ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask.from_seqlens_local(
            q_lens, padding, lens, 6), 4 * padding),
        "paged_causal_local": (ab.PagedBlockDiagonalCausalLocalPaddedKeysMask.from_seqlens_local(
            q_lens, lens, table, page, 6), table.numel() * page),
        "padded_local": (ab.BlockDiagonalLocalAttentionPaddedKeysMask.from_seqlens_local(
            [1] * 4, padding, lens, 4, 3), 4 * padding) if mq == 1 else None,
    }


@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("mq", [1, 3])
@pytest.mark.parametrize("op", DECODE_OPS)
def test_local_decode_masks_through_the_api(op, mq, softcap):
    g = torch.Generator().manual_seed(mq)
    for name, entry in _decode_masks(mq).items():
        if entry is None:
            continue
        mask, rows = entry
        q = torch.randn(1, 4 * mq, 4, 16, generator=g).to(DTYPE)
        k, v = (torch.randn(1, rows, 2, 16, generator=g).to(DTYPE) for _ in range(2))
        out = fmha_ops.memory_efficient_attention(*(t.to(DEVICE) for t in (q, k, v)), mask.to(DEVICE), scale=0.3,
                                                  op=op, softcap=softcap)
        ref = _mask_reference(q, k, v, mask, 0.3, softcap)
        assert error_report(out.cpu(), ref)["rel"] < 3 * FP16_REL, name


def test_dense_local_mask_one_query_through_the_decoder():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 4, 16, generator=g).to(DTYPE)
    k, v = (torch.randn(2, 33, 2, 16, generator=g).to(DTYPE) for _ in range(2))
    for mask in (ab.LocalAttentionFromBottomRightMask(window_left=5, window_right=2),
                 ab.LowerTriangularFromBottomRightMask().make_local_attention(4)):
        out = fmha_ops.memory_efficient_attention(*(t.to(DEVICE) for t in (q, k, v)), mask, op="triton_decoderF")
        ref = _mask_reference(q, k, v, mask, 16 ** -0.5, 0.0)
        assert error_report(out.cpu(), ref)["rel"] < FP16_REL


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("page_size", [None, 8])
def test_flash_attn_with_kvcache_window_and_softcap(window, page_size):
    """FA3's window_size=(left, 0) with causal=True and softcap on the decode ops, dense and paged caches."""
    g = torch.Generator().manual_seed(window + 1)
    B, MQ, L = 3, 2, 40
    q = torch.randn(B, MQ, 4, 16, generator=g).to(DTYPE)
    k, v = (torch.randn(B, L, 2, 16, generator=g).to(DTYPE) for _ in range(2))
    lens = torch.tensor([MQ, 23, 40], dtype=torch.int32)
    if page_size is None:
        kc, vc, table = k, v, None
    else:
        (kc, vc), table = paged_from_dense([k, v], page_size, generator=g)
        table = table.to(DEVICE)
    ref, _ = reference(q, k, v, lens, 16 ** -0.5, window_left=window, softcap=1.5)
    for op in DECODE_OPS:
        with fmha_ops.use_ops(op):
            out = fmha_ops.flash_attn_with_kvcache(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE),
                                                   cache_seqlens=lens.to(DEVICE), page_table=table, causal=True,
                                                   window_size=(window, 0), softcap=1.5)
        assert error_report(out.cpu(), ref)["rel"] < FP16_REL, op


# ---- GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("window_left,softcap", [(0, 0.0), (255, 0.0), (1000, 30.0), (-1, 30.0), (4095, 0.0)])
def test_gpu_window_softcap_real_sizes(fp8, page_size, window_left, softcap):
    from fmha_ops.kernels.decode_splits import choose_num_splits

    lens = [4097, 0, 1, 1000, 3000, 17]
    q, kw, k, v = make_case(6, 1, 32, 8, 128, lens, page_size=page_size, dtype=torch.bfloat16, fp8=fp8,
                            dist="transformer", seed=window_left + 3)
    for s in (1, 4, choose_num_splits(6 * 8, 4097, 132)):
        check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], num_splits=s, window_left=window_left, softcap=softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("G,MQ,D", [(4, 1, 128), (8, 2, 64), (1, 5, 128), (4, 1, 256), (4, 1, 64)])
@pytest.mark.parametrize("window_left,softcap", [(0, 0.0), (300, 0.0), (100, 20.0), (-1, 20.0)])
def test_gpu_gluon_window_softcap(page_size, G, MQ, D, window_left, softcap):
    if not _gluon_runs():
        pytest.skip("the Gluon decoder runs on sm90")
    check_gluon([0, 1, 17, 1000, 4097, 33], G, MQ, D, page_size, G + MQ + window_left, window_left=window_left,
                softcap=softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("MQ,G", [(4, 4), (16, 1), (3, 5)])
def test_gpu_window_several_queries(MQ, G):
    q, kw, k, v = make_case(3, MQ, 2 * G, 2, 64, [MQ + 700, MQ, 2500], page_size=64, dtype=torch.bfloat16, seed=G)
    for s in (1, 3):
        check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], num_splits=s, window_left=100, softcap=10.0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs")
def test_gpu_window_kvcache_graph_replay():
    """flash_attn_with_kvcache with a window and softcap, captured in a CUDA graph, matches eager and the
    reference after the lengths change in place."""
    from fmha_ops.kv_cache import build_fp8_paged_cache

    g = torch.Generator(device="cuda").manual_seed(0)
    B, L = 8, 3000
    k, v = (torch.randn(B, L, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(B, 1, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k8, v8, ks, vs, table = build_fp8_paged_cache(k, v, 64)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")

    def call():
        return fmha_ops.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, k_descale=ks,
                                                v_descale=vs, causal=True, window_size=(511, 0), softcap=20.0)

    eager = call()
    from bench.common import capture_graph

    out_holder = []
    graph = capture_graph(lambda: out_holder.append(call()))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_holder[-1], eager)
    lens.copy_(torch.tensor([3000, 1, 17, 600, 512, 513, 2999, 0], dtype=torch.int32))
    graph.replay()
    kd = k8.float() * ks[..., None]
    vd = v8.float() * vs[..., None]
    from fmha_ops.kv_cache import dense_from_paged

    ref, _ = reference(q, dense_from_paged(kd, table, L), dense_from_paged(vd, table, L), lens.cpu(), 128 ** -0.5,
                       window_left=511, softcap=20.0)
    assert error_report(out_holder[-1].cpu().float(), ref)["rel"] < GPU_REL[torch.bfloat16]
