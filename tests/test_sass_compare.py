"""``bench/diagnostics/sass_compare.py`` on a hand-written SASS loop (CPU, no compile): the steady-state iteration
is the inner softmax loop's unmasked path, every mbarrier wait taken once, and its counts and wait placement."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.diagnostics import sass_compare as sc  # noqa: E402
from bench.diagnostics.aot import sass_instructions  # noqa: E402

EXPS = sc.MIN_EXP


def _sass(lines: list[str]) -> str:
    """``lines`` as cuobjdump prints them, 16 bytes apart from address 0; ``{name}`` in a line is replaced by the
    address of the line that starts with ``name:`` (the label is dropped)."""
    labels = {}
    body = []
    for line in lines:
        if ":" in line.split()[0]:
            labels[line.split(":")[0]] = len(body)
            line = line.split(":", 1)[1].strip()
        body.append(line)
    text = [t.format(**{k: f"0x{16 * v:x}" for k, v in labels.items()}) for t in body]
    return "\n".join(f"        /*{16 * i:04x}*/                   {t} ;" for i, t in enumerate(text))


LOOP = _sass([
    "outer: NOP",
    "head: SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x10], R2",
    "@P0 BRA {issue}",
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x10], R2",  # the second try of the same wait
    "issue: WARPGROUP.ARRIVE",
    "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT, gsb0",
    "QGMMA.64x64x32.F32.E4M3.E4M3 R88, R152, gdesc[UR12], R88, gsb0",
    "WARPGROUP.DEPBAR.LE gsb0, 0x1",
    "@!P1 BRA {masked}",
    *["MUFU.EX2 R3, R4"] * EXPS,
    "BRA {join}",
    "masked: ISETP.GE.AND P2, PT, R5, R6, PT",  # the masked path is longer by its compares and selects
    "FSEL R4, R4, -INF, P2",
    *["MUFU.EX2 R3, R4"] * EXPS,
    "join: WARPGROUP.DEPBAR.LE gsb0, 0x0",
    "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R152, R3, R4, RZ",
    "@P3 BRA {head}",
    "@P4 BRA {outer}",
    "EXIT",
])


def test_steady_iteration_takes_the_inner_loops_unmasked_path_with_each_wait_once():
    texts = sc.steady_iteration(sass_instructions(LOOP))
    assert texts[0].startswith("SYNCS.PHASECHK") and texts[-1] == "@P3 BRA 0x10"
    assert not any(t.startswith(("ISETP", "FSEL")) for t in texts)
    assert sum("TRYWAIT" in t for t in texts) == 1
    assert len(texts) == 11 + EXPS  # wait, branch, arrive, 2 wgmmas, wait, branch, exps, branch, wait, F2FP, branch


def test_loop_report_counts_the_mix_and_what_runs_under_the_pv_wgmma():
    row = sc.loop_report(sc.steady_iteration(sass_instructions(LOOP)), block_n=64)
    assert (row["S_wgmma"], row["PV_wgmma"], row["MUFU.EX2"], row["F2FP"]) == (1, 1, EXPS, 1)
    assert (row["mbar_wait"], row["waits"], row["scores"]) == (1, "0x1 0x0", 32)
    assert (row["exp_under_PV"], row["after_PV_wait"]) == (EXPS, 2)
    assert row["instr"] == sum(row[c] for c in sc.MIX) + row["other"]
