"""``sinks=`` and value head dims of their own through the public entry points (CPU: the reference and the Triton
ops under the interpreter, float16), against a float64 reference; the ops' declarations; validation errors."""
import math
import re

import pytest
import torch

import fmha_ops
from fmha_ops import LowerTriangularFromBottomRightMask, memory_efficient_attention
from fmha_ops.testing import error_report
from tests.conftest import DEVICE
from fmha_ops.ops.common import dequantize
from fmha_ops.validation import validate_sinks
from tests.test_kernel_sinks import FP8_P_TOLERANCE, reference

TRITON_PAIR = ("triton_attnF", "triton_attnB")


def _inputs(b=2, mq=17, mk=17, hq=4, hkv=2, d=48, dv=32, dtype=torch.float16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, mq, hq, d, generator=g), torch.randn(b, mk, hkv, d, generator=g)
    v, sinks = torch.randn(b, mk, hkv, dv, generator=g), torch.randn(hq, generator=g) * 2.0
    q, k, v = (t.to(DEVICE, dtype).requires_grad_(grad) for t in (q, k, v))
    return q, k, v, sinks.to(DEVICE).requires_grad_(grad)


@pytest.mark.parametrize("op", ["torch_referenceF", TRITON_PAIR, ("triton_attnF", "torch_referenceB")])
def test_memory_efficient_attention_sinks_and_gradients(op):
    """Output and the gradients of q, k, v (K=48, Kv=32) and the sinks against float64 autograd."""
    q, k, v, sinks = _inputs(grad=True)
    out = memory_efficient_attention(q, k, v, LowerTriangularFromBottomRightMask(), op=op, sinks=sinks)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, sinks)]
    ref, _ = reference(*leaves[:3], q.shape[-1] ** -0.5, True, leaves[3])
    want = torch.autograd.grad(ref, leaves, grad.double())
    assert error_report(out, ref)["rel"] < 2e-3
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        rep = error_report(g, w)  # dsinks: a sum of both signs over rows, float16 rounding weighs more
        assert rep["rel"] < (1e-2 if name == "dsinks" else 3e-3) and rep["cos"] > 0.9999, (name, rep)


def test_partial_lse_includes_the_sinks_and_rows_without_keys():
    """The partial call's LSE holds the sink; a row without keys (top-left causal, Mq > Mk) gets out 0, lse = sink."""
    q, k, v, sinks = _inputs(mq=5, mk=3)
    out, lse = fmha_ops.memory_efficient_attention_partial(q, k, v, LowerTriangularFromBottomRightMask(),
                                                           op="triton_attnF", sinks=sinks,
                                                           output_dtype=torch.float16)
    ref, ref_lse = reference(q, k, v, q.shape[-1] ** -0.5, True, sinks)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-4
    assert error_report(out, ref)["rel"] < 2e-3
    assert not out[:, 0].any() and torch.allclose(lse[:, :, 0], sinks.expand(2, -1))


def test_flash_attn_func_and_varlen_sinks():
    q, k, v, sinks = _inputs(b=1, mq=20, mk=20)
    want, _ = reference(q, k, v, q.shape[-1] ** -0.5, True, sinks)
    out = fmha_ops.flash_attn_func(q, k, v, causal=True, sinks=sinks)
    assert error_report(out, want)["rel"] < 2e-3
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=DEVICE)
    packed = fmha_ops.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 13, 13, causal=True, sinks=sinks)
    for a, b in ((0, 7), (7, 20)):
        ref, _ = reference(q[:, a:b], k[:, a:b], v[:, a:b], q.shape[-1] ** -0.5, True, sinks)
        assert error_report(packed[a:b], ref[0])["rel"] < 2e-3


@pytest.mark.parametrize("op", [None, "triton_decoderF", "triton_splitKF"])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_decode_sinks_value_dim(paged, op):
    """flash_attn_with_kvcache (appending, then decoding) and plan_kvcache with sinks, K=48 and Kv=32 caches; the
    selector's op, or a Triton decoder forced."""
    if op is None:
        _kvcache_decode(paged)
    else:
        with fmha_ops.use_ops(op):
            _kvcache_decode(paged)


