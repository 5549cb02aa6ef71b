"""CPU checks of the backend and selector benchmarks' own logic: ratios, regret rows and summaries, the call
lists, the record each writes, and a quick selector run (forward and backward) on the CPU ops."""
import csv
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import backends, selector  # noqa: E402
from tests.test_autotune import SecondReferenceBw, cache, grad_ops  # noqa: E402,F401  (fixtures)


def test_ratio_takes_the_best_measured_denominator():
    assert backends.ratio(90.0, 100.0, None, 80.0) == pytest.approx(0.9)
    assert backends.ratio(None, 100.0) is None and backends.ratio(90.0, None, None) is None


def test_backends_summary_names_the_worst_shape_and_the_unmeasured_ratios():
    rows = [{"shape": "a", "api/best": 0.99, "api_bw/best": None}, {"shape": "b", "api/best": 0.95}]
    lines = backends.summary_lines(rows)
    assert lines[0].startswith("api/best: min 0.950 at b over 2 shapes")
    assert lines[1] == "api_bw/best: not measured"
    text = backends.notes(rows, ["c"])
    assert "min 0.950 at b" in text and "Not measured (time budget): c." in text


def test_backends_record_has_every_column(tmp_path):
    rows = [{"shape": backends.shape_label(4, 32, 8, 4096, 128, True), "api": 500.0, "cudnn": 510.0,
             "api/best": 500 / 510}]
    path = backends.RECORD.write(rows, {"torch": "t", "date": "d"}, notes=backends.notes(rows, []),
                                 results_dir=str(tmp_path))
    text = open(path).read()
    assert "| 4x32/8x4096x128 causal |" in text and "fwd api/best" in text and "Reproduce: `PYTHONPATH" in text
    assert text.count("\n|---") == 1 and text.count("|---") == len(backends.COLUMNS)


def test_regret_row_and_summary():
    # (device, host) seconds: an op's time per call is the larger of the two
    row = selector.regret_row("c", "a", {"a": (3e-6, 1e-6), "b": (1e-6, 2e-6)})
    assert row["best"] == "b" and row["regret"] == pytest.approx(0.5) and row["t_sel_us"] == pytest.approx(3.0)
    assert row["device_us"]["b"] == pytest.approx(1.0) and row["host_us"]["b"] == pytest.approx(2.0)
    assert selector.regret_row("c", "z", {"a": (1e-6, 0.0)})["regret"] is None  # selected op not timed
    s = selector.summarize([row, selector.regret_row("d", "a", {"a": (1e-6, 0.0)}),
                            selector.regret_row("e", "z", {"a": (1.0, 0.0)})])
    assert s["median_regret"] == pytest.approx(0.25) and s["worst_regret"] == pytest.approx(0.5)
    assert s["calls"] == 3 and s["unmeasured_selected"] == 1
    assert selector.summarize([])["median_regret"] is None


def test_selector_calls_interleave_dtypes_and_add_backward_rows():
    made = selector.calls("cpu", False)
    kinds = [k for k, _ in made]
    n_prefill = len(selector.PREFILL_SHAPES) * len(selector.DEFAULT_DTYPES)
    assert kinds.count("bw") == len(selector.PREFILL_SHAPES)
    assert len(made) == n_prefill + len(selector.PREFILL_SHAPES) + len(selector.DECODE_CALLS)
    assert kinds[:len(selector.DEFAULT_DTYPES) + 1] == ["fw", "bw"] + ["fw"] * (len(selector.DEFAULT_DTYPES) - 1)
    assert all(k == "fw" for k, _ in selector.calls("cpu", False, ("fp8_tensor",)))
    decode = selector.calls("cpu", False, decode=True)
    assert len(decode) == len(selector.DECODE_CALLS) and decode[-1][1]().label.startswith("decode fp8 B4 L512")
    picked = selector.calls("cpu", False, None, (3,))  # one prefill shape, every default dtype, no decode calls
    assert len(picked) == len(selector.DEFAULT_DTYPES) + 1
    assert picked[0][1]().label.startswith("prefill bfloat16 B32 N256")


def test_selector_quick_run_measures_forward_and_backward_in_every_mode(tmp_path):
    res = selector.main(["--quick", "--no-record", "--out", str(tmp_path)])
    assert list(res["runs"]) == list(selector.MODES)
    calls = [r["call"] for r in res["runs"]["table"]]
    assert any(c.startswith("backward ") for c in calls) and any(c.startswith("prefill ") for c in calls)
    for rows in res["runs"].values():
        for r in rows:
            assert r["selected"] in r["times_us"] and r["regret"] is not None and r["regret"] >= 0
    for mode in selector.MODES:
        assert os.path.exists(tmp_path / f"selector_{mode}.json")


def test_selector_budget_leaves_calls_unmeasured(tmp_path):
    res = selector.main(["--quick", "--no-record", "--out", str(tmp_path), "--budget", "1e-9", "--modes", "table"])
    assert res["runs"] == {} and len(res["skipped"]) == 3


def test_measure_backward_times_every_supporting_backward_op():
    call = selector.prefill_call(1, 64, 4, 2, 32, True, "float32", "cpu")
    selected, times, estimates = selector.measure_backward(call, "cpu")
    assert set(estimates) == set(times) and all(e["model_us"] > 0 for e in estimates.values())
    assert selected in times and all(min(t) > 0 for t in times.values())
    assert torch.is_tensor(call.args[0]) and not call.args[0].requires_grad  # the call's own tensors are untouched


