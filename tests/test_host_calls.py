"""The hit path of every GPU row of ``bench/host_time.py`` does no more Python work than it does today: per row, one
repeated public call after warm-up enters at most ``PYTHON_CALLS`` Python functions and calls at most ``C_CALLS`` C
functions (``bench/host_calls.py``: the H100's op forced, its kernel stubbed, on the CPU). Counts, not times, so
a regression fails on any machine; a change that lowers a count lowers its budget here."""
from __future__ import annotations

import pytest

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