def _kvcache_decode(paged):
    from fmha_ops.kv_cache import paged_from_dense

    b, length, hq, hkv, d, dv = 2, 32, 4, 2, 48, 32
    q, k, v, sinks = _inputs(b=b, mq=1, mk=length, hq=hq, hkv=hkv, d=d, dv=dv, seed=3)
    lengths = torch.tensor([20, 9], dtype=torch.int32, device=DEVICE)
    table = None
    k_cache, v_cache = k.clone(), v.clone()
    if paged:
        (k_cache, v_cache), table = paged_from_dense([k, v], 8)
    new_k, new_v = k[:, :1] * 0.5, v[:, :1] * 0.5
    out = fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=lengths, page_table=table,
                                           causal=True, sinks=sinks)
    assert out.shape == (b, 1, hq, dv)
    plan = fmha_ops.plan_kvcache(q, k_cache, v_cache, cache_seqlens=lengths + 1, page_table=table, causal=True,
                                 sinks=sinks)
    planned = plan.run(q).clone()
    other = plan.run(q, sinks=sinks * 0.0 - 30.0)  # another layer's sinks: here, almost none
    for i, n in enumerate(lengths.tolist()):
        kk = torch.cat([k[i:i + 1, :n], new_k[i:i + 1]], 1)
        vv = torch.cat([v[i:i + 1, :n], new_v[i:i + 1]], 1)
        ref, _ = reference(q[i:i + 1], kk, vv, d ** -0.5, True, sinks)
        assert error_report(out[i:i + 1], ref)["rel"] < 2e-3
        assert error_report(planned[i:i + 1], ref)["rel"] < 2e-3
        without, _ = reference(q[i:i + 1], kk, vv, d ** -0.5, True, None)
        assert error_report(other[i:i + 1], without)["rel"] < 2e-3
    with pytest.raises(ValueError, match="sinks"):
        fmha_ops.plan_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, page_table=table, causal=True).run(
            q, sinks=sinks)


@pytest.mark.parametrize("op", ["triton_decoderF", "triton_splitKF"])
def test_kvcache_decode_plan_takes_each_calls_sinks(op, monkeypatch):
    """flash_attn_with_kvcache with sinks keeps its decode plan (GPT-OSS: every layer its own sinks, one cache
    layout): a repeated call skips the checks (no ``kvcache_call``), appends, and attends with its own sinks."""
    from fmha_ops import checks, kvcache_call
    from fmha_ops.kv_cache import paged_from_dense

    monkeypatch.setattr(checks, "wanted", lambda *t: False)  # index tensors treated as a GPU's (the plan's path)
    checked, check = [], kvcache_call.kvcache_call
    monkeypatch.setattr(kvcache_call, "kvcache_call", lambda *a: checked.append(1) or check(*a))
    q, k, v, _ = _inputs(b=2, mq=1, mk=32, seed=6)
    (k_cache, v_cache), table = paged_from_dense([k, v], 8)
    lengths = torch.tensor([20, 9], dtype=torch.int32, device=DEVICE)
    layers = [torch.randn(q.shape[2], generator=torch.Generator().manual_seed(i)).to(DEVICE) * 2 for i in range(3)]
    fmha_ops.SELECTOR.clear()
    with fmha_ops.use_ops(op):
        outs = []
        for i, sinks in enumerate(layers):  # each call appends its token (k / v scaled by the layer) at lengths + i
            new_k, new_v = k[:, :1] * (i + 2), v[:, :1] * (i + 2)
            outs.append(fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=lengths + i,
                                                         page_table=table, causal=True, sinks=sinks))
    assert len(checked) == 1  # the first call's checks; the plan ran the others
    for i, (out, sinks) in enumerate(zip(outs, layers)):
        for b, n in enumerate(lengths.tolist()):
            kk = torch.cat([k[b:b + 1, :n]] + [k[b:b + 1, :1] * (j + 2) for j in range(i + 1)], 1)
            vv = torch.cat([v[b:b + 1, :n]] + [v[b:b + 1, :1] * (j + 2) for j in range(i + 1)], 1)
            ref, _ = reference(q[b:b + 1], kk, vv, q.shape[-1] ** -0.5, True, sinks)
            assert error_report(out[b:b + 1], ref)["rel"] < 2e-3, (i, b)


