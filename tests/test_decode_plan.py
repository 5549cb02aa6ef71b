"""``plan_kvcache`` / ``PagedDecodePlan.run``: the same results as ``flash_attn_with_kvcache`` step after step
(lengths and caches updated in place, caches swapped per run), bad arguments named, CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

import fmha_ops
from fmha_ops.kv_cache import paged_from_dense, quantize_kv_fp8
from fmha_ops.testing import error_report
from tests.conftest import DEVICE, HAS_CUDA

DTYPE = torch.float16 if DEVICE == "cpu" else torch.bfloat16
REL = 2e-3 if DEVICE == "cpu" else 8e-3


def _cache(B=3, L=40, Hkv=2, D=16, page_size=8, fp8=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, L, Hkv, D, generator=g).to(DTYPE) for _ in range(2))
    scales = []
    if fp8:
        k8, v8, ks, vs = quantize_kv_fp8(k, v)
        tensors = [k8.view(torch.uint8), v8.view(torch.uint8), ks, vs]
    else:
        tensors = [k, v]
    if page_size is None:
        cache, table = tensors, None
    else:
        cache, table = paged_from_dense(tensors, page_size, generator=g)
        table = table.to(DEVICE)
    cache = [c.to(DEVICE) for c in cache]
    if fp8:
        cache[0], cache[1] = cache[0].view(torch.float8_e4m3fn), cache[1].view(torch.float8_e4m3fn)
        scales = cache[2:]
    return cache[0], cache[1], scales, table


@pytest.mark.parametrize("op", [None, "triton_decoderF", "triton_splitKF"])
@pytest.mark.parametrize("page_size,fp8", [(8, False), (None, False), (8, True)])
def test_run_matches_flash_attn_with_kvcache_over_steps(op, page_size, fp8):
    k_cache, v_cache, scales, table = _cache(page_size=page_size, fp8=fp8, seed=3)
    scale_kw = dict(k_descale=scales[0], v_descale=scales[1]) if fp8 else {}
    lens = torch.tensor([1, 17, 30], dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 1, 4, 16, generator=g).to(DEVICE, DTYPE)
    kw = dict(cache_seqlens=lens, page_table=table, causal=True, softcap=2.0, window_size=(11, 0), **scale_kw)
    scope = fmha_ops.use_ops(op) if op else fmha_ops.use_ops()
    with scope:
        plan = fmha_ops.plan_kvcache(q, k_cache, v_cache, **kw)
        assert plan.op.NAME == (op or plan.op.NAME)
        for step in range(3):
            q.copy_(torch.randn(3, 1, 4, 16, generator=g))
            out = plan.run(q)
            want = fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
            assert out is plan.out
            assert error_report(out.cpu().float(), want.cpu().float())["rel"] < REL, step
            lens += 3  # the loop's lengths, in place


def test_run_with_lse_and_swapped_caches():
    k_cache, v_cache, _, table = _cache(seed=4)
    k2, v2, _, _ = _cache(seed=5)
    lens = torch.tensor([5, 40, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 2, 4, 16).to(DEVICE, DTYPE)
    with fmha_ops.use_ops("triton_splitKF"):
        plan = fmha_ops.plan_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table, causal=True,
                                     return_softmax_lse=True)
        out, lse = plan.run(q, k2, v2)
        want, want_lse = fmha_ops.flash_attn_with_kvcache(q, k2, v2, cache_seqlens=lens, page_table=table, causal=True,
                                                          return_softmax_lse=True)
        assert error_report(out.cpu().float(), want.cpu().float())["rel"] < REL
        seen = torch.isfinite(want_lse)
        assert torch.equal(seen, torch.isfinite(lse)) and (lse - want_lse)[seen].abs().max() < 1e-3
        mine = torch.empty_like(out)
        assert plan.run(q, out=mine, lse=torch.empty_like(lse))[0] is mine


def test_bad_runs_are_named():
    k_cache, v_cache, _, table = _cache(seed=6)
    lens = torch.tensor([5, 40, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 1, 4, 16).to(DEVICE, DTYPE)
    plan = fmha_ops.plan_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table, causal=True)
    with pytest.raises(ValueError, match=r"q \(3, 2, 4, 16\).*does not match the plan's \(3, 1, 4, 16\)"):
        plan.run(torch.randn(3, 2, 4, 16).to(DEVICE, DTYPE))
    with pytest.raises(ValueError, match="k_cache .* does not match the plan's cache"):
        plan.run(q, k_cache[:-1], v_cache[:-1])
    with pytest.raises(ValueError, match="lse is given but the plan returns no lse"):
        plan.run(q, lse=torch.empty(3, 4, 1))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        plan.run(q, out=torch.empty(3, 1, 4, 8))
    with pytest.raises(ValueError, match="k_descale / v_descale are for an fp8 cache"):
        plan.run(q, k_descale=torch.ones(1), v_descale=torch.ones(1))
    with pytest.raises(ValueError, match="page_table has shape"):  # planning validates as the function does
        fmha_ops.plan_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table[:2], causal=True)



@pytest.mark.parametrize("role", ["k_descale", "v_descale"])
def test_swapped_descales_are_checked_like_the_function_checks_them(role):
    """A negative descale passed to ``run`` raises naming it (host descales always, device ones in check mode), as
    ``flash_attn_with_kvcache`` would; a zero one (an all-zero token) runs."""
    k8, v8, scales, table = _cache(fp8=True, seed=7)
    lens = torch.tensor([5, 40, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 1, 4, 16).to(DEVICE, DTYPE)
    plan = fmha_ops.plan_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, k_descale=scales[0],
                                 v_descale=scales[1], causal=True)
    swapped = dict(k_descale=scales[0].clone(), v_descale=scales[1].clone())
    swapped[role][0, 3, 1] = 0.0
    assert not plan.run(q, k8, v8, **swapped).isnan().any()
    swapped[role][0, 3, 1] = -0.5
    with fmha_ops.check_inputs(), pytest.raises(ValueError, match=rf"{role} must be >= 0 .* is -0.5"):
        plan.run(q, k8, v8, **swapped)
    with fmha_ops.check_inputs(), pytest.raises(ValueError, match=rf"{role} must be >= 0 .* is -0.5"):
        fmha_ops.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, causal=True, **swapped)


#: (planned tensor, entry, value written in place between runs, the error ``flash_attn_with_kvcache`` gives for it)
_MUTATIONS = [("lengths", (1,), 41, r"cache_seqlens.* 41"), ("lengths", (0,), -1, r"cache_seqlens.* -1"),
              ("table", (0, 0), 10 ** 6, "page_table"), ("leftpad", (0,), 6, "cache_leftpad"),
              ("k_scale", (0, 3, 1), -0.5, r"k_descale must be >= 0 .* is -0.5"),
              ("v_scale", (0, 3, 1), float("nan"), "v_descale")]


@pytest.mark.parametrize("name,entry,value,message", _MUTATIONS)
def test_run_checks_the_plans_own_indices_and_descales_like_the_first_call(name, entry, value, message):
    """Index tensors and descales the plan holds, changed in place between runs, raise at ``run`` as they do in
    ``flash_attn_with_kvcache`` (host ones always, device ones in check mode), and run again once restored."""
    k8, v8, scales, table = _cache(fp8=True, seed=8)
    lens = torch.tensor([5, 40, 0], dtype=torch.int32, device=DEVICE)
    leftpad = torch.tensor([1, 0, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 1, 4, 16).to(DEVICE, DTYPE)
    arguments = dict(cache_seqlens=lens, page_table=table, k_descale=scales[0], v_descale=scales[1], causal=True,
                     cache_leftpad=leftpad)
    plan = fmha_ops.plan_kvcache(q, k8, v8, **arguments)
    want = plan.run(q).clone()
    planned = dict(lengths=lens, table=table, leftpad=leftpad, k_scale=scales[0], v_scale=scales[1])
    saved = {n: t.clone() for n, t in planned.items()}
    planned[name][entry] = value
    with fmha_ops.check_inputs(), pytest.raises(ValueError, match=message):
        plan.run(q)
    with fmha_ops.check_inputs(), pytest.raises(ValueError, match=message):
        fmha_ops.flash_attn_with_kvcache(q, k8, v8, **arguments)
    planned[name].copy_(saved[name])
    with fmha_ops.check_inputs():
        assert torch.equal(plan.run(q), want)


def test_run_checks_only_the_descales_it_reads():
    """Descales passed to ``run`` replace the plan's: a bad planned descale is not read, so not checked."""
    k8, v8, scales, table = _cache(fp8=True, seed=9)
    lens = torch.tensor([5, 40, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 1, 4, 16).to(DEVICE, DTYPE)
    plan = fmha_ops.plan_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, k_descale=scales[0],
                                 v_descale=scales[1], causal=True)
    good = [s.clone() for s in scales]
    scales[0][0, 0, 0] = -1.0
    with fmha_ops.check_inputs():
        assert not plan.run(q, k8, v8, *good).isnan().any()
        with pytest.raises(ValueError, match="k_descale must be >= 0"):
            plan.run(q)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs")
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_plan_run_in_a_cuda_graph(fp8):
    from bench.common import capture_graph
    from fmha_ops.kv_cache import build_fp8_paged_cache

    g = torch.Generator(device="cuda").manual_seed(0)
    B, L, ps = 16, 2048, 64
    k, v = (torch.randn(B, L, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(B, 1, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k8, v8, ks, vs, table = build_fp8_paged_cache(k, v, ps)
    if fp8:
        kc, vc, kw = k8, v8, dict(k_descale=ks, v_descale=vs)
    else:
        order = table.flatten().argsort()
        kc, vc = (t.view(-1, ps, 8, 128)[order] for t in (k, v))
        kw = {}
    lens = torch.full((B,), 1500, dtype=torch.int32, device="cuda")
    plan = fmha_ops.plan_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=True, **kw)
    graph = capture_graph(lambda: plan.run(q))
    for step in range(3):
        q.copy_(torch.randn(q.shape, device="cuda", generator=g))
        lens.copy_(torch.randint(0, L + 1, (B,), device="cuda", generator=g, dtype=torch.int32))
        graph.replay()
        want = fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=True, **kw)
        assert error_report(plan.out.float(), want.float())["rel"] < 1e-3, step


# ---- flash_attn_with_kvcache's fast path (repeated paged calls on device tensors) ----------------------------

@pytest.mark.parametrize("fp8,per_tensor", [(False, False), (True, False), (True, True)])
def test_fast_path_matches_the_full_path(monkeypatch, fp8, per_tensor):
    """Index tensors on a GPU are not read back, and repeated calls of one layout skip validation and selection: the
    fast path (forced here on the CPU, whose index tensors are otherwise always checked) gives the full path's
    results, follows new lengths, and leaves calls of another layout (or under use_ops) to the full path."""
    from fmha_ops import checks
    from fmha_ops import flash_attn_interface as fa
    from fmha_ops.plans import PLANS

    k_cache, v_cache, scales, table = _cache(fp8=fp8, seed=7)
    if per_tensor:
        scales = [torch.full((1,), 0.02, device=DEVICE), torch.full((1,), 0.03, device=DEVICE)]
    kw = dict(k_descale=scales[0], v_descale=scales[1]) if fp8 else {}
    lens = torch.tensor([1, 17, 30], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 1, 4, 16).to(DEVICE, DTYPE)
    with fmha_ops.use_ops("triton_splitKF"):
        want = [fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens + d, page_table=table,
                                                 causal=True, **kw) for d in (0, 5)]
        PLANS.clear()
        monkeypatch.setattr(checks, "wanted", lambda *t: False)
        got = [fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens + d, page_table=table,
                                                causal=True, **kw) for d in (0, 5, 0)]
        assert len(PLANS.plans(fa.flash_attn_with_kvcache)) == 1
    for a, b in zip(got, want + want[:1]):
        assert error_report(a.cpu().float(), b.cpu().float())["rel"] < 1e-6
    with pytest.raises(ValueError, match="page_table has shape"):  # a new layout is validated in full
        fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table[:2], causal=True,
                                         **kw)


