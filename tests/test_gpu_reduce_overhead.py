"""torch.compile(mode="reduce-overhead") (CUDA graphs) of the prefill and training calls, compiled in a process that
made no eager call before: forward and forward + backward of ``memory_efficient_attention(op=("triton_attnF",
"triton_attnB"))`` and of ``fp8_attention``, against eager.

CUDA graph trees run the first calls of a compiled function in the graph's memory pool and fail the capture when a
tensor allocated there outlives the call without being an output (a device tensor the host path caches on first
use). An eager call earlier in the process would have made such a cache outside the pool and hidden the fault, so
the compiled calls run in a fresh interpreter, all of them before any eager call, and the eager references after.
"""
from __future__ import annotations

import json

import pytest

from tests.compiled_child import run_compiled

pytestmark = pytest.mark.gpu

#: compiled calls per case: the first runs in the pool (warm-up), the second records the graph, the third replays it
CALLS = 3
_SCRIPT = r"""
import json, sys
import torch
import torch._inductor.config
import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.testing import normal_qkv
from torch._dynamo.utils import counters

B, M, HQ, HKV, D = 2, 200, 4, 2, 64  # a partial last tile (200 = 3 * 64 + 8), GQA 2
calls = int(sys.argv[1])
torch._inductor.config.compile_threads = 1  # a few tiny kernels: no compile worker pool to start
q, k, v = normal_qkv((B, M, HQ, D), (B, M, HKV, D), dtype=torch.bfloat16, device="cuda")
do = torch.randn_like(q)
mask = ab.LowerTriangularMask()
cases = {
    "triton_attnF": lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, mask,
                                                                        op=("triton_attnF", "triton_attnB")),
    "fp8_attention": lambda q, k, v: fmha_ops.fp8_attention(q, k, v, causal=True),
}

def run(fn, grad):
    xs = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs, do) if grad else ()
    return [t.detach().clone() for t in (out, *grads)]

compiled, errors = {}, {}
for name, fn in cases.items():
    for grad in (False, True):
        label = f"{name} {'forward + backward' if grad else 'forward'}"
        step = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
        try:
            for _ in range(calls):
                torch.compiler.cudagraph_mark_step_begin()
                compiled[label] = run(step, grad)
            torch.cuda.synchronize()
        except Exception as e:  # the capture's error, reported per case
            errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
skips = counters["inductor"]["cudagraph_skips"]
result = {}
for name, fn in cases.items():
    for grad in (False, True):
        label = f"{name} {'forward + backward' if grad else 'forward'}"
        if label in errors:
            result[label] = {"error": errors[label]}
            continue
        want = run(fn, grad)
        result[label] = {"max_abs_diff": [(g.float() - w.float()).abs().max().item()
                                          for g, w in zip(compiled[label], want)],
                         "scale": [w.float().abs().max().item() for w in want]}
print(json.dumps({"cudagraph_skips": skips, "cases": result}))
"""

#: compiled and eager run the same kernels on the same inputs; allow a few bf16 ulps of the largest value
REL_TOL = 4 * 2.0 ** -8


@pytest.fixture(scope="module")
def reduce_overhead_results() -> dict:
    r = run_compiled(_SCRIPT, str(CALLS))
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_reduce_overhead_captures_every_call(reduce_overhead_results):
    """No call fell back to eager (a skipped CUDA graph would pass the value checks below)."""
    assert reduce_overhead_results["cudagraph_skips"] == 0


@pytest.mark.parametrize("case", ["triton_attnF forward", "triton_attnF forward + backward", "fp8_attention forward",
                                  "fp8_attention forward + backward"])
def test_reduce_overhead_without_eager_call_matches_eager(reduce_overhead_results, case):
    r = reduce_overhead_results["cases"][case]
    assert "error" not in r, r.get("error")
    for diff, scale in zip(r["max_abs_diff"], r["scale"]):
        assert scale > 0 and diff <= REL_TOL * scale, (case, r)
