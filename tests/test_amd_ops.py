"""CPU tests of the AMD ops: FlyDSL decode ops (declarations, legacy CK names, host-side argument
preparation against the kernels' torch reference) and the aiter asm i8fp8 adapter (argument mapping
against a recorded fake of aiter's function). No AMD GPU here: kernels are never launched."""
from __future__ import annotations

import dataclasses
import sys
import types
import warnings

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.dispatch import REGISTRY, SELECTOR
from fmha_ops.inputs import Inputs, Problem
from fmha_ops.kv_cache import paged_from_dense
from fmha_ops.kernels.flydsl import host
from fmha_ops.ops import aiter_asm, aliases
from fmha_ops.ops.aiter_asm import AiterAsmI8Fp8FwOp
from fmha_ops.ops.flydsl_decode import FIXED_SPLIT_OPS, FlyDSLDecoderFwOp, FlyDSLSplitKFwOp
from fmha_ops.ops.reference import ReferenceFwOp
from registry import Arch
from fmha_ops.testing import error_report, transformer_like

MI300 = Arch("rocm", gfx="gfx942", name="MI300X")
MI355 = Arch("rocm", gfx="gfx950", name="MI355X")
FLYDSL_OPS = (FlyDSLDecoderFwOp, FlyDSLSplitKFwOp, *FIXED_SPLIT_OPS.values())
BF16, F16 = torch.bfloat16, torch.float16
FNUZ, FN = torch.float8_e4m3fnuz, torch.float8_e4m3fn


def problem(**kw) -> Problem:
    base = dict(arch=MI300, q_dtype=BF16, k_dtype=BF16, v_dtype=BF16, out_dtype=BF16, batch=4, seqlen_q=1,
                seqlen_k=4096, total_q=4, heads_q=32, heads_kv=8, head_dim=128, head_dim_v=128,
                bias=ab.PADDED_KEYS_CAUSAL, q_uniform=True, page_size=0, descales=("none",) * 3, quantize_kv=False,
                dropout=False, needs_lse=False, needs_grad=False, deterministic=False, graph_capture=False)
    base.update(kw)
    return Problem(**base)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(REGISTRY, "_warned", set())
    monkeypatch.setattr(aliases, "_WARNED", set())


# ---- registration and declarations ---------------------------------------------------------------------

def test_registered_with_declarations():
    for op in (*FLYDSL_OPS, AiterAsmI8Fp8FwOp):
        assert REGISTRY.get(op.NAME) is op and op in fmha_ops.ALL_FW_OPS
        assert op.ARCHS == ("rocm:gfx942,gfx950",) and op.KIND == "fw"
        assert op.supports_arch(MI300) and op.supports_arch(MI355)
        assert not op.supports_arch(Arch("rocm", gfx="gfx90a")) and not op.supports_arch(Arch("cuda", (9, 0)))
    for op in FLYDSL_OPS:
        assert op.REQUIRES == ("flydsl",) and tuple(op.HEAD_DIMS) == host.HEAD_DIMS
        assert op.PARTIAL and op.CUDA_GRAPH and op.QUANTIZE_KV and op.GQA and op.MAX_SEQLEN_Q == 16
        assert not op.RAGGED_Q and op.DESCALES["k"] == {"none", "token"} and op.DESCALES["q"] == {"none"}
    assert AiterAsmI8Fp8FwOp.REQUIRES == ("aiter",) and tuple(AiterAsmI8Fp8FwOp.HEAD_DIMS) == (128,)
    assert AiterAsmI8Fp8FwOp.OUT_DTYPES == {BF16} and AiterAsmI8Fp8FwOp.BIAS_KINDS == {ab.NONE}
    assert FlyDSLDecoderFwOp.NUM_SPLITS == 1 and FlyDSLSplitKFwOp.NUM_SPLITS is None
    for n, op in FIXED_SPLIT_OPS.items():
        assert op.NAME == f"flydsl_splitK{n}F" and issubclass(op, FlyDSLSplitKFwOp) and op.NUM_SPLITS == n
        assert op.estimate(problem()) is None  # forced / benchmark use only


