"""Public API on CPU vs an independent float64 implementation (dense hand-built masks) and the float64
reference path: every mask kind, layouts, GQA, odd lengths, empty sequences, paging, fp8/int8 descales,
quantize_kv_to_fp8, partial + merge, autograd, overrides and introspection."""
from __future__ import annotations

import math

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.quant import K_SCALE_BLOCK as KB
from fmha_ops.quant import Q_SCALE_BLOCK as QB
from fmha_ops.inputs import Inputs
from fmha_ops.ops.reference import ReferenceBwOp, ReferenceFwOp, reference_attention
from fmha_ops.testing import normal_qkv
from fmha_ops.testing import error_report
from tests.test_attn_bias import hand_mask, make_bias, naive_attention, naive_lse

F8 = torch.float8_e4m3fn
MEA = fmha_ops.memory_efficient_attention
# output dtype -> (max rel L2 error, min cosine) vs float64 on the same (rounded) inputs
TOL = {torch.float32: (2e-6, 1 - 1e-10), torch.bfloat16: (8e-3, 0.99995), torch.float16: (1e-3, 0.999999)}


def rnd(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype)


def assert_close(out, ref, dtype=None):
    rel, cos = TOL[dtype or out.dtype]
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all()
    r = error_report(out, ref)
    assert r["rel"] <= rel and r["cos"] >= cos, r


def mask_geometry(spec):
    """(B, Mq, Mk) of the q / key tensors for a spec (batch 1 for packed masks)."""
    kind = spec["kind"]
    if kind == "varlen":
        return 1, sum(spec["q"]), sum(spec["k"])
    if kind == "padded":
        return 1, sum(spec["q"]), len(spec["k"]) * spec["padding"]
    if kind == "paged":
        return 1, sum(spec["q"]), spec["pool_pages"] * spec["page"]
    return spec.get("b", 2), spec["mq"], spec["mk"]


