"""Property-based tests (hypothesis): random valid calls match an independent float64 attention; random
invalid calls raise ValueError naming the offending argument."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fmha_ops
from fmha_ops.quant import K_SCALE_BLOCK as KB
from fmha_ops.quant import Q_SCALE_BLOCK as QB
from fmha_ops.testing import error_report
from tests.test_api import mask_geometry
from tests.test_attn_bias import hand_mask, make_bias, naive_attention

F8 = torch.float8_e4m3fn
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# output dtype -> max relative L2 error vs float64 on the same inputs
REL = {torch.float32: 5e-6, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


@st.composite
def mask_specs(draw):
    kind = draw(st.sampled_from(["none", "causal", "causal_br", "varlen", "padded", "paged"]))
    if kind in ("none", "causal", "causal_br"):
        return {"kind": kind, "b": draw(st.integers(1, 3)), "mq": draw(st.integers(1, 20)),
                "mk": draw(st.integers(1, 20))}
    nseq = draw(st.integers(1, 4))
    lens = st.lists(st.integers(0, 12), min_size=nseq, max_size=nseq)
    if kind == "varlen":
        return {"kind": kind, "q": draw(lens), "k": draw(lens), "causal": draw(st.sampled_from(["", "tl", "br"]))}
    q = draw(st.lists(st.integers(0, 3), min_size=nseq, max_size=nseq))
    k = draw(lens)
    causal = draw(st.sampled_from(["", "br"]))
    if kind == "padded":
        return {"kind": kind, "q": q, "k": k, "padding": max(k) + draw(st.integers(0, 3)), "causal": causal}
    page = draw(st.sampled_from([1, 2, 4, 16]))
    max_pages = max(1, -(-max(k) // page))
    pool = nseq * max_pages + draw(st.integers(0, 2))
    perm = draw(st.permutations(list(range(pool))))
    table = [perm[i * max_pages:(i + 1) * max_pages] for i in range(nseq)]
    return {"kind": kind, "q": q, "k": k, "page": page, "table": table, "pool_pages": pool, "causal": causal}


@st.composite
def valid_calls(draw):
    spec = draw(mask_specs())
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    hkv = draw(st.integers(1, 3))
    hq = hkv * draw(st.integers(1, 4))
    d = draw(st.sampled_from([8, 16, 24]))
    dv = draw(st.sampled_from([d, 8]))
    seed = draw(st.integers(0, 2 ** 16))
    scale = draw(st.sampled_from([None, 0.25, 1.0]))
    return spec, dtype, hq, hkv, d, dv, seed, scale


@SETTINGS
@given(valid_calls())
def test_valid_calls_match_reference(call):
    spec, dtype, hq, hkv, d, dv, seed, scale = call
    b, mq, mk = mask_geometry(spec)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, mq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, mk, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, mk, hkv, dv, generator=g).to(dtype)
    bias = make_bias(spec)
    report = fmha_ops.explain(q, k, v, bias, scale=scale)
    assert report.selected is not None, str(report)
    out = fmha_ops.memory_efficient_attention(q, k, v, bias, scale=scale)
    assert out.shape == (b, mq, hq, dv) and out.dtype == dtype
    ref = naive_attention(q, k, v, hand_mask(spec, mq, mk), scale=scale)
    rep = error_report(out, ref)
    assert torch.isfinite(out).all() and rep["rel"] <= REL[dtype], (report.selected.NAME, rep)


@SETTINGS
@given(st.sampled_from(["tensor", "head", "block"]), st.sampled_from(["tensor", "head", "block"]),
       st.sampled_from(["tensor", "head", "channel"]), st.booleans(), st.integers(1, 140), st.integers(1, 70),
       st.integers(0, 2 ** 16))
def test_fp8_and_i8fp8_descales_match_reference(qk, kk, vk, int8, mq, mk, seed):
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, d = 2, 4, 2, 16
    if int8:
        q = (torch.randn(b, mq, hq, d, generator=g) * 40).round().clamp(-127, 127).to(torch.int8)
        k = (torch.randn(b, mk, hkv, d, generator=g) * 40).round().clamp(-127, 127).to(torch.int8)
        base = 0.02
    else:
        q, k = ((torch.randn(b, m, h, d, generator=g) * 3).to(F8) for m, h in ((mq, hq), (mk, hkv)))
        base = 0.5
    v = (torch.randn(b, mk, hkv, d, generator=g) * 3).to(F8)

    def ds(kind, rows, blk, heads, base):
        shape = {"tensor": (1,), "head": (b, hkv), "block": (b, heads, -(-rows // blk)), "channel": (b, hkv, d)}[kind]
        return (torch.rand(*shape, generator=g) + 0.5) * base

    qd, kd, vd = ds(qk, mq, QB, hq, base), ds(kk, mk, KB, hkv, base), ds(vk, mk, 1, hkv, 0.5)
    out = fmha_ops.memory_efficient_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd,
                                              output_dtype=torch.float32)

    def expand(x, dsc, kind, blk, heads):
        xf = x.double()
        if kind == "tensor":
            return xf * dsc.double()
        if kind == "head":
            return xf * dsc.double().repeat_interleave(heads // hkv, 1)[:, None, :, None]
        if kind == "block":
            rows = torch.arange(x.shape[1]) // blk
            return xf * dsc.double()[:, :, rows].permute(0, 2, 1)[..., None]
        return xf * dsc.double()[:, None]  # channel

    ref = naive_attention(expand(q, qd, qk, QB, hq), expand(k, kd, kk, KB, hkv), expand(v, vd, vk, 0, hkv), None)
    rep = error_report(out, ref)
    assert rep["rel"] < 1e-5, rep


# ---- invalid inputs ---------------------------------------------------------------------------------------

def _base(g, dtype=torch.float16, b=2, mq=5, mk=6, hq=4, hkv=2, d=16):
    return (torch.randn(b, mq, hq, d, generator=g).to(dtype), torch.randn(b, mk, hkv, d, generator=g).to(dtype),
            torch.randn(b, mk, hkv, d, generator=g).to(dtype))


def _fp8(g, b=2, mq=5, mk=6, hq=4, hkv=2, d=16):
    q, k, v = _base(g, torch.float32, b, mq, mk, hq, hkv, d)
    return q.to(F8), k.to(F8), v.to(F8)


MUTATIONS = {
    # name -> (build(g, n) -> (args, kwargs), argument the message must name)
    "query_ndim": (lambda g, n: ((_base(g)[0][0, :, :n % 3 + 1, 0],) + _base(g)[1:], {}), "query"),
    "key_ndim": (lambda g, n: ((_base(g)[0], torch.randn(*([2] * (n % 3 + 2))).half(), _base(g)[2]), {}), "key"),
    "value_seqlen": (lambda g, n: (_base(g)[:2] + (torch.randn(2, 7 + n, 2, 16).half(),), {}), "value"),
    "key_headdim": (lambda g, n: ((_base(g)[0], torch.randn(2, 6, 2, 16 + n + 1).half(), _base(g)[2]), {}),
                    "head dim"),
    "gqa": (lambda g, n: ((torch.randn(2, 5, 2 * (n % 4) + 3, 16).half(),) + _base(g)[1:], {}), "query heads"),
    "dtype_combo": (lambda g, n: ((_base(g)[0].to([torch.float32, torch.bfloat16, torch.float64][n % 3]),)
                                  + _base(g)[1:], {}), "query/key/value dtypes"),
    "missing_descale": (lambda g, n: (_fp8(g), {r: torch.ones(1) for i, r in enumerate(
        ("q_descale", "k_descale", "v_descale")) if i != n % 3}), "_descale is required"),
    "descale_shape": (lambda g, n: (_fp8(g), {"q_descale": torch.ones(1), "k_descale": torch.ones(1),
                                              "v_descale": torch.ones(1), ["q_descale", "k_descale", "v_descale"][
        n % 3]: torch.ones(3 + n, 2)}), "_descale has shape"),
    "descale_dtype": (lambda g, n: (_fp8(g), {"q_descale": torch.ones(1), "k_descale": torch.ones(1),
                                              "v_descale": torch.ones(1), ["q_descale", "k_descale", "v_descale"][
        n % 3]: torch.ones(2, 2, dtype=[torch.float16, torch.float64, torch.int32][n % 3])}), "_descale must be float32"),
    "descale_on_float": (lambda g, n: (_base(g), {"k_descale": torch.ones(1)}), "descales are only for quantized"),
    "dropout": (lambda g, n: (_base(g) + (None, [-0.5, 1.0, 2.0 + n][n % 3]), {}), "p (dropout)"),
    "output_dtype": (lambda g, n: (_base(g), {"output_dtype": [torch.float64, torch.int8, F8][n % 3]}), "output_dtype"),
    "stride": (lambda g, n: ((torch.randn(2, 5, 4, 32).half()[..., ::2],) + _base(g)[1:], {}), "query must be contiguous"),
    "varlen_tokens": (lambda g, n: (_base(g, b=1, mq=6 + n, mk=6),
                                    {"attn_bias": fmha_ops.BlockDiagonalMask.from_seqlens([2, 3], [3, 3])}), "query has"),
    "padded_rows": (lambda g, n: (_base(g, b=1, mq=2, mk=1 + n % 7), {
        "attn_bias": fmha_ops.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 4, [2, 3])}), "kv_padding"),
    "quantize_kv_f32": (lambda g, n: (_base(g, torch.float32), {"quantize_kv_to_fp8": True}), "quantize_kv_to_fp8"),
}


@SETTINGS
@given(st.sampled_from(sorted(MUTATIONS)), st.integers(0, 20), st.integers(0, 2 ** 16))
def test_invalid_calls_raise_naming_the_argument(name, n, seed):
    build, needle = MUTATIONS[name]
    args, kwargs = build(torch.Generator().manual_seed(seed), n)
    with pytest.raises(ValueError) as e:
        fmha_ops.memory_efficient_attention(*args, **kwargs)
    assert needle in str(e.value), (name, str(e.value))
    assert not isinstance(e.value, fmha_ops.NoSupportedOpError), str(e.value)  # rejected by validation, not selection
