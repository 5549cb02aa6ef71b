"""``bench/host_time.py``'s rows time the same work on both sides, so ``ours - direct`` is the call path's host cost:
on the CPU rows the direct call runs the aten operations ours runs (the BHMK views any caller with BMHK tensors
makes included), and each decode row's direct launch binds the decoder ours binds."""
from __future__ import annotations

import collections
from unittest import mock

import pytest
import torch

import fmha_ops
from bench import host_calls, host_time

#: CPU rows whose direct side is not the op's launch plan on the call's own tensors, and why
NOT_ALIKE = {
    "merge_attentions (2 parts)": "direct is the merge's plain arithmetic; ours also reads the host LSEs and keeps "
                                  "parts of -inf LSE out of the sum",
    "flash_attn_varlen_func causal": "direct takes the batch-1 tensors; ours makes those views of the packed ones",
}


def _aten_ops(fn) -> collections.Counter:
    """The aten operations one call of ``fn`` runs (after two warm-up calls: plans made)."""
    fn()
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


@pytest.fixture(scope="module")
def cpu_rows():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield host_time.cases("cpu")
    finally:
        torch.set_num_threads(threads)


def test_every_cpu_row_is_named(cpu_rows):
    assert set(NOT_ALIKE) <= {row[0] for row in cpu_rows}


def test_cpu_rows_run_the_same_aten_operations_on_both_sides(cpu_rows):
    for label, op, ours, direct, _ in cpu_rows:
        if label not in NOT_ALIKE:
            assert _aten_ops(ours) == _aten_ops(direct), (label, op)


def test_kvcache_rows_bind_the_same_decoder_on_both_sides():
    """Each decode row launches, on its direct side, the decoder ours binds (LSE or not, the lengths'
    offset, sinks, key starts), so a row times one decoder, not two. The op is forced and its launch and the append
    kernel stubbed, so the GPU rows run on the CPU."""
    from fmha_ops import kvcache_call
    from fmha_ops.kernels.triton import kv_append

    kinds = []

    def launch(q, k_cache, v_cache, k_scale, v_scale, seqlens, table, out, lse, seqlen_offset=0, sinks=None,
               key_start=None):
        kinds.append((lse is None, seqlen_offset, sinks is None, key_start is None))

    class Appender:  # the append kernel's bound launch (``kvcache_call.decode_run`` makes one)
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, *args):
            pass

    op = fmha_ops.REGISTRY.get("triton_decoderF")
    with (host_calls.forced(op.NAME),
          mock.patch.object(op, "decode_launcher", classmethod(lambda cls, *a, **kw: launch)),
          mock.patch.object(kvcache_call.checks, "wanted", lambda *t: False),
          mock.patch.object(kv_append, "kv_append", lambda *a, **kw: None),
          mock.patch.object(kv_append, "KVAppender", Appender)):
        rows = host_time._kvcache_rows("cpu")
        assert len(rows) == 3
        for label, _, ours, direct, _ in rows:
            seen = []
            for side in (ours, direct):
                kinds.clear()
                side()
                side()  # ours: the second call runs the stored plan
                seen.append(kinds[-1])
            assert seen[0] == seen[1], (label, "ours", seen[0], "direct", seen[1])


@pytest.mark.gpu
def test_gpu_rows_run_the_same_aten_operations_on_both_sides():
    """On the GPU the rows' two sides run the same aten operations too (kernel launches of Triton and of the
    extensions are no aten operations: this compares the views, allocations and torch kernels around them)."""
    for label, op, ours, direct, _ in host_time.cases("cuda"):
        if label not in NOT_ALIKE:
            assert _aten_ops(ours) == _aten_ops(direct), (label, op)
