"""Per-sequence key starts (``cache_leftpad``) in the paged decoders, against float64 references.

Kernel level: ``paged_decode(key_start=)`` against ``test_kernel_decode.reference`` (starts 0, mid-sequence and equal
to the length, odd lengths, GQA, several queries, pages, splits, fp8 KV, with a window), a cache whose values in the
tiles wholly below every start are NaN (a tile the kernel read there would turn the output NaN), and device starts
out of range (clamped). API level: ``flash_attn_with_kvcache(cache_leftpad=)`` and ``plan_kvcache(cache_leftpad=)``
on the decode ops and the reference op, appending or not; the errors naming ``cache_leftpad``; the ops that do not
declare key starts. CPU runs use the Triton interpreter at tiny sizes (fp16: its bf16 dot is wrong).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.kv_cache import paged_from_dense
from fmha_ops.testing import error_report
from tests.compiled_child import run_compiled
from tests.conftest import DEVICE
from tests.test_kernel_decode import (FP16_REL, GPU_REL, _decode_problem, _gluon_runs, check, check_gluon, make_case,
                                      ranked, reference, run)

DTYPE = torch.float16 if DEVICE == "cpu" else torch.bfloat16
DECODE_OPS = ("triton_decoderF", "triton_splitKF")


def _starts(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("page_size", [None, 3, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_key_start(page_size, num_splits):
    """Starts 0, mid-sequence (inside a tile and on a tile edge) and equal to the length (rows with no key: out 0,
    lse -inf), on odd lengths with GQA and two queries per sequence."""
    q, kw, k, v = make_case(5, 2, 4, 2, 32, [70, 0, 9, 37, 33], page_size=page_size, seed=num_splits)
    check(q, kw, k, v, rel=FP16_REL, num_splits=num_splits, key_start=_starts([13, 0, 9, 16, 32]), block_n=16)


@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn])
def test_key_start_fp8_window_and_several_queries(fp8):
    q, kw, k, v = make_case(3, 3, 8, 2, 32, [80, 5, 41], page_size=16, fp8=fp8, seed=5)
    for splits in (1, 2):
        check(q, kw, k, v, rel=FP16_REL, num_splits=splits, key_start=_starts([20, 4, 0]), block_n=16)
        check(q, kw, k, v, rel=FP16_REL, num_splits=splits, key_start=_starts([70, 1, 30]), window_left=9,
              block_n=16)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_tiles_below_the_start_are_not_read(page_size, num_splits):
    """The values of the keys in 16-key tiles wholly below a sequence's start are NaN; a read would reach the
    output (0 * NaN in P @ V). The start's own tile is read and masked."""
    g = torch.Generator().manual_seed(3)
    B, MQ, HQ, HKV, D, L = 2, 1, 4, 2, 16, 96
    lens, starts = [96, 61], [50, 33]
    q = torch.randn(B, MQ, HQ, D, generator=g).to(DTYPE)
    k, v = (torch.randn(B, L, HKV, D, generator=g).to(DTYPE) for _ in range(2))
    poisoned = v.clone()
    for b, s in enumerate(starts):
        poisoned[b, :s // 16 * 16] = float("nan")
    if page_size is None:
        (kc, vc), bt = (k, poisoned), None
    else:
        (kc, vc), bt = paged_from_dense([k, poisoned], page_size, generator=g)
    kw = dict(k_cache=kc.to(DEVICE), v_cache=vc.to(DEVICE), seqlens=_starts(lens), scale=D ** -0.5,
              block_table=None if bt is None else bt.to(DEVICE))
    out, lse = run(q.to(DEVICE), kw, num_splits=num_splits, key_start=_starts(starts), block_n=16)
    ref, ref_lse = reference(q, k, v, torch.tensor(lens), D ** -0.5, key_start=starts)
    assert not out.isnan().any()
    assert error_report(out.cpu(), ref)["rel"] < FP16_REL
    assert (lse.cpu().double() - ref_lse).abs().max() < 1e-3


def test_out_of_range_starts_are_clamped():
    """Device starts are not read back: a negative start counts as 0, one past the length as the length."""
    q, kw, k, v = make_case(3, 1, 4, 2, 16, [20, 7, 33], page_size=4, seed=2)
    out, lse = run(q, kw, num_splits=2, key_start=_starts([-5, 100, 3]), block_n=16)
    ref, _ = reference(q, k, v, kw["seqlens"].cpu(), kw["scale"], key_start=[0, 7, 3])
    assert error_report(out.cpu(), ref)["rel"] < FP16_REL
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all()


def test_kernel_refuses_bad_key_start():
    from fmha_ops.kernels.triton.decode import paged_decode

    q, kw, _, _ = make_case(2, 1, 2, 1, 16, [4, 3])
    for bad in (_starts([0, 1]).long(), _starts([0]), _starts([0, 1, 2, 3])[::2]):
        with pytest.raises(ValueError, match="key_start must be int32"):
            paged_decode(q, **kw, key_start=bad)


# ---- masks, ops and the public API -----------------------------------------------------------------------

def test_paged_mask_key_start():
    """The paged masks' ``key_start`` (device int32 (B,)): the reference op's segments and ``materialize`` start each
    sequence's keys there; the signature tells masks with starts from masks without."""
    lens, table = _starts([5, 9]), _starts([[0, 1], [2, 3]])
    plain = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_device_seqlens(1, lens, table, 8)
    mask = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_device_seqlens(1, lens, table, 8,
                                                                                  key_start=_starts([2, 0]))
    assert plain.key_start is None and mask.signature() != plain.signature()
    allowed = mask.materialize((1, 2, 32)).isfinite()
    assert allowed[0, 0].nonzero().squeeze(1).tolist() == [2, 3, 4]
    assert allowed[0, 1].nonzero().squeeze(1).tolist() == list(range(16, 25))
    with pytest.raises(TypeError, match="key_start"):
        ab.PagedBlockDiagonalPaddedKeysMask.from_device_seqlens(1, lens, table, 8, key_start=[2, 0])


def _kvcache_case(page_size, seed=0, B=4, MQ=2, L=40):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, MQ, 4, 16, generator=g).to(DTYPE)
    k, v = (torch.randn(B, L, 2, 16, generator=g).to(DTYPE) for _ in range(2))
    if page_size is None:
        kc, vc, table = k.clone(), v.clone(), None
    else:
        (kc, vc), table = paged_from_dense([k, v], page_size, generator=g)
        table = table.to(DEVICE)
    return q, k, v, kc.to(DEVICE), vc.to(DEVICE), table


