"""Paged decode kernels (split-K decoder + reduce) against a float64 reference.

CPU runs go through the Triton interpreter at tiny sizes. The interpreter's bf16 ``tl.dot``
multiplies raw bf16 bit patterns (triton 3.6 ``create_dot``), so CPU tests run fp16 queries
and the bf16 path is covered by the ``gpu`` tests.
"""
from __future__ import annotations

import pytest
import torch

from registry.arch import Arch

from fmha_ops.kv_cache import dequantize_fp8, keys_contiguous, paged_from_dense, quantize_kv_fp8
from tests.conftest import DEVICE, HAS_CUDA
from fmha_ops.testing import error_report, transformer_like

CPU_DTYPE = torch.float16


def reference(q, k, v, seqlens, scale, key_ends=None, window_left=-1, softcap=0.0, key_start=None):
    """float64 decode attention on q's device; k, v dense (B, L, Hkv, D); returns CPU (out, lse (B, Hq, Mq)).
    Query i of sequence b sits at position seqlens[b] - Mq + i and sees keys j <= that position and
    j < key_ends[b] (default: seqlens), and with ``window_left`` >= 0 keys j >= that position - window_left;
    ``softcap`` > 0 caps the scaled scores s to softcap * tanh(s / softcap); ``key_start`` (B,) ints: keys
    j >= key_start[b] only (None: all)."""
    B, MQ, HQ, D = q.shape
    HKV = k.shape[2]
    G = HQ // HKV
    out = torch.zeros(B, MQ, HQ, D, dtype=torch.float64)
    lse = torch.full((B, HQ, MQ), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(seqlens[b])
        end = max(int(seqlens[b] if key_ends is None else key_ends[b]), 0)
        kk = k[b, :end].to(q.device).double()
        vv = v[b, :end].to(q.device).double()
        s = torch.einsum("mkgd,nkd->kgmn", q[b].double().view(MQ, HKV, G, D), kk) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = n - MQ + torch.arange(MQ, device=q.device)
        keys = torch.arange(end, device=q.device)[None, :]
        seen = keys <= pos[:, None]
        if window_left >= 0:
            seen &= keys >= pos[:, None] - window_left
        if key_start is not None:
            seen &= keys >= int(key_start[b])
        s = s.masked_fill(~seen, float("-inf"))
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
        both = torch.stack(cache[:2], 3)  # (..., Hkv, 2, D): each head's K row, then its V row
        cache[:2] = [both[:, :, :, 0], both[:, :, :, 1]]
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


def _gluon_runs() -> bool:
    """Whether the Gluon fp8 decoder can run here (compiled, sm90)."""
    return HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def run_gluon(q, kw, num_splits=1, **extra):
    """The Gluon fp8 decoder (+ the split reduce) on ``make_case``'s inputs, into NaN-poisoned outputs; ``extra``:
    ``launch``'s keywords (``window_left``, ``softcap``, ``key_start``)."""
    from fmha_ops.kernels.gluon import decode as gd
    from fmha_ops.kernels.softmax import LOG2E
    from fmha_ops.kernels.triton.decode import reduce_splits, split_buffers

    B, MQ, HQ, D = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, HQ, MQ), float("nan"), device=q.device)
    o_buf, l_buf, o_strides, l_strides = split_buffers(q, num_splits, out, lse)
    table = kw["block_table"]
    gd.launch(q, kw["k_cache"], kw["v_cache"], kw["k_scale"], kw["v_scale"], kw["seqlens"], table, o_buf, l_buf,
              o_strides, l_strides, kw["scale"] * LOG2E.value, num_splits,
              None if table is None else kw["k_cache"].shape[1], **extra)
    if num_splits > 1:
        reduce_splits(o_buf, l_buf, out, lse)
    return out, lse


def check(q, kw, k, v, *, rel, lse_tol=2e-4, runner=run, **extra):
    out, lse = runner(q, kw, **extra)
    starts = extra.get("key_start")
    ref, ref_lse = reference(q, k, v, kw["seqlens"].cpu(), kw["scale"], window_left=extra.get("window_left", -1),
                             softcap=extra.get("softcap", 0.0), key_start=None if starts is None else starts.cpu())
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


def check_gluon(lens, G, MQ, D, page_size, seed, **extra):
    """The Gluon fp8 decoder against the float reference on a transformer-like bf16 case quantized to fp8 (2 KV heads
    of G query heads, ``lens`` keys per sequence), with 1, 3 and 8 splits; ``extra``: ``launch``'s keywords."""
    q, kw, k, v = make_case(len(lens), MQ, 2 * G, 2, D, lens, page_size=page_size, dtype=torch.bfloat16,
                            fp8=torch.float8_e4m3fn, dist="transformer", seed=seed)
    for s in (1, 3, 8):
        check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], runner=run_gluon, num_splits=s, **extra)


