"""GPU checks of the FlashAttention-3 ops against the float32 reference (H200: pytest -m gpu).

Each test skips, with the op's own reason, where no FlashAttention-3 build is installed (``fmha-ops[fa3]``)."""
import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.ops.fa3 import BUILD, FA3BwOp, FA3FwOp
from fmha_ops.quant import quantize_qkv_fp8
from fmha_ops.testing import error_report, transformer_like
from tests.test_gpu_ext_ops import needs, per_tensor, ref

pytestmark = pytest.mark.gpu
DEV = "cuda"


def qkv(b, mq, mk, hq, hkv, d, dv=None, seed=0, dtype=torch.bfloat16):
    q, k, v = transformer_like((b, mq, hq, d), (b, mk, hkv, d), device=DEV, seed=seed)
    if dv is not None:
        v = torch.randn(b, mk, hkv, dv, device=DEV, generator=torch.Generator(DEV).manual_seed(seed))
    return q.to(dtype), k.to(dtype), v.to(dtype)


@needs(FA3FwOp)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mq,mk,hkv,bias", [
    (1000, 1000, 8, None), (333, 333, 2, ab.LowerTriangularMask()),
    (17, 1000, 1, ab.LowerTriangularFromBottomRightMask()), (1, 1000, 8, ab.LowerTriangularFromBottomRightMask()),
    (1000, 17, 2, None), (3000, 3000, 1, ab.LowerTriangularMask())])
def test_fa3_bf16_forward_matches_reference(d, mq, mk, hkv, bias):
    q, k, v = qkv(2, mq, mk, 8, hkv, d, seed=d + mq)
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, op="fa3F")
    assert out.dtype == torch.bfloat16 and out.shape == (2, mq, 8, d)
    rep = error_report(out, ref(q, k, v, bias))
    assert rep["cos"] > 0.9999 and rep["rel"] < 1e-2, rep


@needs(FA3FwOp)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mq,mk,hkv,bias", [
    (1000, 1000, 4, None), (1000, 1000, 16, ab.LowerTriangularFromBottomRightMask()),
    (17, 1000, 4, ab.LowerTriangularFromBottomRightMask()), (1, 333, 1, None),
    (3000, 3000, 2, ab.LowerTriangularMask())])
@pytest.mark.parametrize("granularity", ["head", "tensor"])
def test_fa3_fp8_forward_matches_reference_on_the_same_quantized_inputs(d, mq, mk, hkv, bias, granularity):
    q, k, v = qkv(2, mq, mk, 16, hkv, d, seed=d + mq)
    if granularity == "head":
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    else:
        (q8, k8, v8), kw = per_tensor(q, k, v)
    out = fmha_ops.memory_efficient_attention(q8, k8, v8, bias, op="fa3F", **kw)
    assert out.dtype == torch.bfloat16 and out.shape == (2, mq, 16, d)
    rep = error_report(out, ref(q8, k8, v8, bias, **kw))
    assert rep["cos"] > 0.999 and rep["rel"] < 5e-2, rep


@needs(FA3FwOp)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fa3_value_head_dim_of_its_own(dtype):
    q, k, v = qkv(2, 777, 777, 16, 4, 192, dv=128, seed=5)
    kw = {}
    if dtype != torch.bfloat16:
        q, k, v, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    bias = ab.LowerTriangularFromBottomRightMask()
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, op="fa3F", **kw)
    assert out.shape == (2, 777, 16, 128)
    rep = error_report(out, ref(q, k, v, bias, **kw))
    assert rep["cos"] > 0.999, rep


@needs(FA3FwOp)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fa3_varlen_and_lse(causal, dtype):
    mask = ab.BlockDiagonalMask.from_seqlens([17, 1000, 1, 333], [40, 1000, 7, 333], device=DEV)
    if causal:
        mask = mask.make_causal_from_bottomright()
    q, k, v = qkv(1, 1351, 1380, 8, 2, 128, seed=3)
    kw = {}
    if dtype != torch.bfloat16:
        (q, k, v), kw = per_tensor(q, k, v)
    out, lse = fmha_ops.memory_efficient_attention_partial(q, k, v, mask, op="fa3F", **kw)
    r_out, r_lse = fmha_ops.memory_efficient_attention_partial(q, k, v, mask, op="torch_referenceF", **kw)
    rep = error_report(out, r_out)
    assert rep["cos"] > (0.9999 if dtype == torch.bfloat16 else 0.999), rep
    assert lse.shape == r_lse.shape and torch.allclose(lse, r_lse, atol=5e-2, rtol=1e-2)


@needs(FA3FwOp)
def test_fa3_flash_attn_func_fp8_with_kv_head_descales_and_softcap():
    q, k, v = qkv(2, 1000, 1000, 16, 4, 128, seed=9)
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    with fmha_ops.use_ops("fa3F"):
        out = fmha_ops.flash_attn_func(q8, k8, v8, causal=True, softcap=30.0, **kw)
    with fmha_ops.use_ops("torch_referenceF"):
        want = fmha_ops.flash_attn_func(q8, k8, v8, causal=True, softcap=30.0, **kw)
    rep = error_report(out, want)
    assert rep["cos"] > 0.999, rep


