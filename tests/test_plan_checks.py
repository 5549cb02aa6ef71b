"""A cached plan never skips a check whose result could differ for a new call, at every public entry point.

For each entry point: a good call runs twice (the second runs the plan the first stored), then a variant that
changes one argument (its type, dtype, shape, strides, device-side flags, a scalar's type or value, a tensor's
values where a check reads them) must end exactly as it ends on a fresh process (no plan stored): the same
exception type and message, or the same result bit for bit. The key of a call is built from every argument the
entry point was given (``fmha_ops.plans.call_key``), so this holds by construction; these tests pin it.
"""
from __future__ import annotations

import math

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops import checks
from fmha_ops.flash_attn_interface import _KVCACHE_UNKEYED
from fmha_ops.kv_cache import paged_from_dense, quantize_kv_fp8
from fmha_ops.plans import PLANS

F8 = torch.float8_e4m3fn


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _outcome(fn):
    """What a call ends with: ("raised", type, message) or ("returned", tensors) (torch's generator seeded first:
    dropout draws from it)."""
    torch.manual_seed(0)
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001 - the outcome is compared, whatever it is
        return ("raised", type(e), str(e))
    flat = res if isinstance(res, (tuple, list)) else (res,)
    return ("returned", [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in flat])


def _same(a, b) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "raised":
        return a[1:] == b[1:]
    return len(a[1]) == len(b[1]) and all(
        (torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y)
        for x, y in zip(a[1], b[1]))


def _pin(good, variants: dict) -> None:
    """``good()`` twice (storing its plan), then each variant: the same end as on an empty plan cache."""
    for name, variant in variants.items():
        fmha_ops.SELECTOR.clear()  # an empty plan cache (the plans go with the selector's memo)
        fresh = _outcome(variant)
        fmha_ops.SELECTOR.clear()
        assert _outcome(good)[0] == "returned", "the good call must succeed"
        before = len(PLANS)
        assert _outcome(good)[0] == "returned"
        assert len(PLANS) == before, "the repeated good call runs its plan"
        cached = _outcome(variant)
        same = _same(fresh, cached)
        assert same, (f"{name}: fresh {fresh[0]} {fresh[1:] if fresh[0] == 'raised' else ''} vs after a plan "
                      f"{cached[0]} {cached[1:] if cached[0] == 'raised' else ''}")


def _dense(dtype=torch.float32, mq=7, mk=9, hq=4, hkv=2, d=16, seed=0):
    return (_randn(2, mq, hq, d, dtype=dtype, seed=seed), _randn(2, mk, hkv, d, dtype=dtype, seed=seed + 1),
            _randn(2, mk, hkv, d, dtype=dtype, seed=seed + 2))


def _tensor_variants(q, k, v, call):
    """Variants of q / k / v's metadata every entry point that takes them validates."""
    return {
        "k float64": lambda: call(q, k.double(), v),
        "q fewer heads than k": lambda: call(q[:, :, :1], k, v),
        "q head dim 8": lambda: call(q[..., :8], k, v),
        "k strided last dim": lambda: call(q, k.transpose(1, 3).contiguous().transpose(1, 3), v),
        "v shorter": lambda: call(q, k, v[:, :3]),
        "q 3-D": lambda: call(q[0], k, v),
        "k a list": lambda: call(q, k.tolist(), v),
        "q requires grad": lambda: call(q.clone().requires_grad_(), k, v),
    }


def test_memory_efficient_attention_family():
    q, k, v = _dense()
    mask = ab.LowerTriangularFromBottomRightMask()
    for fn in (fmha_ops.memory_efficient_attention, fmha_ops.memory_efficient_attention_forward,
               fmha_ops.memory_efficient_attention_partial,
               fmha_ops.memory_efficient_attention_forward_requires_grad):
        def call(q, k, v, fn=fn, **kw):
            return fn(q, k, v, kw.pop("attn_bias", mask), **kw)
        variants = _tensor_variants(q, k, v, call)
        variants.update({
            "scale nan": lambda: call(q, k, v, scale=math.nan),
            "scale int": lambda: call(q, k, v, scale=1),
            "scale bool": lambda: call(q, k, v, scale=True),
            "p 0.5": lambda: call(q, k, v, p=0.5),
            "p int 0": lambda: call(q, k, v, p=0),
            "softcap -1": lambda: call(q, k, v, softcap=-1.0),
            "mask string": lambda: call(q, k, v, attn_bias="causal"),
            "mask class": lambda: call(q, k, v, attn_bias=ab.LowerTriangularMask),
            "top-left causal": lambda: call(q, k, v, attn_bias=ab.LowerTriangularMask()),
            "op unknown": lambda: call(q, k, v, op="no_such_op"),
            "op forced": lambda: call(q, k, v, op="torch_referenceF"),
            "output float16": lambda: call(q, k, v, output_dtype=torch.float16),
            "output int8": lambda: call(q, k, v, output_dtype=torch.int8),
            "descales on floats": lambda: call(q, k, v, q_descale=torch.ones(1)),
            "quantize_kv 1": lambda: call(q, k, v, quantize_kv_to_fp8=1),
        })
        _pin(lambda fn=fn: fn(q, k, v, mask), variants)


