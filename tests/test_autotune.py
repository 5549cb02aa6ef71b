"""Autotune on the CPU's own ops: it times the contenders at the call's exact problem, picks the measured fastest,
persists and reloads the seconds, ignores a corrupt or foreign file, never overrides a forced op, never times
under a torch.compile trace, and times a call needing gradients' backward ops on its chosen forward's output."""
import json
import os

import pytest
import torch

import fmha_ops
from fmha_ops import timing
from fmha_ops.dispatch import SELECTOR
from fmha_ops.ops.reference import ReferenceBwOp
from registry import select
from registry.measured import MeasuredTimes
from tests.test_api import NoAutogradFw  # a forward without autograd of its own


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty autotune folder, every op on the CPU a contender (the span would leave only sdpa_flashF)."""
    monkeypatch.setenv("FMHA_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FMHA_OPS_AUTOTUNE", raising=False)
    monkeypatch.setattr(select, "AUTOTUNE_SPAN", 1e9)
    SELECTOR.refresh_env()
    yield tmp_path
    monkeypatch.undo()
    SELECTOR.refresh_env()


@pytest.fixture
def timed(monkeypatch):
    """The ops timed through the public calls (each still runs once, then reports 1 ms)."""
    names = []

    def fake(fns, device):
        for fn in fns.values():
            fn()
        names.extend(fns)
        return {name: 1e-3 for name in fns}
    monkeypatch.setattr(timing, "calls_seconds", fake)
    return names


def qkv(seed=0, m=33):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, m, 4, 16, generator=g) for _ in range(3)]


def problem_of(q, k, v, bias=None):
    inp = fmha_ops.make_inputs(q, k, v, bias)
    inp.validate()
    return inp.problem(False)


def test_picks_the_measured_fastest_and_explain_says_measured_here(cache):
    p = problem_of(*qkv())
    times = {"sdpa_mathF": 1e-6, "sdpa_flashF": 1e-3, "torch_referenceF": 5e-3}
    assert SELECTOR.select(("at-1",), lambda: p, "fw").NAME == "sdpa_flashF"  # the model's choice
    with fmha_ops.autotune():
        asked = []
        chosen = SELECTOR.select(("at-1",), lambda: p, "fw", None,
                                 lambda ops: {o.NAME: times[o.NAME] for o in ops if not asked.append(o.NAME)})
        report = SELECTOR.explain(p, "fw")
    assert chosen.NAME == "sdpa_mathF" and sorted(asked) == sorted(times)
    assert report.selected.NAME == "sdpa_mathF"
    assert all(v.source == "measured here" for v in report.verdicts if v.ok), str(report)
    assert SELECTOR.select(("at-1",), lambda: p, "fw").NAME == "sdpa_flashF", "outside the block the model decides"


def test_measurements_persist_and_reload_without_timing_again(cache):
    p = problem_of(*qkv(1))
    times = {"sdpa_mathF": 2e-6, "sdpa_flashF": 3e-6, "torch_referenceF": 1e-3}
    with fmha_ops.autotune():
        SELECTOR.select(("at-2",), lambda: p, "fw", None, lambda ops: {o.NAME: times[o.NAME] for o in ops})
    files = os.listdir(cache)
    assert files == [f"autotune-{p.arch.name}.json"], files  # one file per device, no temporary left behind
    data = json.loads((cache / files[0]).read_text())
    assert data["device"] == p.arch.name and data["problems"][f"fw {p}"]["sdpa_mathF"] == 2e-6
    SELECTOR.measured.clear()
    SELECTOR.clear()

    def never(ops):
        raise AssertionError(f"{[o.NAME for o in ops]} timed again")
    with fmha_ops.autotune():
        assert SELECTOR.select(("at-2",), lambda: p, "fw", None, never).NAME == "sdpa_mathF"


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 1, "device": "another GPU", "problems": {}}),
                                     json.dumps({"format": 1, "device": "cpu", "problems": {"x": {"a": -1}}}),
                                     json.dumps([1, 2])])
def test_a_corrupt_or_foreign_file_is_ignored_with_a_warning(tmp_path, content):
    store = MeasuredTimes(str(tmp_path))
    with open(store.path("cpu"), "w") as f:
        f.write(content)
    with pytest.warns(UserWarning, match="fmha_ops autotune: ignoring"):
        assert store.times("cpu", "fw anything") == {}
    store.record("cpu", "fw p", {"sdpa_mathF": 1e-3})
    assert MeasuredTimes(str(tmp_path)).times("cpu", "fw p") == {"sdpa_mathF": 1e-3}, "the bad file is replaced"


def test_processes_sharing_a_file_keep_each_others_measurements(tmp_path):
    """Two processes on GPUs of one name (two ranks of a job), each having read the file before the other wrote: the
    file ends with both one's problems, and an op the second did not measure keeps the first one's time."""
    first, second = MeasuredTimes(str(tmp_path)), MeasuredTimes(str(tmp_path))
    assert first.times("gpu", "fw a") == second.times("gpu", "fw a") == {}
    first.record("gpu", "fw a", {"x": 1e-3})
    first.record("gpu", "fw b", {"x": 2e-3, "y": 3e-3})
    second.record("gpu", "fw b", {"y": 4e-3})
    on_disk = MeasuredTimes(str(tmp_path))
    assert on_disk.times("gpu", "fw a") == {"x": 1e-3} and on_disk.times("gpu", "fw b") == {"x": 2e-3, "y": 4e-3}


def test_the_public_call_times_each_new_problem_once(cache, timed):
    q, k, v = qkv(2)
    with fmha_ops.autotune():
        out = fmha_ops.memory_efficient_attention(q, k, v, fmha_ops.LowerTriangularMask())
        first = len(timed)
        fmha_ops.memory_efficient_attention(q, k, v, fmha_ops.LowerTriangularMask())
        fmha_ops.memory_efficient_attention_forward(q, k, v, fmha_ops.LowerTriangularMask())
    assert first == 3 and len(timed) == 3 and set(timed) == {"sdpa_flashF", "sdpa_mathF", "torch_referenceF"}, timed
    ref = fmha_ops.memory_efficient_attention(q, k, v, fmha_ops.LowerTriangularMask(), op="torch_referenceF")
    assert torch.allclose(out, ref, atol=1e-5)
    assert "measured here" not in str(fmha_ops.explain(q, k, v, fmha_ops.LowerTriangularMask()))
    with fmha_ops.autotune():
        assert "measured here" in str(fmha_ops.explain(q, k, v, fmha_ops.LowerTriangularMask()))


def test_a_deterministic_call_is_measured_apart(cache, timed):
    """Deterministic mode picks other kernels (and other speeds) for the same shapes: its problem has measurements
    of its own, in memory and on disk."""
    q, k, v = qkv(10)
    with fmha_ops.autotune():
        fmha_ops.memory_efficient_attention(q, k, v)
        first = len(timed)
        torch.use_deterministic_algorithms(True)
        try:
            fmha_ops.memory_efficient_attention(q, k, v)
        finally:
            torch.use_deterministic_algorithms(False)
    assert first >= 2 and len(timed) > first, timed


def test_forced_ops_are_never_timed_or_overridden(cache, timed):
    q, k, v = qkv(3)
    with fmha_ops.autotune():
        fmha_ops.memory_efficient_attention(q, k, v, op="sdpa_mathF")
        with fmha_ops.use_ops("torch_referenceF"):
            fmha_ops.memory_efficient_attention(q, k, v)
    assert timed == []


def test_the_environment_switch_and_a_block_that_turns_it_off(cache, timed, monkeypatch):
    q, k, v = qkv(4)
    monkeypatch.setenv("FMHA_OPS_AUTOTUNE", "1")
    SELECTOR.refresh_env()
    with fmha_ops.autotune(False):
        fmha_ops.memory_efficient_attention(q, k, v)
    assert timed == []
    fmha_ops.memory_efficient_attention(q, k, v)
    assert len(timed) == 3


def test_nothing_is_timed_under_a_torch_compile_trace(cache, timed):
    q, k, v = qkv(5)
    fn = torch.compile(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v), backend="eager", fullgraph=True)
    with fmha_ops.autotune():
        out = fn(q, k, v)
    assert timed == []
    assert torch.allclose(out, fmha_ops.memory_efficient_attention(q, k, v, op="torch_referenceF"), atol=1e-5)


class SecondReferenceBw(ReferenceBwOp):
    """A second backward op on the CPU (torch_referenceB is the only one), so there is a backward to choose."""

    NAME = "test_referenceB"


#: seconds the fake timing of ``grad_ops`` gives ops other than the test ops (1 ms when not listed)
FASTEST: dict[str, float] = {}


@pytest.fixture
def grad_ops(monkeypatch):
    """The test forward and backward registered for the test; fake timings that make them the fastest."""
    from fmha_ops.dispatch import REGISTRY

    for op in (NoAutogradFw, SecondReferenceBw):
        monkeypatch.setitem(REGISTRY._ops, op.NAME, op)
        monkeypatch.setitem(REGISTRY._names, op.NAME, op)
    names = []

    def fake(fns, device):
        for fn in fns.values():
            fn()
        names.append(sorted(fns))
        return {name: 1e-6 if name.startswith("test_") else FASTEST.get(name, 1e-3) for name in fns}
    monkeypatch.setattr(timing, "calls_seconds", fake)
    SELECTOR.clear()
    yield names
    monkeypatch.undo()
    SELECTOR.clear()


def test_a_call_that_needs_gradients_times_its_forward_then_its_backward_ops(cache, grad_ops):
    q, k, v = (t.requires_grad_() for t in qkv(6))
    mask = fmha_ops.LowerTriangularMask()
    with fmha_ops.autotune():
        out = fmha_ops.memory_efficient_attention(q, k, v, mask)
        out.sum().backward()
        inp = fmha_ops.make_inputs(q, k, v, mask)
        inp.validate()
        backward = SELECTOR.explain(inp.problem(False), "bw")
    assert grad_ops == [["sdpa_flashF", "sdpa_mathF", "test_no_autogradF", "torch_referenceF"],
                        ["test_referenceB", "torch_referenceB"]], grad_ops
    assert backward.selected is SecondReferenceBw and backward.verdicts[0].source == "measured here", str(backward)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = fmha_ops.memory_efficient_attention(*leaves, mask, op="torch_referenceF")
    want.sum().backward()
    assert torch.allclose(out, want, atol=1e-5)
    for got, ref in zip((q, k, v), leaves):
        assert torch.allclose(got.grad, ref.grad, atol=1e-5)


def test_the_backward_ops_are_timed_on_a_forward_that_returns_the_lse(cache, grad_ops, monkeypatch):
    """The fastest forward here, sdpa_mathF, differentiates itself and returns no LSE: the backward ops are timed on
    the output and LSE of the fastest forward that pairs with them."""
    monkeypatch.setitem(FASTEST, "sdpa_mathF", 1e-9)
    q, k, v = (t.requires_grad_() for t in qkv(9))
    with fmha_ops.autotune():
        fmha_ops.memory_efficient_attention(q, k, v).sum().backward()
    assert grad_ops[1] == ["test_referenceB", "torch_referenceB"] and q.grad is not None, grad_ops


@pytest.mark.parametrize("fn", ["fp8_attention", "i8fp8_attention"])
def test_a_quantized_call_times_its_backward_ops_at_its_backward(cache, grad_ops, fn):
    """fp8_attention's backward (bf16 at the dequantized inputs) times the backward ops on the gradient it is given."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 17, 2, 16, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))
    with fmha_ops.autotune():
        out = getattr(fmha_ops, fn)(q, k, v, causal=True)
        out.backward(torch.randn_like(out))
    assert grad_ops[-1] == ["test_referenceB", "torch_referenceB"] and torch.isfinite(q.grad.float()).all(), grad_ops