# fp16 out rounding (2^-11) and P rounded to fp16 before P @ V give rel ~5e-4 on random inputs.
FP16_REL = 2e-3


@pytest.mark.parametrize("page_size", [None, 1, 3, 16, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_pages_and_splits(page_size, num_splits):
    q, kw, k, v = make_case(4, 2, 4, 2, 32, [70, 0, 1, 37], page_size=page_size, seed=page_size or 0)
    check(q, kw, k, v, rel=FP16_REL, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_length_offset_and_no_lse(num_splits):
    """``seqlen_offset`` adds to every length on the device (lengths + offset clamped to the cache), and
    ``lse_wanted=False`` writes the same output with no LSE."""
    from fmha_ops.kernels.triton.decode import paged_decode

    q, kw, k, v = make_case(3, 2, 4, 2, 32, [60, 9, 1], page_size=16, seed=21)
    lens = kw["seqlens"]
    want, _, _ = check(q, kw, k, v, rel=FP16_REL, num_splits=num_splits)
    shifted = dict(kw, seqlens=lens - 2)
    out, lse = run(q, shifted, num_splits=num_splits, seqlen_offset=2)
    assert torch.equal(out.cpu(), want)
    out = torch.full_like(q, float("nan"))
    o, no_lse = paged_decode(q, out=out, lse_wanted=False, num_splits=num_splits, **kw)
    assert o is out and no_lse is None and torch.equal(out.cpu(), want)
    full = dict(kw, seqlens=torch.full_like(lens, kw["block_table"].shape[1] * kw["k_cache"].shape[1]))
    clamped, _ = run(q, full, num_splits=num_splits, seqlen_offset=5)  # past the capacity: clamped to it
    assert torch.equal(clamped, run(q, full, num_splits=num_splits)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not _gluon_runs(), reason="the Gluon fp8 decoder runs on sm90")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gpu_gluon_length_offset_and_no_lse(num_splits):
    """The Gluon fp8 decoder: ``seqlen_offset`` as the lengths plus that offset, ``store_lse=False`` the same
    output with the LSE placeholder untouched."""
    from fmha_ops.kernels.gluon import decode as gd
    from fmha_ops.kernels.softmax import LOG2E
    from fmha_ops.kernels.triton.decode import reduce_splits, split_buffers

    q, kw, k, v = make_case(3, 1, 8, 2, 128, [300, 17, 1], page_size=64, dtype=torch.bfloat16,
                            fp8=torch.float8_e4m3fn, seed=22)
    want, _, _ = check(q, kw, k, v, rel=1e-2, lse_tol=1e-2, runner=run_gluon, num_splits=num_splits)
    for offset, store_lse in ((3, True), (0, False)):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((3, 8, 1), float("nan"), device=q.device) if store_lse else None
        o_buf, l_buf, o_strides, l_strides = split_buffers(q, num_splits, out, lse)
        gd.launch(q, kw["k_cache"], kw["v_cache"], kw["k_scale"], kw["v_scale"], kw["seqlens"] - offset,
                  kw["block_table"], o_buf, l_buf, o_strides, l_strides, kw["scale"] * LOG2E.value, num_splits, 64,
                  store_lse=store_lse, seqlen_offset=offset)
        if num_splits > 1:
            reduce_splits(o_buf, l_buf, out, lse)
        assert torch.equal(out.cpu(), want), (offset, store_lse)
        assert not store_lse or not lse.isnan().any()


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
    from fmha_ops.kernels.decode_splits import choose_num_splits

    assert choose_num_splits(64 * 8, 4096, 132) == 1
    assert choose_num_splits(128 * 8, 1024, 132) == 1
    long = choose_num_splits(8, 131072, 132)
    assert 16 <= long <= 64
    assert choose_num_splits(8, 600, 132) == 1  # too short to split
    assert choose_num_splits(8 * 8, 32768, 132) > 1


def test_choose_num_splits_latency_bound_waves():
    """fp8 KV (resident programs per SM given): splits fill whole waves of resident programs."""
    from fmha_ops.kernels.decode_splits import choose_num_splits
    from fmha_ops.kernels.triton.decode import programs_per_split, resident_programs

    assert resident_programs(128, False, 4) is None
    assert resident_programs(128, True, 4) == 4 and resident_programs(256, True, 4) == 3
    assert resident_programs(128, True, 64) == 2  # 64-row blocks: four-warp programs
    assert programs_per_split(64, 8, 4) == 512 and programs_per_split(2, 1, 256) == 8  # 64-row blocks
    # 512 programs on 132 x 4 slots: one wave, no split helps
    assert choose_num_splits(512, 4096, 132, resident_programs(128, True, 4)) == 1
    # 512 programs on 132 x 3 slots are 1.3 waves (2 launched); 3 splits make 3.9 waves of thirds
    assert choose_num_splits(512, 4096, 132, resident_programs(256, True, 4)) == 3
    # 64 programs: 4 splits fill one wave of 264; 9 (the bandwidth rule) would need 3 waves of ninths
    assert choose_num_splits(64, 32768, 132) == 9
    assert choose_num_splits(64, 32768, 132, 2) == 4
    assert choose_num_splits(8, 600, 132, 2) == 1  # too short to split
    # 8 programs in one wave of 528 slots: as many splits as the wave holds, past the usual cap of 64
    assert choose_num_splits(8, 131072, 132, 4) == 66
    assert choose_num_splits(8, 20000, 132, 4) == 20000 // 512  # but each split keeps >= 512 keys
    for B, L, D, rows in ((1, 131072, 128, 8), (3, 5000, 256, 4), (200, 70000, 64, 64)):
        r = resident_programs(D, True, rows)
        s = choose_num_splits(programs_per_split(B, 8, rows), L, 132, r)
        assert 1 <= s <= max(1, L // 512) and (s <= 64 or B * 8 * s <= 132 * r)


H200 = Arch("cuda", (9, 0), name="NVIDIA H200")


def test_op_split_counts_follow_their_kernels_programs():
    """Each decode op counts its own kernel's programs: the Gluon decoder's D64 programs take two KV heads each
    (B64 x 8 heads: 256 programs, so 2 splits fill the wave that 1 split of the D128 programs fills); the Triton
    fp8 kernel takes one head per program."""
    from fmha_ops.ops.gluon_decode import GluonFp8DecodeFwOp as Gluon
    from fmha_ops.ops.triton_decode import TritonDecoderFwOp, TritonSplitKFwOp

    assert Gluon.num_splits(64, 8, 4096, 4, 128, 64, H200) == 1
    assert Gluon.num_splits(64, 8, 4096, 4, 64, 64, H200) == 2
    assert Gluon.num_splits(64, 8, 4096, 4, 64, 64, H200, heads_adjacent=False) == 1  # heads apart: one each
    assert TritonSplitKFwOp.num_splits(64, 8, 4096, 4, 64, True, H200) == 1
    assert TritonSplitKFwOp.num_splits(1, 8, 131072, 8, 128, False, H200) == 64  # bf16: bandwidth rule
    assert TritonDecoderFwOp.num_splits(1, 8, 131072, 8, 128, False, H200) == 1


def _decode_problem(B=64, L=4096, hq=32, hkv=8, D=128, page=64, mq=1, kv=torch.float8_e4m3fn, quantize=False,
                    arch=H200):
    from fmha_ops.problem import Problem

    fp8 = kv.itemsize == 1
    return Problem(arch=arch, q_dtype=torch.bfloat16, k_dtype=kv, v_dtype=kv, out_dtype=torch.bfloat16, batch=B,
                   seqlen_q=mq, seqlen_k=L, total_q=B * mq, heads_q=hq, heads_kv=hkv, head_dim=D, head_dim_v=D,
                   bias="paged_causal" if page else "causal_bottom_right", q_uniform=True, page_size=page,
                   descales=("none", "token" if fp8 else "none", "token" if fp8 else "none"), quantize_kv=quantize,
                   dropout=False, needs_lse=False, needs_grad=False, deterministic=False, graph_capture=False)


def test_gluon_decode_op_declaration():
    """The Gluon fp8-KV decoder is an op of its own: sm90, e4m3fn KV (or quantize_kv_to_fp8), D 64/128/256,
    <= 16 query rows per KV head, pages its tiles cover; never available on a CPU."""
    from fmha_ops.dispatch import REGISTRY
    from fmha_ops.ops.gluon_decode import GluonFp8DecodeFwOp as Gluon

    assert REGISTRY.get("gluon_fp8_decodeF") is Gluon and Gluon.ARCHS == ("cuda>=9.0,<10.0",)
    if not torch.cuda.is_available():
        assert Gluon.available() is not None
    assert Gluon.not_supported_reasons(_decode_problem()) == []
    for kw, why in [(dict(D=96), "head dim K=96"), (dict(hq=64, mq=4), "32 query rows per KV head"),
                    (dict(page=24), "page_size=24 not supported; pages must divide 32 keys"),
                    (dict(kv=torch.bfloat16), "needs an fp8 KV cache"),
                    (dict(arch=Arch("cuda", (10, 0), name="B200")), "runs on"),
                    (dict(kv=torch.float8_e5m2), "dtypes")]:
        p = _decode_problem(**kw)
        reasons = " ".join(Gluon.not_supported_reasons(p))
        assert why in reasons or not Gluon.supports_arch(p.arch), (kw, reasons)
    for page in (None, 1, 8, 16, 32, 48, 64, 256):
        assert Gluon.not_supported_reasons(_decode_problem(page=page or 0, D=64, hq=16 * 8)) == []
    assert Gluon.not_supported_reasons(_decode_problem(kv=torch.bfloat16, quantize=True)) == []
    from fmha_ops.kernels.gluon import decode as gd

    assert gd.resident_programs(64, 128) == 4 and gd.resident_programs(16, 128) == 4  # 32-key tiles
    assert gd.resident_programs(48, 128) == 8  # 16-key tiles


def ranked(p) -> str:
    """The decode op (Gluon or Triton) the H200's tuning table, else its calibrated estimates, rank first for ``p``
    (an H200 problem)."""
    from fmha_ops.dispatch import REGISTRY, SELECTOR

    est = {}
    for name in ("gluon_fp8_decodeF", "triton_decoderF", "triton_splitKF"):
        op = REGISTRY.get(name)
        if op.not_supported_reasons(p):
            continue
        e = SELECTOR.tables.lookup(H200.name, name, p.bucket())
        if e is None:
            e = op.estimate(p) * (SELECTOR.tables.calibration(H200.name, name) or 1.0)
        est[name] = e
    return min(est, key=est.get)


def test_gluon_decode_op_ranks_first_for_fp8_kv_on_h200():
    """With the H200 tuning table, the Gluon op's estimate beats both Triton decode ops wherever it supports an
    fp8-KV call (an fp8 cache or quantize_kv_to_fp8), so the selector picks it there; bf16 KV is not its."""
    for B, L, hq in ((1, 131072, 64), (8, 32768, 32), (64, 4096, 32), (128, 1024, 32), (3, 5000, 8)):
        for D in (64, 128, 256):
            for page in (0, 1, 16, 48, 64, 256):
                assert ranked(_decode_problem(B, L, hq, 8, D, page)) == "gluon_fp8_decodeF", (B, L, D, page)
                assert ranked(_decode_problem(B, L, hq, 8, D, page, kv=torch.bfloat16, quantize=True)) \
                    == "gluon_fp8_decodeF"
            assert ranked(_decode_problem(B, L, hq, 8, D, 64, kv=torch.bfloat16)) != "gluon_fp8_decodeF"
        assert ranked(_decode_problem(B, L, 32, 8, 128, 64, mq=8)).startswith("triton_")  # 32 rows per KV head


def test_gluon_heads_per_program():
    """D64 programs take two adjacent KV heads when both heads' query rows fit the 16-row mma."""
    from fmha_ops.kernels.gluon import decode as gd

    assert gd.heads_per_program(64, 8, 4) == 2 and gd.heads_per_program(64, 2, 8) == 2
    assert gd.heads_per_program(64, 8, 9) == 1  # 18 rows would not fit
    assert gd.heads_per_program(64, 1, 4) == 1 and gd.heads_per_program(64, 3, 4) == 1  # no pair for every head
    assert gd.heads_per_program(128, 8, 4) == 1 and gd.heads_per_program(256, 8, 4) == 1
    assert gd.warps_per_program(256) == 2 and gd.warps_per_program(128) == gd.warps_per_program(64) == 1
    assert gd.tile_config(64, 128) == gd.TileConfig(32, 2) and gd.tile_config(64, 64) == gd.TileConfig(32, 3)
    assert gd.tile_config(16, 128) == gd.TileConfig(32, 2)
    assert gd.tile_config(48, 128) == gd.TileConfig(16, 4) and gd.tile_config(8, 128) == gd.TileConfig(32, 2)
    assert gd.tile_config(1, 64) == gd.TileConfig(32, 3) and gd.tile_config(24, 128) is None
    # 128-byte rows: 3 stages only with 16-byte scale copies and programs of >= 1536 keys
    assert gd.tile_config(64, 128, 4096, True) == gd.TileConfig(32, 3) and gd.tile_config(None, 128, 1536, True) == gd.TileConfig(32, 3)
    assert gd.tile_config(64, 128, 1024, True) == gd.TileConfig(32, 2) and gd.tile_config(64, 128, 4096, False) == gd.TileConfig(32, 2)
    assert gd.tile_config(64, 256, 4096, True) == gd.TileConfig(32, 2) and gd.tile_config(48, 128, 4096, True) == gd.TileConfig(16, 4)


def test_gluon_vector_scales():
    """Scales move 4 per copy when each head's slots are contiguous and their count is a multiple of 4."""
    from fmha_ops.kernels.gluon import decode as gd

    tok = torch.zeros(10, 64, 2)
    assert not gd.vector_scales(tok, tok)
    head = keys_contiguous(tok)
    assert gd.vector_scales(head, head) and not gd.vector_scales(head, tok)
    odd = keys_contiguous(torch.zeros(3, 1001, 2))  # dense, 1001 slots: the last copy would leave the tensor
    assert not gd.vector_scales(odd, odd)


def test_gluon_decoder_shapes_and_layouts():
    """The Gluon decoder takes D 64/128/256, <= 16 rows per KV head and pages its tiles cover; heads need not be
    contiguous (a D64 program then takes one head instead of a pair); scales any strides."""
    from fmha_ops.kernels.gluon import decode as gd

    assert gd.takes_shape(128, 4, 64) and gd.takes_shape(128, 4, None) and gd.takes_shape(128, 4, 8)
    assert not gd.takes_shape(128, 4, 24)  # no tile size covers whole pages of 24
    assert not gd.takes_shape(96, 4, 64) and not gd.takes_shape(128, 24, 64)
    k = torch.zeros(10, 64, 2, 64)
    both = torch.zeros(10, 64, 2, 2, 64)  # K and V interleaved: heads not contiguous
    assert gd.heads_adjacent(k, k) and not gd.heads_adjacent(both[:, :, :, 0], both[:, :, :, 1])
    assert gd.heads_per_program(64, 8, 4, heads_adjacent=False) == 1


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
    from fmha_ops.kernels.decode_splits import choose_num_splits

    lens = [4097, 0, 1, 1000, 3000, 17]
    q, kw, k, v = make_case(6, 1, 32, 8, 128, lens, page_size=page_size, dtype=dtype, fp8=fp8,
                            dist="transformer", seed=11)
    for s in (1, 4, choose_num_splits(6 * 8, 4097, 132)):
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
    """fp8 KV on sm90: the Gluon decoder against the Triton kernel and the float32 reference: ragged lengths incl.
    0, 1 and partial tiles, splits 1 / 3 / 8."""
    if not _gluon_runs():
        pytest.skip("the Gluon decoder runs on sm90")
    lens = [0, 1, 17, 1000, 4097, 33]
    q, kw, k, v = make_case(6, MQ, 2 * G, 2, D, lens, page_size=page_size, dtype=torch.bfloat16, fp8=torch.float8_e4m3fn,
                            dist="transformer", seed=G + MQ)
    for s in (1, 3, 8):
        out_g, lse_g, rep = check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], runner=run_gluon, num_splits=s)
        out_t, lse_t = (t.cpu() for t in run(q, kw, num_splits=s))
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
    if not _gluon_runs():
        pytest.skip("the Gluon decoder runs on sm90")
    assert gd.heads_per_program(64, 8, G * MQ) == 2
    q, kw, k, v = make_case(3, MQ, 8 * G, 8, 64, [2049, 1, 700], page_size=page_size, dtype=torch.bfloat16,
                            fp8=torch.float8_e4m3fn, dist="transformer", seed=G)
    head_major = _head_major_scales(kw)
    for s in (1, 4):
        out_g, lse_g, rep = check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], runner=run_gluon, num_splits=s)
        out_t, lse_t = (t.cpu() for t in run(q, kw, num_splits=s))
        assert error_report(out_g, out_t)["rel"] < GPU_REL[torch.bfloat16]
        assert (lse_g - lse_t)[torch.isfinite(lse_t)].abs().max() < 1e-3
        out_h, lse_h = run_gluon(q, head_major, num_splits=s)
        assert torch.equal(out_h.cpu(), out_g) and torch.equal(lse_h.cpu(), lse_g)
        print(page_size, G, MQ, s, rep)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 32, 64, 256])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("kernel", ["triton", "gluon"])