@pytest.mark.parametrize("page_size", [None, 8])
@pytest.mark.parametrize("op", DECODE_OPS + ("torch_referenceF",))
def test_flash_attn_with_kvcache_leftpad(op, page_size):
    """FA3's cache_leftpad: sequence b's keys are slots [cache_leftpad[b], cache_seqlens[b]) of its cache row; the
    queries sit at the end. Starts 0, mid-row and equal to the length (no key: zeros)."""
    q, k, v, kc, vc, table = _kvcache_case(page_size, seed=len(op))
    lens, starts = [2, 23, 40, 17], [0, 7, 31, 17]
    ref, _ = reference(q, k, v, torch.tensor(lens), 16 ** -0.5, key_start=starts)
    with fmha_ops.use_ops(op):
        out = fmha_ops.flash_attn_with_kvcache(q.to(DEVICE), kc, vc, cache_seqlens=_starts(lens), page_table=table,
                                               cache_leftpad=_starts(starts), causal=True)
    assert error_report(out.cpu(), ref)["rel"] < FP16_REL
    assert (out[3] == 0).all()


@pytest.mark.parametrize("op", DECODE_OPS)
def test_flash_attn_with_kvcache_leftpad_appends(op):
    """Appended tokens land at cache_seqlens (after the start) and are attended with the cached ones from the start
    on; a start equal to cache_seqlens leaves the appended tokens only."""
    q, k, v, kc, vc, table = _kvcache_case(8, seed=4, MQ=1)
    knew, vnew = (torch.randn(4, 1, 2, 16, generator=torch.Generator().manual_seed(9)).to(DTYPE) for _ in range(2))
    lens, starts = [3, 20, 30, 0], [1, 20, 12, 0]
    with fmha_ops.use_ops(op):
        out = fmha_ops.flash_attn_with_kvcache(q.to(DEVICE), kc, vc, knew.to(DEVICE), vnew.to(DEVICE),
                                               cache_seqlens=_starts(lens), page_table=table,
                                               cache_leftpad=_starts(starts), causal=True)
    for b, n in enumerate(lens):
        k[b, n], v[b, n] = knew[b, 0], vnew[b, 0]
    ref, _ = reference(q, k, v, torch.tensor(lens) + 1, 16 ** -0.5, key_start=starts)
    assert error_report(out.cpu(), ref)["rel"] < FP16_REL


