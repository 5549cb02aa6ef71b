"""Fuzz of the public API with fixed seeds (tests/fuzz): every public function, through the reference, SDPA
and Triton (interpreter) ops at tiny sizes, each call in a forked worker so a crash is counted, not fatal.

Asserts: >= 2000 invalid and >= 300 valid calls; no call crashes or hangs; >= 98% of the invalid calls that
are not leniently accepted raise a clear error (ValueError / TypeError / NotImplementedError naming the
argument); no invalid call is accepted with a wrong result; every valid call matches the float64
reference. ``pytest -s`` prints the classification table; ``python -m tests.fuzz`` runs it as a script.
"""
from __future__ import annotations

import os

import pytest
import torch

MIN_INVALID, MIN_VALID = 2000, 300
MIN_CLEAR_RATE = 0.98
SHOWN = 40  # failing calls listed in an assertion message


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fuzz isolates calls in forked workers")
@pytest.mark.skipif(torch.cuda.is_available(), reason="fuzzes the CPU paths (Triton through the interpreter)")
def test_fuzz_public_api():
    from tests.fuzz.runner import run
    from tests.fuzz.suite import all_cases

    results = run(all_cases(), workers=2)
    print("\n" + results.report(limit=SHOWN))
    invalid, valid = results.total(valid=False), results.total(valid=True)

    def listed(*categories):
        return "\n".join(f"[{o.category}] {c.name}: {o.detail}" for c, o in results.failures(categories)[:SHOWN])

    assert sum(invalid.values()) >= MIN_INVALID and sum(valid.values()) >= MIN_VALID, results.table()
    assert invalid["crash"] + valid["crash"] == 0, listed("crash")
    assert invalid["silent wrong"] == 0, listed("silent wrong")
    assert valid["wrong"] + valid["error"] == 0, listed("wrong", "error")
    assert results.clear_rate() >= MIN_CLEAR_RATE, listed("unclear")