def shuffled_table(nseq, max_pages, pool_pages, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(pool_pages, generator=g)[: nseq * max_pages].reshape(nseq, max_pages).tolist()


SPECS = {
    "none": {"kind": "none", "mq": 17, "mk": 23},
    "causal": {"kind": "causal", "mq": 17, "mk": 23},
    "causal_mq_gt_mk": {"kind": "causal", "mq": 9, "mk": 4},
    "causal_br": {"kind": "causal_br", "mq": 17, "mk": 23},
    "causal_br_square": {"kind": "causal_br", "mq": 13, "mk": 13},
    "causal_br_decode": {"kind": "causal_br", "mq": 1, "mk": 17},
    "causal_br_mq_gt_mk": {"kind": "causal_br", "mq": 6, "mk": 3},
    "varlen": {"kind": "varlen", "q": [5, 0, 17, 1], "k": [3, 0, 17, 9], "causal": ""},
    "varlen_causal": {"kind": "varlen", "q": [5, 0, 17, 1], "k": [6, 2, 17, 9], "causal": "tl"},
    "varlen_causal_br": {"kind": "varlen", "q": [5, 0, 17, 1], "k": [6, 2, 17, 9], "causal": "br"},
    "padded": {"kind": "padded", "q": [1, 1, 1], "k": [5, 0, 17], "padding": 19, "causal": ""},
    "padded_causal": {"kind": "padded", "q": [3, 1, 2], "k": [5, 1, 17], "padding": 17, "causal": "br"},
    "paged_p1": {"kind": "paged", "q": [1, 2, 1], "k": [5, 0, 9], "page": 1, "pool_pages": 30, "causal": "br",
                 "table": shuffled_table(3, 9, 30, 1)},
    "paged_p16": {"kind": "paged", "q": [1, 1, 1], "k": [17, 0, 33], "page": 16, "pool_pages": 9, "causal": "",
                  "table": shuffled_table(3, 3, 9, 2)},
    "paged_p16_causal": {"kind": "paged", "q": [2, 1, 3], "k": [1, 16, 40], "page": 16, "pool_pages": 10,
                         "causal": "br", "table": shuffled_table(3, 3, 10, 3)},
}


def _spec_inputs(spec, dtype, hq=4, hkv=2, d=16, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, mq, mk = mask_geometry(spec)
    q = rnd(b, mq, hq, d, dtype=dtype, gen=g)
    k = rnd(b, mk, hkv, d, dtype=dtype, gen=g)
    v = rnd(b, mk, hkv, dv or d, dtype=dtype, gen=g)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(SPECS))
def test_every_mask_kind(name, dtype):
    spec = SPECS[name]
    q, k, v = _spec_inputs(spec, dtype, seed=hash(name) % 1000)
    bias = make_bias(spec)
    ref = naive_attention(q, k, v, hand_mask(spec, q.shape[1], k.shape[1]))
    out = MEA(q, k, v, bias)
    assert out.dtype == dtype
    assert_close(out, ref)
    ref64, _ = reference_attention(Inputs(q, k, v, bias), compute_dtype=torch.float64)
    assert error_report(ref64, ref)["rel"] < 1e-12  # the package's float64 path agrees with the naive one
    # every op that claims support gives the same answer
    for op in ops_claiming(Inputs(q, k, v, bias)):
        assert_close(MEA(q, k, v, bias, op=op), ref)


def ops_claiming(inp, skip_known_bad=True):
    """Forward ops whose verdict on this call is ok (minus the known interpreter-bf16 failure)."""
    ops = [op for op in fmha_ops.ALL_FW_OPS if fmha_ops.SELECTOR.verdict(op, inp.problem()).ok]
    if skip_known_bad and inp.query.device.type == "cpu" and inp.query.dtype == torch.bfloat16:
        ops = [op for op in ops if not op.NAME.startswith("triton_")]
    return ops


def test_triton_ops_claiming_bf16_on_cpu_are_correct():
    q, k, v = _spec_inputs(SPECS["none"], torch.bfloat16)
    ref = naive_attention(q, k, v, None)
    for op in ops_claiming(Inputs(q, k, v), skip_known_bad=False):
        assert_close(MEA(q, k, v, op=op), ref)


def test_every_mask_kind_selects_a_non_reference_op_where_it_can():
    q, k, v = _spec_inputs(SPECS["none"], torch.float32)
    assert fmha_ops.explain(q, k, v).selected.NAME != "torch_referenceF"
    assert fmha_ops.explain(q, k, v, ab.LowerTriangularMask()).selected.NAME != "torch_referenceF"


def test_scale_argument_and_head_dim_v():
    spec = SPECS["varlen_causal"]
    q, k, v = _spec_inputs(spec, torch.float32, d=24, dv=8)
    allowed = hand_mask(spec, q.shape[1], k.shape[1])
    assert_close(MEA(q, k, v, make_bias(spec), scale=0.37), naive_attention(q, k, v, allowed, scale=0.37))
    q, k, v = _spec_inputs(SPECS["none"], torch.float32, d=24, dv=8)
    assert_close(MEA(q, k, v, scale=1.3), naive_attention(q, k, v, None, scale=1.3))


@pytest.mark.parametrize("ratio", range(1, 17))
def test_gqa_ratios(ratio):
    hkv = 2 if ratio <= 8 else 1
    g = torch.Generator().manual_seed(ratio)
    q, k, v = rnd(2, 5, hkv * ratio, 8, gen=g), rnd(2, 7, hkv, 8, gen=g), rnd(2, 7, hkv, 8, gen=g)
    assert_close(MEA(q, k, v, ab.LowerTriangularFromBottomRightMask()),
                 naive_attention(q, k, v, hand_mask({"kind": "causal_br"}, 5, 7)))
    # explicit per-head loop: query head h uses kv head h // ratio
    out = MEA(q, k, v)
    for h in (0, hkv * ratio - 1):
        kv = h // ratio
        one = naive_attention(q[:, :, h:h + 1], k[:, :, kv:kv + 1], v[:, :, kv:kv + 1], None)
        assert_close(out[:, :, h:h + 1], one)


@pytest.mark.parametrize("mq,mk", [(1, 1), (1, 17), (17, 1), (17, 17), (33, 130), (130, 33)])
def test_lengths(mq, mk):
    g = torch.Generator().manual_seed(mq * 1000 + mk)
    q, k, v = rnd(1, mq, 2, 16, gen=g), rnd(1, mk, 2, 16, gen=g), rnd(1, mk, 2, 16, gen=g)
    assert_close(MEA(q, k, v), naive_attention(q, k, v, None))
    assert_close(MEA(q, k, v, ab.LowerTriangularMask()), naive_attention(q, k, v, hand_mask({"kind": "causal"}, mq, mk)))


def test_empty_query_and_empty_keys():
    q, k, v = rnd(1, 0, 2, 16), rnd(1, 5, 2, 16), rnd(1, 5, 2, 16)
    assert MEA(q, k, v).shape == (1, 0, 2, 16)
    q, k, v = rnd(1, 3, 2, 16), rnd(1, 0, 2, 16), rnd(1, 0, 2, 16)
    out = MEA(q, k, v)
    assert out.shape == (1, 3, 2, 16) and torch.equal(out, torch.zeros_like(out))


# ---- layouts ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expanded", [True, False])
def test_bmghk(expanded):
    b, m, n, g_, h, d = 2, 6, 9, 2, 3, 8
    gen = torch.Generator().manual_seed(7)
    q = rnd(b, m, g_, h, d, gen=gen)
    if expanded:  # xformers MQA/GQA convention: k/v expanded over the head dim
        k = rnd(b, n, g_, 1, d, gen=gen).expand(b, n, g_, h, d)
        v = rnd(b, n, g_, 1, d, gen=gen).expand(b, n, g_, h, d)
    else:
        k, v = rnd(b, n, g_, h, d, gen=gen), rnd(b, n, g_, h, d, gen=gen)
    out = MEA(q, k, v, ab.LowerTriangularFromBottomRightMask())
    assert out.shape == (b, m, g_, h, d)
    allowed = hand_mask({"kind": "causal_br"}, m, n)
    for gi in range(g_):
        for hi in range(h):
            ref = naive_attention(q[:, :, gi, hi:hi + 1], k[:, :, gi, hi:hi + 1], v[:, :, gi, hi:hi + 1], allowed)
            assert_close(out[:, :, gi, hi:hi + 1], ref)
    o, lse = fmha_ops.memory_efficient_attention_partial(q, k, v)
    assert o.shape == (b, m, g_, h, d) and lse.shape == (b, g_, h, m)
    ref_lse = naive_lse(q[:, :, 1, 2:3], k[:, :, 1, 2:3], None)  # (b, 1, m)
    assert torch.allclose(lse[:, 1, 2], ref_lse[:, 0].float(), atol=1e-5, rtol=1e-5)


def test_bmghk_mixed_expanded_value():
    """key expanded over heads but value not: value's distinct heads must not be dropped."""
    b, m, n, g_, h, d = 1, 4, 5, 1, 3, 8
    q = rnd(b, m, g_, h, d)
    k = rnd(b, n, g_, 1, d).expand(b, n, g_, h, d)
    v = rnd(b, n, g_, h, d)
    out = MEA(q, k, v)
    for hi in range(h):
        assert_close(out[:, :, 0, hi:hi + 1], naive_attention(q[:, :, 0, hi:hi + 1], k[:, :, 0, hi:hi + 1],
                                                              v[:, :, 0, hi:hi + 1], None))


def test_bmk():
    q, k, v = rnd(3, 7, 16), rnd(3, 11, 16), rnd(3, 11, 16)
    out = MEA(q, k, v, ab.LowerTriangularMask())
    assert out.shape == (3, 7, 16)
    ref = naive_attention(q[:, :, None], k[:, :, None], v[:, :, None], hand_mask({"kind": "causal"}, 7, 11))[:, :, 0]
    assert_close(out, ref)
    o, lse = fmha_ops.memory_efficient_attention_partial(q, k, v)
    assert o.shape == (3, 7, 16) and lse.shape == (3, 7)


# ---- quantized inputs -----------------------------------------------------------------------------------------

def my_dequant(x, d, kind, role, seq_of_row=None):
    """Independent dequantization: x (B, M, H, K) fp8/int8 times a descale of ``kind``. ``seq_of_row``: for
    varlen masks, the sequence of each packed row ("head" descales are per sequence then)."""
    xf = x.double()
    if kind == "none":
        return xf
    d = d.double()
    b_, m_, h_, k_ = x.shape
    out = torch.empty_like(xf)
    for bi in range(b_):
        for mi in range(m_):
            for hi in range(h_):
                if kind == "tensor":
                    s = d.reshape(())
                elif kind == "head":
                    s = d[bi if seq_of_row is None else seq_of_row[mi], hi // (h_ // d.shape[1])]
                elif kind == "block":
                    s = d[bi, hi, mi // (QB if role == "q" else KB)]
                elif kind == "token":
                    s = d[bi, mi, hi]
                else:  # channel
                    s = d[bi, hi]
                out[bi, mi, hi] = xf[bi, mi, hi] * s
    return out


def quantized(dtype, shape, gen):
    x = torch.randn(*shape, generator=gen)
    if dtype == torch.int8:
        return (x * 40).round().clamp(-127, 127).to(torch.int8)
    return (x * 3).to(dtype)


def descale(kind, role, b, mq, mk, hq, hkv, dv, gen, base, nseq=None):
    if kind == "none":
        return None
    shape = {"tensor": (1,), "head": (nseq or b, hkv), "channel": (b, hkv, dv), "token": (b, mk, hkv),
             "block": (b, hq, -(-mq // QB)) if role == "q" else (b, hkv, -(-mk // KB))}[kind]
    return (torch.rand(*shape, generator=gen) + 0.5) * base


def rows_to_seq(lens):
    return [i for i, n in enumerate(lens) for _ in range(n)]


QUANT_CASES = [
    # (q dtype, kv dtype, q kind, k kind, v kind)
    (F8, F8, "tensor", "tensor", "tensor"),
    (F8, F8, "head", "head", "head"),
    (F8, F8, "block", "block", "channel"),
    (F8, F8, "head", "tensor", "channel"),
    (torch.float8_e4m3fnuz, torch.float8_e4m3fnuz, "tensor", "head", "head"),
    (torch.int8, F8, "tensor", "tensor", "tensor"),
    (torch.int8, F8, "block", "block", "head"),
    (torch.int8, F8, "head", "head", "channel"),
    (torch.bfloat16, F8, "none", "token", "token"),
    (torch.float16, F8, "none", "head", "head"),
    (torch.bfloat16, F8, "none", "tensor", "token"),
]


def _quant_params():
    for mask in ("none", "varlen_causal"):
        for case in QUANT_CASES:
            marks = []
            yield pytest.param(*case, mask, marks=marks,
                               id=f"{mask}-" + "-".join(str(x).replace("torch.", "") for x in case))


@pytest.mark.parametrize("qd,kd,qk,kk,vk,mask", list(_quant_params()))
def test_quantized_descales(qd, kd, qk, kk, vk, mask):
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = 4, 2, 16
    if mask == "none":
        b, mq, mk, bias, allowed, nseq, qseq, kseq = 2, 130, 70, None, None, None, None, None
    else:  # varlen: "head" descales are (num_sequences, Hkv)
        spec = {"kind": "varlen", "q": [3, 0, 127], "k": [4, 1, 66], "causal": "tl"}
        b, mq, mk, bias = 1, 130, 71, make_bias(spec)
        allowed, nseq, qseq, kseq = hand_mask(spec, mq, mk), 3, rows_to_seq(spec["q"]), rows_to_seq(spec["k"])
    q = quantized(qd, (b, mq, hq, d), gen) if qd in (F8, torch.float8_e4m3fnuz, torch.int8) else \
        rnd(b, mq, hq, d, dtype=qd, gen=gen)
    k, v = quantized(kd if qd != torch.int8 else torch.int8, (b, mk, hkv, d), gen), quantized(kd, (b, mk, hkv, d), gen)
    qbase = 0.02 if qd == torch.int8 else 0.5
    ds = dict(q_descale=descale(qk, "q", b, mq, mk, hq, hkv, d, gen, qbase, nseq),
              k_descale=descale(kk, "k", b, mq, mk, hq, hkv, d, gen, qbase, nseq),
              v_descale=descale(vk, "v", b, mq, mk, hq, hkv, d, gen, 0.5, nseq))
    out = MEA(q, k, v, bias, **ds)
    assert out.dtype == (qd if qd in (torch.float16, torch.bfloat16) else torch.bfloat16)
    ref = naive_attention(my_dequant(q, ds["q_descale"], qk, "q", qseq), my_dequant(k, ds["k_descale"], kk, "k", kseq),
                          my_dequant(v, ds["v_descale"], vk, "v", kseq), allowed)
    assert_close(out, ref, torch.bfloat16)
    out32 = MEA(q, k, v, bias, output_dtype=torch.float32, **ds)
    assert out32.dtype == torch.float32
    assert error_report(out32, ref)["rel"] < 1e-5
    r = fmha_ops.explain(q, k, v, bias, **ds)
    assert r.selected is not None


def my_quantize_per_token(x):
    """Symmetric per-(token, head) e4m3fn round trip, written independently."""
    xf = x.double()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (xf / scale).float().clamp(-448, 448).to(F8).double() * scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["none", "padded_causal", "paged_p16"])
def test_quantize_kv_to_fp8(dtype, mask):
    spec = SPECS[mask] if mask != "none" else {"kind": "none", "mq": 5, "mk": 37}
    q, k, v = _spec_inputs(spec, dtype, seed=5)
    k = k * 3
    k[:, :3] = 0  # an all-zero token row (scale 1, not 0/0)
    bias = make_bias(spec)
    allowed = hand_mask(spec, q.shape[1], k.shape[1])
    out = MEA(q, k, v, bias, quantize_kv_to_fp8=True, output_dtype=torch.float32)
    ref_q = naive_attention(q, my_quantize_per_token(k), my_quantize_per_token(v), allowed)
    assert error_report(out, ref_q)["rel"] < 1e-5, error_report(out, ref_q)
    exact = naive_attention(q, k, v, allowed)
    rep = error_report(out, exact)
    assert 1e-4 < rep["rel"] < 0.08, rep  # quantization really happened, and is only fp8-sized


# ---- partial + merge ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("splits", [(0, 9, 23), (9, 9, 23), (23,), (5, 12, 12, 23)])
def test_partial_merge_reproduces_full(splits):
    gen = torch.Generator().manual_seed(len(splits))
    q, k, v = rnd(2, 17, 4, 16, gen=gen), rnd(2, 23, 2, 16, gen=gen), rnd(2, 23, 2, 16, gen=gen)
    bounds = (0,) + splits
    outs, lses = [], []
    for a, b_ in zip(bounds, bounds[1:]):
        o, lse = fmha_ops.memory_efficient_attention_partial(q, k[:, a:b_], v[:, a:b_])
        assert o.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (2, 4, 17)
        if a == b_:  # the split sees no keys
            assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
        else:
            assert_close(o, naive_attention(q, k[:, a:b_], v[:, a:b_], None))
            assert torch.allclose(lse.double(), naive_lse(q, k[:, a:b_], None), atol=1e-5, rtol=1e-6)
        outs.append(o)
        lses.append(lse)
    full = naive_attention(q, k, v, None)
    out, lse = fmha_ops.merge_attentions(outs, lses)
    assert_close(out, full)
    assert torch.allclose(lse.double(), naive_lse(q, k, None), atol=1e-5, rtol=1e-6)
    out2, none = fmha_ops.merge_attentions(torch.stack(outs), torch.stack(lses), write_lse=False,
                                           output_dtype=torch.bfloat16)
    assert none is None and out2.dtype == torch.bfloat16
    assert_close(out2, full, torch.bfloat16)


def test_partial_with_mask_and_all_empty_merge():
    spec = SPECS["varlen_causal"]
    q, k, v = _spec_inputs(spec, torch.bfloat16)
    o, lse = fmha_ops.memory_efficient_attention_partial(q, k, v, make_bias(spec))
    allowed = hand_mask(spec, q.shape[1], k.shape[1])
    assert o.dtype == torch.float32
    assert_close(o, naive_attention(q, k, v, allowed), torch.bfloat16)
    ref_lse = naive_lse(q, k, allowed)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin].double(), ref_lse[fin], atol=1e-4)
    zeros = torch.zeros(2, 1, 3, 2, 4)
    out, lse = fmha_ops.merge_attentions(zeros, torch.full((2, 1, 2, 3), -math.inf))
    assert torch.equal(out, torch.zeros(1, 3, 2, 4)) and torch.isneginf(lse).all()


def test_partial_merge_bmghk():
    gen = torch.Generator().manual_seed(9)
    q = rnd(2, 5, 2, 3, 8, gen=gen)
    k, v = rnd(2, 11, 2, 1, 8, gen=gen).expand(2, 11, 2, 3, 8), rnd(2, 11, 2, 1, 8, gen=gen).expand(2, 11, 2, 3, 8)
    parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, a:b_], v[:, a:b_]) for a, b_ in ((0, 4), (4, 11))]
    out, lse = fmha_ops.merge_attentions([p[0] for p in parts], [p[1] for p in parts])
    full, full_lse = fmha_ops.memory_efficient_attention_partial(q, k, v)
    assert out.shape == (2, 5, 2, 3, 8) and lse.shape == full_lse.shape == (2, 2, 3, 5)
    assert_close(out, full.double())
    assert torch.allclose(lse, full_lse, atol=1e-5)


