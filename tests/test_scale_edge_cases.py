"""Softmax scales of 0 and below and zero descales give the float32 reference's result in every op and entry point
that takes them (the Triton kernels through the interpreter on the CPU); a negative descale is refused naming the
argument at every entry point: host descales on every call, device ones in check mode."""
from __future__ import annotations

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.kv_cache import dequantize_fp8, paged_from_dense, quantize_kv_fp8
from fmha_ops.testing import error_report, normal_qkv

F8 = torch.float8_e4m3fn
MASKS = {"none": None, "causal": ab.LowerTriangularMask(),
         "bottom-right causal": ab.LowerTriangularFromBottomRightMask()}


def _reference(q, k, v, mask, **kw):
    return fmha_ops.memory_efficient_attention_partial(q, k, v, mask, op="torch_referenceF", **kw)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("scale", [0.0, -0.7, 1e-30])
def test_any_finite_scale_matches_the_reference(mask, scale):
    q, k, v = normal_qkv((2, 17, 4, 16), (2, 23, 2, 16), dtype=torch.float16, seed=3)
    bias = MASKS[mask]
    out, lse = fmha_ops.memory_efficient_attention_partial(q, k, v, bias, scale=scale, output_dtype=torch.float16)
    ref, ref_lse = _reference(q.float(), k.float(), v.float(), bias, scale=scale, output_dtype=torch.float32)
    assert not out.isnan().any() and not lse.isnan().any()
    assert error_report(out.float(), ref)["rel"] < 2e-3
    seen = ref_lse > -torch.inf
    assert torch.equal(lse == -torch.inf, ~seen) and (lse[seen] - ref_lse[seen]).abs().max() < 1e-3


@pytest.mark.parametrize("scale", [0.0, 0.3])
def test_triton_attention_takes_a_zero_scale(scale):
    q, k, v = normal_qkv((1, 17, 2, 16), (1, 23, 2, 16), dtype=torch.float16, seed=4)
    bias = ab.LowerTriangularFromBottomRightMask()
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, scale=scale, op="triton_attnF")
    ref = fmha_ops.memory_efficient_attention(q.float(), k.float(), v.float(), bias, scale=scale,
                                              op="torch_referenceF")
    assert error_report(out.float(), ref)["rel"] < 2e-3


def test_kernels_declare_no_negative_scale_and_the_selector_finds_one_that_does():
    q, k, v = normal_qkv((1, 8, 2, 16), (1, 8, 2, 16), dtype=torch.float16, seed=5)
    report = fmha_ops.explain(q, k, v, ab.LowerTriangularMask(), scale=-0.5)
    assert report.selected is not None and report.selected.NEGATIVE_SCALE
    with pytest.raises(ValueError, match="softmax scale below 0 not supported"):
        fmha_ops.memory_efficient_attention(q, k, v, scale=-0.5, op="triton_attnF")


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("zero", ["q", "k", "both"])
def test_zero_descales_match_the_reference(mask, zero):
    """A descale of 0 (another quantizer's for an all-zero block; ours give such a block 1) makes its scores 0, never
    NaN."""
    q, k, v = (t.to(F8) for t in normal_qkv((1, 17, 2, 16), (1, 23, 2, 16), seed=6))
    one, nil = torch.ones(1), torch.zeros(1)
    qd, kd = (nil if zero in ("q", "both") else one), (nil if zero in ("k", "both") else one)
    bias = MASKS[mask]
    out, lse = fmha_ops.memory_efficient_attention_partial(q, k, v, bias, q_descale=qd, k_descale=kd, v_descale=one,
                                                          op="triton_fp8F")
    ref, ref_lse = _reference(q, k, v, bias, q_descale=qd, k_descale=kd, v_descale=one)
    assert not out.isnan().any()
    assert error_report(out.float(), ref.float())["rel"] < 1e-5
    seen = ref_lse > -torch.inf
    assert (lse[seen] - ref_lse[seen]).abs().max() < 1e-5


@pytest.mark.parametrize("role", ["q_descale", "k_descale", "v_descale"])
def test_a_negative_descale_is_refused_naming_it(role):
    q, k, v = (t.to(F8) for t in normal_qkv((1, 8, 2, 16), (1, 8, 2, 16), seed=7))
    descales = {r: torch.ones(1) for r in ("q_descale", "k_descale", "v_descale")}
    descales[role] = torch.tensor([-0.5])
    for _ in range(2):  # host descales are read on every call, planned or not
        with pytest.raises(ValueError, match=rf"{role} must be >= 0 .* entry 0 is -0.5"):
            fmha_ops.memory_efficient_attention(q, k, v, **descales)
        descales_ok = dict(descales, **{role: torch.ones(1)})
        fmha_ops.memory_efficient_attention(q, k, v, **descales_ok)