def test_fast_path_leaves_strided_indices_to_the_full_path(monkeypatch):
    """Lengths and page-table rows given as strided views (the kernels read them as consecutive ints) keep the full
    path, which makes them contiguous, on every call: the fast path's layout is marked so once, and the results
    equal those of contiguous indices (decode alone and with an append)."""
    from fmha_ops import checks
    from fmha_ops import flash_attn_interface as fa
    from fmha_ops.plans import PLANS

    k_cache, v_cache, _, table = _cache(seed=11)
    lens = torch.tensor([1, 17, 30], dtype=torch.int32, device=DEVICE)
    strided = dict(cache_seqlens=torch.stack([lens, lens], 1)[:, 0],
                   page_table=torch.stack([table, table], 2).view(table.shape[0], -1)[:, ::2])
    assert strided["cache_seqlens"].stride() == (2,) and strided["page_table"].stride(1) == 2
    q = torch.randn(3, 1, 4, 16).to(DEVICE, DTYPE)
    new = [torch.randn(3, 1, 2, 16).to(DEVICE, DTYPE) for _ in range(2)]
    monkeypatch.setattr(checks, "wanted", lambda *t: False)
    with fmha_ops.use_ops("triton_splitKF"):
        want = fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table,
                                                causal=True)
        PLANS.clear()
        for _ in range(2):
            got = fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, **strided)
            assert torch.equal(got, want)
        assert not PLANS.plans(fa.flash_attn_with_kvcache)
        caches = [[c.clone() for c in (k_cache, v_cache)] for _ in range(3)]
        want = fmha_ops.flash_attn_with_kvcache(q, *caches[0], k=new[0], v=new[1], cache_seqlens=lens,
                                                page_table=table, causal=True)
        PLANS.clear()
        for cache in caches[1:]:
            got = fmha_ops.flash_attn_with_kvcache(q, *cache, k=new[0], v=new[1], causal=True, **strided)
            assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(cache, caches[0]))
        assert not PLANS.plans(fa.flash_attn_with_kvcache)


def test_split_workspace_reused_across_runs(monkeypatch):
    """A split-K plan owns one workspace: runs after runs (new queries, new lengths) still match the full path."""
    from fmha_ops.ops.triton_decode import TritonSplitKFwOp

    monkeypatch.setattr(TritonSplitKFwOp, "num_splits", classmethod(lambda cls, *a, **k: 3))
    k_cache, v_cache, _, table = _cache(seed=8)
    lens = torch.tensor([3, 40, 21], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 1, 4, 16).to(DEVICE, DTYPE)
    with fmha_ops.use_ops("triton_splitKF"):
        plan = fmha_ops.plan_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table, causal=True,
                                     return_softmax_lse=True)
        for step in range(2):
            q.copy_(torch.randn_like(q))
            out, lse = plan.run(q)
            want, want_lse = fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                              page_table=table, causal=True, return_softmax_lse=True)
            assert error_report(out.cpu().float(), want.cpu().float())["rel"] < REL, step
            assert (lse - want_lse).abs().max() < 1e-3
            lens -= 2
