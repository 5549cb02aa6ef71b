"""Launch plans of repeated calls (``fmha_ops.plans.PLANS``): a repeated call skips validation, ``Inputs`` and the
selector, gives bit-identical results to the full path, and never outlives what it was built from (grad mode,
``use_ops``, the selector's memo, the tensors' layout); and the causal alignment sdpa_flashF declares per device
(the CUDA flash kernels' causal is bottom-right, the CPU kernel's top-left)."""
from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

import fmha_ops
from registry import Arch
from fmha_ops import api, attn_bias as ab, inputs, kvcache_call, plans, validation
from fmha_ops import compiled as compiled_layer
from fmha_ops.testing import normal_qkv

from .test_api import SPECS, _spec_inputs, make_bias

CAUSAL = ab.LowerTriangularMask()


def _qkv(b=1, m=16, hq=2, hkv=2, d=16, mk=None, dtype=torch.float32, seed=0):
    return list(normal_qkv((b, m, hq, d), (b, mk or m, hkv, d), dtype=dtype, seed=seed))


@pytest.fixture
def counted(monkeypatch):
    """Counts of validation runs, ``make_inputs`` calls and signatures computed while the test runs."""
    counts = {"validate": 0, "make_inputs": 0, "signature": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(validation, "validate", counting("validate", validation.validate))
    monkeypatch.setattr(api, "make_inputs", counting("make_inputs", api.make_inputs))
    monkeypatch.setattr(inputs.Inputs, "signature", counting("signature", inputs.Inputs.signature))
    fmha_ops.SELECTOR.clear()
    return counts


def test_repeated_call_runs_no_validation_no_inputs_no_selection(counted):
    q, k, v = _qkv()
    first = fmha_ops.memory_efficient_attention(q, k, v, CAUSAL)
    assert counted == {"validate": 1, "make_inputs": 1, "signature": 1}
    q2, k2, v2 = _qkv(seed=1)  # new tensors of the same layout, a new mask object of the same kind
    out = fmha_ops.memory_efficient_attention(q2, k2, v2, ab.LowerTriangularMask())
    assert counted == {"validate": 1, "make_inputs": 1, "signature": 1}
    assert not torch.equal(out, first)
    fmha_ops.SELECTOR.clear()  # the plans go with the selector's memo
    assert torch.equal(fmha_ops.memory_efficient_attention(q2, k2, v2, CAUSAL), out)
    assert counted["validate"] == 2


CASES = {
    "causal fp32": (dict(), dict(attn_bias=CAUSAL)),
    "no mask, scale": (dict(), dict(scale=0.3)),
    "bottom-right causal, Mq < Mk": (dict(m=5, mk=16), dict(attn_bias=ab.LowerTriangularFromBottomRightMask())),
    "gqa bf16": (dict(hq=4, hkv=1, dtype=torch.bfloat16), dict(attn_bias=CAUSAL)),
    "output float32": (dict(dtype=torch.bfloat16), dict(output_dtype=torch.float32)),
    "local window": (dict(m=12), dict(attn_bias=ab.LocalAttentionFromBottomRightMask(3, 1))),
    "forced op": (dict(m=7), dict(attn_bias=CAUSAL, op="torch_referenceF")),
    "zero scale causal": (dict(), dict(attn_bias=CAUSAL, scale=0.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_is_bit_identical_to_the_full_path(case):
    shape, kwargs = CASES[case]
    fmha_ops.SELECTOR.clear()
    results = []
    for seed in (0, 1):
        q, k, v = _qkv(**shape, seed=seed)
        fmha_ops.SELECTOR.clear()
        full = fmha_ops.memory_efficient_attention(q, k, v, **kwargs)
        assert len(plans.PLANS), "the full call left a plan"
        planned = fmha_ops.memory_efficient_attention(q, k, v, **kwargs)
        assert planned.shape == full.shape and planned.dtype == full.dtype and planned.stride() == full.stride()
        assert torch.equal(planned, full)
        results.append(planned)
    assert not torch.equal(*results)


def test_partial_forward_and_flash_attn_func_plans_match_the_full_path():
    q, k, v = _qkv(m=9, hq=4, hkv=2)
    entry_points = {
        "partial": lambda: fmha_ops.memory_efficient_attention_partial(q, k, v, CAUSAL),
        "forward": lambda: fmha_ops.memory_efficient_attention_forward(q, k, v, CAUSAL),
        "flash_attn_func": lambda: fmha_ops.flash_attn_func(q, k, v, causal=True),
        "flash_attn_func lse": lambda: fmha_ops.flash_attn_func(q, k, v, causal=True, return_attn_probs=True),
    }
    for name, fn in entry_points.items():
        fmha_ops.SELECTOR.clear()
        full, planned = fn(), fn()
        for a, b in zip(*((r,) if isinstance(r, torch.Tensor) else r for r in (full, planned))):
            assert torch.equal(a, b), name


def test_gradients_through_a_plan_match_the_full_path():
    base = _qkv(m=11)
    grads = []
    for _ in range(2):  # the full path, then the plan it left
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = fmha_ops.memory_efficient_attention(q, k, v, CAUSAL)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), q.grad, k.grad, v.grad))
        assert out.grad_fn is not None
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    with torch.no_grad():  # the same tensors without autograd: a plan of its own, no graph
        assert fmha_ops.memory_efficient_attention(q, k, v, CAUSAL).grad_fn is None
        assert fmha_ops.memory_efficient_attention(q, k, v, CAUSAL).grad_fn is None
    assert fmha_ops.memory_efficient_attention_forward(q, k, v, CAUSAL).grad_fn is None


def _same(a, b) -> bool:
    """Whether two results (a tensor or a tuple of tensors) are equal, element by element."""
    a, b = ((r,) if isinstance(r, torch.Tensor) else r for r in (a, b))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_plans_take_each_calls_sinks(counted):
    """Calls with sinks (GPT-OSS: every layer its own) keep plans: a repeated layout runs no validation, and each
    call's own sinks, not those of the call that made the plan, reach the op: bit-identical to the full path with
    them, through every entry point that plans (the low-level backward's too)."""
    q, k, v = _qkv(m=9, hq=4, hkv=2)
    layers = [torch.randn(4, generator=torch.Generator().manual_seed(i)) * 2 for i in range(2)]
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out, lse = fmha_ops.memory_efficient_attention_forward_requires_grad(q, k, v, CAUSAL, sinks=layers[0])
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    entry_points = {
        "memory_efficient_attention": lambda s: fmha_ops.memory_efficient_attention(q, k, v, CAUSAL, sinks=s),
        "forward": lambda s: fmha_ops.memory_efficient_attention_forward(q, k, v, CAUSAL, sinks=s),
        "partial": lambda s: fmha_ops.memory_efficient_attention_partial(q, k, v, CAUSAL, sinks=s),
        "forward_requires_grad": lambda s: fmha_ops.memory_efficient_attention_forward_requires_grad(
            q, k, v, CAUSAL, sinks=s),
        "backward": lambda s: fmha_ops.memory_efficient_attention_backward(grad, out, lse, q, k, v, CAUSAL, sinks=s),
        "flash_attn_func": lambda s: fmha_ops.flash_attn_func(q, k, v, causal=True, sinks=s),
        "flash_attn_varlen_func": lambda s: fmha_ops.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5,
                                                                            causal=True, sinks=s),
    }
    for name, fn in entry_points.items():
        fmha_ops.SELECTOR.clear()
        first = fn(layers[0])  # the full path, which leaves the plan
        validated = counted["validate"]
        planned = fn(layers[1])  # the plan, with another layer's sinks
        assert counted["validate"] == validated, name
        fmha_ops.SELECTOR.clear()
        assert _same(planned, fn(layers[1])), name
        # the backward reads the sinks through the LSE it is given (they choose its op): the same gradients
        assert _same(planned, first) == (name == "backward"), name