@pytest.mark.parametrize("fn", ["fp8_attention", "i8fp8_attention"])
def test_quantized_calls_take_each_calls_sinks(fn, monkeypatch):
    """fp8_attention / i8fp8_attention called again with another layer's sinks (their plans hit, the quantized
    forward's launch plan too): the output of the full path with those sinks, not the first call's."""
    from fmha_ops import call as call_path

    monkeypatch.setattr(call_path, "_plannable", lambda inp: True)  # descales treated as a GPU's (no per-call check)
    q, k, v, sinks = _inputs(b=1, mq=33, mk=33, d=32, dv=32)
    call = getattr(fmha_ops, fn)
    fmha_ops.SELECTOR.clear()
    first, again = call(q, k, v, causal=True, sinks=sinks), call(q, k, v, causal=True, sinks=-sinks)
    fmha_ops.SELECTOR.clear()
    assert torch.equal(again, call(q, k, v, causal=True, sinks=-sinks)) and not torch.equal(again, first)


@pytest.mark.parametrize("fn", ["fp8_attention", "i8fp8_attention"])
def test_quantized_training_sinks_gradient(fn):
    q, k, v, sinks = _inputs(b=1, mq=33, mk=33, d=32, dv=32, grad=True)
    out = getattr(fmha_ops, fn)(q, k, v, causal=True, sinks=sinks)
    out.float().square().sum().backward()
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, sinks)]
    ref, _ = reference(*leaves[:3], q.shape[-1] ** -0.5, True, leaves[3])
    ref.square().sum().backward()
    assert error_report(out, ref)["cos"] > 0.995
    assert error_report(sinks.grad, leaves[3].grad)["cos"] > 0.99


def test_declarations():
    """Ops that take sinks declare them; SDPA refuses them with the reason; the decoders take Kv != K."""
    q, k, v, sinks = _inputs(dtype=torch.float32)
    report = fmha_ops.explain(q, k, v, LowerTriangularFromBottomRightMask(), sinks=sinks)
    text = str(report)
    assert "attention sinks (sinks=) not supported" in text
    assert report.selected is not None and report.selected.SINKS
    for name in ("torch_referenceF", "torch_referenceB", "triton_attnF", "triton_fp8F", "triton_i8fp8F",
                 "triton_attnB", "triton_decoderF", "triton_splitKF"):
        assert fmha_ops.get_op(name).SINKS, name
    assert not fmha_ops.get_op("sdpa_mathF").SINKS
    assert 128 in fmha_ops.get_op("triton_splitKF").HEAD_DIMS_V and 192 in fmha_ops.get_op("triton_splitKF").HEAD_DIMS
    assert 192 in fmha_ops.get_op("triton_attnB").HEAD_DIMS


@pytest.mark.parametrize("bad, error", [
    (torch.zeros(4, dtype=torch.float16), "float32"),
    (torch.zeros(3), r"expected \(4,\)"),
    ([0.0] * 4, "tensor"),
])
def test_sinks_validated(bad, error):
    q, k, v, _ = _inputs(dtype=torch.float32)
    with pytest.raises((ValueError, TypeError), match=error):
        memory_efficient_attention(q, k, v, sinks=bad)


class _NotSinks:
    """An argument of no kind the package knows."""


