"""torch.compile(fullgraph=True) of the public functions: no graph break, same values as eager, gradients too.

The selector runs at trace time (``fmha_ops.compiled``): ops whose apply is plain torch are traced, the others run
behind the ``fmha_ops::`` custom ops. aot_eager covers the autograd graphs quickly; inductor runs once on a small
transformer block, forward and backward.
"""
from __future__ import annotations

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.testing import normal_qkv

B, M, HQ, HKV, D = 2, 33, 4, 2, 16


def _qkv(dtype=torch.float32, b=B, m=M, seed=0):
    q, k, v = normal_qkv((b, m, HQ, D), (b, m, HKV, D), dtype=dtype, seed=seed)
    return q, k, v


def _compiled(fn, backend="aot_eager"):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


def _check(fn, *args, grad=False, backend="aot_eager", atol=1e-5):
    """fn(*args) compiled fullgraph equals eager (outputs and, with ``grad``, gradients w.r.t. the float args)."""
    def leaves():
        return [a.detach().clone().requires_grad_(grad) if isinstance(a, torch.Tensor) and a.is_floating_point()
                else a for a in args]

    def run(f):
        xs = leaves()
        out = f(*xs)
        outs = list(out) if isinstance(out, tuple) else [out]
        if not grad:
            return outs
        diff = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
        return outs + list(torch.autograd.grad(outs[0].float().square().sum(), diff))

    want, got = run(fn), run(_compiled(fn, backend))
    assert len(want) == len(got)
    for w, g in zip(want, got):
        if w is None:
            assert g is None
            continue
        assert g.shape == w.shape and g.dtype == w.dtype
        # half-precision results may differ by rounding (another op's accumulation order): two ulps of the dtype
        rtol = 1e-4 if w.dtype == torch.float32 else 2 * torch.finfo(w.dtype).eps
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol)


def _graph_breaks(fn, *args) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_break_count


CAUSAL = ab.LowerTriangularMask()


def _bf16(*ts):
    """The quantize-inside functions take bfloat16 / float16 tensors."""
    return [t.to(torch.bfloat16) for t in ts]


@pytest.mark.parametrize("name, fn", [
    ("memory_efficient_attention", lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, CAUSAL)),
    ("reference op (custom op)", lambda q, k, v: fmha_ops.memory_efficient_attention(
        q, k, v, CAUSAL, op="torch_referenceF")),
    ("bottom-right causal", lambda q, k, v: fmha_ops.memory_efficient_attention(
        q, k[:, :20], v[:, :20], ab.LowerTriangularFromBottomRightMask())),
    ("flash_attn_func", lambda q, k, v: fmha_ops.flash_attn_func(q, k, v, causal=True)),
    ("fp8_attention", lambda q, k, v: fmha_ops.fp8_attention(*_bf16(q, k, v), causal=True)),
    ("i8fp8_attention", lambda q, k, v: fmha_ops.i8fp8_attention(*_bf16(q, k, v))),
])
def test_differentiable_entry_points_compile_fullgraph(name, fn):
    _check(fn, *_qkv(), grad=True)


def test_forward_and_partial_and_merge_compile_fullgraph():
    q, k, v = _qkv(seed=1)
    _check(lambda q, k, v: fmha_ops.memory_efficient_attention_forward(q, k, v, CAUSAL), q, k, v)

    def split_and_merge(q, k, v):
        parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, s], v[:, s]) for s in (slice(0, 9), slice(9, M))]
        return fmha_ops.merge_attentions([o for o, _ in parts], [lse for _, lse in parts])

    _check(split_and_merge, q, k, v)
    whole = fmha_ops.memory_efficient_attention(q, k, v)
    torch.testing.assert_close(_compiled(split_and_merge)(q, k, v)[0], whole, atol=1e-5, rtol=1e-4)


def test_varlen_mask_compiles_fullgraph_with_gradients():
    mask = ab.BlockDiagonalCausalMask.from_seqlens([5, 17, 11], [9, 13, 11])
    q, k, v = normal_qkv((1, 33, HQ, D), (1, 33, HKV, D), dtype=torch.float32, seed=2)
    _check(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, mask), q, k, v, grad=True)


