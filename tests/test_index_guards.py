"""Index guards of the decode and append kernels, host validation of index arguments, and check mode.

The kernels must never touch memory outside their tensors, whatever page tables, lengths and append
positions hold. The caches here sit inside larger buffers whose extra pages hold NaN (e4m3 0x7F for fp8):
a read outside the cache shows up as NaN in the output, a write outside it as a changed fence. Bad indices
give masked output: a length is clamped to [0, capacity]; a sequence's keys (within a kernel's key split) stop
at its first block-table entry that is not a page of the pool; appended tokens outside the cache are dropped.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import fmha_ops
from fmha_ops import checks
from fmha_ops.kv_cache import append_to_cache, build_fp8_paged_cache, keys_contiguous, paged_from_dense
from tests.conftest import DEVICE
from fmha_ops.testing import error_report
from tests.test_kernel_decode import FP16_REL, make_case, reference

F8 = torch.float8_e4m3fn


def fenced(t: torch.Tensor, pad: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(view of ``t`` inside a buffer with ``pad`` NaN pages before and after it, the buffer)."""
    store = t.view(torch.uint8) if t.element_size() == 1 else t
    nan = 0x7F if t.element_size() == 1 else float("nan")
    big = torch.full((t.shape[0] + 2 * pad, *t.shape[1:]), nan, dtype=store.dtype, device=t.device)
    big[pad:-pad] = store
    inner = big[pad:-pad]
    return (inner.view(t.dtype) if t.element_size() == 1 else inner), big


def fence_case(kw: dict) -> dict:
    """``kw`` of ``make_case`` with its caches and scales moved inside NaN fences."""
    kw = dict(kw)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        if name in kw:
            kw[name] = fenced(kw[name])[0]
    return kw


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN fences compare equal to themselves)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def decode(q, kw, **extra):
    from fmha_ops.kernels.triton.decode import paged_decode

    out, lse = paged_decode(q, **kw, **extra)
    return out.cpu(), lse.cpu()


def padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """Dense (B, L, ...) zero-padded to ``length`` keys (the slots of a page past L hold zeros)."""
    out = x.new_zeros((x.shape[0], length, *x.shape[2:]))
    out[:, :x.shape[1]] = x
    return out


# ------------------------------------------------------------------------------------------ decode kernels

# (page_size, block_n): pages shorter than a tile (a page id per key), and pages a multiple of it (per tile)
PAGINGS = [(3, None), (16, None), (32, 16)]


@pytest.mark.parametrize("page_size,block_n", PAGINGS)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("fp8", [None, F8])
def test_decode_bad_page_entries_are_masked(page_size, block_n, num_splits, fp8):
    """Entries past the pool, negative and far out of range: no read outside the caches (no NaN), good sequences
    exact; single pass: a sequence's keys stop at its first bad entry; with splits each split's keys stop at the
    first bad entry in it (a subset of the keys: lse <= the sequence's)."""
    lens = [70, 40, 50, 33]
    q, kw, k, v = make_case(4, 2, 4, 2, 32, lens, page_size=page_size, fp8=fp8, seed=page_size)
    kw = fence_case(kw)
    table = kw["block_table"].clone()
    num_pages = kw["k_cache"].shape[0]
    table[0, 1] = num_pages  # the first page past the pool
    table[1, 0] = -1
    table[2, 2] = 10 ** 6
    if table.shape[1] * page_size > 33 + page_size:
        table[3, -1] = -7  # past sequence 3's keys: never read
    kw["block_table"] = table
    out, lse = decode(q, kw, num_splits=num_splits, **({"block_n": block_n} if block_n else {}))
    assert not out.isnan().any() and not lse.isnan().any()
    cut = [page_size, 0, 2 * page_size, 33]
    ends = [min(n, c) for n, c in zip(lens, cut)]
    ref, ref_lse = reference(q, k, v, lens, kw["scale"], ends)
    full, full_lse = reference(q, k, v, lens, kw["scale"])
    assert error_report(out[3], full[3])["rel"] < FP16_REL
    if num_splits == 1:
        assert (out[1] == 0).all() and torch.isinf(lse[1]).all()
        assert error_report(out, ref)["rel"] < FP16_REL
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), seen) and (lse.double() - ref_lse)[seen].abs().max() < 1e-3
    else:
        assert (lse.double() <= full_lse + 1e-3).all()


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_lengths_clamped_to_the_cache(page_size, num_splits):
    """Lengths past the capacity attend the whole cache (no read past it); negative lengths see no key."""
    lens = [40, 9, 17]
    q, kw, k, v = make_case(3, 1, 4, 2, 32, lens, page_size=page_size, seed=3)
    kw = fence_case(kw)
    capacity = kw["k_cache"].shape[1] if page_size is None else kw["block_table"].shape[1] * page_size
    bad = torch.tensor([4000, -5, 17], dtype=torch.int32)
    kw["seqlens"] = bad.to(DEVICE)
    out, lse = decode(q, kw, num_splits=num_splits)
    assert not out.isnan().any() and not lse.isnan().any()
    clamped = [capacity, 0, 17]
    ref, ref_lse = reference(q, padded(k, capacity), padded(v, capacity), clamped, kw["scale"])
    assert error_report(out, ref)["rel"] < FP16_REL
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and (out[1] == 0).all()