def test_gradients_with_sinks_through_a_plan_match_the_full_path():
    """The sinks' gradient too (a plan's autograd pair gets the call's sinks); sinks without requires_grad: a plan
    of its own, no gradient for them."""
    base = _qkv(m=11, hq=4, hkv=2)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5))
    grads = []
    for _ in range(2):  # the full path, then the plan it left
        q, k, v, s = (t.clone().requires_grad_() for t in (*base, sinks))
        out = fmha_ops.memory_efficient_attention(q, k, v, CAUSAL, sinks=s)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), q.grad, k.grad, v.grad, s.grad))
    assert grads[0][4].abs().sum() > 0
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    q = base[0].clone().requires_grad_()
    for _ in range(2):
        out = fmha_ops.memory_efficient_attention(q, base[1], base[2], CAUSAL, sinks=sinks)
        assert out.grad_fn is not None and not sinks.requires_grad


def test_forward_records_no_graph_whatever_requires_grad():
    q, k, v = _qkv(m=6)
    bias = torch.randn(1, 2, 6, 6, requires_grad=True)
    for _ in range(2):  # the full path, then the plans
        assert fmha_ops.memory_efficient_attention_forward(q, k, v, bias).grad_fn is None
        assert fmha_ops.memory_efficient_attention_forward(q, k, v, ab.LowerTriangularMask().add_bias(bias)).grad_fn \
            is None
        assert fmha_ops.memory_efficient_attention_forward(q.requires_grad_(), k, v, CAUSAL).grad_fn is None
        assert fmha_ops.memory_efficient_attention(q, k, v, CAUSAL).grad_fn is not None
        q = q.detach()


def test_forward_never_runs_a_differentiable_plan():
    q, k, v = _qkv(m=7)
    q.requires_grad_()
    for _ in range(2):  # memory_efficient_attention's full path, then its plan: a graph-recording plan exists
        assert fmha_ops.memory_efficient_attention(q, k, v, CAUSAL).grad_fn is not None
    for _ in range(2):
        out = fmha_ops.memory_efficient_attention_forward(q, k, v, CAUSAL)
        assert out.grad_fn is None and not out.requires_grad
    assert torch.equal(out, fmha_ops.memory_efficient_attention(q.detach(), k, v, CAUSAL))