@needs(FA3FwOp)
@pytest.mark.parametrize("seqlens,mq,hkv,d", [([1, 17, 1000, 4096], 1, 8, 128), ([5, 300], 4, 2, 64),
                                              ([2049] * 3, 1, 1, 256)])
def test_fa3_decode_on_a_contiguous_cache_with_append(seqlens, mq, hkv, d):
    b, cap = len(seqlens), max(seqlens) + 64
    g = torch.Generator(DEV).manual_seed(sum(seqlens))
    k_cache = torch.randn(b, cap, hkv, d, device=DEV, generator=g, dtype=torch.bfloat16)
    v_cache = torch.randn(b, cap, hkv, d, device=DEV, generator=g, dtype=torch.bfloat16)
    q = torch.randn(b, mq, 4 * hkv, d, device=DEV, generator=g, dtype=torch.bfloat16)
    k_new = torch.randn(b, mq, hkv, d, device=DEV, generator=g, dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEV)
    outs = {}
    for op in ("fa3F", "torch_referenceF"):
        kc, vc = k_cache.clone(), v_cache.clone()
        with fmha_ops.use_ops(op):
            outs[op] = fmha_ops.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, causal=True)
    rep = error_report(outs["fa3F"], outs["torch_referenceF"])
    assert rep["cos"] > 0.9999, rep


@pytest.mark.skipif(not BUILD.has("PAGEDKV") or FA3FwOp.available() is not None,
                    reason=f"FlashAttention-3 with a paged KV cache is not installed ({BUILD.package})")
def test_fa3_decode_on_a_paged_cache():
    b, hkv, d, page = 3, 2, 128, 64
    lens = [100, 1, 700]
    pages = torch.randperm(3 * 12, device=DEV).to(torch.int32).view(3, 12)
    k_pool = torch.randn(36, page, hkv, d, device=DEV, dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    q = torch.randn(b, 1, 8, d, device=DEV, dtype=torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    outs = {}
    for op in ("fa3F", "torch_referenceF"):
        with fmha_ops.use_ops(op):
            outs[op] = fmha_ops.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seq, page_table=pages,
                                                        causal=True)
    assert error_report(outs["fa3F"], outs["torch_referenceF"])["cos"] > 0.9999


@needs(FA3BwOp)
@pytest.mark.parametrize("bias", [None, ab.LowerTriangularFromBottomRightMask()])
def test_fa3_backward_matches_reference(bias):
    q, k, v = (t.requires_grad_() for t in qkv(2, 1000, 1000, 8, 2, 128, seed=4))
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, op=("fa3F", "fa3B"))
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad(ref(qr, kr, vr, bias), (qr, kr, vr), g.float())
    for name, got, want in zip("qkv", grads, expected):
        assert error_report(got, want)["cos"] > 0.999, name


@needs(FA3FwOp)
def test_fa3_forward_captures_in_a_cuda_graph():
    q, k, v = qkv(2, 512, 512, 8, 2, 128, seed=6)
    fmha_ops.memory_efficient_attention(q, k, v, op="fa3F")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fmha_ops.memory_efficient_attention(q, k, v, op="fa3F")
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert error_report(out, ref(q, k, v))["cos"] > 0.9999


@needs(FA3FwOp)
@pytest.mark.parametrize("return_lse", [False, True])
def test_fa3_planned_decode_steps_follow_the_lengths(return_lse):
    b, cap, hkv, d = 4, 3000, 2, 128
    g = torch.Generator(DEV).manual_seed(11)
    k_cache = torch.randn(b, cap, hkv, d, device=DEV, generator=g, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, 1, 16, d, device=DEV, generator=g, dtype=torch.bfloat16)
    lens = torch.tensor([1, 17, 1000, 2999], dtype=torch.int32, device=DEV)
    with fmha_ops.use_ops("fa3F"):
        plan = fmha_ops.plan_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                     return_softmax_lse=return_lse)
    assert plan.op.NAME == "fa3F"
    for step in range(2):
        got = plan.run(q)
        with fmha_ops.use_ops("torch_referenceF"):
            want = fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                                    return_softmax_lse=return_lse)
        got, want = (got, want) if return_lse else ((got,), (want,))
        assert error_report(got[0], want[0])["cos"] > 0.9999
        if return_lse:
            assert torch.allclose(got[1], want[1], atol=2e-2)
        lens += 1