@pytest.mark.parametrize("bad", [[0.0] * 4, 1.0, _NotSinks(), torch.zeros(4, dtype=torch.float16), torch.zeros(3),
                                 torch.zeros(1, 4)], ids=["list", "float", "object", "float16", "3 heads", "2-D"])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_sinks_validated_before_the_append(bad, paged):
    """flash_attn_with_kvcache checks ``sinks`` as the other entry points do (``validation.validate_sinks``'s own
    error, whatever the object), before anything is appended, on a repeated call too."""
    q, k, v, _ = _inputs(b=2, mq=1, mk=16, d=16, dv=16)
    new_k, new_v = k[:, :1].contiguous(), v[:, :1].contiguous()
    caches = [k.view(4, 8, 2, 16).clone(), v.view(4, 8, 2, 16).clone()] if paged else [k.clone(), v.clone()]
    table = dict(page_table=torch.arange(4, dtype=torch.int32, device=DEVICE).view(2, 2)) if paged else {}
    before = [c.clone() for c in caches]
    with pytest.raises((TypeError, ValueError)) as want:
        validate_sinks(bad, 4, q.device)
    for _ in range(2):
        with pytest.raises(want.type, match=re.escape(str(want.value))):
            fmha_ops.flash_attn_with_kvcache(q, *caches, new_k, new_v, cache_seqlens=3, sinks=bad, **table)
        assert all(torch.equal(c, b) for c, b in zip(caches, before))


def test_sinks_equal_an_extra_zero_value_key():
    """A sink is a key whose score is the sink and whose value row is 0: the same output from the reference."""
    q, k, v, sinks = _inputs(b=1, mq=6, mk=6, hq=2, hkv=2, d=16, dv=16, dtype=torch.float32)
    scale = 0.25
    out = memory_efficient_attention(q, k, v, scale=scale, sinks=sinks, op="torch_referenceF")
    # an extra key per head with q . k_extra * scale == sink: k_extra = sink / (scale * |q|^2) q, per query row
    extra = []
    for i in range(q.shape[1]):
        kx = (sinks[None, :, None] / (scale * q[:, i].square().sum(-1, keepdim=True))) * q[:, i]  # (1, H, D)
        o = memory_efficient_attention(q[:, i:i + 1], torch.cat([k, kx[:, None]], 1),
                                       torch.cat([v, torch.zeros_like(v[:, :1])], 1), scale=scale)
        extra.append(o)
    assert torch.allclose(out, torch.cat(extra, 1), atol=1e-5)
    assert math.isfinite(out.sum().item())


def test_compiled_call_gives_the_sinks_gradient():
    """Under torch.compile the op runs behind fmha_ops::attention_forward; its autograd gives the sinks' gradient."""
    q, k, v, sinks = _inputs(b=1, mq=9, mk=9, d=16, dv=16, dtype=torch.float32, grad=True)

    def fn(q, k, v, s):
        return memory_efficient_attention(q, k, v, LowerTriangularFromBottomRightMask(), sinks=s,
                                          op=("torch_referenceF", "torch_referenceB"))
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, sinks)
    got = torch.autograd.grad(out.sum(), (q, sinks))
    want = torch.autograd.grad(fn(q, k, v, sinks).sum(), (q, sinks))
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5)


GPU_OPS = ["triton_attnF", ("triton_attnF", "triton_attnB"), "fa4F", ("triton_attnF", "fa4B"), "triton_fp8F"]


@pytest.mark.gpu
@pytest.mark.parametrize("op", GPU_OPS)
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_ops_with_sinks(op, window):
    """GPT-OSS attention (64 / 8 heads of dim 64, bf16, causal, full or a 128-key window) with sinks through each op
    that declares them, against the float32 reference; with a backward op: the gradients, the sinks' included."""
    fw = op[0] if isinstance(op, tuple) else op
    reason = fmha_ops.get_op(fw).available() or (isinstance(op, tuple) and fmha_ops.get_op(op[1]).available())
    if reason:
        pytest.skip(reason)
    grad = isinstance(op, tuple)
    q, k, v, sinks = _inputs(b=2, mq=1000, mk=1000, hq=64, hkv=8, d=64, dv=64, dtype=torch.bfloat16, grad=grad)
    mask = LowerTriangularFromBottomRightMask()
    mask = mask if window is None else mask.make_local_attention(window)
    if fw == "triton_fp8F":
        from fmha_ops.quant import quantize_qkv_fp8

        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        out = memory_efficient_attention(q8, k8, v8, mask, q_descale=qd, k_descale=kd, v_descale=vd, op=op,
                                         sinks=sinks)
        q, k, v = (dequantize(x8, x_d, "head") for x8, x_d in ((q8, qd), (k8, kd), (v8, vd)))  # what it reads
    else:
        out = memory_efficient_attention(q, k, v, mask, op=op, sinks=sinks)
    leaves = [t.detach().float().requires_grad_(grad) for t in (q, k, v, sinks)]
    ref = memory_efficient_attention(*leaves[:3], mask, sinks=leaves[3], op="torch_referenceF")
    assert error_report(out, ref)["rel"] < (FP8_P_TOLERANCE if fw == "triton_fp8F" else 1e-2)
    if grad:
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v, sinks), g)
        want = torch.autograd.grad(ref, leaves, g.float())
        for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
            assert error_report(a, b)["rel"] < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("op", [None, "triton_attnF", ("triton_attnF", "triton_attnB"), "fa3F", "fa4F"])