def test_measure_backward_under_autotune_selects_the_backward_measured_at_the_call(cache, grad_ops, monkeypatch):
    """The autotune mode's backward row: the call with gradients made once under autotune (its forward ops timed,
    then its backward ops), and the row's selection the measured one."""
    monkeypatch.setitem(selector._RUN, "autotune", True)
    call = selector.prefill_call(1, 64, 4, 2, 32, True, "float32", "cpu")
    selected, times, estimates = selector.measure_backward(call, "cpu")
    assert ["test_referenceB", "torch_referenceB"] in grad_ops, grad_ops
    assert selected == SecondReferenceBw.NAME and estimates[selected]["source"] == "measured here", estimates


def test_selector_compile_only_shards_the_calls_and_writes_nothing(tmp_path):
    res = selector.main(["--quick", "--compile-only", "--shard", "1/2", "--out", str(tmp_path)])
    assert res["runs"] == {} and not any(name.endswith(".json") for name in os.listdir(tmp_path))


def test_selector_record_groups_calls_and_names_the_unmeasured(tmp_path, monkeypatch):
    class Capture:  # the record's writer, returning what it would write
        @staticmethod
        def write(table, env, png, notes):
            return table, notes

    monkeypatch.setattr(selector, "RECORD", Capture)
    monkeypatch.setattr(selector, "RESULTS", str(tmp_path))
    rows = [selector.regret_row("prefill bfloat16 B1 N8", "a", {"a": (2e-6, 0.0), "b": (1e-6, 0.0)}),
            selector.regret_row("backward bfloat16 B1 N8", "a", {"a": (1e-6, 0.0)})]
    table, notes = selector.record({"table": rows, "anchors": rows[:1]}, {}, None, ("decode bf16 B2",))
    assert [t["kind"] for t in table] == ["prefill bfloat16", "backward bfloat16"]
    assert table[0]["off the grid / table"] == table[0]["anchors / table"] == "100.0% / 100.0% (1; B1 N8: a vs b)"
    assert table[1] == {"kind": "backward bfloat16", "off the grid / table": "0.0% / 0.0% (1)"}
    assert ("off the grid / table: median 50.0% (target <= 2.0%: missed), worst 100.0% (target <= 15.0%: missed)"
            in notes)
    assert "Not measured (time budget): 1 calls, from decode bf16 B2." in notes
    with open(tmp_path / selector.CALLS_FILE) as f:
        lines = list(csv.reader(f))
    assert lines[0] == list(selector.CALL_COLUMNS) and len(lines) == 4
    assert lines[1] == ["off the grid / table", "prefill bfloat16 B1 N8", "a", "b", "2", "1", "1"]
    assert lines[3][0] == "anchors / table" and "bench/results/selector_calls.csv" in notes


def test_selector_record_from_the_json_of_separate_runs(tmp_path, monkeypatch):
    """Modes measured by separate runs (--no-record), their JSON files in one folder: --record-from writes one record
    of every mode with the runs' environment, measuring nothing."""
    first, second = tmp_path / "first", tmp_path / "second"
    selector.main(["--quick", "--no-record", "--modes", "table,autotune", "--out", str(first)])
    selector.main(["--quick", "--no-record", "--modes", "anchors", "--out", str(second)])
    gathered = tmp_path / "all"
    gathered.mkdir()
    for path in list(first.glob("selector_*.json")) + list(second.glob("selector_*.json")):
        data = json.loads(path.read_text())
        data["env"]["gpu"] = "GPU of the runs"
        (gathered / path.name).write_text(json.dumps(data))
    written = []

    class Capture:
        @staticmethod
        def write(table, env, png, notes):
            written.append((table, env, notes))
            return "record"

    monkeypatch.setattr(selector, "RECORD", Capture)
    monkeypatch.setattr(selector, "RESULTS", str(tmp_path))
    monkeypatch.setattr(selector, "measure_mode", lambda *a: pytest.fail("--record-from measured"))
    res = selector.main(["--record-from", str(gathered), "--out", str(tmp_path / "figure")])
    assert not (gathered / "selector.png").exists(), "a fetched results folder is read-only: the figure goes to --out"
    (table, env, notes), = written
    assert list(res["runs"]) == list(selector.MODES) and env["gpu"] == "GPU of the runs"
    assert {mode for t in table for mode in t if mode != "kind"} == set(selector.MODE_LABELS.values())
    assert "anchors / table: median" in notes
    with pytest.raises(SystemExit):
        selector.main(["--record-from", str(tmp_path)])


def test_selector_targets_are_the_issue_bounds_per_mode():
    assert selector.target_text("table", {"median_regret": 0.01, "worst_regret": 0.2}) == (
        "median 1.0% (target <= 2.0%: met), worst 20.0% (target <= 15.0%: missed)")
    assert selector.target_text("anchors", {"median_regret": None, "worst_regret": None}) == "median -, worst -"


def test_backends_columns_are_the_median_of_interleaved_rounds(monkeypatch):
    order, ms = [], {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}

    def fake_time(fn):
        order.append(fn())
        return next(ms[order[-1]])

    monkeypatch.setitem(backends._RUN, "call", fake_time)
    got = backends.interleaved({"a": lambda: "a", "b": lambda: "b", "none": None})
    assert got == {"a": 2.0, "b": 5.0, "none": None}
    assert order == ["a", "b"] * backends.ROUNDS  # every column once per round, in turn