# ------------------------------------------------------------------------------------------ append kernel

def _append_inputs(D, paged, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, M, H = 3, 3, 2
    kn = torch.randn(B, M, H, D, generator=g).to(dtype if dtype.itemsize > 1 else torch.float16)
    vn = torch.randn(B, M, H, D, generator=g).to(kn.dtype)
    shape = (6, 4) if paged else (B, 8)
    store = torch.uint8 if dtype.itemsize == 1 else dtype
    kc = torch.randint(0, 100, (*shape, H, D), generator=g).to(store)
    vc = torch.randint(0, 100, (*shape, H, D), generator=g).to(store)
    if dtype.itemsize == 1:
        kc, vc = kc.view(dtype), vc.view(dtype)
    ks, vs = keys_contiguous(torch.rand(*shape, H, generator=g)), keys_contiguous(torch.rand(*shape, H, generator=g))
    # paged: sequence 0 ends past its last page, sequence 1 reaches an entry past the pool, sequence 2 starts at a
    # negative position; dense: the same lengths against 8 slots
    table = torch.tensor([[0, 1], [2, 6], [3, 4]], dtype=torch.int32) if paged else None
    lens = torch.tensor([6, 3, -2], dtype=torch.int32)
    return kn, vn, kc, vc, ks, vs, lens, table


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("D", [32, 80, 96])
def test_append_out_of_range_positions_are_dropped(paged, D):
    """Positions past the capacity, on an entry past the pool, or negative are not written (fences intact); the
    rest lands where ``append_to_cache`` (torch) puts it; head dims that are not powers of two work."""
    from fmha_ops.kernels.triton.kv_append import kv_append

    kn, vn, kc, vc, ks, vs, lens, table = _append_inputs(D, paged, seed=D)
    expected = [t.clone() for t in (kc, vc)]
    append_to_cache(kn, vn, *expected, lens, block_table=table)
    dev = [t.to(DEVICE) for t in (kc, vc)]
    (kf, kbig), (vf, vbig) = fenced(dev[0]), fenced(dev[1])
    fence_k, fence_v = kbig.clone(), vbig.clone()
    kv_append(kn.to(DEVICE), vn.to(DEVICE), kf, vf, lens.to(DEVICE),
              block_table=None if table is None else table.to(DEVICE))
    assert same_bits(kbig[:2], fence_k[:2]) and same_bits(kbig[-2:], fence_k[-2:])
    assert same_bits(vbig[:2], fence_v[:2]) and same_bits(vbig[-2:], fence_v[-2:])
    assert torch.equal(kf.cpu(), expected[0]) and torch.equal(vf.cpu(), expected[1])
    assert not torch.equal(expected[0], kc)  # something was written


@pytest.mark.parametrize("paged", [False, True])
def test_append_fp8_out_of_range(paged):
    """fp8 caches: rows and their scales outside the cache are not written; written scales are amax / 448."""
    from fmha_ops.kernels.triton.kv_append import kv_append

    kn, vn, kc, vc, ks, vs, lens, table = _append_inputs(80, paged, dtype=F8, seed=1)
    dev = [fenced(t.to(DEVICE)) for t in (kc, vc, ks, vs)]
    before = [big.clone() for _, big in dev]
    kv_append(kn.to(DEVICE), vn.to(DEVICE), dev[0][0], dev[1][0], lens.to(DEVICE),
              block_table=None if table is None else table.to(DEVICE), k_scale=dev[2][0], v_scale=dev[3][0])
    for (_, big), old in zip(dev, before):
        assert same_bits(big[:2], old[:2]) and same_bits(big[-2:], old[-2:])
    exp_ks = ks.clone()
    append_to_cache(kn, vn, kc.clone(), vc.clone(), lens, block_table=table, k_scale=exp_ks, v_scale=vs.clone())
    assert torch.equal(dev[2][0].cpu(), exp_ks)


def test_append_to_cache_fp8_matches_quantize():
    """The torch append writes what ``build_fp8_paged_cache`` would have for the same tokens."""
    k = torch.randn(2, 10, 2, 48, dtype=torch.bfloat16)
    v = torch.randn(2, 10, 2, 48, dtype=torch.bfloat16)
    kc, vc, ks, vs, table = build_fp8_paged_cache(k, v, 4, num_pages=8)
    kc2, vc2, ks2, vs2 = (torch.zeros_like(t) for t in (kc.view(torch.uint8), vc.view(torch.uint8), ks, vs))
    kc2, vc2 = kc2.view(F8), vc2.view(F8)
    ks2, vs2 = keys_contiguous(ks2), keys_contiguous(vs2)
    append_to_cache(k, v, kc2, vc2, torch.zeros(2, dtype=torch.int32), block_table=table, k_scale=ks2, v_scale=vs2)
    assert torch.equal(kc2.view(torch.uint8), kc.view(torch.uint8)) and torch.equal(ks2, ks) and torch.equal(vs2, vs)


# ------------------------------------------------------------------------------------------ flash_attn_with_kvcache

def _kvcache_inputs(B=2, L=8, H=2, D=16, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, 2 * H, D, generator=g).to(dtype)
    kc = torch.randn(B, L, H, D, generator=g).to(dtype)
    vc = torch.randn(B, L, H, D, generator=g).to(dtype)
    return q, kc, vc


def _raises(match, **kw):
    q, kc, vc = kw.pop("tensors", None) or _kvcache_inputs()
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=match):
        fmha_ops.flash_attn_with_kvcache(q, kc, vc, **kw)


