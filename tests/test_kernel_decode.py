"""Paged decode kernels (split-K decoder + reduce) against a float64 reference.

CPU runs go through the Triton interpreter at tiny sizes. The interpreter's bf16 ``tl.dot``
multiplies raw bf16 bit patterns (triton 3.6 ``create_dot``), so CPU tests run fp16 queries
and the bf16 path is covered by the ``gpu`` tests.
"""
from __future__ import annotations

import pytest
import torch

from fmha_ops.kv_cache import dequantize_fp8, keys_contiguous, paged_from_dense, quantize_kv_fp8
from tests.conftest import DEVICE
from fmha_ops.testing import error_report, transformer_like

CPU_DTYPE = torch.float16


def reference(q, k, v, seqlens, scale):
    """float64 decode attention on q's device; k, v dense (B, L, Hkv, D); returns CPU (out, lse (B, Hq, Mq))."""
    B, MQ, HQ, D = q.shape
    HKV = k.shape[2]
    G = HQ // HKV
    out = torch.zeros(B, MQ, HQ, D, dtype=torch.float64)
    lse = torch.full((B, HQ, MQ), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(seqlens[b])
        kk = k[b, :n].to(q.device).double()
        vv = v[b, :n].to(q.device).double()
        s = torch.einsum("mkgd,nkd->kgmn", q[b].double().view(MQ, HKV, G, D), kk) * scale
        pos = n - MQ + torch.arange(MQ, device=q.device)
        s = s.masked_fill(~(torch.arange(n, device=q.device)[None, :] <= pos[:, None]), float("-inf"))
        lb = torch.logsumexp(s, -1)
        p = torch.exp(s - lb[..., None]).nan_to_num(0.0)
        out[b] = torch.einsum("kgmn,nkd->mkgd", p, vv).reshape(MQ, HQ, D).cpu()
        lse[b] = lb.reshape(HQ, MQ).cpu()
    return out, lse


def make_case(B, MQ, HQ, HKV, D, seqlens, *, page_size=None, dtype=CPU_DTYPE, fp8=None, seed=0,
              dist="normal", split_kv=False):
    """Random inputs; returns (q, kwargs for paged_decode, dense reference K, V)."""
    g = torch.Generator().manual_seed(seed)
    L = max(max(seqlens), 1)
    if dist == "transformer":
        q, k, v = transformer_like((B, MQ, HQ, D), (B, L, HKV, D), dtype=dtype, seed=seed)
    else:
        q = torch.randn(B, MQ, HQ, D, generator=g).to(dtype)
        k = torch.randn(B, L, HKV, D, generator=g).to(dtype)
        v = torch.randn(B, L, HKV, D, generator=g).to(dtype)
    seq = torch.tensor(seqlens, dtype=torch.int32)
    tensors = [k, v]
    if fp8 is not None:
        k8, v8, ks, vs = quantize_kv_fp8(k, v, fp8)
        k, v = dequantize_fp8(k8, ks), dequantize_fp8(v8, vs)
        tensors = [k8.view(torch.uint8), v8.view(torch.uint8), ks, vs]
    if page_size is None:
        cache, bt = tensors, None
    else:
        cache, bt = paged_from_dense(tensors, page_size, num_pages=B * -(-L // page_size) + 3, generator=g)
    cache = [c.to(DEVICE) for c in cache]
    if split_kv:  # K and V interleaved in one buffer: each has its own non-contiguous strides
        # (built on the device: .to() would make the strided views contiguous)
        both = torch.stack(cache[:2], 2)
        cache[:2] = [both[:, :, 0], both[:, :, 1]]
    if fp8 is not None:
        cache[0], cache[1] = cache[0].view(fp8), cache[1].view(fp8)
    kw = dict(k_cache=cache[0], v_cache=cache[1], seqlens=seq.to(DEVICE), scale=D ** -0.5,
              block_table=None if bt is None else bt.to(DEVICE))
    if fp8 is not None:
        kw.update(k_scale=cache[2], v_scale=cache[3])
    return q.to(DEVICE), kw, k, v


def run(q, kw, **extra):
    from fmha_ops.kernels.triton.decode import paged_decode

    B, MQ, HQ, D = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, HQ, MQ), float("nan"), device=q.device)
    o, l = paged_decode(q, out=out, lse=lse, **kw, **extra)
    assert o is out and l is lse
    return out, lse


def check(q, kw, k, v, *, rel, lse_tol=2e-4, **extra):
    out, lse = run(q, kw, **extra)
    ref, ref_lse = reference(q, k, v, kw["seqlens"].cpu(), kw["scale"])
    out, lse = out.cpu(), lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten output"
    rep = error_report(out, ref)
    assert rep["rel"] < rel and rep["cos"] > 1 - rel, rep
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (out.permute(0, 2, 1, 3)[empty] == 0).all()
    err = (lse.double() - ref_lse).abs()[~empty]
    assert err.numel() == 0 or err.max() < lse_tol * (1 + ref_lse.abs()[~empty].max()), err.max()
    return out, lse, rep


# fp16 out rounding (2^-11) and P rounded to fp16 before P @ V give rel ~5e-4 on random inputs.
FP16_REL = 2e-3


@pytest.mark.parametrize("page_size", [None, 1, 3, 16, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_pages_and_splits(page_size, num_splits):
    q, kw, k, v = make_case(4, 2, 4, 2, 32, [70, 0, 1, 37], page_size=page_size, seed=page_size or 0)
    check(q, kw, k, v, rel=FP16_REL, num_splits=num_splits)


def test_reduce_in_head_dim_chunks():
    """Few output rows: the split reduce runs several programs per row, each on a chunk of the head dims (D=128:
    4 chunks of 32), and matches the single pass."""
    from fmha_ops.kernels.triton.decode import _reduce_chunks

    assert _reduce_chunks(2 * 4, 128) == 4 and _reduce_chunks(4096, 128) == 1
    q, kw, k, v = make_case(2, 1, 4, 2, 128, [90, 33], page_size=16, seed=13)
    one, one_lse, _ = check(q, kw, k, v, rel=FP16_REL, num_splits=1)
    split, split_lse, _ = check(q, kw, k, v, rel=FP16_REL, num_splits=3)
    assert error_report(split, one)["rel"] < FP16_REL and (split_lse - one_lse).abs().max() < 1e-4


@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_n,num_splits", [(16, 1), (32, 1), (16, 3)])
def test_page_aligned_tiles(fp8, block_n, num_splits):
    """Pages a multiple of BLOCK_N: one page id per tile, loaded a tile ahead (shuffled pages, several per
    sequence, a split boundary inside a page)."""
    q, kw, k, v = make_case(3, 1, 4, 2, 32, [150, 1, 64], page_size=32, fp8=fp8, seed=9)
    check(q, kw, k, v, rel=FP16_REL, num_splits=num_splits, block_n=block_n)


@pytest.mark.parametrize("G", range(1, 17))
def test_gqa_ratios_and_q_lengths(G):
    MQ = (7 * G) % 16 + 1  # every Mq in 1..16 once over the 16 ratios
    q, kw, k, v = make_case(3, MQ, 2 * G, 2, 16, [MQ - 1, 45, MQ + 20], page_size=16, seed=G)
    check(q, kw, k, v, rel=FP16_REL, num_splits=1 + G % 3)


def test_many_rows_several_row_blocks():
    q, kw, k, v = make_case(2, 16, 16, 1, 16, [16, 90], page_size=64, seed=3)  # 256 rows per kv head
    check(q, kw, k, v, rel=FP16_REL, num_splits=2)


@pytest.mark.parametrize("page_size", [None, 16])
def test_fp8_kv_matches_dequantized_reference(page_size):
    # float8_e4m3fnuz is not covered: the interpreter cannot convert fp8e4b8 ("fail to convert")
    q, kw, k, v = make_case(3, 3, 8, 2, 32, [80, 2, 0], page_size=page_size, fp8=torch.float8_e4m3fn, seed=5)
    check(q, kw, k, v, rel=FP16_REL, num_splits=2)


def test_fp8_v_scales_changing_across_tiles():
    # acc is kept in units of the current tile's largest V scale: tiles whose V magnitudes differ by
    # 1e7 (both directions) must rescale it exactly; 16-key tiles put several tiles in each split
    g = torch.Generator().manual_seed(9)
    B, MQ, HQ, HKV, D, L = 2, 2, 4, 2, 32, 100
    mag = torch.where(torch.arange(L) % 48 < 16, 1e-4, 1e3)[None, :, None, None]
    k = torch.randn(B, L, HKV, D, generator=g).half()
    v = (torch.randn(B, L, HKV, D, generator=g) * mag).half()
    q = torch.randn(B, MQ, HQ, D, generator=g).half()
    k8, v8, ks, vs = quantize_kv_fp8(k, v, torch.float8_e4m3fn)
    kd, vd = dequantize_fp8(k8, ks), dequantize_fp8(v8, vs)
    cache = [c.to(DEVICE) for c in (k8.view(torch.uint8), v8.view(torch.uint8), ks, vs)]
    seq = torch.tensor([L, 61], dtype=torch.int32)
    kw = dict(k_cache=cache[0].view(torch.float8_e4m3fn), v_cache=cache[1].view(torch.float8_e4m3fn),
              k_scale=cache[2], v_scale=cache[3], seqlens=seq.to(DEVICE), scale=D ** -0.5)
    for splits in (1, 2):
        check(q.to(DEVICE), kw, kd, vd, rel=FP16_REL, num_splits=splits, block_n=16)


def test_separate_strided_kv_and_transformer_like():
    q, kw, k, v = make_case(2, 4, 8, 2, 32, [150, 9], page_size=16, dist="transformer", split_kv=True)
    assert not kw["k_cache"].is_contiguous()
    _, _, rep = check(q, kw, k, v, rel=FP16_REL, num_splits=2)
    print("transformer_like", rep)


def test_splits_equal_single_pass():
    q, kw, k, v = make_case(2, 2, 4, 1, 32, [200, 130], page_size=16, seed=7, dist="transformer")
    o1, l1 = run(q, kw, num_splits=1)
    for s in (2, 5, 9):
        o, l = run(q, kw, num_splits=s)
        assert (l - l1).abs().max() < 1e-5
        assert error_report(o, o1)["rel"] < 1.5e-3


def test_choose_num_splits():
    from fmha_ops.kernels.triton.decode import choose_num_splits

    assert choose_num_splits(64, 8, 4096, 4, 132) == 1
    assert choose_num_splits(128, 8, 1024, 4, 132) == 1
    long = choose_num_splits(1, 8, 131072, 8, 132)
    assert 16 <= long <= 64
    assert choose_num_splits(1, 8, 600, 8, 132) == 1  # too short to split
    assert choose_num_splits(8, 8, 32768, 4, 132) > 1


def test_choose_num_splits_latency_bound_waves():
    """fp8 KV (resident programs per SM given): splits fill whole waves of resident programs."""
    from fmha_ops.kernels.triton.decode import choose_num_splits, resident_programs

    assert resident_programs(128, False, 4) is None
    assert resident_programs(128, True, 4) == 4 and resident_programs(256, True, 4) == 3
    assert resident_programs(128, True, 64) == 2  # 64-row blocks: four-warp programs
    # 512 programs on 132 x 4 slots: one wave, no split helps
    assert choose_num_splits(64, 8, 4096, 4, 132, resident_programs(128, True, 4)) == 1
    # 512 programs on 132 x 3 slots are 1.3 waves (2 launched); 3 splits make 3.9 waves of thirds
    assert choose_num_splits(64, 8, 4096, 4, 132, resident_programs(256, True, 4)) == 3
    # 64 programs: 4 splits fill one wave of 264; 9 (the bandwidth rule) would need 3 waves of ninths
    assert choose_num_splits(8, 8, 32768, 4, 132) == 9
    assert choose_num_splits(8, 8, 32768, 4, 132, 2) == 4
    assert choose_num_splits(1, 8, 600, 8, 132, 2) == 1  # too short to split
    # 8 programs in one wave of 528 slots: as many splits as the wave holds, past the usual cap of 64
    assert choose_num_splits(1, 8, 131072, 8, 132, 4) == 66
    assert choose_num_splits(1, 8, 20000, 8, 132, 4) == 20000 // 512  # but each split keeps >= 512 keys
    for B, L, D, rows in ((1, 131072, 128, 8), (3, 5000, 256, 4), (200, 70000, 64, 64)):
        r = resident_programs(D, True, rows)
        s = choose_num_splits(B, 8, L, rows, 132, r)
        assert 1 <= s <= max(1, L // 512) and (s <= 64 or B * 8 * s <= 132 * r)


def test_default_num_splits_counts_gluon_programs():
    """The split count follows the programs of the kernel that runs: the Gluon decoder's D64 programs take two
    KV heads each (B64 x 8 heads: 256 programs, so 2 splits fill the wave the D128 kernel fills with 1)."""
    from fmha_ops.kernels.triton.decode import default_num_splits

    assert default_num_splits(64, 8, 4096, 4, 128, True, 64, (9, 0), 132) == 1
    assert default_num_splits(64, 8, 4096, 4, 64, True, 64, (9, 0), 132) == 2
    assert default_num_splits(64, 8, 4096, 4, 64, True, 64, (8, 9), 132) == 1  # Triton kernel: one head each
    assert default_num_splits(1, 8, 131072, 8, 128, False, 64, (9, 0), 132) == 64  # bf16: bandwidth rule


def test_gluon_fp8_decoder_routing():
    """The Gluon decoder runs compiled on sm90 only: under the interpreter (and on a CPU) the Triton kernel
    runs, so the CPU tests above cover it; the shape rule matches the Gluon module's tile rule."""
    from fmha_ops.kernels.triton.decode import _gluon_decoder, gluon_fp8_decoder, resident_programs

    assert _gluon_decoder(torch.device("cpu")) is None
    assert gluon_fp8_decoder((9, 0), 128, 4, 64) and gluon_fp8_decoder((9, 0), 64, 16, None)
    assert not gluon_fp8_decoder((8, 9), 128, 4, 64)  # measured on sm90 only
    assert gluon_fp8_decoder((9, 0), 256, 4, 64)  # two-warp programs
    assert not gluon_fp8_decoder((9, 0), 96, 4, 64) and not gluon_fp8_decoder((9, 0), 128, 32, 64)
    assert gluon_fp8_decoder((9, 0), 128, 4, 8) and gluon_fp8_decoder((9, 0), 64, 4, 1)  # tiles span pages
    assert not gluon_fp8_decoder((9, 0), 128, 4, 24)  # 32-key tiles neither span whole pages nor fit in one
    assert resident_programs(128, True, 4, gluon=True, page_size=64) == 4
    assert resident_programs(128, True, 4, gluon=True, page_size=16) == 4  # 32-key tiles over two pages
    assert resident_programs(128, True, 4, gluon=True, page_size=48) == 8  # 16-key tiles


def test_gluon_heads_per_program():
    """D64 programs take two adjacent KV heads when both heads' query rows fit the 16-row mma."""
    from fmha_ops.kernels.gluon import decode as gd

    assert gd.heads_per_program(64, 8, 4) == 2 and gd.heads_per_program(64, 2, 8) == 2
    assert gd.heads_per_program(64, 8, 9) == 1  # 18 rows would not fit
    assert gd.heads_per_program(64, 1, 4) == 1 and gd.heads_per_program(64, 3, 4) == 1  # no pair for every head
    assert gd.heads_per_program(128, 8, 4) == 1 and gd.heads_per_program(256, 8, 4) == 1
    assert gd.warps_per_program(256) == 2 and gd.warps_per_program(128) == gd.warps_per_program(64) == 1
    assert gd.tile_config(64, 128) == (32, 2) and gd.tile_config(64, 64) == (32, 3)
    assert gd.tile_config(16, 128) == (32, 2)
    assert gd.tile_config(48, 128) == (16, 4) and gd.tile_config(8, 128) == (32, 2)
    assert gd.tile_config(1, 64) == (32, 3) and gd.tile_config(24, 128) is None
    # 128-byte rows: 3 stages only with 16-byte scale copies and programs of >= 1536 keys
    assert gd.tile_config(64, 128, 4096, True) == (32, 3) and gd.tile_config(None, 128, 1536, True) == (32, 3)
    assert gd.tile_config(64, 128, 1024, True) == (32, 2) and gd.tile_config(64, 128, 4096, False) == (32, 2)
    assert gd.tile_config(64, 256, 4096, True) == (32, 2) and gd.tile_config(48, 128, 4096, True) == (16, 4)


def test_gluon_vector_scales():
    """Scales move 4 per copy when each head's slots are contiguous and their count is a multiple of 4."""
    from fmha_ops.kernels.gluon import decode as gd

    tok = torch.zeros(10, 64, 2)
    assert not gd.vector_scales(tok, tok)
    head = keys_contiguous(tok)
    assert gd.vector_scales(head, head) and not gd.vector_scales(head, tok)
    odd = keys_contiguous(torch.zeros(3, 1001, 2))  # dense, 1001 slots: the last copy would leave the tensor
    assert not gd.vector_scales(odd, odd)


def test_gluon_decoder_supported_inputs():
    """The Gluon decoder takes contiguous heads of e4m3fn K/V with per-token scales (any strides), D 64/128/256,
    <= 16 rows per KV head and pages its tiles cover; anything else stays on the Triton kernel."""
    from fmha_ops.kernels.gluon import decode as gd

    f8 = torch.float8_e4m3fn
    q = torch.zeros(2, 1, 8, 128)
    k = torch.zeros(10, 64, 2, 128).to(f8)
    s = torch.zeros(10, 64, 2)
    assert gd.supported(q, k, k, s, s, 64) and gd.supported(q, k, k, s, s, None)
    assert gd.supported(q, k, k, s, s, 8)  # 32-key tiles spanning four pages
    assert not gd.supported(q, k, k, s, s, 24)  # no tile size covers whole pages of 24
    assert not gd.supported(torch.zeros(2, 1, 8, 96), k, k, s, s, 64)  # head dim
    assert not gd.supported(torch.zeros(2, 3, 16, 128), k, k, s, s, 64)  # 24 rows per KV head
    assert not gd.supported(q, k.to(torch.float8_e5m2), k.to(torch.float8_e5m2), s, s, 64)
    both = torch.zeros(10, 64, 2, 2, 128).to(f8)  # K and V interleaved: heads not contiguous
    assert not gd.supported(q, both[:, :, :, 0], both[:, :, :, 1], s, s, 64)
    head_major = torch.zeros(10, 2, 64).transpose(1, 2)  # scales of a head's tokens contiguous: any strides work
    assert gd.supported(q, k, k, head_major, head_major, 64)


# ---------------------------------------------------------------- GPU, real sizes

GPU_REL = {torch.bfloat16: 8e-3, torch.float16: FP16_REL}


def _head_major_scales(kw: dict) -> dict:
    """``kw`` with the per-token scales stored head-major (a head's tokens contiguous), same values."""
    return dict(kw, k_scale=keys_contiguous(kw["k_scale"]), v_scale=keys_contiguous(kw["v_scale"]))


GPU_CASES = [(torch.bfloat16, p, f) for p in (None, 1, 16, 64, 256) for f in (None, torch.float8_e4m3fn)]
GPU_CASES += [(torch.float16, 64, None), (torch.float16, 16, torch.float8_e4m3fn)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,page_size,fp8", GPU_CASES)
def test_gpu_real_sizes(dtype, page_size, fp8):
    from fmha_ops.kernels.triton.decode import choose_num_splits

    lens = [4097, 0, 1, 1000, 3000, 17]
    q, kw, k, v = make_case(6, 1, 32, 8, 128, lens, page_size=page_size, dtype=dtype, fp8=fp8,
                            dist="transformer", seed=11)
    for s in (1, 4, choose_num_splits(6, 8, 4097, 4, 132)):
        _, _, rep = check(q, kw, k, v, rel=GPU_REL[dtype], num_splits=s)
    print(dtype, page_size, fp8, rep)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("G,MQ", [(1, 1), (4, 4), (8, 1), (16, 16), (5, 3)])
def test_gpu_head_dims_gqa_mq(D, G, MQ):
    q, kw, k, v = make_case(3, MQ, 2 * G, 2, D, [MQ + 700, MQ - 1, 2500], page_size=64,
                            dtype=torch.bfloat16, seed=G)
    for s in (1, 3):
        check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], num_splits=s)


@pytest.mark.gpu
def test_gpu_long_context_split():
    q, kw, k, v = make_case(1, 1, 64, 8, 128, [131071], page_size=64, dtype=torch.bfloat16,
                            dist="transformer", seed=2)
    _, _, rep = check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], num_splits=33)
    print("131071 keys, 33 splits", rep)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 8])
