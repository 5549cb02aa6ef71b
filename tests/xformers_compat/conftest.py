"""xformers 0.0.35's own attention tests, run against fmha_ops.

``test_mem_eff_attention.py`` and ``utils.py`` are xformers' files unchanged; ``test_fmha_merge_attentions.py``
is xformers' file with the edits its header lists (BSD licence: ``LICENSE.xformers``). Two ways in:

- Tests parametrized over ``xformers.ops.fmha.ALL_FW_OPS`` / ``ALL_BW_OPS`` (``test_forward``,
  ``test_logsumexp``, ``test_backward``, ``test_lowlevel_api_shapes``, ``test_empty_tensors_*``, ...):
  this file appends our ops there before the module is imported, as xformers op classes
  (``fmha_ops.xformers_ops``), so xformers' shape generator, mask builder (``create_attn_bias``, xformers'
  own mask objects), reference and tolerances test our ops through xformers' API. On the CPU the
  selector's ops (``fmha_opsF`` / ``fmha_opsB``: SDPA or the reference there); on a GPU also the Triton
  forward and backward.
- The mask tests (``OWN_MASK_TESTS``) build masks with ``fmha.attn_bias``: they run with the test module's
  ``fmha`` / ``xformers`` names pointing at fmha_ops (``attn_bias``, the attention functions).

Every other test exercises xformers' own kernels or dispatcher and is deselected.

Sampling (CI's time budget): the op-parametrized cases fall into groups of one test, op, device, dtype and mask type
(tests without those parameters: one group per test); each group keeps ``ceil(n / XFORMERS_COMPAT_SAMPLE)``
of its n cases (at least one), the ones with the smallest CRC-32 of ``XFORMERS_COMPAT_SEED`` + test id. So
every mask type and dtype stays and a seeded subset of shapes / layouts runs; sampled runs leave xformers'
large shapes on the CPU out (``CPU_MAX_HEADS``, ``CPU_MAX_LEN``). Defaults: 1 in 16 on the CPU, 1 in 4 on a GPU;
``XFORMERS_COMPAT_SAMPLE=1`` runs every case. Cases on a CUDA device carry the ``gpu``
marker (``pytest -m gpu tests/xformers_compat`` on the GPU; CI runs ``-m "not gpu"``).

A refusal by our op is a skip whose reason names the op and "unsupported"; the terminal summary counts
passed / refused / failed / skipped per mask type. On CUDA every test waits for its kernels before it ends
(``pytest_runtest_call``), so an asynchronous CUDA error fails the test that caused it.
"""
from __future__ import annotations

import collections
import os
import re
import types
import warnings
import zlib

import pytest
import torch

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # xformers warns that its C++ extension does not load here
        import xformers
        from xformers.ops import fmha
except ImportError:
    fmha = None
    collect_ignore_glob = ["test_*.py"]

HERE = os.path.dirname(os.path.abspath(__file__))
HAS_CUDA = torch.cuda.is_available()
#: one case in SAMPLE of each group runs (1: all); SEED picks which
SAMPLE = int(os.environ.get("XFORMERS_COMPAT_SAMPLE", "4" if HAS_CUDA else "16"))
SEED = os.environ.get("XFORMERS_COMPAT_SEED", "0")
#: test sizes of our op classes (xformers' defaults: batch 1 and 300, K 32 and 128)
TEST_BATCH_SIZES, TEST_K = [1, 3], [16, 64]
#: xformers tests of the attn_bias API (no op parameter), run with fmha_ops' attn_bias
OWN_MASK_TESTS = {
    "test_attn_bias_causal", "test_attn_bias_torch_tensor", "test_attn_bias_blockdiag",
    "test_attn_bias_blockdiag_batched", "test_attn_bias_blockdiag_crossattn_causal",
    "test_attn_bias_blockdiag_crossattn_causal_with_prefix_qk_cond",
    "test_attn_bias_blockdiag_crossattn_causal_with_prefix", "test_attn_bias_from_seqlens", "test_local_attn_bias",
    "test_window_size_materialize", "test_attn_bias_padded", "test_attn_bias_blockdiag_doc",
    "test_merge_attentions_against_ref",  # test_fmha_merge_attentions.py: fmha_ops' merge_attentions alone
}
#: op-parametrized tests that assert xformers' ops refuse something ours runs (the CPU)
NOT_APPLICABLE = {"test_unsupported_cpu"}
OUR_NAMES: set[str] = set()

if fmha is not None:
    import fmha_ops
    from fmha_ops import xformers_ops

    OURS_FW = [xformers_ops.FwOp] + ([xformers_ops.fw_op("triton_attnF")] if HAS_CUDA else [])
    OURS_BW = [xformers_ops.BwOp] + ([xformers_ops.bw_op("triton_attnB")] if HAS_CUDA else [])
    for op in OURS_FW + OURS_BW:
        op._TEST_BATCH_SIZES, op._TEST_K = TEST_BATCH_SIZES, TEST_K
    fmha.ALL_FW_OPS.extend(OURS_FW)
    fmha.ALL_BW_OPS.extend(OURS_BW)
    OUR_NAMES = {op.NAME for op in OURS_FW + OURS_BW}
    xformers_ops.install()  # xformers' dispatcher tries ours first (op=None calls inside the tests)

    _OURS = {name: getattr(fmha_ops, name) for name in (
        "memory_efficient_attention", "memory_efficient_attention_forward", "memory_efficient_attention_partial",
        "memory_efficient_attention_forward_requires_grad", "memory_efficient_attention_backward",
        "merge_attentions", "BlockDiagonalMask", "LowerTriangularMask")}
    FMHA_AS_OURS = types.SimpleNamespace(**{**vars(fmha), **_OURS, "attn_bias": fmha_ops.attn_bias})
    XFORMERS_AS_OURS = types.SimpleNamespace(ops=types.SimpleNamespace(**{**vars(xformers.ops), **_OURS,
                                                                         "fmha": FMHA_AS_OURS}))