def test_gpu_decoder_ignores_cache_bytes_past_the_end(page_size, D, head_major, kernel):
    """fp8 cache bytes past each sequence's end set to NaN (e4m3 0x7F), their scales too: none of them may reach
    the output (0 * NaN is NaN: masked keys must be zero-filled, not just weighted 0). Partial last tiles, D64 head
    pairs, splits 1/3; head-major scales move 4 per copy (the Gluon decoder reads up to 3 past the end there)."""
    if kernel == "gluon" and not _gluon_runs():
        pytest.skip("the Gluon decoder runs on sm90")
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
        check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], runner=run_gluon if kernel == "gluon" else run, num_splits=s)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 64, 256])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_gluon_decoder_head_major_scales(page_size, D):
    """Per-token scales stored head-major (a head's tokens contiguous: 16-byte scale copies, also where 32-key tiles
    span pages of 16, and 3 stages where a program walks >= 1536 keys) against token-major scales: float32-
    reference accuracy and bit-identical outputs, splits 1 and 3, lengths ending inside a copy of 4 scales."""
    from fmha_ops.kernels.gluon import decode as gd
    if not _gluon_runs():
        pytest.skip("the Gluon decoder runs on sm90")
    q, kw, k, v = make_case(4, 1, 8, 2, D, [4093, 1, 33, 4096], page_size=page_size, dtype=torch.bfloat16,
                            fp8=torch.float8_e4m3fn, dist="transformer", seed=5)
    kw = dict(kw, k_scale=kw["k_scale"].contiguous(), v_scale=kw["v_scale"].contiguous())
    head_major = _head_major_scales(kw)
    assert head_major["k_scale"].stride(-1) != 1 and gd.vector_scales(head_major["k_scale"], head_major["v_scale"])
    assert not gd.vector_scales(kw["k_scale"], kw["v_scale"])
    for s in (1, 3):
        out_c, lse_c = run_gluon(q, kw, num_splits=s)
        out_h, lse_h, _ = check(q, head_major, k, v, rel=GPU_REL[torch.bfloat16], runner=run_gluon, num_splits=s)
        assert torch.equal(out_h, out_c.cpu()) and torch.equal(lse_h, lse_c.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_gluon_decoder_heads_apart(page_size, D):
    """K and V interleaved in one buffer (heads not contiguous): the Gluon decoder reads each head through its
    stride (D64: one head per program instead of a pair)."""
    if not _gluon_runs():
        pytest.skip("the Gluon decoder runs on sm90")
    q, kw, k, v = make_case(3, 1, 16, 4, D, [1500, 1, 333], page_size=page_size, dtype=torch.bfloat16,
                            fp8=torch.float8_e4m3fn, dist="transformer", seed=8)
    both = torch.stack([kw["k_cache"].view(torch.uint8), kw["v_cache"].view(torch.uint8)], 3)  # (.., Hkv, 2, D)
    kw = dict(kw, k_cache=both[:, :, :, 0].view(torch.float8_e4m3fn), v_cache=both[:, :, :, 1].view(torch.float8_e4m3fn))
    assert kw["k_cache"].stride(2) == 2 * D
    for s in (1, 3):
        check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], runner=run_gluon, num_splits=s)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_fp8_cache_through_the_api_runs_the_gluon_op(page_size):
    """flash_attn_with_kvcache on an fp8 cache from build_fp8_paged_cache: explain names gluon_fp8_decodeF on
    sm90 (the op that runs), the result matches the float32 reference of the dequantized cache."""
    import fmha_ops
    from fmha_ops.kv_cache import build_fp8_paged_cache, dense_from_paged

    g = torch.Generator().manual_seed(page_size)
    B, L, H, G, D = 4, 1000, 2, 4, 128
    k = torch.randn(B, L, H, D, generator=g).to(DEVICE, torch.bfloat16)
    v = torch.randn(B, L, H, D, generator=g).to(DEVICE, torch.bfloat16)
    q = torch.randn(B, 1, H * G, D, generator=g).to(DEVICE, torch.bfloat16)
    kc, vc, ks, vs, table = build_fp8_paged_cache(k, v, page_size)
    lens = torch.tensor([1000, 1, 517, 64], dtype=torch.int32, device=DEVICE)
    out = fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, k_descale=ks,
                                           v_descale=vs, causal=True)
    kd = dequantize_fp8(dense_from_paged(kc.view(torch.uint8), table, L).view(kc.dtype), dense_from_paged(ks, table, L))
    vd = dequantize_fp8(dense_from_paged(vc.view(torch.uint8), table, L).view(vc.dtype), dense_from_paged(vs, table, L))
    ref, _ = reference(q, kd, vd, lens.cpu(), D ** -0.5)
    assert error_report(out.cpu(), ref)["rel"] < GPU_REL[torch.bfloat16]
    if _gluon_runs():
        from fmha_ops import attn_bias as ab

        bias = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask(
            ab._SeqLenInfo.from_seqlens([1] * B), ab._PaddedSeqLenInfo.from_device_seqlens(lens, table.shape[1] * page_size),
            table, page_size)
        pool = (1, kc.shape[0] * page_size)
        rep = fmha_ops.explain(q.reshape(1, B, H * G, D), kc.reshape(pool + kc.shape[2:]),
                               vc.reshape(pool + vc.shape[2:]), bias, k_descale=ks.reshape(pool + ks.shape[2:]),
                               v_descale=vs.reshape(pool + vs.shape[2:]))
        assert rep.selected.NAME == "gluon_fp8_decodeF", str(rep)