def test_gpu_graph_replay_equals_eager(num_splits):
    q, kw, k, v = make_case(4, 2, 16, 4, 128, [3000, 1, 0, 777], page_size=16, dtype=torch.bfloat16,
                            fp8=torch.float8_e4m3fn, seed=4)
    eager_o, eager_l = run(q, kw, num_splits=num_splits)
    from fmha_ops.kernels.triton.decode import paged_decode

    out = torch.empty_like(q)
    lse = torch.empty(4, 16, 2, device="cuda")
    paged_decode(q, out=out, lse=lse, **kw, num_splits=num_splits)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        paged_decode(q, out=out, lse=lse, **kw, num_splits=num_splits)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_o) and torch.equal(lse.isinf(), eager_l.isinf())
    assert torch.equal(lse[~lse.isinf()], eager_l[~eager_l.isinf()])
    # new data through the same graph: seqlens and q changed in place
    kw["seqlens"].copy_(torch.tensor([2999, 5, 3, 0], dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    g.replay()
    ref, _ = reference(q, k, v, kw["seqlens"].cpu(), kw["scale"])
    assert error_report(out.cpu(), ref)["rel"] < GPU_REL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 1, 8, 16, 48, 64, 256])
@pytest.mark.parametrize("G,MQ,D", [(4, 1, 128), (8, 2, 64), (16, 1, 128), (1, 5, 128), (4, 1, 64), (2, 4, 64),
                                    (1, 5, 64), (4, 1, 256), (2, 3, 256)])