def test_merge_attentions_repeated_layout_matches_and_still_validates():
    q, k, v = _qkv(m=9, mk=20, hq=4, hkv=2)
    parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, s], v[:, s]) for s in (slice(0, 8), slice(8, None))]
    outs, lses = [o for o, _ in parts], [lse for _, lse in parts]
    first = fmha_ops.merge_attentions(outs, lses)
    for attn_split, lse_split in ((outs, lses), (tuple(outs), tuple(lses)), (torch.stack(outs), torch.stack(lses))):
        for _ in range(2):  # the full path, then the layout's validated path
            again = fmha_ops.merge_attentions(attn_split, lse_split)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert len(outs) == 2  # the caller's list is read, never changed
    with pytest.raises(ValueError, match="does not match attn_split"):
        fmha_ops.merge_attentions(outs, [lse[:, :, :5] for lse in lses])
    with pytest.raises(TypeError, match="must be a tensor or a non-empty list of tensors"):
        fmha_ops.merge_attentions(outs, [lse.tolist() for lse in lses])


def test_a_plan_never_serves_another_scope_or_layout(monkeypatch):
    q, k, v = _qkv()
    fmha_ops.memory_efficient_attention(q, k, v, CAUSAL)
    ran = []
    ref = fmha_ops.get_op("torch_referenceF")
    orig = ref.apply
    monkeypatch.setattr(ref, "apply", classmethod(lambda cls, inp, lse: ran.append(inp) or orig(inp, lse)))
    with fmha_ops.use_ops("torch_referenceF"):
        fmha_ops.memory_efficient_attention(q, k, v, CAUSAL)
        fmha_ops.memory_efficient_attention(q, k, v, CAUSAL)
    assert len(ran) == 2  # the full path, then the scope's own (generic) plan, both on the forced op
    fmha_ops.memory_efficient_attention(q, k, v, CAUSAL)
    assert len(ran) == 2
    # a non-contiguous query of the same shape is another layout: validated, refused with its name
    bad = q.transpose(1, 3).contiguous().transpose(1, 3)
    with pytest.raises(ValueError, match="query must be contiguous in its last dim"):
        fmha_ops.memory_efficient_attention(bad, k, v, CAUSAL)
    with pytest.raises(ValueError, match="query/key/value dtypes float32/float64/float32"):
        fmha_ops.memory_efficient_attention(q, k.double(), v, CAUSAL)
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        fmha_ops.memory_efficient_attention(q, k.tolist(), v, CAUSAL)


def test_strided_views_get_plans_of_their_own():
    packed = torch.randn(1, 16, 3, 2, 16)  # q, k, v as views of one packed projection (not contiguous)
    q, k, v = packed.unbind(2)
    dense = [t.contiguous() for t in (q, k, v)]
    want = fmha_ops.memory_efficient_attention(*dense, CAUSAL)
    assert torch.equal(fmha_ops.memory_efficient_attention(*dense, CAUSAL), want)
    for _ in range(2):
        assert torch.equal(fmha_ops.memory_efficient_attention(q, k, v, CAUSAL), want)
    assert plans.call_key("entry", (q, k, v, CAUSAL)) != plans.call_key("entry", (*dense, CAUSAL))


def test_calls_with_per_call_checks_keep_the_full_path(counted):
    spec = SPECS["paged_p16"]  # a paged mask checks its block table on every call
    q, k, v = _spec_inputs(spec, torch.float32)
    paged = make_bias(spec)
    for _ in range(2):
        fmha_ops.memory_efficient_attention(q, k, v, paged)
    assert counted["make_inputs"] == 2 and counted["validate"] == 1
    q, k, v = _qkv(m=8)
    bias = torch.randn(1, 2, 8, 8)  # a tensor bias: wrapped per call, its gradient follows the grad mode
    for _ in range(2):
        fmha_ops.memory_efficient_attention(q, k, v, bias)
    assert counted["make_inputs"] == 4
    varlen = ab.BlockDiagonalMask.from_seqlens([3, 5])  # host-built sequence starts: a plan of its own
    full = fmha_ops.memory_efficient_attention(q, k, v, varlen)
    assert torch.equal(fmha_ops.memory_efficient_attention(q, k, v, ab.BlockDiagonalMask.from_seqlens([3, 5])), full)
    assert counted["make_inputs"] == 5
    swapped = ab.BlockDiagonalMask.from_seqlens([5, 3])  # the same signature: the plan runs it with its own starts
    other = fmha_ops.memory_efficient_attention(q, k, v, swapped)
    assert counted["make_inputs"] == 5 and not torch.equal(other, full)
    fmha_ops.SELECTOR.clear()
    assert torch.equal(fmha_ops.memory_efficient_attention(q, k, v, swapped), other)