def _paged_cache(fp8: bool, seed: int = 8):
    """A paged KV cache (B=2, 32 slots, Hkv=2, D=16, pages of 8) with an all-zero token in each of k and v (an fp8
    cache: a descale of 0 there, as another quantizer may give it; ours give 1), its page table and the dense keys /
    values it holds (dequantized) for a reference."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(2, 32, 2, 16, generator=g).to(torch.float16) for _ in range(2))
    k[0, 5], v[1, 7] = 0.0, 0.0
    if not fp8:
        (kc, vc), table = paged_from_dense([k, v], 8, generator=g)
        return kc, vc, {}, table, k.float(), v.float()
    k8, v8, ks, vs = quantize_kv_fp8(k, v)
    ks[0, 5], vs[1, 7] = 0.0, 0.0
    (kc, vc, kss, vss), table = paged_from_dense([k8.view(torch.uint8), v8.view(torch.uint8), ks, vs], 8, generator=g)
    return (kc.view(F8), vc.view(F8), dict(k_descale=kss, v_descale=vss), table, dequantize_fp8(k8, ks),
            dequantize_fp8(v8, vs))


def _decode_reference(q, k, v, lens, scale):
    """Each sequence's queries (bottom-right causal) against its first ``lens[b]`` keys, float32 reference op."""
    return torch.cat([fmha_ops.memory_efficient_attention(
        q[b:b + 1].float(), k[b:b + 1, :n], v[b:b + 1, :n], ab.LowerTriangularFromBottomRightMask(), scale=scale,
        op="torch_referenceF") for b, n in enumerate(lens.tolist())])


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("op,scale", [(op, scale) for op in ("triton_decoderF", "triton_splitKF", None)
                                      for scale in (0.0, 1e-30)] + [(None, -0.7)])
def test_decode_takes_any_finite_scale_and_zero_token_descales(op, scale, fp8, planned):
    """flash_attn_with_kvcache and plan_kvcache's run give the reference's result for a scale of 0 or below and for
    an all-zero cached token (an fp8 cache: with descale 0), through each decode op (None: the selected one; the
    Triton decoders declare no negative scale)."""
    kc, vc, descales, table, k, v = _paged_cache(fp8)
    q = torch.randn(2, 2, 4, 16, generator=torch.Generator().manual_seed(9)).to(torch.float16)
    lens = torch.tensor([20, 31], dtype=torch.int32)
    kw = dict(cache_seqlens=lens, page_table=table, softmax_scale=scale, causal=True, **descales)
    with fmha_ops.use_ops(*(() if op is None else (op,))):
        if planned:
            plan = fmha_ops.plan_kvcache(q, kc, vc, **kw)
            assert op is None or plan.op.NAME == op
            out = plan.run(q)
        else:
            out = fmha_ops.flash_attn_with_kvcache(q, kc, vc, **kw)
    assert not out.isnan().any()
    assert error_report(out.float(), _decode_reference(q, k, v, lens, scale))["rel"] < 3e-3


#: (op, scale): the selected op (None) at 0 and below, the Triton kernel (no negative scale declared) at 0
SCALE_CASES = [(None, 0.0), (None, -0.7), ("triton", 0.0)]


@pytest.mark.parametrize("op,scale", SCALE_CASES)
def test_flash_attn_functions_take_any_finite_scale(op, scale):
    q, k, v = normal_qkv((2, 9, 4, 16), (2, 13, 2, 16), dtype=torch.float16, seed=10)
    br = ab.LowerTriangularFromBottomRightMask()
    with fmha_ops.use_ops(*(() if op is None else ("triton_attnF",))):
        _flash_attn_functions_match_the_reference(q, k, v, br, scale)


def _flash_attn_functions_match_the_reference(q, k, v, br, scale):
    out = fmha_ops.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    ref = fmha_ops.memory_efficient_attention(q.float(), k.float(), v.float(), br, scale=scale, op="torch_referenceF")
    assert error_report(out.float(), ref)["rel"] < 2e-3
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 13], dtype=torch.int32)
    out = fmha_ops.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 5, 7, softmax_scale=scale, causal=True)
    mask = ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens([4, 5], [6, 7])
    ref = fmha_ops.memory_efficient_attention(q[:1].float(), k[:1].float(), v[:1].float(), mask, scale=scale,
                                              op="torch_referenceF")[0]
    assert error_report(out.float(), ref)["rel"] < 2e-3


@pytest.mark.parametrize("fn", [fmha_ops.fp8_attention, fmha_ops.i8fp8_attention])
@pytest.mark.parametrize("op,scale", SCALE_CASES)
def test_quantized_attention_takes_any_finite_scale(fn, op, scale):
    q, k, v = normal_qkv((1, 17, 2, 16), (1, 17, 2, 16), dtype=torch.float16, seed=11)
    triton = "triton_fp8F" if fn is fmha_ops.fp8_attention else "triton_i8fp8F"
    with fmha_ops.use_ops(*(() if op is None else (triton,))):
        out = fn(q, k, v, causal=True, softmax_scale=scale)
    ref = fmha_ops.memory_efficient_attention(q.float(), k.float(), v.float(), ab.LowerTriangularMask(), scale=scale,
                                              op="torch_referenceF")
    assert not out.isnan().any() and error_report(out.float(), ref)["rel"] < 5e-2