def _stand_in(monkeypatch, source, install):
    """Launch ``source`` (a kernel) through a ``CachedKernel`` of a compiled (not interpreted) JITFunction of the
    same parameters, whose compiles return stand-in kernels recording every direct launch; ``install(cached)``
    puts it where the code under test takes the kernel's launcher. Returns the list of stand-in kernels."""
    from types import SimpleNamespace

    from triton.runtime.jit import JITFunction

    from fmha_ops.kernels.triton import launch as launch_mod

    fn = JITFunction(getattr(source, "fn", source))
    compiled = []

    class Run:
        launch_cooperative_grid, launch_pdl, num_ctas = False, False, 1
        global_scratch_size = global_scratch_align = profile_scratch_size = profile_scratch_align = 0

        def __init__(self, record):
            def launcher(gx, gy, gz, stream, *rest):  # the C launcher, behind Triton's descriptor wrapper
                record(((gx, gy, gz), rest[9:]))

            def inner(*args):
                return launcher(*args)

            self.launch = inner

    def compile_(*args, grid, warmup, **kwargs):
        kernel = SimpleNamespace(function="f", packed_metadata="m", launches=[],
                                 src=SimpleNamespace(signature={p.name: "i32" for p in fn.params}),
                                 metadata=SimpleNamespace(tensordesc_meta=None), constexprs=kwargs)
        kernel.run = Run(kernel.launches.append)
        compiled.append(kernel)
        return kernel

    monkeypatch.setattr(fn, "run", compile_)
    monkeypatch.setattr(launch_mod, "driver", SimpleNamespace(active=SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 0)))
    install(launch_mod.CachedKernel(fn))
    return compiled