def test_unavailable_here_with_clear_reason():
    if torch.version.hip is not None:
        pytest.skip("ROCm build")
    for op in FLYDSL_OPS:
        reason = op.available()
        assert reason and ("flydsl" in reason or "rocm:gfx942,gfx950" in reason), reason
    assert "flydsl" in FlyDSLDecoderFwOp.unavailable_reason() or "ROCm" in FlyDSLDecoderFwOp.unavailable_reason()
    reason = AiterAsmI8Fp8FwOp.available()
    assert reason and ("aiter" in reason or "GPU" in reason)


def _decode_call(B=3, Mq=1, Hq=4, Hkv=2, D=128, pad=40, lens=(40, 1, 17), dtype=F16, causal=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, B * Mq, Hq, D, generator=g, dtype=torch.float32).to(dtype)
    k = torch.randn(1, B * pad, Hkv, D, generator=g, dtype=torch.float32).to(dtype)
    v = torch.randn(1, B * pad, Hkv, D, generator=g, dtype=torch.float32).to(dtype)
    cls = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask if causal else ab.BlockDiagonalPaddedKeysMask
    return q, k, v, cls.from_seqlens([Mq] * B, pad, list(lens))


def test_explain_lists_reasons():
    q, k, v, bias = _decode_call()
    report = fmha_ops.explain(q, k, v, bias)
    verdicts = {vd.op.NAME: vd for vd in report.verdicts}
    for op in (*FLYDSL_OPS, AiterAsmI8Fp8FwOp):
        assert op.NAME in verdicts and not verdicts[op.NAME].ok
    assert report.selected is not FlyDSLDecoderFwOp
    if torch.version.hip is None:
        text = str(report)
        for op in FLYDSL_OPS:
            assert verdicts[op.NAME].unavailable and f"{op.NAME}" in text
        assert "no: unavailable: needs a GPU (rocm:gfx942,gfx950)" in text or "flydsl" in text


# ---- legacy names ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("legacy,target", [("ck_decoderF", FlyDSLDecoderFwOp), ("ck_splitKF", FlyDSLSplitKFwOp)]
                         + [(f"ck_splitK{n}", op) for n, op in FIXED_SPLIT_OPS.items()])
def test_legacy_names_warn_once_same_class(fresh_warnings, legacy, target):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert fmha_ops.get_op(legacy) is target
        assert fmha_ops.get_op(legacy) is target
        assert SELECTOR.resolve(legacy, "fw") is target
    assert len(w) == 1 and target.NAME in str(w[0].message) and legacy in str(w[0].message)
    assert REGISTRY.is_legacy(legacy)


@pytest.mark.parametrize("name,target", [("MemoryEfficientAttentionCkDecoderOp", FlyDSLDecoderFwOp),
                                         ("MemoryEfficientAttentionSplitKCkOp", FlyDSLSplitKFwOp)])
def test_xformers_tuples_warn_once(fresh_warnings, name, target):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert getattr(fmha_ops, name) == (target, None)
        from fmha_ops import MemoryEfficientAttentionCkDecoderOp  # noqa: F401  (import form works too)
        assert getattr(fmha_ops, name) == (target, None)
    mine = [x for x in w if name in str(x.message)]
    assert len(mine) == 1 and mine[0].category is DeprecationWarning and target.NAME in str(mine[0].message)
    with pytest.raises(AttributeError):
        fmha_ops.MemoryEfficientAttentionNoSuchOp  # noqa: B018