def test_gpu_value_head_dim_192_128(op):
    """DeepSeek-V3 heads (K=192, Kv=128, bf16, causal) through the selector and each op that declares Kv != K (an
    op whose declaration refuses the shape is skipped with its reason: FA4 declares Kv == K)."""
    from fmha_ops import inputs

    names = [] if op is None else list(op) if isinstance(op, tuple) else [op]
    grad = op is None or isinstance(op, tuple)
    q, k, v, _ = _inputs(b=2, mq=1000, mk=1000, hq=16, hkv=16, d=192, dv=128, dtype=torch.bfloat16, grad=grad)
    mask = LowerTriangularFromBottomRightMask()
    for name in names:
        if name not in [o.NAME for o in fmha_ops.ALL_FW_OPS + fmha_ops.ALL_BW_OPS]:
            pytest.skip(f"{name} is not registered here")
        reason = fmha_ops.get_op(name).available()
        if reason:
            pytest.skip(reason)
        call = inputs.make_inputs(q, k, v, mask)
        call.validate()
        refused = fmha_ops.get_op(name).not_supported_reasons(call.problem())
        if refused:
            pytest.skip(f"{name}: {'; '.join(refused)}")
    out = memory_efficient_attention(q, k, v, mask, op=op)
    leaves = [t.detach().float().requires_grad_(grad) for t in (q, k, v)]
    ref = memory_efficient_attention(*leaves, mask, op="torch_referenceF")
    assert out.shape == (2, 1000, 16, 128) and error_report(out, ref)["rel"] < 1e-2
    if grad:
        g = torch.randn_like(out)
        for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, leaves,
                                                                                                    g.float())):
            assert error_report(a, b)["rel"] < 2e-2, name


def test_low_level_forward_backward_with_sinks():
    """xformers' low-level pair with sinks: the LSE includes them, the backward gives the autograd gradients, and
    sink_grad the sinks'."""
    from fmha_ops.sinks import sink_grad

    q, k, v, sinks = _inputs(dtype=torch.float32)
    mask = LowerTriangularFromBottomRightMask()
    out, lse = fmha_ops.memory_efficient_attention_forward_requires_grad(q, k, v, mask, sinks=sinks)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    dq, dk, dv = fmha_ops.memory_efficient_attention_backward(grad, out, lse, q, k, v, mask, sinks=sinks)
    leaves = [t.double().requires_grad_(True) for t in (q, k, v, sinks)]
    ref, ref_lse = reference(*leaves[:3], q.shape[-1] ** -0.5, True, leaves[3])
    want = torch.autograd.grad(ref, leaves, grad.double())
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), (dq, dk, dv, sink_grad(out, grad, lse, sinks)), want):
        assert error_report(g, w)["rel"] < 1e-5, name


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gluon_fp8_decodeF", "triton_splitKF", "triton_decoderF"])
@pytest.mark.parametrize("lengths", [(4096, 1, 1000, 4095), (64, 64, 64, 64)])
def test_gpu_fp8_kv_decode_sinks(op, lengths):
    """GPT-OSS decode on an fp8 paged cache with sinks (the Gluon decoder through its split reduce, the Triton
    decoders) against the float32 reference on the dequantized cache; planned runs with another layer's sinks."""
    reason = fmha_ops.get_op(op).available()
    if reason:
        pytest.skip(reason)
    _fp8_kv_decode(op, lengths, dict(hq=64, hkv=8, d=64, dv=64, dtype=torch.bfloat16), 64, 2e-2)