def test_plan_kvcache_leftpad_read_at_every_run():
    """``plan_kvcache(cache_leftpad=)`` keeps the starts like the lengths: updated in place between runs."""
    q, k, v, kc, vc, table = _kvcache_case(8, seed=6, MQ=1)
    lens, starts = _starts([5, 23, 40, 17]), _starts([0, 7, 31, 2])
    plan = fmha_ops.plan_kvcache(q.to(DEVICE), kc, vc, cache_seqlens=lens, page_table=table, cache_leftpad=starts,
                                 causal=True)
    assert plan.op.KEY_START
    for values in ([0, 7, 31, 2], [4, 0, 39, 17]):
        starts.copy_(_starts(values))
        ref, _ = reference(q, k, v, lens.cpu(), 16 ** -0.5, key_start=values)
        assert error_report(plan.run(q.to(DEVICE)).cpu(), ref)["rel"] < FP16_REL


def test_flash_attn_with_kvcache_leftpad_errors():
    q, _, _, kc, vc, table = _kvcache_case(8, MQ=1)
    lens = _starts([5, 23, 40, 17])
    call = dict(cache_seqlens=lens, page_table=table, causal=True)
    cases = [(_starts([0, 1, 2, 3]).long(), "cache_leftpad has dtype torch.int64"),
             (_starts([0, 1]), r"cache_leftpad has shape \(2,\); expected \(4,\)"),
             ([0, 1, 2, 3], "cache_leftpad must be a tensor"),
             (_starts([0, -1, 2, 3]), r"cache_leftpad\[1\] = -1 is outside \[0, cache_seqlens\[1\] = 23\]"),
             (_starts([0, 1, 41, 3]), r"cache_leftpad\[2\] = 41 is outside \[0, cache_seqlens\[2\] = 40\]")]
    if DEVICE == "cpu":
        cases.append((torch.zeros(4, dtype=torch.int32, device="meta"), "cache_leftpad is on meta but q is on cpu"))
    for bad, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            fmha_ops.flash_attn_with_kvcache(q.to(DEVICE), kc, vc, cache_leftpad=bad, **call)


def test_ops_without_key_starts_say_so():
    """An op that does not declare KEY_START gives a reason naming cache_leftpad, so the selector never picks it
    for such a call; the Triton and Gluon decoders, FA3 (``leftpad_k``) and the reference op declare them."""
    from fmha_ops.dispatch import REGISTRY

    p = replace(_decode_problem(kv=torch.bfloat16), key_start=True)
    declared = {op.NAME for op in REGISTRY.ops("fw") if op.KEY_START}
    assert declared == {"triton_decoderF", "triton_splitKF", "gluon_fp8_decodeF", "fa3F", "torch_referenceF"}
    for op in REGISTRY.ops("fw"):
        reasons = " ".join(op.not_supported_reasons(p))
        assert ("cache_leftpad" in reasons) == (not op.KEY_START), op.NAME