def test_gpu_gluon_decoder_matches_triton(page_size, G, MQ, D):
    """fp8 KV on sm90: the Gluon decoder (default) against the Triton kernel (chosen by passing its tile
    options) and the float32 reference: ragged lengths incl. 0, 1 and partial tiles, splits 1 / 3 / 8."""
    from fmha_ops.kernels.triton.decode import _gluon_decoder

    if _gluon_decoder(torch.device(DEVICE)) is None:
        pytest.skip("the Gluon decoder runs on sm90")
    lens = [0, 1, 17, 1000, 4097, 33]
    q, kw, k, v = make_case(6, MQ, 2 * G, 2, D, lens, page_size=page_size, dtype=torch.bfloat16, fp8=torch.float8_e4m3fn,
                            dist="transformer", seed=G + MQ)
    for s in (1, 3, 8):
        out_g, lse_g, rep = check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], num_splits=s)
        out_t, lse_t = (t.cpu() for t in run(q, kw, num_splits=s, block_n=64, num_warps=2, num_stages=3))
        assert error_report(out_g, out_t)["rel"] < GPU_REL[torch.bfloat16]
        seen = torch.isfinite(lse_t)
        assert torch.equal(seen, torch.isfinite(lse_g)) and (lse_g - lse_t)[seen].abs().max() < 1e-3
        print(page_size, G, MQ, D, s, rep)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 8, 16, 64])