@pytest.mark.parametrize("op", ["triton_decoderF", "triton_splitKF"])
def test_fp8_kv_decode_sinks_value_dim(op):
    """The same on the CPU (interpreter, float16) with Kv=32 != K=48 and 8-token pages."""
    _fp8_kv_decode(op, (20, 1, 9), dict(hq=4, hkv=2, d=48, dv=32, dtype=torch.float16), 8, 2e-3)


def _fp8_kv_decode(op, lengths, heads: dict, page: int, tolerance: float):
    """flash_attn_with_kvcache and plan_kvcache (run with other sinks) on an fp8 paged cache with ``op`` forced,
    each sequence's output within ``tolerance`` (relative) of the reference on the dequantized cache."""
    from fmha_ops.kv_cache import build_fp8_paged_cache

    b = len(lengths)
    q, k, v, sinks = _inputs(b=b, mq=1, mk=max(lengths), seed=7, **heads)
    kc, vc, ks, vs, table = build_fp8_paged_cache(k, v, page)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    with fmha_ops.use_ops(op):
        out = fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, k_descale=ks,
                                               v_descale=vs, causal=True, sinks=sinks)
        plan = fmha_ops.plan_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, k_descale=ks,
                                     v_descale=vs, causal=True, sinks=sinks)
        planned = plan.run(q, sinks=sinks + 1.0).clone()
    assert plan.op.NAME == op and out.shape == (b, 1, heads["hq"], heads["dv"])
    kd = (kc.float() * ks[..., None])[table.long()].reshape(b, -1, *k.shape[2:])
    vd = (vc.float() * vs[..., None])[table.long()].reshape(b, -1, *v.shape[2:])
    for i, n in enumerate(lengths):
        for got, s in ((out, sinks), (planned, sinks + 1.0)):
            ref, _ = reference(q[i:i + 1].float(), kd[i:i + 1, :n], vd[i:i + 1, :n], heads["d"] ** -0.5, True, s)
            assert error_report(got[i:i + 1], ref)["rel"] < tolerance


def test_kv_cache_helpers_value_dim():
    """The KV-cache builders and the append kernel with Kv=32 != K=48, bf16-like (float16) and fp8 caches."""
    from fmha_ops.kernels.triton.kv_append import kv_append
    from fmha_ops.kv_cache import append_to_cache, build_fp8_paged_cache, dense_from_paged

    _, k, v, _ = _inputs(b=2, mk=40, d=48, dv=32, seed=5)
    kc, vc, ks, vs, table = build_fp8_paged_cache(k, v, 16)
    assert kc.shape[-1] == 48 and vc.shape[-1] == 32
    back = dense_from_paged(vc.float() * vs[..., None], table, 40)
    assert error_report(back, v)["rel"] < 0.05
    new_k, new_v = k[:, :2] * 2, v[:, :2] * 2
    lengths = torch.tensor([5, 30], dtype=torch.int32, device=DEVICE)
    for fp8 in (False, True):
        caches = [t.clone() for t in ((kc, vc, ks, vs) if fp8 else (k, v))]
        want = [t.clone() for t in caches]
        scales = dict(k_scale=caches[2], v_scale=caches[3]) if fp8 else {}
        kv_append(new_k, new_v, caches[0], caches[1], lengths, block_table=table if fp8 else None, **scales)
        append_to_cache(new_k, new_v, want[0], want[1], lengths, block_table=table if fp8 else None,
                        **(dict(k_scale=want[2], v_scale=want[3]) if fp8 else {}))
        if not fp8:
            assert all(torch.equal(got, ref) for got, ref in zip(caches, want))
            continue
        # fp8: the interpreter rounds float32 -> fp8 casts its own way (HARDWARE.md); compare dequantized values
        for cache, scale, ref_cache, ref_scale in ((caches[0], caches[2], want[0], want[2]),
                                                   (caches[1], caches[3], want[1], want[3])):
            got = cache.float() * scale[..., None]
            assert error_report(got, ref_cache.float() * ref_scale[..., None])["rel"] < 0.05