def test_gluon_decoder_takes_key_starts():
    """The Gluon fp8-KV decoder declares key starts: an fp8-KV call with them on the H200 has no reason against it
    and still ranks it first (its kernel reads no tile wholly below the start: the cost of the call without)."""
    from fmha_ops.ops.gluon_decode import GluonFp8DecodeFwOp as Gluon

    for page in (0, 16, 64):
        p = replace(_decode_problem(page=page), key_start=True)
        assert Gluon.not_supported_reasons(p) == [] and ranked(p) == "gluon_fp8_decodeF", page


_GLUON_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from fmha_ops.kernels.gluon.decode import _decode_fp8_kernel as kernel

TYPES = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "KS": "*fp32", "VS": "*fp32", "SEQ": "*i32", "BT": "*i32",
         "OUT": "*fp32", "LSE": "*fp32", "KEY_START": "*i32", "qk_scale": "fp32", "softcap_log2": "fp32"}
# what a launch specializes: 16-byte aligned pointers and cache strides (cp.async copies 16 bytes), unit scale strides
ALIGNED = ("stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs", "stride_vh", "stride_ksp", "stride_ksh",
           "stride_vsp", "stride_vsh")
BASE = dict(G=4, MQ=1, D=128, HEADS=1, WARPS=1, BLOCK_N=32, PAGE_SIZE=64, PAGED=True, PARTIAL=True, STAGES=2,
            PDL=False, SC_VEC=4, WINDOW=False, SOFTCAP=False, STORE_LSE=True, HAS_KEY_START=True, stride_kss=1,
            stride_vss=1)
for change in ({}, dict(MQ=3, WINDOW=True, SOFTCAP=True), dict(G=2, D=64, HEADS=2, PAGE_SIZE=8),
               dict(D=256, WARPS=2, PAGED=False, PARTIAL=False), dict(BLOCK_N=16, PAGE_SIZE=48, STAGES=4)):
    consts = {**BASE, **change}
    sig = {n: "constexpr" if n in consts else TYPES.get(n, "i32") for n in kernel.arg_names}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in kernel.arg_names
             if sig[n].startswith("*") or n in ALIGNED}
    src = GluonASTSource(kernel, sig, constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()},
                         attrs=attrs)
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": consts["WARPS"]}).asm["cubin"]
    print("compiled", change)