def test_merge_errors():
    with pytest.raises(ValueError, match=r"attn_split \(2, 1, 3, 2, 4\) / lse_split \(2, 1, 3\): expected"):
        fmha_ops.merge_attentions(torch.zeros(2, 1, 3, 2, 4), torch.zeros(2, 1, 3))
    with pytest.raises(ValueError, match=r"does not match attn_split"):
        fmha_ops.merge_attentions(torch.zeros(2, 1, 3, 2, 4), torch.zeros(2, 1, 2, 4))


# ---- autograd --------------------------------------------------------------------------------------------------

class NoAutogradFw(ReferenceFwOp):
    """An unregistered forward without autograd: exercises the (fw, bw) pairing in call._Attention."""

    NAME = "test_no_autogradF"
    AUTOGRAD = False

    @classmethod
    def apply(cls, inp, needs_lse):
        with torch.no_grad():
            return super().apply(inp, needs_lse)


@pytest.mark.parametrize("mask", ["none", "causal", "varlen_causal", "padded_causal", "paged_p1"])
@pytest.mark.parametrize("op", [None, (NoAutogradFw, ReferenceBwOp)], ids=["auto", "fw+bw"])
def test_gradients_match_float64(mask, op):
    spec = SPECS[mask]
    q, k, v = _spec_inputs(spec, torch.float32, hq=4, hkv=2, seed=3)
    allowed = hand_mask(spec, q.shape[1], k.shape[1])
    go = torch.randn(q.shape[0], q.shape[1], 4, 16)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = MEA(*leaves, make_bias(spec), scale=0.3, op=op)
    assert out.requires_grad
    grads = torch.autograd.grad(out, leaves, go)
    leaves64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = naive_attention(*leaves64, allowed, scale=0.3)
    ref_grads = torch.autograd.grad(ref, leaves64, go.double())
    assert_close(out, ref.detach())
    for g, rg, name in zip(grads, ref_grads, "qkv"):
        rep = error_report(g, rg)
        assert rep["rel"] < 1e-5 and rep["cos"] > 1 - 1e-9, (name, rep)