I32 = torch.int32


def test_kvcache_index_arguments_validated_on_the_host():
    """CPU-resident index arguments are always validated: the message names the argument, entry and bound."""
    _raises(r"cache_seqlens\[1\] = 4000 is outside \[0, 8\]", cache_seqlens=torch.tensor([4, 4000], dtype=I32))
    _raises(r"cache_seqlens\[0\] = -1", cache_seqlens=torch.tensor([-1, 4], dtype=I32))
    _raises(r"cache_seqlens=9 is outside \[0, 8\]", cache_seqlens=9)
    q, kc, vc = _kvcache_inputs()
    pages = (kc.view(4, 4, 2, 16), vc.view(4, 4, 2, 16))
    _raises(r"page_table\[0, 1\] = 5 is outside \[0, 3\]: k_cache has 4 pages", tensors=(q, *pages),
            cache_seqlens=torch.tensor([6, 2], dtype=I32), page_table=torch.tensor([[0, 5], [1, 2]], dtype=I32))
    _raises(r"page_table\[1, 0\] = -2", tensors=(q, *pages), cache_seqlens=torch.tensor([6, 2], dtype=I32),
            page_table=torch.tensor([[0, 3], [-2, 2]], dtype=I32))
    # entries past a sequence's keys are not read: anything goes there
    fmha_ops.flash_attn_with_kvcache(q, *pages, cache_seqlens=torch.tensor([6, 2], dtype=I32),
                                     page_table=torch.tensor([[0, 3], [1, -9]], dtype=I32))
    _raises(r"cache_batch_idx\[1\] = 2 is outside \[0, 1\]", cache_seqlens=3, cache_batch_idx=torch.tensor([0, 2]))
    # appending past the cache: the lengths plus the new tokens must fit
    _raises(r"cache_seqlens\[0\] = 7 is outside \[0, 6\].*2 new tokens", cache_seqlens=torch.tensor([7, 0], dtype=I32),
            k=torch.randn(2, 2, 2, 16).half(), v=torch.randn(2, 2, 2, 16).half())
    _raises("page_table has shape", tensors=(q, *pages), cache_seqlens=3, page_table=torch.tensor([0, 1], dtype=I32))
    _raises("page_table has dtype", tensors=(q, *pages), cache_seqlens=3,
            page_table=torch.tensor([[0], [1]], dtype=torch.int64))