def test_the_backward_call_times_the_backward_ops_on_its_own_tensors(cache, grad_ops):
    q, k, v = qkv(8)
    out, lse = fmha_ops.memory_efficient_attention_forward_requires_grad(q, k, v)
    grad = torch.ones_like(out)
    want = fmha_ops.memory_efficient_attention_backward(grad, out, lse, q, k, v, op="torch_referenceB")
    with fmha_ops.autotune():
        got = fmha_ops.memory_efficient_attention_backward(grad, out, lse, q, k, v)
    assert grad_ops == [["test_referenceB", "torch_referenceB"]], grad_ops
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


def test_the_timing_interleaves_the_ops_and_sizes_rounds_by_their_cost():
    from fmha_ops import timing

    order = []
    fns = {"slow": lambda: order.append("slow") or sum(range(20000)), "fast": lambda: order.append("fast")}
    seconds = timing.calls_seconds(fns, "cpu")
    assert seconds["slow"] > seconds["fast"] > 0
    timed = order[4:]  # after each op's warm and sizing calls
    switches = sum(a != b for a, b in zip(timed, timed[1:]))
    assert switches >= timing.TUNE_ROUNDS, "rounds alternate between the ops"
    assert order.count("fast") > order.count("slow"), "a cheaper call gets more calls per round"


