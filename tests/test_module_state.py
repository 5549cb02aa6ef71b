"""The module-level state of ``fmha_ops`` is the plan cache and what holds no call.

Every memoized function (``functools.cache`` / ``lru_cache``) and every module-level container made empty and filled
at run time is listed here with why it may stay: a repeated call's work belongs to its plan (``fmha_ops.plans``,
one bounded LRU cleared with the selector's memo), so a new cache of calls fails this test instead of growing
beside it. Constant tables (a literal dict of values) are not state and are not listed.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fmha_ops")
#: what a container made empty at module level is built by
_EMPTY_CALLS = frozenset({"dict", "set", "list", "collections.OrderedDict", "OrderedDict", "collections.defaultdict",
                          "defaultdict", "weakref.WeakKeyDictionary", "weakref.WeakValueDictionary"})

#: the decode split count's wave model: 3-27 us per call uncached on the CPU (bf16 3 us; fp8 8 us at B8 L8192, 27 us at
#: B1 L131072), run by every decode call of ``memory_efficient_attention`` (a paged mask checks its index values per
#: call, so those calls take the full path and the op's ``apply``, with no plan to hold the count) and by each selection
SPLIT_MEMO = ("a bounded memo of a pure function of a few ints (nothing of a call's tensors): the decode split "
              "count, 3-27 us uncached per full-path decode call")
COMPILED = "compiled kernels or their launch layouts (the compiled-kernel caches)"
DEVICE = "a property or resource per device (the arch cache's kind: a handful of entries per process)"
PROBE = "a lazy import or package probe, answered once per process"
ALLOWED = {
    "api._merge_kernel": PROBE,
    "checks._env": "the environment's check-mode switch (FMHA_OPS_CHECK), read by refresh_env",
    "context_parallel.ring._STREAMS": DEVICE,
    "kernels.flydsl.launcher._COMPILED": COMPILED,
    "kernels.gluon.attention_fwd_ws._SM_COUNT": DEVICE,
    "kernels.gluon.attention_fwd_ws._host_box": COMPILED,
    "kernels.tile_counter._PAIRS": DEVICE + ": the tile counters of each stream",
    "kernels.triton.decode._asm_cvt": DEVICE,
    "kernels.triton.decode.programmatic_launch": DEVICE,
    "kernels.triton.launch._KERNELS": COMPILED,
    "ops.aliases._WARNED": "the xformers names already warned about (each warns once)",
    "ops.cudnn_graphs.cudnn_package_reason": PROBE,
    "ops.fa3.forward_kernel": PROBE,
    "ops.fa3.interface": PROBE,
    "ops.fa4.fa4_package_reason": PROBE,
    "ops.gluon_decode._split_count": SPLIT_MEMO,
    "ops.triton_decode._split_count": SPLIT_MEMO,
    "timing._CYCLES_PER_S": "the sleep kernel's clock, measured once",
    "xformers_ops._op_class": "the xformers op class made for each of our ops (one class per name, kept for identity)",
    "xformers_ops._xformers": PROBE,
}


def _is_empty_container(value: ast.expr) -> bool:
    if isinstance(value, ast.Dict):
        return not value.keys
    if isinstance(value, (ast.List, ast.Set)):  # [] or a switch of one item ([False]), not a one-name __all__
        return not value.elts or (len(value.elts) == 1 and isinstance(value.elts[0], ast.Constant)
                                  and not isinstance(value.elts[0].value, str))
    return isinstance(value, ast.Call) and ast.unparse(value.func) in _EMPTY_CALLS and not value.args


def module_state() -> set[str]:
    """``module.name`` (under fmha_ops) of every memoized function and every module-level container made empty."""
    found = set()
    for folder, _, files in os.walk(ROOT):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if any("cache" in ast.unparse(d) for d in node.decorator_list):
                        found.add(f"{module}.{node.name}")
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if _is_empty_container(node.value):
                        found |= {f"{module}.{t.id}" for t in targets if isinstance(t, ast.Name)}
    return found


def test_module_state_is_the_plan_cache_and_what_holds_no_call():
    found = module_state()
    new = sorted(found - set(ALLOWED))
    assert not new, (f"module-level state {new}: keep what a repeated call may skip in its plan (fmha_ops.plans); "
                     f"state that holds no call goes in ALLOWED with why")
    assert not set(ALLOWED) - found, f"listed but gone: {sorted(set(ALLOWED) - found)}"


#: values derived from a call that the plan cache holds (or that are made per call) instead of a memo of their own
HELD_BY_PLANS = ("attn_bias._uniform_queries", "compiled._host_seqinfo", "context_parallel.schedule.geometry",
                 "integrations.transformers._causal_mask")


def test_call_derived_values_have_no_memo_of_their_own():
    assert not set(HELD_BY_PLANS) & module_state()