def test_kvcache_shape_and_descale_errors():
    q, kc, vc = _kvcache_inputs()
    _raises(r"k has shape \(2, 1, 1, 16\); appended keys must be \(batch=2, Mnew, k_cache heads=2",
            cache_seqlens=2, k=torch.randn(2, 1, 1, 16).half(), v=torch.randn(2, 1, 1, 16).half())
    _raises(r"k has shape \(2, 1, 2, 8\)", cache_seqlens=2, k=torch.randn(2, 1, 2, 8).half(),
            v=torch.randn(2, 1, 2, 8).half())
    _raises("k and v are appended together", cache_seqlens=2, k=torch.randn(2, 1, 2, 16).half())
    _raises("a page .* needs >= 1 slot", tensors=(q, kc[:, :0], vc[:, :0]), cache_seqlens=0)
    k8, v8 = kc.to(F8), vc.to(F8)
    tok = torch.ones(2, 8, 2)
    _raises("v_descale is required", tensors=(q, k8, v8), cache_seqlens=3, k_descale=tok)
    _raises(r"k_descale has shape \(2, 2\).*per-\(sequence, head\) descales \(batch, Hkv\) are not supported",
            tensors=(q, k8.view(4, 4, 2, 16), v8.view(4, 4, 2, 16)), cache_seqlens=3,
            page_table=torch.tensor([[0, 1], [2, 3]], dtype=I32), k_descale=torch.ones(2, 2), v_descale=torch.ones(2, 2))
    _raises("per-token k_descale/v_descale", tensors=(q, k8, v8), cache_seqlens=3, k_descale=torch.ones(1),
            v_descale=torch.ones(1), k=torch.randn(2, 1, 2, 16).half(), v=torch.randn(2, 1, 2, 16).half())
    _raises("are for an fp8 cache", cache_seqlens=3, k_descale=tok, v_descale=tok)


def test_kvcache_fp8_one_slot_one_head_append():
    """An fp8 cache of one slot and one KV head: its per-token scale (numel 1) is per token, so the appended
    token's scale is written and the decode attends it."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 2, 16, generator=g).half()
    kc, vc = torch.zeros(1, 1, 1, 16).to(F8), torch.zeros(1, 1, 1, 16).to(F8)
    ks, vs = torch.zeros(1, 1, 1), torch.zeros(1, 1, 1)
    kn, vn = torch.randn(1, 1, 1, 16, generator=g).half(), torch.randn(1, 1, 1, 16, generator=g).half()
    out = fmha_ops.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=0, k_descale=ks, v_descale=vs)
    assert ks.item() == pytest.approx(kn.float().abs().max().item() / 448)
    v_deq = vc.float() * vs[..., None]
    assert error_report(out.float(), v_deq.expand(1, 1, 2, 16))["rel"] < 1e-3  # one key: out = its value


@pytest.mark.parametrize("D", [80, 96])
def test_kvcache_append_head_dims_not_powers_of_two(D):
    """Append with head dims 80 / 96 through the public call (CPU: the torch append); the decode sees them."""
    g = torch.Generator().manual_seed(D)
    q = torch.randn(2, 1, 4, D, generator=g)
    kc, vc = torch.zeros(2, 8, 2, D), torch.zeros(2, 8, 2, D)
    kn, vn = torch.randn(2, 2, 2, D, generator=g), torch.randn(2, 2, 2, D, generator=g)
    fmha_ops.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([3, 6], dtype=I32))
    assert torch.equal(kc[0, 3:5], kn[0]) and torch.equal(vc[1, 6:8], vn[1]) and (kc[0, 5:] == 0).all()


def test_paged_from_dense_errors():
    x = torch.randn(2, 10, 3)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="page_size must be an int >= 1"):
            paged_from_dense([x], bad)
    with pytest.raises(ValueError, match="num_pages=3 cannot hold 2 sequences of 10 keys"):
        paged_from_dense([x], 4, num_pages=3)
    with pytest.raises(ValueError, match="must share"):
        paged_from_dense([x, torch.randn(2, 9, 3)], 4)


# ------------------------------------------------------------------------------------------ check mode

def test_check_mode_switches():
    lens = torch.tensor([3, 9], dtype=I32)
    check = checks.IndexCheck("cache_seqlens", lens, 0, 8, "the cache holds 8 keys per sequence")
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 9 is outside \[0, 8\]"):
        checks.validate_indices(check)  # a host tensor: always checked
    assert checks.wanted(lens)
    with checks.check_inputs():
        assert checks.checks_enabled()
        with checks.check_inputs(False):
            assert not checks.checks_enabled()
        assert checks.checks_enabled()
    assert fmha_ops.check_inputs is checks.check_inputs


def test_check_mode_environment(monkeypatch):
    monkeypatch.setenv("FMHA_OPS_CHECK", "1")
    checks.refresh_env()
    try:
        assert checks.checks_enabled()
        with checks.check_inputs(False):
            assert not checks.checks_enabled()
    finally:
        monkeypatch.delenv("FMHA_OPS_CHECK")
        checks.refresh_env()
    assert not checks.checks_enabled()


def test_page_table_check_reads_only_used_entries():
    """Only the entries holding a sequence's keys are checked (4-key pages: 4 keys use entry 0, 12 use 0-2)."""
    table = torch.tensor([[0, 7, -1], [2, 1, 0]], dtype=I32)
    checks.validate_indices(checks.page_table_check("page_table", table, torch.tensor([4, 12], dtype=I32), 4, 3,
                                                    "k_cache"))
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 7 is outside \[0, 2\]: k_cache has 3 pages"):
        checks.validate_indices(checks.page_table_check("page_table", table, torch.tensor([5, 2], dtype=I32), 4, 3,
                                                        "k_cache"))
    with pytest.raises(ValueError, match=r"page_table\[1, 0\] = 2 is outside \[0, 1\]"):
        checks.validate_indices(checks.page_table_check("page_table", table, torch.tensor([1, 1], dtype=I32), 4, 2,
                                                        "k_cache"))


