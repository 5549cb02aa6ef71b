"""`python -m fmha_ops tune` on the CPU: it writes a table the selector then reads."""
import json

import torch

import fmha_ops
from fmha_ops.dispatch import SELECTOR, TUNING_DIRS
from fmha_ops.tune import decode_call, prefill_call, tune


def test_tune_writes_table_and_selector_uses_it(tmp_path):
    out = tmp_path / "cpu.json"
    table = tune(str(out), quick=True, device="cpu")
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["timings"] and data["calibration"]
    assert all(v > 0 for rows in data["timings"].values() for v in rows.values())
    saved = TUNING_DIRS[1]
    TUNING_DIRS[1] = str(tmp_path)  # the selector's TuningTables reads this list
    SELECTOR.tables.reload()
    SELECTOR.clear()
    try:
        call = prefill_call(1, 64, 4, 2, 32, True, "float32", "cpu")
        report = fmha_ops.explain(*call.args, **call.kwargs)
        sources = {v.op.NAME: v.source for v in report.verdicts if v.ok}
        measured = {name for name, rows in table.timings.items() if call.problem().bucket() in rows}
        assert measured and all(sources[name] == "table" for name in measured)
        fastest = min(measured, key=lambda n: table.timings[n][call.problem().bucket()])
        assert report.selected.NAME == fastest
        other = prefill_call(1, 300, 4, 4, 64, False, "float32", "cpu")  # between measured buckets of its kind
        srcs = {v.source for v in fmha_ops.explain(*other.args).verdicts if v.ok}
        assert any(s.startswith("model x ") and s.endswith("from 1 measured bucket") for s in srcs), srcs
        unmeasured = prefill_call(1, 300, 4, 4, 16, False, "float32", "cpu")  # a head dim the grid lacks
        srcs = {v.source for v in fmha_ops.explain(*unmeasured.args).verdicts if v.ok}
        assert "calibrated model" in srcs
    finally:
        TUNING_DIRS[1] = saved
        SELECTOR.tables.reload()
        SELECTOR.clear()


def test_decode_call_paged_matches_dense():
    dense = decode_call(2, 40, 4, 2, 32, 0, "bf16", "cpu", seed=1)
    paged = decode_call(2, 40, 4, 2, 32, 16, "bf16", "cpu", seed=1)
    a = fmha_ops.memory_efficient_attention(*dense.args, op="torch_referenceF").float()
    b = fmha_ops.memory_efficient_attention(*paged.args, op="torch_referenceF").float()
    assert torch.allclose(a.view(-1), b.view(-1), atol=1e-2)


def test_call_times_on_a_cpu_is_the_median_wall_time_for_both():
    from fmha_ops.timing import call_times

    calls = []
    device_s, host_s = call_times(lambda: calls.append(1), "cpu")
    assert device_s == host_s >= 0 and len(calls) == 4  # one untimed call, three timed


def test_tune_on_a_cpu_records_no_host_times(tmp_path):
    table = tune(str(tmp_path / "cpu.json"), quick=True, device="cpu")
    assert table.timings and table.host == {}
    assert json.loads((tmp_path / "cpu.json").read_text())["host"] == {}