@pytest.mark.skipif(torch.version.hip is not None, reason="needs a machine where FlyDSL cannot run")
@pytest.mark.parametrize("op", ["ck_decoderF", "flydsl_decoderF", "ck_splitK4", "xformers_decoder", "xformers_splitk"])
def test_forced_op_raises_with_reason_no_fallback(fresh_warnings, op):
    op = {"xformers_decoder": "MemoryEfficientAttentionCkDecoderOp",
          "xformers_splitk": "MemoryEfficientAttentionSplitKCkOp"}.get(op, op)
    if op.startswith("MemoryEfficient"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            op = getattr(fmha_ops, op)
    q, k, v, bias = _decode_call()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pattern = r"op='flydsl_\w+' cannot run this call: unavailable: .*(flydsl|rocm:gfx942,gfx950)"
        with pytest.raises(ValueError, match=pattern):
            fmha_ops.memory_efficient_attention_forward(q, k, v, bias, op=op)


# ---- declarations vs hand-built problems on gfx942 / gfx950 ----------------------------------------------

SUPPORTED = [
    {},
    dict(bias=ab.PADDED_KEYS, seqlen_q=7, total_q=28),
    dict(bias=ab.PAGED_CAUSAL, page_size=16),
    dict(bias=ab.PAGED, page_size=256, seqlen_q=16, total_q=64, heads_q=8),
    dict(bias=ab.NONE, batch=2, seqlen_q=3, total_q=6, seqlen_k=1000),
    dict(bias=ab.CAUSAL_BR, batch=2, seqlen_k=1),
    dict(head_dim=256, head_dim_v=256, q_dtype=F16, k_dtype=F16, v_dtype=F16, out_dtype=F16),
    dict(k_dtype=FNUZ, v_dtype=FNUZ, descales=("none", "token", "token")),
    dict(arch=MI355, k_dtype=FN, v_dtype=FN, descales=("none", "token", "token"), bias=ab.PAGED_CAUSAL, page_size=1),
    dict(quantize_kv=True),
    dict(needs_lse=True),
    dict(graph_capture=True, heads_q=8, heads_kv=1),
]

UNSUPPORTED = [
    (dict(head_dim=64, head_dim_v=64), "head dim K=64"),
    (dict(head_dim=128, head_dim_v=256), "value head dim"),
    (dict(seqlen_q=2, total_q=8), "causal decode with 2 queries"),
    (dict(bias=ab.CAUSAL_BR, seqlen_q=2, total_q=8), "causal decode with 2 queries"),
    (dict(bias=ab.PAGED_CAUSAL, page_size=16, seqlen_q=4, total_q=16), "causal decode with 4 queries"),
    (dict(k_dtype=FN, v_dtype=FN, descales=("none", "token", "token")), "not the native format of gfx942"),
    (dict(arch=MI355, k_dtype=FNUZ, v_dtype=FNUZ, descales=("none", "token", "token")), "native format of gfx950"),
    (dict(k_dtype=FNUZ, v_dtype=FNUZ, descales=("none", "head", "head")), "k_descale kind 'head'"),
    (dict(k_dtype=FNUZ, v_dtype=FNUZ, descales=("none", "tensor", "tensor")), "k_descale kind 'tensor'"),
    (dict(q_dtype=torch.float32, k_dtype=torch.float32, v_dtype=torch.float32, out_dtype=torch.float32), "dtypes"),
    (dict(out_dtype=torch.float32), "output dtype"),
    (dict(bias=ab.CAUSAL), "attn_bias causal"),
    (dict(bias=ab.BLOCK_DIAGONAL_CAUSAL), "attn_bias block_diagonal_causal"),
    (dict(seqlen_q=17, total_q=68, bias=ab.PADDED_KEYS), "query length 17"),
    (dict(q_uniform=False, seqlen_q=3, total_q=5, bias=ab.PADDED_KEYS), "different lengths"),
    (dict(dropout=True), "dropout"),
    (dict(bias=ab.NONE, seqlen_k=0), "no keys"),
    (dict(seqlen_k=1 << 22, heads_kv=8), "int32"),
]


@pytest.mark.parametrize("kw", SUPPORTED)
@pytest.mark.parametrize("op", [FlyDSLDecoderFwOp, FlyDSLSplitKFwOp, FIXED_SPLIT_OPS[8]])
def test_flydsl_accepts(op, kw):
    p = problem(**kw)
    assert op.supports_arch(p.arch)
    assert op.not_supported_reasons(p) == []


@pytest.mark.parametrize("kw,reason", UNSUPPORTED)
def test_flydsl_rejects(kw, reason):
    for op in (FlyDSLDecoderFwOp, FlyDSLSplitKFwOp):
        reasons = op.not_supported_reasons(problem(**kw))
        assert any(reason in r for r in reasons), reasons


def test_flydsl_estimates_rank_split_k_for_long_few_sequences():
    long_few = problem(batch=1, seqlen_k=32768, total_q=1)
    many_short = problem(batch=256, seqlen_k=512, total_q=256)
    for p in (long_few, many_short):
        for op in (FlyDSLDecoderFwOp, FlyDSLSplitKFwOp):
            assert 1e-6 < op.estimate(p) < 1e-2
    assert FlyDSLSplitKFwOp.estimate(long_few) < 0.5 * FlyDSLDecoderFwOp.estimate(long_few)
    assert FlyDSLSplitKFwOp.estimate(many_short) <= 1.05 * FlyDSLDecoderFwOp.estimate(many_short)
    fp8 = problem(batch=64, seqlen_k=8192, k_dtype=FNUZ, v_dtype=FNUZ, descales=("none", "token", "token"))
    assert FlyDSLSplitKFwOp.estimate(fp8) < FlyDSLSplitKFwOp.estimate(dataclasses.replace(
        fp8, k_dtype=BF16, v_dtype=BF16, descales=("none",) * 3))


def i8fp8_problem(**kw):
    base = dict(q_dtype=torch.int8, k_dtype=torch.int8, v_dtype=FNUZ, out_dtype=BF16, bias=ab.NONE, seqlen_q=4096,
                total_q=4 * 4096, heads_kv=32, descales=("tensor",) * 3)
    base.update(kw)
    return problem(**base)


@pytest.mark.parametrize("kw", [{}, dict(descales=("head",) * 3), dict(heads_kv=8),
                                dict(arch=MI355, v_dtype=FN, seqlen_q=1, seqlen_k=17)])
def test_aiter_accepts(kw):
    assert AiterAsmI8Fp8FwOp.not_supported_reasons(i8fp8_problem(**kw)) == []
    assert 0 < AiterAsmI8Fp8FwOp.estimate(i8fp8_problem(**kw)) < 1.0


@pytest.mark.parametrize("kw,reason", [
    (dict(head_dim=64, head_dim_v=64), "head dim K=64"),
    (dict(bias=ab.CAUSAL_BR), "attn_bias"),
    (dict(out_dtype=F16), "output dtype"),
    (dict(q_dtype=FNUZ, k_dtype=FNUZ), "dtypes"),
    (dict(v_dtype=FN), "not the native format of gfx942"),
    (dict(descales=("tensor", "head", "tensor")), "one kind"),
    (dict(descales=("block", "block", "tensor")), "q_descale kind 'block'"),
    (dict(heads_kv=12, heads_q=36), "power of two"),
    (dict(needs_lse=True), "LSE"),
    (dict(dropout=True), "dropout"),
    (dict(graph_capture=True), "CUDA-graph"),
])
def test_aiter_rejects(kw, reason):
    reasons = AiterAsmI8Fp8FwOp.not_supported_reasons(i8fp8_problem(**kw))
    assert any(reason in r for r in reasons), reasons


# ---- FlyDSL host-side argument preparation vs the kernels' torch reference -------------------------------

def _fake_launcher(calls):
    """Stands in for launcher.paged_decode: checks the arguments with the kernels' own packing code
    (host.decode_args asserts layouts) and returns what the kernels compute (host references)."""
    def paged_decode(q, k_cache, v_cache, block_table, seqlens, *, k_scale=None, v_scale=None, scale=None,
                     num_splits=1, out=None, lse=None, stream=None):
        B, Mq, Hq, D = q.shape
        S = num_splits
        if S == 1:
            o, l = torch.empty_like(q), torch.empty(B, Hq, Mq)
        else:
            o, l = torch.empty(B, S, Mq, Hq, D), torch.empty(B, S, Hq, Mq)
        host.decode_args(q, k_cache, v_cache, block_table, seqlens, o, l, k_scale=k_scale, v_scale=v_scale,
                         scale=scale, num_splits=S)
        calls.append(dict(q=q, k=k_cache, v=v_cache, table=block_table, seqlens=seqlens, ks=k_scale, splits=S))
        res = host.decode_reference(q, k_cache, v_cache, block_table, seqlens, k_scale=k_scale, v_scale=v_scale,
                                    scale=scale, num_splits=S)
        if S > 1:
            res = host.reduce_reference(*res)
        return res[0].to(q.dtype), res[1].float()
    return paged_decode


@pytest.fixture
def fake_launch(monkeypatch):
    from fmha_ops.kernels.flydsl import launcher

    calls = []
    monkeypatch.setattr(launcher, "paged_decode", _fake_launcher(calls))
    return calls


def _check(inp, op, calls, needs_lse=True, tol=2e-3):
    inp.validate()
    p = inp.problem(needs_lse)
    assert op.not_supported_reasons(dataclasses.replace(p, arch=MI300)) == [] or inp.key.dtype == FN
    out, lse = op.apply(inp, needs_lse)
    ref_out, ref_lse = ReferenceFwOp.apply(inp, True)
    assert out.shape == inp.query.shape[:3] + (inp.value.shape[3],) and out.dtype == inp.query.dtype
    rep = error_report(out.float(), ref_out.float())
    assert rep["rel"] < tol and rep["cos"] > 0.9999, rep
    if needs_lse:
        assert lse.shape == ref_lse.shape
        fin = torch.isfinite(ref_lse)
        assert torch.equal(fin, torch.isfinite(lse))
        assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-5)
    return calls[-1]