# ------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
def test_gpu_check_mode_reads_device_indices():
    """On the GPU, bad device-resident indices pass silently (masked) by default and raise in check mode."""
    q, kc, vc = (t.cuda() for t in _kvcache_inputs(dtype=torch.bfloat16))
    lens = torch.tensor([4, 4000], dtype=I32, device="cuda")
    out = fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    assert out.isfinite().all()
    with fmha_ops.check_inputs(), pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 4000 is outside \[0, 8\]"):
        fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    table = torch.tensor([[0, 9]], dtype=I32, device="cuda").expand(2, 2).contiguous()
    pages = kc.view(4, 4, 2, 16), vc.view(4, 4, 2, 16)
    with fmha_ops.check_inputs(), pytest.raises(ValueError, match=r"page_table\[0, 1\] = 9"):
        fmha_ops.flash_attn_with_kvcache(q, *pages, cache_seqlens=torch.tensor([6, 2], dtype=I32, device="cuda"),
                                         page_table=table)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [80, 96])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_kvcache_append_head_dims_not_powers_of_two(D, fp8):
    """Append with head dims 80 / 96 through flash_attn_with_kvcache on the GPU (the kernel with a padded block):
    the cache holds what the torch append writes, and the call attends the new tokens."""
    g = torch.Generator().manual_seed(D)
    B, L, H = 3, 64, 2
    q = torch.randn(B, 1, 4 * H, D, generator=g).cuda().bfloat16()
    k, v = torch.randn(B, L, H, D, generator=g).bfloat16().cuda(), torch.randn(B, L, H, D, generator=g).bfloat16().cuda()
    kn, vn = torch.randn(B, 3, H, D, generator=g).bfloat16().cuda(), torch.randn(B, 3, H, D, generator=g).bfloat16().cuda()
    lens = torch.tensor([0, 17, 61], dtype=I32, device="cuda")
    if fp8:
        kc, vc, ks, vs, table = build_fp8_paged_cache(k, v, 16)
        kw = dict(page_table=table, k_descale=ks, v_descale=vs)
        expected = [kc.clone(), vc.clone(), ks.clone(), vs.clone()]
        append_to_cache(kn, vn, *expected[:2], lens, block_table=table, k_scale=expected[2], v_scale=expected[3])
    else:
        kc, vc, kw = k.clone(), v.clone(), {}
        expected = [k.clone(), v.clone()]
        append_to_cache(kn, vn, *expected, lens)
    out = fmha_ops.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True, **kw)
    got = [kc, vc] + ([kw["k_descale"], kw["v_descale"]] if fp8 else [])
    for a, b in zip(got, expected):
        assert same_bits(a, b)
    assert out.isfinite().all()