def test_flash_attn_varlen_func_compiles_fullgraph_with_gradients():
    q, k, v = (t[0] for t in normal_qkv((1, 33, HQ, D), (1, 33, HKV, D), dtype=torch.float32, seed=7))
    cu = torch.tensor([0, 5, 22, 33], dtype=torch.int32)
    _check(lambda q, k, v: fmha_ops.flash_attn_varlen_func(q, k, v, cu, cu, 17, 17, causal=True), q, k, v, grad=True)
    _check(lambda q, k, v: fmha_ops.flash_attn_varlen_func(q, k, v, cu, cu, 17, 17, return_attn_probs=True), q, k, v)
    assert _graph_breaks(lambda q, k, v: fmha_ops.flash_attn_varlen_func(q, k, v, cu, cu, 17, 17), q, k, v) == 0


class LowerTriangularMask:
    """Stands for xformers' mask of the same name (``from_xformers`` converts by type name and fields)."""


class BlockDiagonalCausalMask:
    def __init__(self, q_seqlens, k_seqlens):
        self.q_seqinfo, self.k_seqinfo = _XformersSeqInfo(q_seqlens), _XformersSeqInfo(k_seqlens)


class _XformersSeqInfo:
    def __init__(self, seqlens):
        self.seqstart_py = [sum(seqlens[:i]) for i in range(len(seqlens) + 1)]
        self.seqstart = torch.tensor(self.seqstart_py, dtype=torch.int32)


def test_xformers_style_masks_compile_fullgraph():
    q, k, v = _qkv(seed=3)
    _check(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, LowerTriangularMask()), q, k, v)
    mask = BlockDiagonalCausalMask([5, 28], [5, 28])
    _check(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, mask), q[:1], k[:1], v[:1])


def test_xformers_masks_compile_fullgraph():
    xf = pytest.importorskip("xformers.ops.fmha.attn_bias")
    q, k, v = _qkv(seed=4)
    causal = xf.LowerTriangularMask()  # a tensor subclass in xformers: made outside the compiled function
    _check(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, causal), q, k, v)
    mask = xf.BlockDiagonalCausalMask.from_seqlens([5, 28])
    _check(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, mask), q[:1], k[:1], v[:1])


def test_kvcache_decode_compiles_fullgraph():
    """flash_attn_with_kvcache with host-resident lengths: the host index checks stay out of the trace."""
    q, _, _ = _qkv(b=4, m=1, seed=2)
    _, k, v = _qkv(b=4, m=40, seed=3)
    lengths = torch.tensor([40, 17, 1, 0], dtype=torch.int32)
    decode = lambda q, k, v: fmha_ops.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths)  # noqa: E731
    assert _graph_breaks(decode, q, k, v) == 0
    _check(decode, q, k, v)


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("bad", [dict(sinks=torch.zeros(3)), dict(sinks=torch.zeros(4, dtype=torch.float16)),
                                 dict(softcap=-1.0)])
def test_kvcache_append_traced_call_rejected_before_the_append(fullgraph, bad):
    """A traced flash_attn_with_kvcache call that appends k/v and fails the op path's checks (sinks, softcap: the
    traced plan validates where the trace checks it) appends nothing, as an eager call: with fullgraph the trace
    raises before any graph runs; without it, where Dynamo breaks the graph at the failing call, the eager path
    raises naming the argument."""
    q, k, v = _qkv(b=2, m=1, seed=7)
    k_cache, v_cache = torch.zeros(2, 8, HKV, D), torch.zeros(2, 8, HKV, D)
    lengths = torch.tensor([3, 5], dtype=torch.int32)
    append = lambda q, kc, vc, k, v: fmha_ops.flash_attn_with_kvcache(  # noqa: E731
        q, kc, vc, k, v, cache_seqlens=lengths, **bad)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported if fullgraph else ValueError):
        torch.compile(append, fullgraph=fullgraph, backend="aot_eager")(q, k_cache, v_cache, k, v)
    assert not k_cache.any() and not v_cache.any()


def test_new_sequence_lengths_recompile_with_dynamic_shapes():
    """A second length makes Dynamo trace with symbolic sizes; the selection specializes on them."""
    fn = _compiled(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, CAUSAL, op="torch_referenceF"))
    for m in (33, 40, 47):
        q, k, v = _qkv(m=m, seed=m)
        torch.testing.assert_close(fn(q, k, v), fmha_ops.memory_efficient_attention(q, k, v, CAUSAL),
                                   atol=1e-5, rtol=1e-4)


def test_trace_time_choice_follows_use_ops():
    q, k, v = _qkv(seed=5)
    with fmha_ops.use_ops("torch_referenceF"):
        _check(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, CAUSAL), q, k, v)
    with pytest.raises(Exception, match="cannot run this call"):  # a forced op that cannot run raises when traced
        _compiled(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, CAUSAL, op="sdpa_flashF", p=0.5))(
            q, k, v)


