"""The hit path of every GPU row of ``bench/host_time.py`` does no more Python work than it does today: per row, one
repeated public call after warm-up enters at most ``PYTHON_CALLS`` Python functions and calls at most ``C_CALLS`` C
functions (``bench/host_calls.py``: the H100's op forced, its kernel stubbed, on the CPU). Counts, not times, so
a regression fails on any machine; a change that lowers a count lowers its budget here."""
from __future__ import annotations

from unittest import mock

import pytest

import fmha_ops

from bench import host_calls

#: row -> (Python functions entered, C functions called) by one repeated call of ours, the harness's own lambda
#: and the stubbed launch included (bench/host_calls.py prints them)
BUDGETS = {
    "memory_efficient_attention causal -> sdpa_cudnnF": (8, 16),
    "memory_efficient_attention_forward -> sdpa_cudnnF": (8, 16),
    "flash_attn_func causal -> sdpa_cudnnF": (7, 15),
    "memory_efficient_attention op=sdpa_cudnnF": (8, 16),
    "flash_attn_varlen_func causal -> fa3F": (11, 17),  # 21 / 21 through batch-1 views and the generic launcher
    "flash_attn_func fp8 + descales -> fa3F": (8, 17),  # 17 / 28 through the generic launcher
    "merge_attentions (2 parts) -> triton merge": (9, 19),  # 14 / 15 with the parts listed again per call
    "flash_attn_with_kvcache paged decode -> triton_decoderF": (7, 14),
    "flash_attn_with_kvcache fp8 cache -> gluon_fp8_decodeF": (7, 16),
}


@pytest.fixture(scope="module")
def rows():
    return host_calls.rows()


def test_every_row_has_a_budget(rows):
    assert set(rows) == set(BUDGETS)


@pytest.mark.parametrize("label", list(BUDGETS))
def test_repeated_call_stays_within_its_call_budget(rows, label):
    ours, direct, spec = rows[label]
    with host_calls.installed(spec):
        python_calls, c_calls, names = host_calls.counted(ours)
        direct()  # the direct launch runs under the same stubs
    want_python, want_c = BUDGETS[label]
    assert python_calls <= want_python and c_calls <= want_c, (label, python_calls, c_calls, dict(names))



def test_host_time_kvcache_rows_bind_the_same_decoder_on_both_sides():
    """Each decode row of host_time.py launches, on its direct side, the decoder ours binds (LSE or not, the lengths'
    offset, sinks, key starts), so a row times one decoder, not two. The op is forced and its launch and the append
    kernel stubbed, so the GPU rows run on the CPU."""
    from bench import host_time
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