@pytest.mark.parametrize("G,MQ", [(4, 1), (1, 8)])
def test_gpu_gluon_decoder_head_pairs(page_size, G, MQ):
    """D64 with 8 KV heads: each program takes a pair of adjacent heads (pairs 0-1 .. 6-7); every head's rows
    against the float32 reference and the Triton kernel (one head per program), head-major scales included."""
    from fmha_ops.kernels.gluon import decode as gd
    from fmha_ops.kernels.triton.decode import _gluon_decoder

    if _gluon_decoder(torch.device(DEVICE)) is None:
        pytest.skip("the Gluon decoder runs on sm90")
    assert gd.heads_per_program(64, 8, G * MQ) == 2
    q, kw, k, v = make_case(3, MQ, 8 * G, 8, 64, [2049, 1, 700], page_size=page_size, dtype=torch.bfloat16,
                            fp8=torch.float8_e4m3fn, dist="transformer", seed=G)
    head_major = _head_major_scales(kw)
    for s in (1, 4):
        out_g, lse_g, rep = check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], num_splits=s)
        out_t, lse_t = (t.cpu() for t in run(q, kw, num_splits=s, block_n=64, num_warps=2, num_stages=3))
        assert error_report(out_g, out_t)["rel"] < GPU_REL[torch.bfloat16]
        assert (lse_g - lse_t)[torch.isfinite(lse_t)].abs().max() < 1e-3
        out_h, lse_h = run(q, head_major, num_splits=s)
        assert torch.equal(out_h.cpu(), out_g) and torch.equal(lse_h.cpu(), lse_g)
        print(page_size, G, MQ, s, rep)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 32, 64, 256])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("head_major", [False, True])