# ids look like test_forward[fmha_opsF-cpu-torch.float32-BlockDiagonalMask-1-32-32-1-16-16-BMHK]
_CASE = re.compile(r"\[(?P<op>.+?)-(?P<device>cpu|cuda)-(?P<dtype>torch\.\w+)-(?P<bias>\w+)-"
                   r"(?:(?P<b>\d+)-(?P<mq>\d+)-(?P<mkv>\d+)-(?P<h>\d+)-)?")
#: sampled CPU runs leave xformers' large shapes (its 300 / 2600-head batches, 65537-key rows: minutes in the
#: CPU reference's per-sequence loops) to the GPU run and to XFORMERS_COMPAT_SAMPLE=1
CPU_MAX_HEADS, CPU_MAX_LEN = 256, 16384


def _here(item) -> bool:
    return str(item.path).startswith(HERE)


def _mentions_ours(item) -> bool:
    params = getattr(item, "callspec", None)
    return params is not None and any(getattr(v, "NAME", None) in OUR_NAMES or (
        isinstance(v, tuple) and v and getattr(v[0], "NAME", None) in OUR_NAMES) for v in params.params.values())


def _group(item) -> tuple:
    m = _CASE.search(item.name)
    return (item.originalname, m["op"], m["device"], m["dtype"], m["bias"]) if m else (item.originalname,)


def _large_on_cpu(item) -> bool:
    m = _CASE.search(item.name)
    return bool(m and m["device"] == "cpu" and m["b"] and (
        int(m["b"]) * int(m["h"]) > CPU_MAX_HEADS or max(int(m["mq"]), int(m["mkv"])) > CPU_MAX_LEN))


def _sampled(items: list) -> set:
    """Node ids kept: ceil(n / SAMPLE) of each group's n items, by their seeded hash (sampling: none of
    xformers' large shapes on the CPU)."""
    groups = collections.defaultdict(list)
    for item in items:
        if SAMPLE == 1 or not _large_on_cpu(item):
            groups[_group(item)].append(item.nodeid)
    keep = set()
    for ids in groups.values():
        ids.sort(key=lambda nodeid: zlib.crc32(f"{SEED}:{nodeid}".encode()))
        keep.update(ids[:-(-len(ids) // SAMPLE)])
    return keep


def pytest_collection_modifyitems(config, items):
    """In this folder: our ops' cases (sampled) and the mask tests; the rest exercise xformers' kernels."""
    ours = [item for item in items if _here(item) and item.originalname not in OWN_MASK_TESTS
            and _mentions_ours(item) and item.originalname not in NOT_APPLICABLE]
    sampled = _sampled(ours)
    keep, drop = [], []
    for item in items:
        if not _here(item):
            keep.append(item)
        elif item.originalname in OWN_MASK_TESTS or item.nodeid in sampled:
            if "-cuda-" in item.name:
                item.add_marker(pytest.mark.gpu)
            keep.append(item)
        else:
            drop.append(item)
    items[:] = keep
    if drop:
        config.hook.pytest_deselected(items=drop)


@pytest.fixture(autouse=True)
def _masks_are_ours(request, monkeypatch):
    """The mask tests see fmha_ops where they say ``fmha`` / ``xformers.ops``."""
    if request.node.originalname in OWN_MASK_TESTS:
        monkeypatch.setattr(request.module, "fmha", FMHA_AS_OURS)
        monkeypatch.setattr(request.module, "xformers", XFORMERS_AS_OURS, raising=False)
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """On CUDA, wait for the test's kernels inside its call phase: an asynchronous CUDA error (a fault) fails the
    test that launched the kernel, counted under its mask type, not a later test of the same worker."""
    result = yield
    if HAS_CUDA and _here(item):
        torch.cuda.synchronize()
    return result


_RESULTS: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
    if not report.nodeid.startswith("tests/xformers_compat/") or (
            report.when != "call" and not (report.when == "setup" and report.skipped)):
        return
    m = _CASE.search(report.nodeid)
    bias = m["bias"] if m else "(attn_bias API tests)" if report.nodeid.split("::")[-1].split("[")[0] in \
        OWN_MASK_TESTS else "(no mask parameter)"
    if report.skipped:
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
        outcome = "refused" if "unsupported" in reason and any(n in reason for n in OUR_NAMES) else "skipped"
    else:
        outcome = report.outcome
    _RESULTS[(bias, outcome)] += 1


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    terminalreporter.section("xformers tests against fmha_ops, per mask type")
    for b in sorted({b for b, _ in _RESULTS}):
        counts = ", ".join(f"{n} {o}" for o in ("passed", "refused", "failed", "skipped") if (n := _RESULTS[(b, o)]))
        terminalreporter.write_line(f"{b}: {counts}")