@needs(FA3FwOp)
@pytest.mark.parametrize("append", [False, True])
def test_fa3_decode_with_key_starts(append):
    """``cache_leftpad`` as FA3's ``leftpad_k`` on a contiguous cache (the fa3-fwd wheel has no paged KV): odd
    lengths, starts 0, 1, mid-row, past 128 keys and equal to the length (an empty sequence: zeros), GQA, against
    the reference op on the same cache; then a plan's steps with the starts written in place."""
    b, cap, hkv, d, mq = 6, 4097 + 64, 2, 128, 1
    lens = [1, 17, 1000, 4097, 300, 33]  # after the append, if any
    starts = [0, 1, 999, 2000, 300 - (mq if append else 0), 5]  # sequence 4: no key, or the appended one only
    g = torch.Generator(DEV).manual_seed(5)
    k_cache = torch.randn(b, cap, hkv, d, device=DEV, generator=g, dtype=torch.bfloat16)
    v_cache = torch.randn(b, cap, hkv, d, device=DEV, generator=g, dtype=torch.bfloat16)
    q = torch.randn(b, mq, 8, d, device=DEV, generator=g, dtype=torch.bfloat16)
    new = [torch.randn(b, mq, hkv, d, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(2)] if append \
        else [None, None]
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV) - (mq if append else 0)
    pad = torch.tensor(starts, dtype=torch.int32, device=DEV)
    outs = {}
    for op in ("fa3F", "torch_referenceF"):
        kc, vc = k_cache.clone(), v_cache.clone()
        with fmha_ops.use_ops(op):
            outs[op] = fmha_ops.flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=seq, cache_leftpad=pad,
                                                        causal=True, return_softmax_lse=True)
    (out, lse), (want, want_lse) = outs["fa3F"], outs["torch_referenceF"]
    assert error_report(out, want)["cos"] > 0.9999
    assert append or ((out[4] == 0).all() and torch.isinf(lse[4]).all()), "start == length: no key"
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen) and torch.allclose(lse[seen], want_lse[seen], atol=2e-2)
    if append:
        return
    with fmha_ops.use_ops("fa3F"):
        plan = fmha_ops.plan_kvcache(q, k_cache, v_cache, cache_seqlens=seq, cache_leftpad=pad, causal=True)
    assert plan.op.NAME == "fa3F"
    for values in (starts, [0, 16, 3, 4096, 64, 32]):
        pad.copy_(torch.tensor(values, dtype=torch.int32))
        with fmha_ops.use_ops("torch_referenceF"):
            want = fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seq, cache_leftpad=pad,
                                                    causal=True)
        assert error_report(plan.run(q), want)["cos"] > 0.9999, values


@pytest.mark.skipif(not BUILD.has("PAGEDKV") or FA3FwOp.available() is not None,
                    reason=f"FlashAttention-3 with a paged KV cache is not installed ({BUILD.package})")
def test_fa3_paged_decode_with_key_starts():
    b, hkv, d, page = 3, 2, 128, 64
    lens, starts = [100, 1, 700], [65, 1, 0]
    pages = torch.randperm(3 * 12, device=DEV).to(torch.int32).view(3, 12)
    k_pool = torch.randn(36, page, hkv, d, device=DEV, dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    q = torch.randn(b, 1, 8, d, device=DEV, dtype=torch.bfloat16)
    seq, pad = (torch.tensor(x, dtype=torch.int32, device=DEV) for x in (lens, starts))
    outs = {}
    for op in ("fa3F", "torch_referenceF"):
        with fmha_ops.use_ops(op):
            outs[op] = fmha_ops.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seq, page_table=pages,
                                                        cache_leftpad=pad, causal=True)
    assert error_report(outs["fa3F"], outs["torch_referenceF"])["cos"] > 0.9999


@needs(FA3FwOp)
@pytest.mark.parametrize("case", ["bf16 window", "fp8 per-tensor", "fp8 per-head", "varlen bf16 lse",
                                  "varlen fp8 per-tensor"])
def test_fa3_repeated_calls_match_the_full_path_bitwise(case):
    """A repeated call runs FA3's launch plan (``FA3FwOp.launcher`` / ``varlen_launcher``, keywords bound once): its
    output (and lse) equal the full path's (``apply``) on the same tensors bit for bit."""
    from fmha_ops.plans import PLANS

    if "window" in case and not BUILD.has("LOCAL"):
        pytest.skip(f"this FlashAttention-3 build ({BUILD.package}) has no local windows")
    fp8, varlen = "fp8" in case, case.startswith("varlen")
    first, second = (qkv(1 if varlen else 2, 333, 333, 8, 2, 128, seed=s) for s in (1, 2))
    calls = []
    for q, k, v in (first, second):
        kw = {}
        if fp8 and "per-head" in case:
            q, k, v, qd, kd, vd = quantize_qkv_fp8(q, k, v)
            kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        elif fp8:
            (q, k, v), kw = per_tensor(q, k, v)
        calls.append(((q, k, v), kw))
    cu = torch.tensor([0, 100, 333], dtype=torch.int32, device=DEV)

    def call(tensors, kw):
        q, k, v = tensors
        if varlen:
            res = fmha_ops.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 233, 233, causal=True,
                                                  return_attn_probs="lse" in case, **kw)
        else:
            res = fmha_ops.flash_attn_func(q, k, v, causal=True, window_size=(64, 0) if "window" in case else (-1, -1),
                                           **kw)
        return res if isinstance(res, tuple) else (res,)

    with fmha_ops.use_ops("fa3F"):
        PLANS.clear()
        full = call(*calls[1])  # the full path: apply
        PLANS.clear()
        call(*calls[0])
        planned = call(*calls[1])  # the plan's launch on new tensors of the layout
    assert len(planned) == len(full) and all(torch.equal(p, f) for p, f in zip(planned, full))