"""


def test_gluon_decoder_with_key_starts_compiles_for_sm90():
    """Ahead-of-time sm90 compile (no GPU: Gluon does not run in the interpreter) of the decoder with HAS_KEY_START:
    one query (the one-add mask), several with a window and softcap, D64 head pairs over 8-key pages (tiles
    spanning pages), D256 on two warps over a dense cache, 16-key tiles. In a child process without
    ``TRITON_INTERPRET``."""
    r = run_compiled(_GLUON_COMPILE)
    assert r.returncode == 0 and r.stdout.count("compiled") == 5, r.stderr[-3000:]


def test_forced_op_without_key_starts_raises():
    q, _, _, kc, vc, table = _kvcache_case(8, MQ=1)
    with fmha_ops.use_ops("sdpa_mathF"), pytest.raises(fmha_ops.NoSupportedOpError, match="cache_leftpad"):
        fmha_ops.flash_attn_with_kvcache(q.to(DEVICE), kc, vc, cache_seqlens=_starts([5, 23, 40, 17]),
                                         page_table=table, cache_leftpad=_starts([0, 1, 2, 3]), causal=True)


# ---- GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("page_size", [None, 16, 64])
def test_gpu_key_start_real_sizes(fp8, page_size):
    from fmha_ops.kernels.decode_splits import choose_num_splits

    lens = [4097, 0, 1, 1000, 3000, 17]
    q, kw, k, v = make_case(6, 1, 32, 8, 128, lens, page_size=page_size, dtype=torch.bfloat16, fp8=fp8,
                            dist="transformer", seed=11)
    starts = _starts([2000, 0, 1, 999, 64, 3])
    for s in (1, 4, choose_num_splits(6 * 8, 4097, 132)):
        check(q, kw, k, v, rel=GPU_REL[torch.bfloat16], num_splits=s, key_start=starts)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 8, 16, 48, 64])
@pytest.mark.parametrize("G,MQ,D", [(4, 1, 128), (8, 2, 64), (1, 5, 128), (4, 1, 256), (4, 1, 64)])
@pytest.mark.parametrize("window_left", [-1, 300])
def test_gpu_gluon_key_start(page_size, G, MQ, D, window_left):
    """The Gluon fp8 decoder with key starts against the float reference on the dequantized cache: odd lengths,
    starts 0, 1, past a page / a tile, one key left, equal to the length (no key: out 0, lse -inf) and an empty
    sequence; pages spanning a tile (8), 16-key tiles (48), D64 head pairs, D256 on two warps; splits 1 / 3 / 8."""
    if not _gluon_runs():
        pytest.skip("the Gluon decoder runs on sm90")
    check_gluon([0, 33, 17, 1000, 4097, 70, 129], G, MQ, D, page_size, G + MQ + D,
                key_start=_starts([0, 1, 17, 999, 2000, 65, 100]), window_left=window_left)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])
def test_gpu_gluon_flash_attn_with_kvcache_leftpad(page_size):
    """``flash_attn_with_kvcache(cache_leftpad=)`` and ``plan_kvcache`` on an fp8 cache (per-token descales) with
    the Gluon op forced, against the Triton decoder on the same cache; the plan follows starts written in place."""
    from fmha_ops.kv_cache import quantize_kv_fp8

    if not _gluon_runs():
        pytest.skip("the Gluon decoder runs on sm90")
    g = torch.Generator().manual_seed(1)
    B, L, lens = 5, 2112, [1, 2048, 700, 65, 2100]  # the Gluon op takes contiguous caches of 16-key multiples
    q = torch.randn(B, 1, 32, 128, generator=g).to(DEVICE, torch.bfloat16)
    k, v = (torch.randn(B, L, 8, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    if page_size is None:
        table = None
        kc, vc, ks, vs = (t.to(DEVICE) for t in quantize_kv_fp8(k, v, torch.float8_e4m3fn))
    else:
        (kc, vc), table = paged_from_dense([k, v], page_size, generator=g)
        kc, vc, ks, vs = (t.to(DEVICE) for t in quantize_kv_fp8(kc, vc, torch.float8_e4m3fn))
        table = table.to(DEVICE)
    lengths, starts = _starts(lens), _starts([0, 1, 699, 64, 2100])
    call = dict(cache_seqlens=lengths, page_table=table, k_descale=ks, v_descale=vs, cache_leftpad=starts,
                causal=True)
    outs = {}
    for op in ("gluon_fp8_decodeF", "triton_splitKF"):
        with fmha_ops.use_ops(op):
            outs[op] = fmha_ops.flash_attn_with_kvcache(q, kc, vc, **call)
    assert error_report(outs["gluon_fp8_decodeF"], outs["triton_splitKF"])["rel"] < GPU_REL[torch.bfloat16]
    assert (outs["gluon_fp8_decodeF"][4] == 0).all()
    with fmha_ops.use_ops("gluon_fp8_decodeF"):
        plan = fmha_ops.plan_kvcache(q, kc, vc, **call)
    assert plan.op.NAME == "gluon_fp8_decodeF"
    for values in ([0, 1, 699, 64, 2100], [1, 2000, 0, 33, 7]):
        starts.copy_(_starts(values))
        with fmha_ops.use_ops("triton_splitKF"):
            want = fmha_ops.flash_attn_with_kvcache(q, kc, vc, **call)
        assert error_report(plan.run(q), want)["rel"] < GPU_REL[torch.bfloat16], values