@pytest.mark.parametrize("op,scale", [(None, 0.0), (None, -0.7), (("triton_attnF", "triton_attnB"), 0.0)])
def test_gradients_at_any_finite_scale_match_the_reference(op, scale):
    """The selected ops' gradients (and the Triton kernels', which declare no negative scale) at a scale of 0 or
    below."""
    leaves = [t.requires_grad_() for t in normal_qkv((1, 9, 2, 16), (1, 13, 2, 16), dtype=torch.float16, seed=12)]
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    br = ab.LowerTriangularFromBottomRightMask()
    out = fmha_ops.memory_efficient_attention(*leaves, br, scale=scale, op=op)
    ref = fmha_ops.memory_efficient_attention(*ref_leaves, br, scale=scale, op=("torch_referenceF", "torch_referenceB"))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(13))
    got = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    want = torch.autograd.grad(ref, ref_leaves, grad)
    for name, a, b in zip("qkv", got, want):
        assert not a.isnan().any(), name
        assert (a.float() - b).abs().max() <= 1e-2 * max(b.abs().max(), 1.0), name


_DENSE_ROLES = ("q_descale", "k_descale", "v_descale")
_CACHE_ROLES = ("k_descale", "v_descale")


def _descales(descales: dict, which: str | None, device: str) -> dict:
    """``descales`` on ``device``, the last entry of ``which`` (None: none) set to -0.5."""
    descales = {role: d.to(device) for role, d in descales.items()}
    if which is not None:
        descales[which] = descales[which].clone()
        descales[which].view(-1)[-1] = -0.5
    return descales


def _dense(fn, descale_shape, which, device, **kw):
    """``fn`` on fp8 q (2, 9, 2, 16), k / v (2, 13, 2, 16) with descales of ``descale_shape``."""
    q, k, v = (t.to(device, F8) for t in normal_qkv((2, 9, 2, 16), (2, 13, 2, 16), seed=14))
    return fn(q, k, v, **kw, **_descales({r: torch.ones(descale_shape) for r in _DENSE_ROLES}, which, device))


def _varlen(which, device):
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=device) for c in ([0, 4, 9], [0, 6, 13]))
    return _dense(lambda q, k, v, **kw: fmha_ops.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 5, 7, **kw),
                  (2, 2), which, device, causal=True)


def _kvcache(which, device, append=False, planned=False):
    kc, vc, descales, table, _, _ = _paged_cache(fp8=True, seed=15)
    kc, vc, table = kc.to(device), vc.to(device), table.to(device)
    q = torch.randn(2, 1, 4, 16, generator=torch.Generator().manual_seed(16)).to(device, torch.float16)
    lens = torch.tensor([20, 30], dtype=torch.int32, device=device)
    descales = _descales(descales, which, device)
    if planned:
        return fmha_ops.plan_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, **descales).run(q)
    new = dict(k=q[:, :, :2].clone(), v=q[:, :, :2].clone()) if append else {}
    return fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, **descales, **new)


#: entry point -> (the descales it takes, call(which descale is negative or None, device))
ENTRY_POINTS = {
    "memory_efficient_attention": (_DENSE_ROLES, lambda w, d: _dense(
        fmha_ops.memory_efficient_attention, (1,), w, d)),
    "memory_efficient_attention_forward": (_DENSE_ROLES, lambda w, d: _dense(
        fmha_ops.memory_efficient_attention_forward, (2, 2), w, d)),
    "memory_efficient_attention_partial": (_DENSE_ROLES, lambda w, d: _dense(
        fmha_ops.memory_efficient_attention_partial, (1,), w, d)),
    "flash_attn_func": (_DENSE_ROLES, lambda w, d: _dense(fmha_ops.flash_attn_func, (2, 2), w, d, causal=True)),
    "flash_attn_varlen_func": (_DENSE_ROLES, _varlen),
    "flash_attn_with_kvcache fp8 cache": (_CACHE_ROLES, _kvcache),
    "flash_attn_with_kvcache fp8 cache, appending": (_CACHE_ROLES, lambda w, d: _kvcache(w, d, append=True)),
    "plan_kvcache": (_CACHE_ROLES, lambda w, d: _kvcache(w, d, planned=True)),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_negative_host_descale_is_refused_at_every_entry_point(entry):
    """After a good call stored its plan, a call with a negative host descale raises ValueError naming it, at every
    entry point that takes descales (host values are read on every call, planned or not)."""
    roles, call = ENTRY_POINTS[entry]
    call(None, "cpu")
    call(None, "cpu")
    for role in roles:
        with pytest.raises(ValueError, match=rf"{role} must be >= 0 .* is -0.5"):
            call(role, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_gpu_a_negative_device_descale_is_caught_by_check_mode_at_every_entry_point(entry):
    """Device descales are read in check mode (``check_inputs``: one host sync), planned call or not."""
    roles, call = ENTRY_POINTS[entry]
    with fmha_ops.check_inputs():
        call(None, "cuda")
        call(None, "cuda")
        for role in roles:
            with pytest.raises(ValueError, match=rf"{role} must be >= 0 .* is -0.5"):
                call(role, "cuda")