def test_forced_forward_op_without_backward_raises_in_eager_and_traced_alike():
    """A call that needs gradients with a forward op forced alone (one with no autograd of its own) raises the same
    error eager and traced, naming the (FwOp, BwOp) form; ``(FwOp, None)`` lets the selector pick the backward."""
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=torch.float16, seed=6))
    forced = lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, CAUSAL, op="triton_attnF")  # noqa: E731
    for fn in (forced, _compiled(forced)):
        with pytest.raises(Exception, match=r"'triton_attnF' is a fw op; a bw op is needed here \(a call that needs "
                                            r"gradients takes op=\(FwOp, BwOp\)\)"):
            fn(q, k, v)
    paired = lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, CAUSAL, op=("triton_attnF", None))  # noqa
    _check(paired, *(t.detach() for t in (q, k, v)), grad=True, atol=2e-2)


def test_host_sequence_starts_pass_as_constants_not_custom_op_tensors():
    """Host sequence starts (a decode call's packed queries: a CPU int32 tensor beside ``seqstart_py``) travel in
    the compiled call's spec and are rebuilt inside the op: a CPU tensor made in the trace would be an input of the
    CUDA-graph partition around the custom op, whose pool check rejects host storage under reduce-overhead."""
    from fmha_ops.compiled import flatten, unflatten

    info = ab._SeqLenInfo.from_seqlens([1, 1, 3])
    tensors: list = []
    back = unflatten(flatten(info, tensors), tensors)
    assert tensors == []
    assert back.seqstart_py == [0, 1, 2, 5] and back.seqstart.tolist() == [0, 1, 2, 5]
    assert (back.max_seqlen, back.min_seqlen) == (3, 1)