@pytest.mark.parametrize("op", [FlyDSLDecoderFwOp, FlyDSLSplitKFwOp, FIXED_SPLIT_OPS[4]])
def test_padded_keys_is_paged_without_copy(fake_launch, op):
    q, k, v, bias = _decode_call(lens=(40, 0, 17))  # an empty sequence too
    inp = Inputs(q, k, v, bias)
    call = _check(inp, op, fake_launch)
    assert call["k"].data_ptr() == k.data_ptr() and call["v"].data_ptr() == v.data_ptr()
    assert call["k"].shape == (3, 40, 2, 128) and call["table"].tolist() == [[0], [1], [2]]
    assert call["seqlens"] is bias.k_seqinfo.seqlen and call["splits"] == (op.NUM_SPLITS or call["splits"])


@pytest.mark.parametrize("Mq,Hq,Hkv", [(1, 8, 1), (5, 4, 4), (16, 4, 2)])
def test_padded_keys_noncausal_multi_query_gqa(fake_launch, Mq, Hq, Hkv):
    q, k, v, bias = _decode_call(B=2, Mq=Mq, Hq=Hq, Hkv=Hkv, lens=(33, 1), causal=False, dtype=BF16)
    _check(Inputs(q, k, v, bias), FlyDSLSplitKFwOp, fake_launch, tol=8e-3)