def test_memory_efficient_attention_with_host_descales_checks_values_every_call():
    q, k, v = (t.to(F8) for t in _dense())
    one = torch.ones(1)

    def call(qd=one, kd=one, vd=one, **kw):
        return fmha_ops.memory_efficient_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, **kw)
    _pin(call, {"k_descale nan": lambda: call(kd=torch.full((1,), math.nan)),
                "k_descale inf": lambda: call(kd=torch.full((1,), math.inf)),
                "v_descale float64": lambda: call(vd=torch.ones(1, dtype=torch.float64)),
                "v_descale per head": lambda: call(vd=torch.ones(2, 2)),
                "no q_descale": lambda: call(qd=None)})


def test_memory_efficient_attention_backward():
    q, k, v = _dense()
    mask = ab.LowerTriangularMask()
    out, lse = fmha_ops.memory_efficient_attention_forward_requires_grad(q, k, v, mask)
    grad = torch.ones_like(out)

    def call(grad=grad, out=out, lse=lse, q=q, k=k, v=v, **kw):
        return fmha_ops.memory_efficient_attention_backward(grad, out, lse, q, k, v, kw.pop("attn_bias", mask), **kw)
    _pin(call, {"lse wrong shape": lambda: call(lse=lse[:, :1]),
                "grad wrong shape": lambda: call(grad=grad[:, :3]),
                "out float64": lambda: call(out=out.double()),
                "k float64": lambda: call(k=k.double()),
                "p 0.3": lambda: call(p=0.3),
                "scale nan": lambda: call(scale=math.nan),
                "mask none": lambda: call(attn_bias=None),
                "op a forward op": lambda: call(op="torch_referenceF")})


def test_merge_attentions():
    q, k, v = _dense()
    parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, s], v[:, s]) for s in (slice(0, 4), slice(4, None))]
    outs, lses = [o for o, _ in parts], [lse for _, lse in parts]
    nan = [lses[0], torch.full_like(lses[1], math.nan)]
    _pin(lambda: fmha_ops.merge_attentions(outs, lses), {
        "an empty lse list": lambda: fmha_ops.merge_attentions(outs, []),
        "lse nan (values read every call on the host)": lambda: fmha_ops.merge_attentions(outs, nan),
        "lse float64": lambda: fmha_ops.merge_attentions(outs, [t.double() for t in lses]),
        "write_lse 1": lambda: fmha_ops.merge_attentions(outs, lses, write_lse=1),
        "output int8": lambda: fmha_ops.merge_attentions(outs, lses, output_dtype=torch.int8),
        "a tuple": lambda: fmha_ops.merge_attentions(tuple(outs), tuple(lses)),
        "lse of other rows": lambda: fmha_ops.merge_attentions(outs, [t[..., :3] for t in lses]),
    })


def test_flash_attn_func():
    q, k, v = _dense()

    def call(q=q, k=k, v=v, **kw):
        return fmha_ops.flash_attn_func(q, k, v, **{"causal": True, **kw})
    variants = _tensor_variants(q, k, v, lambda q, k, v: call(q, k, v))
    variants.update({
        "causal 1": lambda: call(causal=1),
        "causal False": lambda: call(causal=False),
        "window list": lambda: call(window_size=[2, 0]),
        "window (2, 0)": lambda: call(window_size=(2, 0)),
        "window strings": lambda: call(window_size=("a", "b")),
        "softmax_scale nan": lambda: call(softmax_scale=math.nan),
        "softmax_scale 0.5": lambda: call(softmax_scale=0.5),
        "qv given": lambda: call(qv=q),
        "attention_chunk 4": lambda: call(attention_chunk=4),
        "return lse": lambda: call(return_attn_probs=True),
        "descales on floats": lambda: call(q_descale=torch.ones(1)),
    })
    _pin(call, variants)