class Block(torch.nn.Module):
    """A pre-norm transformer block: causal GQA attention through fmha_ops, then an MLP."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, m, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, m, self.heads, self.head_dim)
        k, v = (t.view(b, m, self.kv_heads, self.head_dim) for t in (k, v))
        attn = fmha_ops.memory_efficient_attention(q, k, v, CAUSAL)
        x = x + self.proj(attn.reshape(b, m, -1))
        return x + self.mlp(self.norm2(x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_transformer_block_compiles_fullgraph_and_matches_eager(backend):
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 17, 32)
    assert _graph_breaks(block, x) == 0
    compiled = _compiled(block, backend)
    want = block(x)
    torch.testing.assert_close(compiled(x), want, atol=1e-5, rtol=1e-4)
    want.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    compiled(x).square().sum().backward()
    for n, p in block.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_explain_reports_no_graph_break_for_the_entry_points():
    q, k, v = _qkv(seed=6)
    for fn in (lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, CAUSAL, op="torch_referenceF"),
               lambda q, k, v: fmha_ops.flash_attn_func(q, k, v, causal=True),
               lambda q, k, v: fmha_ops.fp8_attention(*_bf16(q, k, v))):
        assert _graph_breaks(fn, q, k, v) == 0


# ---- CUDA: the same entry points with the GPU ops (Triton / Gluon kernels behind the custom ops, SDPA traced) ----

def _cuda_qkv(dtype=torch.bfloat16, b=2, m=256, hq=8, hkv=2, d=64, seed=0):
    return normal_qkv((b, m, hq, d), (b, m, hkv, d), dtype=dtype, device="cuda", seed=seed)


def _fp8(*ts):
    return [t.to(torch.float8_e4m3fn) for t in ts]


_ONE = None


def _one():
    global _ONE
    if _ONE is None:
        _ONE = torch.ones(1, device="cuda")
    return _ONE


def _split_and_merge_cuda(q, k, v):
    parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, s], v[:, s]) for s in (slice(0, 100), slice(100, None))]
    return fmha_ops.merge_attentions([o for o, _ in parts], [lse for _, lse in parts])


_GPU_CASES = [
    ("memory_efficient_attention (selected op) fwd+bwd", lambda q, k, v: fmha_ops.memory_efficient_attention(
        q, k, v, CAUSAL), True, None),
    ("flash_attn_func fwd+bwd", lambda q, k, v: fmha_ops.flash_attn_func(q, k, v, causal=True), True, None),
    ("fp8_attention fwd+bwd", lambda q, k, v: fmha_ops.fp8_attention(q, k, v, causal=True), True, None),
    ("triton_attnF custom op fwd+bwd", lambda q, k, v: fmha_ops.memory_efficient_attention(
        q, k, v, CAUSAL, op=("triton_attnF", None)), True, None),
    ("flash_attn_func fp8 descales", lambda q, k, v: fmha_ops.flash_attn_func(
        q, k, v, causal=True, q_descale=_one(), k_descale=_one(), v_descale=_one()), False, _fp8),
    ("i8fp8_attention fwd+bwd", lambda q, k, v: fmha_ops.i8fp8_attention(q, k, v, causal=True), True, None),
    ("partial + merge_attentions", _split_and_merge_cuda, False, None),
    ("memory_efficient_attention_forward", lambda q, k, v: fmha_ops.memory_efficient_attention_forward(
        q, k, v, CAUSAL), False, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name, fn, grad, convert", _GPU_CASES, ids=[c[0] for c in _GPU_CASES])
def test_gpu_entry_points_compile_fullgraph(name, fn, grad, convert):
    _one()  # the descale tensor exists before any trace
    q, k, v = _cuda_qkv()
    args = convert(q, k, v) if convert else (q, k, v)
    assert _graph_breaks(fn, *args) == 0
    _check(fn, *args, grad=grad, atol=2e-2)


@pytest.mark.gpu
def test_gpu_varlen_mask_compiles_fullgraph_with_gradients():
    q, k, v = _cuda_qkv(b=1, seed=1)
    mask = ab.BlockDiagonalCausalMask.from_seqlens([100, 156], device="cuda")
    masked = lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, mask)  # noqa: E731
    assert _graph_breaks(masked, q, k, v) == 0
    _check(masked, q, k, v, grad=True, atol=2e-2)


@pytest.mark.gpu
def test_gpu_flash_attn_varlen_func_compiles_fullgraph_with_gradients():
    q, k, v = (t[0] for t in _cuda_qkv(b=1, m=300, seed=4))
    cu = torch.tensor([0, 1, 130, 300], dtype=torch.int32, device="cuda")  # a one-token sequence, partial tiles
    varlen = lambda q, k, v: fmha_ops.flash_attn_varlen_func(q, k, v, cu, cu, 170, 170, causal=True)  # noqa: E731
    assert _graph_breaks(varlen, q, k, v) == 0
    _check(varlen, q, k, v, grad=True, atol=2e-2)


@pytest.mark.gpu
def test_gpu_kvcache_decode_compiles_fullgraph():
    q, _, _ = _cuda_qkv(b=4, m=1, seed=2)
    _, k, v = _cuda_qkv(b=4, m=300, seed=3)
    lengths = torch.tensor([300, 17, 1, 256], dtype=torch.int32, device="cuda")
    decode = lambda q, k, v: fmha_ops.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths)  # noqa: E731
    assert _graph_breaks(decode, q, k, v) == 0
    _check(decode, q, k, v, atol=2e-2)


@pytest.mark.gpu
def test_gpu_kvcache_decode_under_reduce_overhead_replays_cuda_graphs():
    """mode="reduce-overhead": the decode step runs from CUDA graphs (no cudagraph skip) and follows new queries and
    new cache lengths written into the same tensors, as a decode loop does."""
    from torch._dynamo.utils import counters

    q, _, _ = _cuda_qkv(b=4, m=1, seed=5)
    _, k, v = _cuda_qkv(b=4, m=300, seed=6)
    lengths = torch.tensor([300, 17, 1, 256], dtype=torch.int32, device="cuda")
    decode = lambda q, k, v: fmha_ops.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths)  # noqa: E731
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(decode, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(4):
        q.copy_(torch.randn(q.shape, generator=g, device="cuda", dtype=q.dtype))
        lengths.copy_(torch.randint(0, 301, (4,), generator=g, device="cuda", dtype=torch.int32))
        got = step(q, k, v).clone()
        torch.testing.assert_close(got.float(), decode(q, k, v).float(), atol=2e-2, rtol=2e-2)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.gpu
def test_gpu_transformer_block_compiles_fullgraph_with_inductor():
    torch.manual_seed(0)
    block = Block(dim=128, heads=4, kv_heads=2).to("cuda", torch.bfloat16)
    x = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16)
    assert _graph_breaks(block, x) == 0
    compiled = _compiled(block, "inductor")
    want = block(x)
    torch.testing.assert_close(compiled(x).float(), want.float(), atol=5e-2, rtol=5e-2)
    want.float().square().sum().backward()
    grads = {n: p.grad.float().clone() for n, p in block.named_parameters()}
    block.zero_grad()
    compiled(x).float().square().sum().backward()
    for n, p in block.named_parameters():
        torch.testing.assert_close(p.grad.float(), grads[n], atol=0.5, rtol=5e-2, msg=n)