def _dense_cache(seed=0):
    """q (2, 1, 4, 16), a dense float32 KV cache (2, 8, 2, 16) on the CPU, one new token per sequence, the lengths."""
    q, k_cache, v_cache = _qkv(b=2, m=1, hq=4, hkv=2, mk=8, seed=seed)
    _, new_k, new_v = _qkv(b=2, m=1, hq=2, hkv=2, seed=seed + 1)
    return q, k_cache, v_cache, new_k, new_v, torch.tensor([3, 5], dtype=torch.int32)


def test_kvcache_call_selects_once_when_its_plan_is_made(counted):
    """A flash_attn_with_kvcache call that keeps no decode plan (a dense cache on the CPU) selects its op when its
    plan is made; the plan's run appends and runs that op without selecting again: the entry point's result."""
    q, k_cache, v_cache, new_k, new_v, lens = _dense_cache()
    caches = (k_cache.clone(), v_cache.clone())
    plan = kvcache_call.plan_kvcache_call(None, q, *caches, new_k, new_v, lens, None, None, None, None, None, None,
                                          True, (-1, -1), 0.0, False)
    assert counted["signature"] == 1 and [op.KIND for op in plan.ops] == ["fw"]
    out = plan.run(q, *caches, new_k, new_v, lens, None, None, None)
    assert counted["signature"] == 1, "the run selects nothing"
    want = fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=lens, causal=True)
    assert torch.equal(out, want) and torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)


def test_kvcache_call_that_no_op_can_run_raises_before_it_appends():
    """The op is selected before the append: a call no op can run raises and leaves the cache as it was."""
    q, k_cache, v_cache, new_k, new_v, lens = _dense_cache()
    caches = (k_cache.clone(), v_cache.clone())
    with fmha_ops.use_ops("sdpa_mathF"), pytest.raises(fmha_ops.NoSupportedOpError, match="sdpa_mathF"):
        fmha_ops.flash_attn_with_kvcache(q, *caches, new_k, new_v, cache_seqlens=lens, causal=True)
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)


def test_kvcache_call_gradient_through_its_plan_matches_the_reference():
    """A kvcache call whose q and cache require gradients runs the op(s) its plan selected with autograd (the
    pair under autograd where the forward op has none): the gradients of a float64 softmax reference."""
    q, k_cache, v_cache, _, _, lens = _dense_cache()
    leaves = [t.clone().requires_grad_(True) for t in (q, k_cache, v_cache)]
    out = fmha_ops.flash_attn_with_kvcache(*leaves, cache_seqlens=lens, causal=True)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    refs = [t.detach().double().requires_grad_(True) for t in (q, k_cache, v_cache)]
    rows = []
    for b, n in enumerate(lens.tolist()):  # one query per sequence: it sees the sequence's n keys
        keys, values = (t[b, :n].repeat_interleave(2, dim=1) for t in refs[1:])  # GQA: 2 query heads per kv head
        scores = torch.einsum("hd,nhd->hn", refs[0][b, 0], keys) * 16 ** -0.5
        rows.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values)[None, None])
    want = torch.cat(rows)
    assert torch.allclose(out.double(), want, atol=1e-5)
    for got, ref in zip(grads, torch.autograd.grad(want.square().sum(), refs)):
        assert torch.allclose(got.double(), ref, atol=1e-5)


def test_a_plan_holds_no_tensor_of_its_first_call():
    q, k, v = _qkv(m=13)
    refs = [weakref.ref(t) for t in (q, k, v)]
    out = fmha_ops.memory_efficient_attention(q, k, v, CAUSAL)
    assert fmha_ops.memory_efficient_attention(q, k, v, CAUSAL).shape == out.shape
    del q, k, v, out
    gc.collect()
    assert all(r() is None for r in refs)


def test_call_key_refuses_what_it_cannot_key():
    q, k, v = _qkv()
    args = (None, 0.0, None, None, None, False, 0.0, None, None, None, False)
    assert plans.call_key("entry", (q, k, v, *args)) is not None
    assert plans.call_key("entry", (q, k, v, object(), *args[1:])) is None  # a foreign mask: converted on the full path
    # True, 1 and 1.0 are three keys (a check may accept one and refuse another); nested lists are keyed item by item
    keys = {plans.call_key("entry", (q, flag)) for flag in (True, 1, 1.0)}
    assert len(keys) == 3
    assert plans.call_key("entry", (q, [q, 0.5])) != plans.call_key("entry", (q, (q, 0.5)))
    outside = plans.call_key("entry", (q,))
    with fmha_ops.checks.check_inputs():  # check mode is part of the key, and host descales keep the full path
        assert plans.call_key("entry", (q,)) != outside
        before = len(plans.PLANS)
        f8 = [t.to(torch.float8_e4m3fn) for t in (q, k, v)]
        one = torch.ones(1)
        for _ in range(2):
            fmha_ops.memory_efficient_attention(*f8, q_descale=one, k_descale=one, v_descale=one, op="torch_referenceF")
        assert len(plans.PLANS) == before