def test_forward_has_no_grad():
    q, k, v = (t.requires_grad_(True) for t in _spec_inputs(SPECS["none"], torch.float32))
    out = fmha_ops.memory_efficient_attention_forward(q, k, v)
    assert not out.requires_grad and out.grad_fn is None
    assert_close(out, naive_attention(q.detach(), k.detach(), v.detach(), None))
    assert MEA(q, k, v).requires_grad


# ---- overrides and introspection ------------------------------------------------------------------------------

@pytest.mark.parametrize("mask,dtype", [("none", torch.float32), ("causal", torch.bfloat16),
                                        ("varlen_causal", torch.float32), ("paged_p16", torch.bfloat16)])
def test_explain_selected_is_what_the_call_uses(monkeypatch, mask, dtype):
    spec = SPECS[mask]
    q, k, v = _spec_inputs(spec, dtype)
    bias = make_bias(spec)
    report = fmha_ops.explain(q, k, v, bias)
    assert report.selected is not None and f"selected: {report.selected.NAME}" in str(report)
    used, planned = [], []
    for op in fmha_ops.ALL_FW_OPS:
        def spy(cls, inp, needs_lse, _orig=op.apply):
            used.append(cls.NAME)
            return _orig(inp, needs_lse)

        def plan_spy(cls, inp, needs_lse, _orig=op.launcher):
            planned.append(cls.NAME)
            return _orig(inp, needs_lse)

        monkeypatch.setattr(op, "apply", classmethod(spy))
        monkeypatch.setattr(op, "launcher", classmethod(plan_spy))
    fmha_ops.SELECTOR.clear()  # the first call takes the full path, the second its launch plan (where it has one)
    out = MEA(q, k, v, bias)
    assert used == [report.selected.NAME] and planned in ([], [report.selected.NAME])
    assert torch.equal(MEA(q, k, v, bias), out)
    assert set(used) == {report.selected.NAME} and (len(used) == 2 or planned == [report.selected.NAME])