def test_flash_attn_varlen_func():
    q, k, v = (t[0] for t in _dense(mq=9, mk=9))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)

    def call(q=q, k=k, v=v, cu_q=cu, cu_k=cu, **kw):
        return fmha_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, **{"causal": True, **kw})
    _pin(call, {
        "cu values not increasing (read every call on the host)": lambda: call(cu_q=torch.tensor([0, 6, 4],
                                                                                             dtype=torch.int32)),
        "cu values past the tokens": lambda: call(cu_k=torch.tensor([0, 4, 12], dtype=torch.int32)),
        "cu other starts": lambda: call(cu_q=torch.tensor([0, 2, 9], dtype=torch.int32),
                                        cu_k=torch.tensor([0, 2, 9], dtype=torch.int32)),
        "cu int64": lambda: call(cu_q=cu.long()),
        "cu 2-D": lambda: call(cu_q=cu[None]),
        "q 4-D": lambda: call(q=q[None]),
        "k float64": lambda: call(k=k.double()),
        "causal 1": lambda: call(causal=1),
        "window (1, 0)": lambda: call(window_size=(1, 0)),
        "seqused_k": lambda: call(seqused_k=cu),
        "return lse": lambda: call(return_attn_probs=True),
    })


def _kv_cache(fp8=False):
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(3, 24, 2, 16, generator=g).to(torch.float16) for _ in range(2))
    if fp8:
        k8, v8, ks, vs = quantize_kv_fp8(k, v)
        (kc, vc, ks, vs), table = paged_from_dense([k8.view(torch.uint8), v8.view(torch.uint8), ks, vs], 8,
                                                   generator=g)
        return kc.view(F8), vc.view(F8), ks, vs, table
    (kc, vc), table = paged_from_dense([k, v], 8, generator=g)
    return kc, vc, None, None, table


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("device_indices", [False, True])
def test_flash_attn_with_kvcache(monkeypatch, fp8, device_indices):
    """Host index tensors are checked on every call (no plan); with the indices taken as device tensors (the check
    switched off as on a GPU) repeated calls run the decode plan, and every metadata variant still ends as on a
    fresh process."""
    kc, vc, ks, vs, table = _kv_cache(fp8)
    if device_indices:
        monkeypatch.setattr(checks, "wanted", lambda *t: False)
    q = _randn(3, 1, 4, 16, dtype=torch.float16, seed=9)
    lens = torch.tensor([3, 17, 9], dtype=torch.int32)
    scales = dict(k_descale=ks, v_descale=vs) if fp8 else {}

    def call(q=q, kc=kc, vc=vc, **kw):
        args = {"cache_seqlens": lens, "page_table": table, "causal": True, **scales, **kw}
        with fmha_ops.use_ops("triton_splitKF", "torch_referenceF"):
            return fmha_ops.flash_attn_with_kvcache(q, kc, vc, **args)
    variants = {
        "page_table rows past the cache": lambda: call(page_table=table[:, :1]),
        "page_table int64": lambda: call(page_table=table.long()),
        "page_table strided": lambda: call(page_table=torch.stack([table, table], 2).view(3, -1)[:, ::2]),
        "cache_seqlens int64": lambda: call(cache_seqlens=lens.long()),
        "cache_seqlens two": lambda: call(cache_seqlens=lens[:2]),
        "cache_seqlens an int": lambda: call(cache_seqlens=5),
        "q float32": lambda: call(q=q.float()),
        "q head dim 8": lambda: call(q=q[..., :8]),
        "q 3 heads": lambda: call(q=q[:, :, :3]),
        "causal 1": lambda: call(causal=1),
        "window (4, 0)": lambda: call(window_size=(4, 0)),
        "window (4, 2) not causal": lambda: call(window_size=(4, 2), causal=False),
        "softcap 2": lambda: call(softcap=2.0),
        "softmax_scale nan": lambda: call(softmax_scale=math.nan),
        "q_descale given": lambda: call(q_descale=torch.ones(1)),
        "attention_chunk 0.0": lambda: call(attention_chunk=0.0),
        "return lse": lambda: call(return_softmax_lse=True),
        "cache_batch_idx with a table": lambda: call(cache_batch_idx=torch.arange(3, dtype=torch.int32)),
        "sinks a list": lambda: call(sinks=[0.0] * 4),
        "sinks float16": lambda: call(sinks=torch.zeros(4, dtype=torch.float16)),
        "sinks 3 heads": lambda: call(sinks=torch.zeros(3)),
    }
    for name in _KVCACHE_UNKEYED:  # checked before the lookup on every call, as no key holds them
        variants[f"{name} given"] = lambda name=name: call(**{name: 1 if name == "attention_chunk" else torch.ones(1)})
    if not device_indices:  # values checked on every call
        variants["cache_seqlens past the cache"] = lambda: call(cache_seqlens=torch.tensor([3, 99, 9],
                                                                                         dtype=torch.int32))
        variants["page_table entry past the pool"] = lambda: call(page_table=table.clone().fill_(99))
    if fp8:
        variants.update({"no k_descale": lambda: call(k_descale=None),
                         "k_descale float64": lambda: call(k_descale=ks.double()),
                         "k_descale per tensor": lambda: call(k_descale=torch.ones(1), v_descale=torch.ones(1))})
        if not device_indices:  # host descales: their values checked on every call
            variants["v_descale negative"] = lambda: call(v_descale=-vs)
    else:
        variants["a k_descale on a float cache"] = lambda: call(k_descale=torch.ones(1))
    _pin(call, variants)