def test_bound_decoder_launches_what_the_keyed_one_does_and_respecializes(monkeypatch):
    """A plan's decoder (``PagedDecoder(bound=True)``) passes each call's own tensors and strides, exactly what the
    keyed launch passes, without rebuilding the launch key; a call whose q is not 16-byte aligned (a specialization
    of its own) compiles and launches its own binary."""
    from fmha_ops.kernels.triton import decode as dec

    decodes = _stand_in(monkeypatch, dec._decode_kernel, lambda ck: monkeypatch.setattr(dec, "_DECODE", ck))
    reduces = _stand_in(monkeypatch, dec._reduce_kernel, lambda ck: monkeypatch.setattr(dec, "_REDUCE", ck))
    PagedDecoder = dec.PagedDecoder
    q, kw, _, _ = make_case(2, 1, 4, 2, 32, [5, 9], page_size=4)
    cache = (kw["k_cache"], kw["v_cache"])
    settings = dict(block_table=kw["block_table"], scale=kw["scale"], num_splits=2, lse_wanted=True)
    bound, keyed = PagedDecoder(q, *cache, **settings, bound=True), PagedDecoder(q, *cache, **settings)
    calls = [(q.clone(), torch.empty(2, 1, 4, 32, dtype=q.dtype)) for _ in range(3)]
    for decoder in (keyed, bound):
        for q_i, out in calls:
            decoder(q_i, *cache, kw["seqlens"], kw["block_table"], None, None, out, None, None, None, None)
    assert len(decodes) == len(reduces) == 1  # one compile each: the bound launches reuse the keyed ones' binaries

    def layout(args):  # what a launch passes, buffers allocated per call by their layout
        return [(t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else (type(t), t) for t in args]

    for launches in (decodes[0].launches, reduces[0].launches):
        assert len(launches) == 5  # keyed: calls 2 and 3 (the first compiled); bound: all three
        for (grid_k, args_k), (grid_b, args_b) in zip(launches[:2], launches[3:]):
            assert grid_k == grid_b and layout(args_k) == layout(args_b)
    for (_, args), (q_i, out) in zip(decodes[0].launches[2:], calls):
        assert args[0] is q_i  # each call's own q
    for (_, args), (q_i, out) in zip(reduces[0].launches[2:], calls):
        assert args[2] is out  # each call's own out
    odd = torch.zeros(q.numel() + 8, dtype=q.dtype)[1:q.numel() + 1].view(q.shape)  # q's strides, 2 bytes off
    bound(odd, *cache, kw["seqlens"], kw["block_table"], None, None, calls[0][1], None, None, None, None)
    assert len(decodes) == 2 and decodes[1].launches == []  # compiled for it (its first launch is Triton's)


def test_bound_fp8_decoder_launches_what_the_one_shot_launch_does(monkeypatch):
    """The Gluon fp8 decoder of a plan (``FP8Decoder(bound=True)``) passes what ``launch`` passes, each call's own
    tensors; a call whose scales have other strides (another choice of scale copies) takes a decoder of its own."""
    from fmha_ops.kernels.gluon import decode as gluon

    seen = []
    launches = _stand_in(monkeypatch, gluon._decode_fp8_kernel, lambda ck: monkeypatch.setattr(
        gluon, "launch_cached", lambda fn: seen.append(fn) or ck))
    B, MQ, HQ, HKV, D, PAGE, PAGES = 2, 1, 8, 2, 128, 64, 4
    q = torch.randn(B, MQ, HQ, D, dtype=torch.bfloat16)
    k8, v8 = (torch.zeros(PAGES, PAGE, HKV, D, dtype=torch.float8_e4m3fn) for _ in range(2))
    ks, vs = (torch.ones(PAGES, HKV, PAGE).transpose(1, 2) for _ in range(2))  # each head's slots contiguous
    table, lengths = torch.arange(PAGES, dtype=torch.int32).view(B, -1), torch.tensor([70, 100], dtype=torch.int32)
    out, lse = torch.empty(B, MQ, HQ, D, dtype=torch.bfloat16), torch.empty(B, HQ, MQ)
    strides = ((0, *out.stride()[:3]), (0, *lse.stride()))
    settings = (0.125 * 1.4426950408889634, 1, PAGE)
    calls = [q.clone() for _ in range(3)]
    for q_i in calls:
        gluon.launch(q_i, k8, v8, ks, vs, lengths, table, out, lse, *strides, *settings)
    decoder = gluon.FP8Decoder(q, k8, v8, ks, vs, table, *settings, bound=True)
    for q_i in calls:
        decoder(q_i, k8, v8, ks, vs, lengths, table, out, lse, *strides)
    assert seen[0] is gluon._decode_fp8_kernel and len(launches) == 1
    recorded = launches[0].launches  # one-shot calls 2 and 3 (the first compiled), then the bound calls 1 to 3
    assert len(recorded) == 5

    def same(a, b):
        return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
            x is y if isinstance(x, torch.Tensor) else type(x) is type(y) and x == y for x, y in zip(a[1], b[1]))

    assert same(recorded[0], recorded[3]) and same(recorded[1], recorded[4])
    assert [args[0] is q_i for (_, args), q_i in zip(recorded[2:], calls)] == [True] * 3
    other = ks.contiguous()  # per-slot rows: 4-byte scale copies, another specialization of the kernel
    decoder(q, k8, v8, other, vs, lengths, table, out, lse, *strides)
    assert len(launches) == 2 and (launches[0].constexprs["SC_VEC"], launches[1].constexprs["SC_VEC"]) == (4, 1)