def test_op_override_forms_and_forced_failure():
    q, k, v = _spec_inputs(SPECS["none"], torch.float32)
    ref = naive_attention(q, k, v, None)
    for op in ("sdpa_mathF", fmha_ops.get_op("torch_referenceF"), (ReferenceFwOp, ReferenceBwOp), ("sdpa_mathF", None)):
        assert_close(MEA(q, k, v, op=op), ref)
    spec = SPECS["varlen"]
    q, k, v = _spec_inputs(spec, torch.float32)
    with pytest.raises(ValueError, match=r"op='sdpa_mathF' cannot run this call: attn_bias block_diagonal not "
                                         r"supported; supported: "):
        MEA(q, k, v, make_bias(spec), op="sdpa_mathF")
    with pytest.raises(ValueError, match="not a registered op"):
        MEA(q, k, v, make_bias(spec), op="no_such_opF")


def test_use_ops_on_api():
    q, k, v = _spec_inputs(SPECS["none"], torch.float32)
    assert fmha_ops.explain(q, k, v).selected.NAME != "torch_referenceF"
    with fmha_ops.use_ops("torch_referenceF"):
        assert fmha_ops.explain(q, k, v).selected is ReferenceFwOp
        assert_close(MEA(q, k, v), naive_attention(q, k, v, None))
    with fmha_ops.use_ops(exclude=[o.NAME for o in fmha_ops.ALL_FW_OPS]):
        with pytest.raises(fmha_ops.NoSupportedOpError, match="no fw op supports this call"):
            MEA(q, k, v)