def test_each_entry_points_finder_takes_every_parameter():
    """The plan finders (and key functions) are generated from the entry points' signatures: one argument per
    parameter (but flash_attn_with_kvcache's unkeyed ones, checked before its lookup), so a call site that leaves
    one out fails at once; where no parameter is a plain tensor their keys hold
    call_key's items (behind a marker of the flat layout), a number of its parameter's declared type as its bare
    value; a finder returns the plan stored under the key it built."""
    import dis
    import inspect

    from fmha_ops import flash_attn_interface as fa, quantized

    pairs = [(api._FIND_MEA, fmha_ops.memory_efficient_attention), (api._FIND_FORWARD,
             fmha_ops.memory_efficient_attention_forward), (api._FIND_PARTIAL, fmha_ops.memory_efficient_attention_partial),
             (api._FIND_FORWARD_REQUIRES_GRAD, fmha_ops.memory_efficient_attention_forward_requires_grad),
             (api._FIND_BACKWARD, fmha_ops.memory_efficient_attention_backward), (api._FIND_MERGE, fmha_ops.merge_attentions),
             (fa._FIND_FUNC, fmha_ops.flash_attn_func), (fa._FIND_VARLEN, fmha_ops.flash_attn_varlen_func),
             (fa._FIND_KVCACHE, fmha_ops.flash_attn_with_kvcache), (quantized._FIND_FP8, fmha_ops.fp8_attention),
             (quantized._FIND_I8FP8, fmha_ops.i8fp8_attention)]
    for find, entry in pairs:
        unkeyed = len(fa._KVCACHE_UNKEYED) if entry is fmha_ops.flash_attn_with_kvcache else 0
        want = len(inspect.signature(entry).parameters) - unkeyed
        assert len(inspect.signature(find).parameters) == want, entry.__name__
    with pytest.raises(ValueError, match="not parameters of"):
        plans.plan_finder(fmha_ops.flash_attn_func, ("rotary_cos",))
    # no finder builds its key through a list (a display past plans._DISPLAY_ITEMS items), nor does the entry point
    # with the most parameters call its finder so: ~0.2-0.3 us per call on the CPU
    for fn in [find for find, _ in pairs] + [fmha_ops.flash_attn_with_kvcache]:
        assert "LIST_TO_TUPLE" not in {i.opname for i in dis.get_instructions(fn)}, fn.__name__
    q, k, v = _qkv()
    parts = ([q, q], [q[:, 0, :, 0], q[:, 0, :, 0]], True, None)
    key_merge = plans.key_function(fmha_ops.merge_attentions)
    flat, generic = key_merge(*parts), plans.call_key(fmha_ops.merge_attentions, parts)
    assert flat[0] == generic[0] and flat != generic
    *state, items = flat[2:]  # the argument items in tuples of at most plans._DISPLAY_ITEMS
    assert (*state, *items[:-2]) == generic[1:-2] and items[-2:] == (True, None) and generic[-2:] == ((bool, True), None)
    with pytest.raises(TypeError):
        key_merge(*parts[:3])
    args = (q, k, v, None, 0.0, None, None, None, None, None, None, False, 0.0, None)
    fmha_ops.SELECTOR.clear()
    key = plans.key_function(fmha_ops.memory_efficient_attention)(*args)
    assert api._FIND_MEA(*args) == (None, key)
    fmha_ops.memory_efficient_attention(q, k, v)
    plan, found = api._FIND_MEA(*args)
    assert found == key and plan is not None and plan is plans.PLANS.get(key)



def test_every_plan_is_keyed_by_the_key_builders():
    """Every key in the plan cache was made by ``plans``' builders (a generated finder's, marked by its flat layout,
    or ``call_key``'s, which starts with the grad mode), the compiled custom ops' spec plans included: no module
    keys a plan by hand."""
    q, k, v = _qkv()
    fmha_ops.SELECTOR.clear()
    fmha_ops.memory_efficient_attention(q, k, v, ab.LowerTriangularMask())
    fmha_ops.flash_attn_varlen_func(q[0], k[0], v[0], *[torch.tensor([0, 7, 16], dtype=torch.int32)] * 2, 9, 9)
    compiled = torch.compile(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, op="torch_referenceF"),
                             fullgraph=True, backend="eager")
    compiled(q, k, v)
    compiled(q, k, v)
    keys = list(plans.PLANS._plans)
    assert any(key[0] is compiled_layer.decode_spec for key in keys)
    assert all(key[1] is plans._FLAT or type(key[1]) is bool for key in keys), keys