def test_gpu_decoder_ignores_cache_bytes_past_the_end(page_size, D, head_major):
    """fp8 cache bytes past each sequence's end set to NaN (e4m3 0x7F), their scales too: none of them may reach
    the output (0 * NaN is NaN: masked keys must be zero-filled, not just weighted 0). Partial last tiles, D64 head
    pairs, splits 1/3; head-major scales move 4 per copy (the Gluon decoder reads up to 3 past the end there)."""
    lens = [17, 1, 1000, 4093, 0, 4096]
    q, kw, k, v = make_case(6, 1, 8, 2, D, lens, page_size=page_size, dtype=torch.bfloat16, fp8=torch.float8_e4m3fn,
                            dist="transformer", seed=21)
    if head_major:
        kw = _head_major_scales(kw)
    caches = [kw["k_cache"].view(torch.uint8), kw["v_cache"].view(torch.uint8), kw["k_scale"], kw["v_scale"]]
    for c, bad in zip(caches, (0x7F, 0x7F, float("nan"), float("nan"))):
        for b, n in enumerate(lens):
            if page_size is None:
                c[b, n:] = bad
            else:
                for j, page in enumerate(kw["block_table"][b].tolist()):
                    c[page, max(n - j * page_size, 0):] = bad
    for s in (1, 3):
        check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], num_splits=s)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 64, 256])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_gluon_decoder_head_major_scales(page_size, D):
    """Per-token scales stored head-major (a head's tokens contiguous: 16-byte scale copies, also where 32-key tiles
    span pages of 16, and 3 stages where a program walks >= 1536 keys) against token-major scales: float32-
    reference accuracy and bit-identical outputs, splits 1 and 3, lengths ending inside a copy of 4 scales."""
    from fmha_ops.kernels.gluon import decode as gd
    from fmha_ops.kernels.triton.decode import _gluon_decoder

    if _gluon_decoder(torch.device(DEVICE)) is None:
        pytest.skip("the Gluon decoder runs on sm90")
    q, kw, k, v = make_case(4, 1, 8, 2, D, [4093, 1, 33, 4096], page_size=page_size, dtype=torch.bfloat16,
                            fp8=torch.float8_e4m3fn, dist="transformer", seed=5)
    kw = dict(kw, k_scale=kw["k_scale"].contiguous(), v_scale=kw["v_scale"].contiguous())
    head_major = _head_major_scales(kw)
    assert head_major["k_scale"].stride(-1) != 1 and gd.vector_scales(head_major["k_scale"], head_major["v_scale"])
    assert not gd.vector_scales(kw["k_scale"], kw["v_scale"])
    for s in (1, 3):
        out_c, lse_c = run(q, kw, num_splits=s)
        out_h, lse_h, _ = check(q, head_major, k, v, rel=GPU_REL[torch.bfloat16], num_splits=s)
        assert torch.equal(out_h, out_c.cpu()) and torch.equal(lse_h, lse_c.cpu())