def test_no_supported_op_error_lists_every_op():
    q, k, v = _spec_inputs(SPECS["none"], torch.float32, d=2000)  # head dim beyond every op
    with pytest.raises(fmha_ops.NoSupportedOpError) as e:
        MEA(q, k, v)
    msg = str(e.value)
    for op in fmha_ops.ALL_FW_OPS:
        assert f"  {op.NAME}: " in msg
    assert "head dim K=2000 not supported" in msg


def test_introspection_names():
    assert fmha_ops.ALL_FW_OPS and fmha_ops.ALL_BW_OPS
    for op in fmha_ops.ALL_FW_OPS + fmha_ops.ALL_BW_OPS:
        assert isinstance(op.NAME, str) and op.NAME
        assert fmha_ops.get_op(op.NAME) is op
    assert all(op.KIND == "fw" for op in fmha_ops.ALL_FW_OPS)
    assert all(op.KIND == "bw" for op in fmha_ops.ALL_BW_OPS)
    names = [op.NAME for op in fmha_ops.ALL_FW_OPS + fmha_ops.ALL_BW_OPS]
    assert len(set(names)) == len(names)
    assert {"torch_referenceF", "torch_referenceB", "sdpa_mathF"} <= set(names)
    with pytest.raises(ValueError, match="not a registered op"):
        fmha_ops.get_op("nopeF")
    r = fmha_ops.explain(*_spec_inputs(SPECS["none"], torch.float32), kind="bw")
    assert [v.op for v in r.verdicts] and all(v.op.KIND == "bw" for v in r.verdicts)