@pytest.mark.parametrize("page_size", [1, 16, 48])
def test_paged_mask(fake_launch, page_size):
    q, k, v, bias = _decode_call(B=3, pad=96, lens=(96, 5, 50), dtype=F16)
    kd, vd = k.view(3, 96, 2, 128), v.view(3, 96, 2, 128)
    (kp, vp), table = paged_from_dense([kd, vd], page_size, num_pages=3 * 96 // page_size + 3,
                                                          generator=torch.Generator().manual_seed(3))
    paged = bias.make_paged(table, page_size)
    inp = Inputs(q, kp.view(1, -1, 2, 128), vp.view(1, -1, 2, 128), paged)
    call = _check(inp, FIXED_SPLIT_OPS[2], fake_launch)
    assert call["table"] is table and call["k"].data_ptr() == kp.data_ptr() and call["k"].shape[1] == page_size


@pytest.mark.parametrize("bias", [None, "causal_br"])
def test_bmhk_calls(fake_launch, bias):
    g = torch.Generator().manual_seed(5)
    mq = 1 if bias else 3
    q = torch.randn(2, mq, 8, 256, generator=g).to(BF16)
    k, v = (torch.randn(2, 77, 2, 256, generator=g).to(BF16) for _ in range(2))
    mask = ab.LowerTriangularFromBottomRightMask() if bias else None
    call = _check(Inputs(q, k, v, mask, scale=0.3), FlyDSLDecoderFwOp, fake_launch, tol=8e-3)
    assert call["k"] is k and call["table"].tolist() == [[0], [1]] and call["seqlens"].tolist() == [77, 77]