def test_flash_attn_with_kvcache_append(monkeypatch):
    """Appending calls: each call appends into its own copy of the cache, so outcomes compare whole."""
    kc, vc, _, _, table = _kv_cache()
    q = _randn(3, 1, 4, 16, dtype=torch.float16, seed=9)
    knew, vnew = (_randn(3, 2, 2, 16, dtype=torch.float16, seed=s) for s in (1, 2))
    lens = torch.tensor([3, 17, 9], dtype=torch.int32)

    def call(**kw):
        caches = [kc.clone(), vc.clone()]
        args = {"k": knew, "v": vnew, "cache_seqlens": lens, "page_table": table, "causal": True, **kw}
        with fmha_ops.use_ops("triton_splitKF", "torch_referenceF"):
            out = fmha_ops.flash_attn_with_kvcache(q, *caches, **args)
        return [out, *caches]
    _pin(call, {
        "k without v": lambda: call(v=None),
        "k float64": lambda: call(k=knew.double(), v=vnew.double()),
        "k one head": lambda: call(k=knew[:, :, :1], v=vnew[:, :, :1]),
        "append past the cache": lambda: call(cache_seqlens=torch.tensor([3, 31, 9], dtype=torch.int32)),
        "k 3 tokens": lambda: call(k=torch.cat([knew, knew[:, :1]], 1), v=torch.cat([vnew, vnew[:, :1]], 1)),
    })


@pytest.mark.parametrize("fn", [fmha_ops.fp8_attention, fmha_ops.i8fp8_attention])
def test_quantized_attention(fn):
    q, k, v = _dense(torch.bfloat16, mq=9, mk=11)

    def call(q=q, k=k, v=v, **kw):
        return fn(q, k, v, **{"causal": True, **kw})
    _pin(call, {
        "q float32": lambda: call(q=q.float()),
        "k float16": lambda: call(k=k.half()),
        "q 3-D": lambda: call(q=q[0]),
        "causal 1": lambda: call(causal=1),
        "softmax_scale nan": lambda: call(softmax_scale=math.nan),
        "softmax_scale 0.1": lambda: call(softmax_scale=0.1),
        "op unknown": lambda: call(op="no_such_op"),
        "q requires grad": lambda: call(q=q.clone().requires_grad_()),
    })


def test_plan_kvcache():
    """``plan_kvcache`` validates every call (it builds a new plan each time), whatever was planned before."""
    kc, vc, _, _, table = _kv_cache()
    q = _randn(3, 1, 4, 16, dtype=torch.float16, seed=9)
    lens = torch.tensor([3, 17, 9], dtype=torch.int32)

    def call(**kw):
        return fmha_ops.plan_kvcache(q, kc, vc, **{"cache_seqlens": lens, "page_table": table, "causal": True,
                                                   **kw}).run(q)
    _pin(call, {"page_table int64": lambda: call(page_table=table.long()),
                "cache_seqlens past the cache": lambda: call(cache_seqlens=torch.tensor([3, 99, 9],
                                                                                        dtype=torch.int32)),
                "causal 1": lambda: call(causal=1)})