def test_a_decode_step_with_an_append_is_timed_without_the_write(cache, timed, monkeypatch):
    """flash_attn_with_kvcache under autotune, on its decode plan's path (paged, index tensors not read back): the
    contenders are timed as the step runs, the new tokens written once (by the call, none by the timed runs), and
    the result is the one without autotune."""
    from fmha_ops import checks
    from fmha_ops.kernels.triton import kv_append as append_kernel
    from fmha_ops.kv_cache import paged_from_dense

    monkeypatch.setattr(checks, "wanted", lambda *t: False)  # index tensors treated as a GPU's (the fast path)
    appends, append = [], append_kernel.KVAppender.__call__  # every append launch, one-shot or a plan's bound one
    monkeypatch.setattr(append_kernel.KVAppender, "__call__", lambda *a: appends.append(1) or append(*a))
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(3, 40, 2, 16, generator=g).to(torch.float16) for _ in range(2))
    (k_cache, v_cache), table = paged_from_dense([k, v], 8, generator=g)
    q, new_k, new_v = (torch.randn(3, 1, h, 16, generator=g).to(torch.float16) for h in (4, 2, 2))
    lens = torch.tensor([1, 17, 30], dtype=torch.int32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = fmha_ops.flash_attn_with_kvcache(q, want_k, want_v, k=new_k, v=new_v, cache_seqlens=lens, page_table=table,
                                           causal=True)
    appends.clear()
    with fmha_ops.autotune():
        got = fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, k=new_k, v=new_v, cache_seqlens=lens,
                                              page_table=table, causal=True)
    assert len(timed) >= 2 and appends == [1], (timed, appends)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert (got.float() - want.float()).abs().max().item() < 1e-3