def test_xformers_lookalike_bias_through_api():
    spec = SPECS["varlen_causal"]
    q, k, v = _spec_inputs(spec, torch.float32)
    ours = make_bias(spec)
    XF = type("BlockDiagonalCausalMask", (), {})
    xf = XF()
    xf.q_seqinfo, xf.k_seqinfo = ours.q_seqinfo, ours.k_seqinfo
    assert_close(MEA(q, k, v, xf), naive_attention(q, k, v, hand_mask(spec, q.shape[1], k.shape[1])))


def test_forward_without_autograd_restores_the_grad_mode():
    """memory_efficient_attention_forward / _partial switch autograd off for the call only: no graph on
    inputs that require grad, and the caller's grad mode back afterwards, also after an error."""
    q, k, v = (t.requires_grad_() for t in normal_qkv((1, 9, 2, 16), (1, 9, 2, 16), dtype=torch.float32))
    out = fmha_ops.memory_efficient_attention_forward(q, k, v)
    assert out.grad_fn is None and not out.requires_grad and torch.is_grad_enabled()
    with pytest.raises(ValueError):
        fmha_ops.memory_efficient_attention_forward(q, k[:, :, :1, :8], v)
    assert torch.is_grad_enabled()
    with torch.no_grad():
        fmha_ops.memory_efficient_attention_forward(q, k, v)
        assert not torch.is_grad_enabled()
    o, lse = fmha_ops.memory_efficient_attention_partial(q.detach(), k.detach(), v.detach())
    assert o.grad_fn is None and torch.is_grad_enabled()