def test_a_number_of_another_type_than_declared_never_finds_the_plan():
    """A generated key holds a number of its parameter's declared type (``causal: bool``, ``softcap: float``) as the
    bare value, any other type as (type, value): ``causal=1`` never finds the plan of ``causal=True`` (``True == 1 ==
    1.0``), so its own check runs and refuses it; the dropout ``p`` as 0.0, 0 and False makes three keys."""
    q, k, v = _qkv()
    fmha_ops.flash_attn_func(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        fmha_ops.flash_attn_func(q, k, v, causal=1)
    key = plans.key_function(fmha_ops.memory_efficient_attention)
    args = [q, k, v, None, 0.0, None, None, None, None, None, None, False, 0.0, None]
    keys = {key(*args[:4], p, *args[5:]) for p in (0.0, 0, False)}
    assert len(keys) == 3


def test_optional_tensor_arguments_are_keyed_by_their_metadata_and_type(monkeypatch):
    """A generated key holds an optional tensor argument (a descale, the sinks, a cache's lengths) as a plain tensor's
    metadata, a subclass with its type, and a list of parts item by item: any change of shape, dtype, strides,
    requires_grad or type gives another key, the same metadata the same key; check mode is keyed as its scope and
    its environment switch."""
    q, k, v = _qkv(hq=4)
    key = plans.key_function(fmha_ops.memory_efficient_attention)
    args = [q, k, v, None, 0.0, None, None, None, None, None, None, False, 0.0]
    sinks = torch.zeros(4)
    variants = [None, sinks, torch.zeros(4, dtype=torch.float64), torch.zeros(8)[::2], torch.zeros(5),
                torch.zeros(4).requires_grad_(), torch.nn.Parameter(torch.zeros(4))]
    keys = [key(*args, s) for s in variants]
    assert len(set(keys)) == len(variants)
    assert key(*args, torch.ones(4)) == keys[1]  # values are not keyed
    merge = plans.key_function(fmha_ops.merge_attentions)
    lse = q[:, 0, :, 0]
    parts = [merge([q, q], [lse, lse], True, None), merge([q, q.clone()], [lse, lse], True, None),
             merge([q, q.transpose(1, 2)], [lse, lse], True, None), merge((q, q), [lse, lse], True, None),
             merge([q, torch.nn.Parameter(q)], [lse, lse], True, None)]
    assert parts[0] == parts[1] and len(set(parts[1:])) == 4
    base = key(*args, None)
    with fmha_ops.checks.check_inputs():
        assert key(*args, None) != base
    monkeypatch.setenv(fmha_ops.checks.ENV_VAR, "1")
    fmha_ops.checks.refresh_env()
    on = key(*args, None)
    monkeypatch.undo()
    fmha_ops.checks.refresh_env()
    assert on != base
    with fmha_ops.checks.check_inputs(False):
        assert key(*args, None) not in (base, on)  # checks off in the block: a key of its own


def test_the_plan_cache_is_one_bounded_lru(monkeypatch):
    """A hit makes a plan the most recently used; a store past the limit drops the least recently used; the plans go
    with the selector's memo."""
    cache = plans.PlanCache(3)
    for name in "abc":
        cache.put(name, plans.Plan(name))
    assert cache.get("a").run == "a"  # a is now the youngest
    cache.put("d", plans.Plan("d"))
    assert [p.run for p in cache.plans()] == ["c", "a", "d"]
    assert cache.get("b") is None and cache.get(None) is None
    fmha_ops.SELECTOR.clear()
    assert len(cache) == 0


def test_quantized_backward_selects_once_per_layout(monkeypatch):
    from fmha_ops import quantized

    made = []
    monkeypatch.setattr(quantized, "make_inputs", lambda *a, **kw: made.append(a[0].dtype) or inputs.make_inputs(*a, **kw))
    fmha_ops.SELECTOR.clear()
    base = _qkv(m=20, hq=4, hkv=2, dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = fmha_ops.fp8_attention(q, k, v, causal=True)
        out.float().sum().backward()
        grads.append((out.detach(), q.grad, k.grad, v.grad))
    assert made.count(torch.bfloat16) == 1  # the backward's Inputs built by make_inputs on the first call only
    for a, b in zip(*grads):
        assert torch.equal(a, b)



def test_a_plan_hit_under_functorch_transforms_matches_eager():
    """An SDPA launch plan made outside a functorch transform serves a call inside one (vmap, functionalize: same
    key): its tensors are then the transform's wrappers, which it views as eager calls do (they have no storage of
    their own for the plan's aliases)."""
    q, k, v = _qkv()
    batch = torch.randn(3, *q.shape)
    fmha_ops.memory_efficient_attention(q, k, v)  # the plan, outside any transform
    want = torch.stack([fmha_ops.memory_efficient_attention(x, k, v) for x in batch])
    got = torch.func.vmap(lambda x: fmha_ops.memory_efficient_attention(x, k, v))(batch)
    assert torch.equal(got, want)
    functional = torch.func.functionalize(lambda x: fmha_ops.memory_efficient_attention(x, k, v))(q)
    assert torch.equal(functional, fmha_ops.memory_efficient_attention(q, k, v))


def test_forward_ad_through_a_plan_hit_ends_as_on_the_full_path():
    """A dual query (forward-mode AD) through a stored plan ends as through the full path: the same tangent, or the
    same error where the selected op's aten function has no forward-AD formula; never an output without tangent."""
    import torch.autograd.forward_ad as fwad

    q, k, v = _qkv()
    tangent = torch.randn_like(q)

    def outcome():
        try:
            with fwad.dual_level():
                out = fmha_ops.memory_efficient_attention(fwad.make_dual(q, tangent), k, v)
                return fwad.unpack_dual(out).tangent
        except Exception as e:  # noqa: BLE001 - the outcome compared
            return type(e)

    fmha_ops.SELECTOR.clear()
    cold = outcome()
    fmha_ops.memory_efficient_attention(q, k, v)  # the plan
    hit = outcome()
    assert cold is not None and hit is not None
    assert (cold == hit) if isinstance(cold, type) else torch.equal(cold, hit)


def test_eager_calls_that_add_plans_recompile_no_compiled_graph():
    q = torch.randn(1, 16, 2, 16)
    compiled = torch.compile(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, ab.LowerTriangularMask()),
                             fullgraph=True, backend="eager")
    want = compiled(q, q, q)
    r = torch.randn(1, 9, 2, 16)
    fmha_ops.memory_efficient_attention(r, r, r)  # new plans, a mask type not seen before
    fmha_ops.memory_efficient_attention(r, r, r, ab.BlockDiagonalMask.from_seqlens([4, 5]))
    fmha_ops.flash_attn_func(r, r, r, causal=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(compiled(q, q, q), want)


# ---- on the GPU (pytest -m gpu) ------------------------------------------------------------------------------

def _reference(q, k, v, bias):
    return fmha_ops.memory_efficient_attention(q.float(), k.float(), v.float(), bias, op="torch_referenceF")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["sdpa_flashF", "sdpa_cudnnF"])
@pytest.mark.parametrize("mq,mk,hkv,mask", [(77, 77, 2, "causal"), (33, 77, 8, "none"), (33, 77, 2, "causal"),
                                            (77, 77, 1, "causal_br"), (33, 77, 2, "causal_br")])
def test_gpu_sdpa_plans_match_the_reference_forward_and_backward(op, mq, mk, hkv, mask):
    bias = {"none": None, "causal": ab.LowerTriangularMask(),
            "causal_br": ab.LowerTriangularFromBottomRightMask()}[mask]
    base = [t.cuda() for t in _qkv(b=2, m=mq, mk=mk, hq=8, hkv=hkv, d=64, dtype=torch.bfloat16)]
    report = fmha_ops.explain(*base, bias, op=op)
    if op == "sdpa_flashF" and mq != mk:  # flash's causal is bottom-right: it takes that kind, refuses top-left
        assert (report.selected is None) == (mask == "causal"), str(report)
    if report.selected is None:
        return
    grad = torch.randn(2, mq, 8, 64, device="cuda", dtype=torch.bfloat16)
    fmha_ops.SELECTOR.clear()
    runs = []
    for _ in range(2):  # the full path, then the plan
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = fmha_ops.memory_efficient_attention(q, k, v, bias, op=op)
        out.backward(grad)
        runs.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in base)
    ref = _reference(qf, kf, vf, bias)
    ref.backward(grad.float())
    for got, want in zip(runs[0], (ref, qf.grad, kf.grad, vf.grad)):
        err = (got.float() - want.detach()).abs().max().item() / want.detach().abs().max().item()
        assert err < 2e-2, err