def test_an_op_forced_by_the_environment_is_never_timed(cache, timed, monkeypatch):
    q, k, v = qkv(7)
    monkeypatch.setenv("FMHA_OPS_FORCE", "torch_referenceF")
    SELECTOR.refresh_env()
    with fmha_ops.autotune():
        fmha_ops.memory_efficient_attention(q, k, v)
        assert fmha_ops.explain(q, k, v).selected.NAME == "torch_referenceF"
    assert timed == []


@pytest.mark.gpu
def test_gpu_nothing_is_timed_under_a_cuda_graph_capture(cache, timed):
    """A call first made under autotune inside a CUDA-graph capture times nothing (the timed calls would be
    captured): the table's op is captured, and the replay gives its result."""
    q, k, v = (torch.randn(2, 256, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    want = fmha_ops.memory_efficient_attention(q, k, v)  # outside the block: the table's op, compiled
    graph = torch.cuda.CUDAGraph()
    with fmha_ops.autotune():
        with torch.cuda.graph(graph):
            out = fmha_ops.memory_efficient_attention(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert timed == [] and torch.allclose(out, want, atol=1e-3)


@pytest.mark.gpu
def test_gpu_autotune_times_the_contenders_and_runs_the_fastest(cache):
    q, k, v = (torch.randn(3, 1500, 12, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bias = fmha_ops.LowerTriangularFromBottomRightMask()
    with fmha_ops.autotune():
        out = fmha_ops.memory_efficient_attention(q, k, v, bias)
        report = fmha_ops.explain(q, k, v, bias)
    measured = [v for v in report.verdicts if v.ok and v.source == "measured here"]
    fastest = min(v.estimate for v in measured)
    chosen = [v for v in measured if v.op is report.selected]
    assert len(measured) >= 2 and chosen and chosen[0].estimate <= (1 + select.TIE_MARGIN) * fastest, str(report)
    ref = fmha_ops.memory_efficient_attention(q, k, v, bias, op="torch_referenceF")
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_gpu_a_call_with_gradients_times_its_backward_ops(cache):
    """bf16 with gradients under autotune: the backward ops that pair with a forward are timed at the call (at least
    two on the H200: triton_attnB and cudnnB / fa4B / fa3B where installed), the backward selected is the fastest
    measured, and the gradients match the reference's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1000, 8, 128, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    bias = fmha_ops.LowerTriangularFromBottomRightMask()
    with fmha_ops.autotune():
        fmha_ops.memory_efficient_attention(q, k, v, bias).float().square().sum().backward()
        inp = fmha_ops.make_inputs(q, k, v, bias)
        inp.validate()
        report = SELECTOR.explain(inp.problem(), "bw")
    measured = [v for v in report.verdicts if v.ok and v.source == "measured here"]
    assert len(measured) >= 2 and report.verdicts[0] in measured, str(report)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    fmha_ops.memory_efficient_attention(*leaves, bias, op="torch_referenceF").square().sum().backward()
    for got, ref in zip((q, k, v), leaves):
        assert torch.nn.functional.cosine_similarity(got.grad.float().flatten(), ref.grad.flatten(), 0) > 0.999