MEMCHECK_SCRIPT = textwrap.dedent('''
    import torch
    import fmha_ops
    from fmha_ops.kernels.triton.decode import paged_decode
    from fmha_ops.kernels.triton.kv_append import kv_append
    from fmha_ops.kv_cache import build_fp8_paged_cache

    torch.manual_seed(0)
    B, H, G, D, P, L = 4, 2, 4, 128, 16, 200
    k = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, 1, H * G, D, device="cuda", dtype=torch.bfloat16)
    for page in (P, 64):
        kc, vc, ks, vs, table = build_fp8_paged_cache(k, v, page)
        n = kc.shape[0]
        table[0, 1], table[1, 0], table[2, 2] = n, -1, 10 ** 6
        lens = torch.tensor([L, L, 4000, -3], dtype=torch.int32, device="cuda")
        kb, vb = kc.float().to(torch.bfloat16), vc.float().to(torch.bfloat16)
        for splits in (1, 3):  # the Triton decoder and split-K + reduce, bf16 and fp8 KV
            out, _ = paged_decode(q, kb, vb, lens, block_table=table, scale=D ** -0.5, num_splits=splits)
            assert out.isfinite().all()
            out, _ = paged_decode(q, kc, vc, lens, block_table=table, scale=D ** -0.5, k_scale=ks, v_scale=vs,
                                  num_splits=splits, block_n=64, num_warps=2, num_stages=3)
            assert out.isfinite().all()
            for window in (0, 37, 150):  # windows start the splits mid-sequence (also past a bad entry)
                out, _ = paged_decode(q, kc, vc, lens, block_table=table, scale=D ** -0.5, k_scale=ks, v_scale=vs,
                                      num_splits=splits, window_left=window, softcap=5.0)
                assert out.isfinite().all()
        # the public call: the selected fp8 decoder (sm90: the Gluon kernel), also with a window and softcap
        out = fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, k_descale=ks,
                                               v_descale=vs, causal=True)
        assert out.isfinite().all()
        out = fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, k_descale=ks,
                                               v_descale=vs, causal=True, window_size=(37, 0), softcap=5.0)
        assert out.isfinite().all()
        # appends past the last page, onto bad entries, from negative positions
        kn = torch.randn(B, 3, H, D, device="cuda", dtype=torch.bfloat16)
        kv_append(kn, kn, kc, vc, lens, block_table=table, k_scale=ks, v_scale=vs)
        kv_append(kn, kn, kb, vb, lens, block_table=table)
        fmha_ops.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=lens, page_table=table, k_descale=ks,
                                         v_descale=vs)
    dense_lens = torch.tensor([L, 10 ** 5, -4, 7], dtype=torch.int32, device="cuda")
    out = fmha_ops.flash_attn_with_kvcache(q, k, v, cache_seqlens=dense_lens,
                                           cache_batch_idx=torch.tensor([0, 9, -1, 3], device="cuda"))
    assert out.isfinite().all()
    torch.cuda.synchronize()
    print("memcheck script done")
''')


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
def test_gpu_memcheck_adversarial_indices():
    """compute-sanitizer memcheck over the decode (single pass, split-K + reduce, bf16 / fp8, windows and softcap, the
    selected fp8 decoder) and append kernels fed out-of-range page entries, lengths and append positions: 0 errors."""
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-c",
                        MEMCHECK_SCRIPT], capture_output=True, text=True, env=env, timeout=540)
    tail = (r.stdout + r.stderr)[-4000:]
    print(tail)
    assert r.returncode == 0 and "memcheck script done" in r.stdout, tail
    assert "ERROR SUMMARY: 0 errors" in r.stdout + r.stderr, tail


def test_descale_kind_one_slot_one_head_is_per_token():
    """A per-token scale of a one-slot, one-KV-head cache has numel 1: its exact shape makes it per token."""
    from fmha_ops.inputs import Inputs
    from fmha_ops.validation import descale_kinds

    q, k = torch.zeros(1, 1, 2, 16).half(), torch.zeros(1, 1, 1, 16).to(F8)
    inp = Inputs(q, k, k, k_descale=torch.ones(1, 1, 1), v_descale=torch.ones(1))
    assert descale_kinds(inp)[1:] == ("token", "tensor")