def test_fp8_kv_per_token_scales_and_transformer_like(fake_launch):
    q, k, v = transformer_like((2, 1, 4, 128), (2, 64, 2, 128), dtype=torch.float32, seed=2)
    k8, ks = host.quantize_per_token(k, FN)
    v8, vs = host.quantize_per_token(v, FN)
    bias = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 64, [64, 23])
    inp = Inputs(q.to(F16).view(1, 2, 4, 128), k8.view(1, 128, 2, 128), v8.view(1, 128, 2, 128), bias,
                 k_descale=ks.view(1, 128, 2), v_descale=vs.view(1, 128, 2))
    call = _check(inp, FlyDSLSplitKFwOp, fake_launch)
    assert call["ks"].shape == (2, 64, 2) and call["ks"].data_ptr() == ks.data_ptr()


def test_quantize_kv_uses_arch_fp8(fake_launch):
    q, k, v, bias = _decode_call(B=2, lens=(40, 9), dtype=BF16)
    call = _check(Inputs(q, k, v, bias, quantize_kv_to_fp8=True), FlyDSLDecoderFwOp, fake_launch, tol=8e-3)
    assert call["k"].dtype == fmha_ops.dtypes.FP8_DTYPES[0] and call["ks"].dtype == torch.float32  # CPU: e4m3fn


def test_kv_with_different_strides_is_made_uniform(fake_launch):
    q, k, v, bias = _decode_call(B=2, lens=(40, 9))
    v_wide = torch.zeros(1, 80, 2, 256, dtype=v.dtype)
    v_wide[..., :128] = v
    inp = Inputs(q, k, v_wide[..., :128], bias)
    call = _check(inp, FlyDSLDecoderFwOp, fake_launch)
    assert call["k"].stride() == call["v"].stride()


def test_split_count_from_heuristic(fake_launch):
    q, k, v, bias = _decode_call(B=1, pad=1024, lens=(1000,), dtype=F16)
    call = _check(Inputs(q, k, v, bias), FlyDSLSplitKFwOp, fake_launch)
    assert call["splits"] == host.choose_num_splits(1, 2, 2, 1024, "gfx942") > 1


# ---- aiter asm i8fp8: argument mapping against a recorded fake -------------------------------------------

