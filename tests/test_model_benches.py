"""bench/models_bench.py and bench/model_features_bench.py end to end on the CPU (--device cpu: tiny sizes; a smoke
run, so that the H200 run cannot die on a Python error): JSON and (with matplotlib) PNG written, the fmha_ops cells measured, no record
written."""
import importlib.util
import json
import os
import shutil
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


def test_models_record_has_a_row_per_cell_and_a_column_per_implementation():
    def row(model, impl, prefill):
        return {"model": model, "batch": 1, "context": 2048, "impl": impl, "prefill_tok_s": prefill,
                "prefill_attn_pct": 25.0, "decode_tok_s": 10.0, "decode_attn_pct": 50.0}
    rows = [row("llama", "fmha_ops", 2000.4), row("llama", "sdpa", 1000.0), row("gpt-oss", "fmha_ops", 900.0),
            {"model": "gpt-oss", "batch": 1, "context": 2048, "impl": "sdpa"}]  # GPT-OSS takes no sdpa
    table = models_bench.record_rows(rows)
    assert [r["model"] for r in table] == ["llama", "gpt-oss"]
    assert table[0]["fmha_ops"] == "2,000 / 10 (25% / 50%)" and "sdpa" not in table[1]
    assert set(models_bench.RECORD.columns) >= {"context", *models_bench.IMPLEMENTATIONS}


def _full_grid_rows() -> tuple[list[dict], list[dict]]:
    """Rows as the H200's full grids give them (every shape and call of both benchmarks measured)."""
    models = [{"model": f"{m} (4)", "batch": b, "context": c, "impl": i, "prefill_tok_s": 1e4, "prefill_attn_pct": 40.0,
               "decode_tok_s": 300.0, "decode_attn_pct": 12.0}
              for m in models_bench.LAYERS for b in (1, 32) for c in (2048, 16384) for i in models_bench.IMPLEMENTATIONS]
    shapes = model_features_bench.SHAPES
    features = [model_features_bench._row(f"{b}x{n} {w}", call, 1.0, 1.01) for b, n in shapes["sinks"]["full"]
                for w in ("full", "window 128") for call in ("bf16 fwd", "fp8 fwd", "bf16 fwd+bwd")]
    features += [model_features_bench._row(f"decode B{b} L{n}", f"{kv} KV {op}", 1.0, 1.0)
                 for b, n in shapes["decode"]["full"] for kv in ("bf16", "fp8")
                 for op in ("triton_decoderF", "triton_splitKF")]
    features += [{"shape": f"{b}x{n}x128 K192/Kv128", "call": call, "speedup": 1.3,
                  "ours/fa3": 0.95 if call == "fwd" else None}
                 for b, n in shapes["value_dim"]["full"] for call in ("fwd", "fwd+bwd")]
    return models, features


def test_full_grid_records_stay_short():
    """BENCHMARKS.md has a line budget (tests/test_bench_records.py): the full grids' records hold one row per
    (model, batch, context) and one per model-features measure; the JSON keeps every call."""
    models, features = _full_grid_rows()
    assert len(models_bench.record_rows(models)) == 8
    summary = model_features_bench.summary_rows(features)
    assert [r["measure"] for r in summary] == [
        "sinks / none, bf16 fwd", "sinks / none, fp8 fwd", "sinks / none, bf16 fwd+bwd", "sinks / none, decode",
        "V padded to 192 / Kv=128, fwd", "FA3 192->128 / ours, fwd", "V padded to 192 / Kv=128, fwd+bwd"]
    assert [r["calls"] for r in summary] == [6, 6, 6, 12, 3, 3, 3]


def test_full_grid_records_fit_benchmarks_md_with_the_pending_forward_records(tmp_path, monkeypatch):
    """The models and model-features records at their full grids, beside the forward and accuracy records at full
    size (tests/test_attention_fwd_bench.py), each measured in an environment of its own (its Environment line stays
    on the page): BENCHMARKS.md still assembles within its line budget."""
    from bench import assemble_benchmarks, attention_fwd_bench as fwd, backends
    from tests.test_bench_records import MAX_LINES

    results = tmp_path / "results"
    shutil.copytree(common.RESULTS, results)
    env = {"gpu": "GPU", "driver": "1", "cuda": "13", "torch": "2", "triton": "3", "cudnn": 9, "date": "2099-01-01"}
    png = tmp_path / "plot.png"
    png.write_bytes(b"png")
    models, features = _full_grid_rows()
    models_bench.RECORD.write(models_bench.record_rows(models), env, str(png), results_dir=str(results))
    model_features_bench.RECORD.write(model_features_bench.summary_rows(features), env, str(png),
                                      results_dir=str(results))
    fwd.SPEED_RECORD.write([{"shape": backends.shape_label(*s), "fa3_fp8": 800.0} for s in fwd.SHAPES], env,
                           str(png), notes=fwd.speed_notes(["x"], ["a"]), results_dir=str(results))
    fwd.ACCURACY_RECORD.write([{"kernel": name, "cos": 0.999} for name in fwd.RECORDED], env,
                              notes=fwd.accuracy_notes(fwd.ACCURACY_SHAPE, ["a", "b"]), results_dir=str(results))
    monkeypatch.setattr(assemble_benchmarks, "RESULTS", str(results))
    assert assemble_benchmarks.assemble().count("\n") <= MAX_LINES


def test_model_features_summary_takes_the_worst_call_by_the_measures_direction():
    rows = [model_features_bench._row("1x8 full", "bf16 fwd", 1.0, 1.01),
            model_features_bench._row("1x8 window 128", "bf16 fwd", 1.0, 1.08),
            model_features_bench._row("1x16 full", "bf16 fwd", 1.0, 0.99),
            {"shape": "1x8 K192/Kv128", "call": "fwd", "speedup": 1.4, "ours/fa3": 0.8},
            {"shape": "4x8 K192/Kv128", "call": "fwd", "speedup": 1.2, "ours/fa3": 1.1}]
    sinks, padded, fa3 = model_features_bench.summary_rows(rows)
    assert (sinks["worst"], sinks["median"], sinks["best"], sinks["worst_at"]) == (1.08, 1.01, 0.99,
                                                                                 "1x8 window 128 bf16 fwd")
    assert (padded["worst"], padded["best"], padded["worst_at"]) == (1.2, 1.4, "4x8 K192/Kv128 fwd")
    assert (fa3["worst"], fa3["target"]) == (0.8, f">= {model_features_bench.FA3_MIN}")
