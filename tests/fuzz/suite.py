"""Every fuzz case, in a fixed order (the CI test runs them all)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before fmha_ops registers the Triton ops (CPU machines)

from . import cases_attention, cases_cache, cases_flash, cases_helpers  # noqa: E402
from .runner import Case  # noqa: E402


def all_cases() -> list[Case]:
    cases = cases_attention.valid_cases() + cases_attention.invalid_cases()
    for make in (cases_flash.flash_cases, cases_flash.varlen_cases, cases_flash.quantized_cases,
                 cases_flash.merge_cases, cases_cache.kvcache_cases, cases_cache.builder_cases,
                 cases_helpers.quant_cases, cases_helpers.mask_cases):
        valid, invalid = make()
        cases += valid + invalid
    seen = set()
    for c in cases:
        if c.name in seen:
            raise AssertionError(f"duplicate fuzz case name {c.name}")
        seen.add(c.name)
    return cases
