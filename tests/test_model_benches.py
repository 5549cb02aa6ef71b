"""bench/models_bench.py and bench/model_features_bench.py end to end on the CPU (--device cpu: tiny sizes; a smoke
run, so that the H200 run cannot die on a Python error): JSON and (with matplotlib) PNG written, the fmha_ops cells measured, no record
written."""
import importlib.util
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("transformers")
from bench import common, model_features_bench, models_bench  # noqa: E402

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _records() -> dict:
    return {n: os.path.getmtime(os.path.join(common.RESULTS, n)) for n in os.listdir(common.RESULTS)}


def test_models_bench_cpu(tmp_path):
    before = _records()
    models_bench.main(["--device", "cpu", "--impl", "fmha_ops", "fmha_ops_fp8", "sdpa",
                       "--out", str(tmp_path)])
    with open(tmp_path / "models.json") as f:
        rows = json.load(f)["rows"]
    assert {r["model"] for r in rows} == {"llama3-8b (2)", "gpt-oss-20b (2)"} and len(rows) == 12
    for r in rows:
        if r["impl"].startswith("fmha_ops") or r["model"].startswith("llama"):  # GPT-OSS takes no sdpa
            assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["decode_attn_ms"] > 0, r  # CPU: noisy %
    if HAS_MATPLOTLIB:  # the [bench] extra draws the figure; CI installs [test] only
        assert (tmp_path / "models.png").stat().st_size > 0
    assert _records() == before


def test_models_bench_budget_leaves_cells_out(tmp_path):
    models_bench.main(["--device", "cpu", "--model", "llama3-8b", "--impl", "fmha_ops",
                       "--budget", "1e-9", "--out", str(tmp_path)])
    with open(tmp_path / "models.json") as f:
        data = json.load(f)
    assert data["rows"] == [] and len(data["left_out"]) == 2


def test_model_features_bench_cpu(tmp_path):
    before = _records()
    model_features_bench.main(["--device", "cpu", "--out", str(tmp_path)])
    with open(tmp_path / "model_features.json") as f:
        rows = json.load(f)["rows"]
    sinks = [r for r in rows if "ratio" in r]
    assert len(sinks) == 10 and all(r["ratio"] for r in sinks), sinks  # every sinks call ran, with and without
    value_dim = [r for r in rows if "speedup" in r]
    assert [r["call"] for r in value_dim] == ["fwd", "fwd+bwd"] and all(r["speedup"] for r in value_dim)
    if HAS_MATPLOTLIB:  # the [bench] extra draws the figure; CI installs [test] only
        assert (tmp_path / "model_features.png").stat().st_size > 0
    assert _records() == before


def test_models_record_has_a_row_per_cell_and_phase_and_a_column_per_implementation():
    def row(model, impl, prefill):
        return {"model": model, "batch": 1, "context": 2048, "impl": impl, "prefill_tok_s": prefill,
                "prefill_attn_pct": 25.0, "decode_tok_s": 10.0, "decode_attn_pct": 50.0}
    rows = [row("llama", "fmha_ops", 2000.4), row("llama", "sdpa", 1000.0), row("gpt-oss", "fmha_ops", 900.0),
            {"model": "gpt-oss", "batch": 1, "context": 2048, "impl": "sdpa"}]  # GPT-OSS takes no sdpa
    table = models_bench.record_rows(rows)
    assert [(r["model"], r["phase"]) for r in table] == [("llama", "prefill"), ("llama", "decode"),
                                                         ("gpt-oss", "prefill"), ("gpt-oss", "decode")]
    assert table[0]["fmha_ops"] == "2,000 (25%)" and table[1]["sdpa"] == "10 (50%)" and "sdpa" not in table[2]
    assert set(models_bench.RECORD.columns) >= {"phase", *models_bench.IMPLEMENTATIONS}