@pytest.mark.gpu
def test_gpu_flash_attn_func_plan_is_the_full_path():
    q, k, v = (t.cuda() for t in _qkv(b=1, m=128, hq=4, hkv=2, d=64, dtype=torch.bfloat16))
    fmha_ops.SELECTOR.clear()
    full = fmha_ops.flash_attn_func(q, k, v, causal=True)
    assert len(plans.PLANS) and torch.equal(fmha_ops.flash_attn_func(q, k, v, causal=True), full)
    assert fmha_ops.explain(q, k, v, ab.LowerTriangularFromBottomRightMask()).selected.NAME in ("sdpa_flashF",
                                                                                                "sdpa_cudnnF",
                                                                                                "triton_attnF")


@pytest.mark.gpu
def test_gpu_merge_attentions_repeated_layout_matches_and_still_validates():
    q, k, v = (t.cuda() for t in _qkv(b=2, m=33, hq=4, hkv=2, d=64, mk=40, dtype=torch.bfloat16))
    parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, s], v[:, s]) for s in (slice(0, 17), slice(17, None))]
    outs, lses = [o for o, _ in parts], [lse for _, lse in parts]
    first = fmha_ops.merge_attentions(outs, lses)
    again = fmha_ops.merge_attentions(outs, lses)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    full = fmha_ops.memory_efficient_attention_partial(q, k, v)
    # the parts are bf16 (each rounded once before the merge): two bf16 ulps of an output near 1
    assert (first[0].float() - full[0].float()).abs().max().item() < 2 * torch.finfo(torch.bfloat16).eps
    with pytest.raises(ValueError, match="does not match attn_split"):
        fmha_ops.merge_attentions(outs, [lse[:, :, :5] for lse in lses])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_kvcache_append_plan_matches_the_full_path(fp8):
    from fmha_ops import flash_attn_interface as fa
    from fmha_ops.kv_cache import build_fp8_paged_cache, paged_from_dense

    b, length, hq, hkv, d, page = 4, 256, 8, 2, 128, 64
    q, k, v = (t.cuda() for t in normal_qkv((b, 1, hq, d), (b, length, hkv, d), dtype=torch.bfloat16))
    knew, vnew = (torch.randn(b, 2, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if fp8:
        kc, vc, ks, vs, table = build_fp8_paged_cache(k, v, page)
    else:
        (kc, vc), table = paged_from_dense([k, v], page)
        ks = vs = None
    lens = torch.tensor([0, 17, 200, 254], dtype=torch.int32, device="cuda")
    fmha_ops.SELECTOR.clear()
    runs = []
    for _ in range(2):  # the full path, then the plan it left, each on a fresh copy of the cache
        state = [None if t is None else t.clone() for t in (kc, vc, ks, vs)]
        out = fmha_ops.flash_attn_with_kvcache(q, state[0], state[1], k=knew, v=vnew, cache_seqlens=lens,
                                               page_table=table, k_descale=state[2], v_descale=state[3],
                                               causal=True)
        runs.append([out] + [t for t in state if t is not None])
    assert plans.PLANS.plans(fa.flash_attn_with_kvcache)
    for a, b_ in zip(*runs):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("arch,mq,mask,refusal", [
    ("cuda", 33, ab.LowerTriangularMask(), "top-left causal with Mq=33 != Mk=77 not supported"),
    ("cuda", 1, ab.LowerTriangularMask(), "top-left causal with Mq=1 != Mk=77 not supported"),
    ("cuda", 33, ab.LowerTriangularFromBottomRightMask(), None),
    ("cuda", 77, ab.LowerTriangularMask(), None),
    ("cpu", 33, ab.LowerTriangularMask(), None),
    ("cpu", 33, ab.LowerTriangularFromBottomRightMask(), "bottom-right causal with Mq=33 != Mk=77 not supported"),
])
def test_sdpa_flash_causal_alignment_per_device(arch, mq, mask, refusal):
    q, k, v = _qkv(m=mq, mk=77, dtype=torch.bfloat16)
    problem = make_problem_for(q, k, v, mask)
    if arch == "cuda":
        problem = dataclasses.replace(problem, arch=Arch("cuda", (9, 0), name="NVIDIA H200"))
    reasons = fmha_ops.get_op("sdpa_flashF").not_supported_reasons(problem)
    causal_reasons = [r for r in reasons if "causal" in r]
    assert len(causal_reasons) == (refusal is not None) and all(r.startswith(refusal) for r in causal_reasons)


def make_problem_for(q, k, v, mask):
    inp = inputs.make_inputs(q, k, v, mask)
    inp.validate()
    return inp.problem()


def test_plans_are_dropped_by_the_exit_handlers():
    """The plan cache empties at exit, before extension modules that report objects still alive when they unload
    (cuDNN-frontend graphs held by launchers): an exit handler registered before fmha_ops runs after its own."""
    import subprocess
    import sys

    script = (
        "import atexit\n"
        "def report():\n"
        "    from fmha_ops.plans import PLANS\n"
        "    print('plans at exit', len(PLANS))\n"
        "atexit.register(report)\n"
        "import torch, fmha_ops\n"
        "q = torch.randn(1, 8, 2, 16)\n"
        "fmha_ops.memory_efficient_attention(q, q, q)\n"
        "from fmha_ops.plans import PLANS\n"
        "print('plans', len(PLANS))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    during, at_exit = (int(line.split()[-1]) for line in run.stdout.splitlines()[-2:])
    assert during > 0 and at_exit == 0, run.stdout


def test_a_compiled_call_spec_plan_holds_its_host_seqinfo():
    """A traced decode call's host query starts are built once, when its spec is parsed: every call of the custom
    op shares them (no memo of its own), with the starts the trace saw."""
    lens = torch.tensor([5, 2, 7], dtype=torch.int32)
    mask = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_device_seqlens(2, 8, lens)
    tensors: list = []
    fields = (("attn_bias", compiled_layer.flatten(mask, tensors)),)
    text = compiled_layer.CallSpec("triton_splitKF", "", fields, False).encode()
    plans.PLANS.clear()
    spec = compiled_layer.decode_spec(text)
    first, again = (compiled_layer.unflatten(dict(compiled_layer.decode_spec(text).fields)["attn_bias"], tensors)
                    for _ in range(2))
    assert compiled_layer.decode_spec(text) is spec and first is not again
    assert first.q_seqinfo is again.q_seqinfo and first.q_seqinfo.seqstart_py == [0, 2, 4, 6]
    assert first.k_seqinfo.seqlen is lens and torch.equal(first.q_seqinfo.seqstart, mask.q_seqinfo.seqstart)
