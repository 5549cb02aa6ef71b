"""Every measured number the README, DESIGN.md and BENCHMARKS.md's findings quote comes from a benchmark record,
and every BENCHMARKS.md section the README or DESIGN.md names exists.

A quoted number is one written with a decimal point (``1.79x``, ``0.9996``, ``21.6 us``) or an integer with a unit
(``43-82 us``, ``52.3%``); shapes (``B64``, ``4x32/8x4096x128``), versions, counts and inline code are not. Each
must equal some number of the records in ``bench/results/`` (what ``bench/assemble_benchmarks.py`` builds
BENCHMARKS.md from) rounded to the digits it is quoted with, so a ratio copied from an older run, or one that
disagrees with its table, fails. A match anywhere in the records is accepted: the check catches stale and
mistyped numbers, not a number matched to the wrong row.
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import assemble_benchmarks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCED = re.compile(r"```.*?```", re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
#: a number or a range "a-b", not part of a name (D128, sm90) or a version (2.13.0), with an optional unit
QUOTED = re.compile(r"(?<![\w./])(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?(?![\d.]*\d)(x\b|%| us\b| ms\b| TB/s| TFLOP/s)?")
RECORD_NUMBER = re.compile(r"\d+(?:\.\d+)?")
#: a named BENCHMARKS.md section: BENCHMARKS.md's "Decode", BENCHMARKS.md, "Training"
SECTION_REF = re.compile(r"BENCHMARKS\.md(?:'s|,)\s+\"([^\"]+)\"")
#: the pages a newcomer reads, beside BENCHMARKS.md itself
DOCS = ("README.md", "DESIGN.md")


def quoted_numbers(text: str) -> list[str]:
    """The measured numbers of prose ``text`` (code blocks and inline code left out), as written."""
    text = INLINE_CODE.sub(" ", FENCED.sub(" ", text))
    found = []
    for m in QUOTED.finditer(text):
        for number in (m.group(1), m.group(2)):
            if number and ("." in number or m.group(3)):
                found.append(number)
    return found


def record_numbers() -> list[float]:
    """Every number in the records BENCHMARKS.md is assembled from (tables, notes and headers)."""
    numbers = []
    for name in assemble_benchmarks.ORDER:
        path = os.path.join(assemble_benchmarks.RESULTS, f"{name}.md")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                numbers += [float(n) for n in RECORD_NUMBER.findall(f.read())]
    return numbers


def unrecorded(text: str, records: list[float]) -> list[str]:
    """The quoted numbers of ``text`` that no record number rounds to at the quoted precision."""
    missing = []
    for number in quoted_numbers(text):
        digits = len(number.partition(".")[2])
        half = 0.5 * 10 ** -digits + 1e-9
        if not any(abs(r - float(number)) <= half for r in records):
            missing.append(number)
    return missing


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_quoted_numbers_parse_as_meant():
    text = ("fp8 at 1.21-1.35x cuDNN (813.3 TFLOP/s at D128), 43-82 us, 52.3%, B64/L4096, 4x32/8x4096x128, "
            "torch 2.13.0, 7 matmuls, `sm90 1.5x`, cosine 0.9996\n```\nx = 2.5\n```")
    assert quoted_numbers(text) == ["1.21", "1.35", "813.3", "43", "82", "52.3", "0.9996"]


def test_a_number_missing_from_the_records_is_reported():
    records = [1.789, 1.785, 21.55]
    assert unrecorded("1.79x and 1.78x, 21.6 us", records) == []
    assert unrecorded("1.72-1.87x, 21.4 us", records) == ["1.72", "1.87", "21.4"]


def test_benchmarks_findings_quote_their_records():
    findings = _read("bench", "findings.md")
    assert unrecorded(findings, record_numbers()) == []


def test_docs_quote_only_recorded_numbers():
    records = record_numbers()
    for doc in DOCS:
        assert unrecorded(_read(doc), records) == [], doc


def test_docs_name_existing_benchmarks_sections():
    headings = [ln[3:] for ln in _read("BENCHMARKS.md").splitlines() if ln.startswith("## ")]
    for doc in DOCS:
        names = [" ".join(n.split()) for n in SECTION_REF.findall(_read(doc))]
        assert doc != "README.md" or names, "the README points at the tables its claims come from"
        for name in names:
            assert any(h.startswith(name) for h in headings), (doc, name, headings)