def _fake_aiter(monkeypatch, with_entry=True):
    """A fake ``aiter`` package whose ``aiter.ops.mha.flash_attn_i8fp8_pertensor_func`` has the recorded
    signature, checks names / shapes / dtypes like aiter's C++ launcher, and returns a float64 reference."""
    calls = []

    def flash_attn_i8fp8_pertensor_func(q, k, v, q_descale, k_descale, v_descale, causal=False,
                                        window_size=(-1, -1, 0), softmax_scale=None):
        assert q.dtype == torch.int8 and k.dtype == torch.int8 and v.dtype in (FN, FNUZ)
        b, sq, hq, d = q.shape
        _, sk, hk, dv = v.shape
        assert k.shape == (b, sk, hk, d) and d == dv == 128 and hq % hk == 0
        assert all(t.stride(-1) == 1 for t in (q, k, v))
        for ds in (q_descale, k_descale, v_descale):
            assert ds.dtype == torch.float32 and tuple(ds.shape) in ((1,), (b, hk)) and ds.is_contiguous()
        assert q_descale.shape == k_descale.shape == v_descale.shape and causal is False
        calls.append(dict(scale=softmax_scale, q=q, descale_shape=tuple(q_descale.shape)))
        scale = d ** -0.5 if softmax_scale is None else softmax_scale

        def deq(x, ds):  # per tensor, or per (batch, kv head) applied to every head of the group
            x = x.double()
            if ds.numel() == 1:
                return x * ds.double().reshape(())
            return x * ds.double().repeat_interleave(x.shape[2] // hk, dim=1)[:, None, :, None]
        g = hq // hk
        qf = deq(q, q_descale)
        kf = deq(k, k_descale).repeat_interleave(g, dim=2)
        vf = deq(v, v_descale).repeat_interleave(g, dim=2)
        s = torch.einsum("bmhd,bnhd->bhmn", qf, kf) * scale
        return torch.einsum("bhmn,bnhd->bmhd", torch.softmax(s, -1), vf).to(torch.bfloat16)

    mha = types.ModuleType("aiter.ops.mha")
    if with_entry:
        mha.flash_attn_i8fp8_pertensor_func = flash_attn_i8fp8_pertensor_func
    ops = types.ModuleType("aiter.ops")
    ops.mha = mha
    pkg = types.ModuleType("aiter")
    pkg.ops = ops
    for name, mod in (("aiter", pkg), ("aiter.ops", ops), ("aiter.ops.mha", mha)):
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


def _i8fp8_inputs(kind, B=2, M=33, N=70, Hq=4, Hkv=2, scale=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (B, M, Hq, 128), generator=g, dtype=torch.int8)
    k = torch.randint(-127, 128, (B, N, Hkv, 128), generator=g, dtype=torch.int8)
    v = (torch.randn(B, N, Hkv, 128, generator=g) * 50).to(FNUZ)
    shape = (1,) if kind == "tensor" else (B, Hkv)
    qd, kd, vd = ((torch.rand(shape, generator=g) + 0.5) * s for s in (0.01, 0.01, 0.02))
    return Inputs(q, k, v, scale=scale, q_descale=qd, k_descale=kd, v_descale=vd)


@pytest.mark.parametrize("kind", ["tensor", "head"])
@pytest.mark.parametrize("scale", [None, 0.05])
def test_aiter_mapping_against_recorded_fake(monkeypatch, kind, scale):
    calls = _fake_aiter(monkeypatch)
    inp = _i8fp8_inputs(kind, scale=scale)
    inp.validate()
    assert inp.problem().descales == (kind,) * 3
    out, lse = AiterAsmI8Fp8FwOp.apply(inp, False)
    assert lse is None and out.dtype == BF16 and out.shape == (2, 33, 4, 128)
    assert calls[-1]["q"] is inp.query and calls[-1]["scale"] == inp.softmax_scale
    assert calls[-1]["descale_shape"] == ((1,) if kind == "tensor" else (2, 2))
    ref, _ = ReferenceFwOp.apply(inp, False)
    rep = error_report(out.float(), ref.float())
    assert rep["rel"] < 8e-3 and rep["cos"] > 0.9999, rep


def test_aiter_scalar_descale_reshaped(monkeypatch):
    calls = _fake_aiter(monkeypatch)
    inp = _i8fp8_inputs("tensor")
    inp.q_descale = inp.q_descale.reshape(())  # a 0-d scalar is a "tensor" descale too
    args, kwargs = aiter_asm.aiter_args(inp)
    assert kwargs["q_descale"].shape == (1,) and set(kwargs) == {"q_descale", "k_descale", "v_descale", "causal",
                                                                  "softmax_scale"}
    AiterAsmI8Fp8FwOp.apply(inp, False)
    assert calls


def test_aiter_availability_reasons(monkeypatch):
    _fake_aiter(monkeypatch)
    assert AiterAsmI8Fp8FwOp.unavailable_reason() is None
    _fake_aiter(monkeypatch, with_entry=False)
    assert "flash_attn_i8fp8_pertensor_func" in AiterAsmI8Fp8FwOp.unavailable_reason()
    monkeypatch.setitem(sys.modules, "aiter", None)  # import fails
    monkeypatch.delitem(sys.modules, "aiter.ops")
    monkeypatch.delitem(sys.modules, "aiter.ops.mha")
    assert "aiter failed to import" in AiterAsmI8Fp8FwOp.unavailable_reason()