def test_bound_appender_launches_what_kv_append_does(monkeypatch):
    """A plan's append (``KVAppender(bound=True)``) passes what ``kv_append`` passes, each call's own tensors."""
    from fmha_ops.kernels.triton import kv_append as mod

    launches = _stand_in(monkeypatch, mod._kv_append_kernel, lambda ck: monkeypatch.setattr(mod, "launch",
                                                                                             lambda fn: ck))
    kc, vc = torch.zeros(4, 8, 2, 32, dtype=CPU_DTYPE), torch.zeros(4, 8, 2, 32, dtype=CPU_DTYPE)
    table, lengths = torch.arange(4, dtype=torch.int32).view(2, 2), torch.tensor([3, 9], dtype=torch.int32)
    calls = [tuple(torch.randn(2, 1, 2, 32, dtype=CPU_DTYPE) for _ in range(2)) for _ in range(3)]
    for k, v in calls:
        mod.kv_append(k, v, kc, vc, lengths, block_table=table)
    appender = mod.KVAppender(*calls[0], kc, vc, block_table=table, bound=True)
    for k, v in calls:
        appender(k, v, kc, vc, lengths, table, None, None)
    recorded = launches[0].launches  # kv_append's calls 2 and 3 (the first compiled), then the bound calls 1 to 3
    assert len(launches) == 1 and len(recorded) == 5
    for a, b in zip(recorded[:2], recorded[3:]):
        assert a[0] == b[0] and all(x is y if isinstance(x, torch.Tensor) else x == y for x, y in zip(a[1], b[1]))
    assert [args[0] is k for (_, args), (k, _) in zip(recorded[2:], calls)] == [True] * 3
