"""CPU checks of the forward benchmark (bench/attention_fwd_bench.py): a smoke run through every code path a CPU has
(the public calls on the Triton interpreter; FA3, cuDNN and the Gluon ops absent), its ratios and the issue's
targets, and its two records within BENCHMARKS.md's line budget."""
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import assemble_benchmarks, backends, common  # noqa: E402
from bench import attention_fwd_bench as fwd  # noqa: E402
from tests.test_bench_records import MAX_LINES  # noqa: E402


def test_cpu_smoke_run_times_the_public_calls_and_checks_accuracy(tmp_path):
    res = fwd.main(["--device", "cpu", "--out", str(tmp_path), "--no-record"])
    rows = res["rows"]
    assert [r["shape"] for r in rows] == [backends.shape_label(*s) for s in fwd.CPU_SHAPES]
    for r in rows:
        for col in ("api_fp8", "op:triton_fp8F:fp8", "ours_fp8", "api_i8fp8", "op:triton_i8fp8F:i8fp8",
                    "api_i8fp8_block", "op:triton_i8fp8F:i8fp8_block", "api_bf16"):
            assert r[col] > 0, col
        assert r["ours_fp8_op"] == "triton_fp8F" and r["ours_i8fp8_op"] == "triton_i8fp8F"
        assert r["api_fp8_op"] and r["api_i8fp8_op"] and r["api_i8fp8_block_op"]
        assert not any(key.startswith("g:") for key in r)  # no CUDA graphs on a CPU
        if backends.fa3_interface() is None:
            assert r.get("fa3_fp8") is None and r["i8fp8/fa3_fp8"] is None and r["ours_fp8/fa3_fp8"] is None
    assert res["not_measured"] == [] and "record" not in res and "accuracy_record" not in res
    assert os.path.exists(tmp_path / "attention_fwd.json") and os.path.exists(tmp_path / "i8fp8_accuracy.json")
    acc = {(r["inputs"], r["kernel"]): r for r in res["accuracy"]}
    for dist in ("normal", "transformer_like"):
        assert acc[(dist, "i8fp8 (head q/k, tensor v), api")]["cos"] > 0.999
        assert acc[(dist, "fp8 (B,Hkv), triton_fp8F")]["cos"] > 0.99
        assert acc[(dist, "bf16, api")]["rel"] < 1e-2
    assert res["accuracy_checks"][0].startswith("i8fp8 (head q/k, tensor v) cosine 0.99")


def test_budget_leaves_shapes_and_accuracy_unmeasured(tmp_path):
    res = fwd.main(["--device", "cpu", "--out", str(tmp_path), "--budget", "1e-9"])
    assert res["rows"] == [] and len(res["not_measured"]) == len(fwd.CPU_SHAPES) and "accuracy" not in res


def test_summary_takes_the_fastest_forced_op_and_the_ratios():
    row = {"fa3_bf16": 600.0, "fa3_fp8": 800.0, "api_fp8": 790.0, "op:triton_fp8F:fp8": 700.0,
           "op:gluon_ws_fp8F:fp8": 810.0, "op:gluon_fp8F:fp8": None, "api_i8fp8": 760.0,
           "op:gluon_ws_i8fp8F:i8fp8": 780.0, "op:triton_i8fp8F:i8fp8_block": 900.0,
           "g:fa3_fp8": 1000.0, "g:op:triton_fp8F:fp8": 950.0}
    fwd.summarize(row)
    assert (row["ours_fp8"], row["ours_fp8_op"]) == (810.0, "gluon_ws_fp8F")
    assert (row["ours_i8fp8"], row["ours_i8fp8_op"]) == (780.0, "gluon_ws_i8fp8F")  # block inputs stay apart
    assert row["i8fp8/fa3_fp8"] == pytest.approx(0.95) and row["i8fp8/fa3_bf16"] == pytest.approx(760 / 600)
    assert row["ours_fp8/fa3_fp8"] == pytest.approx(810 / 800) and row["api_fp8/best"] == pytest.approx(790 / 810)
    assert row["ours_fp8/cudnn_fp8"] is None
    fwd.summarize(row, "g:")
    assert row["g:ours_fp8_op"] == "triton_fp8F" and row["g:ours_fp8/fa3_fp8"] == pytest.approx(0.95)
    assert row["g:i8fp8/fa3_fp8"] is None  # no graph-timed i8fp8 call


def test_targets_follow_the_issue():
    api = {"api_fp8/best": backends.TARGET}
    assert fwd.targets(4, 32, 32, 4096, 128, True) == {**api, "i8fp8/fa3_fp8": 0.95, "i8fp8/fa3_bf16": 1.25,
                                                       "ours_fp8/fa3_fp8": 1.0}
    assert "ours_fp8/fa3_fp8" not in fwd.targets(4, 16, 16, 4096, 64, False)  # fp8's targets are D 128 / 256
    assert fwd.targets(8, 16, 16, 1000, 128, False) == {**api, "i8fp8/fa3_bf16": 1.1, "ours_fp8/fa3_fp8": 0.9}
    assert fwd.targets(16, 32, 8, 512, 64, True) == {**api, "ours_fp8/fa3_fp8": 1.5}
    rows = [{"shape": "a", "i8fp8/fa3_fp8": 0.9, "target:i8fp8/fa3_fp8": 0.95},
            {"shape": "b", "i8fp8/fa3_fp8": 1.0, "target:i8fp8/fa3_fp8": 0.95},
            {"shape": "c", "g:i8fp8/fa3_fp8": 0.97, "target:i8fp8/fa3_fp8": 0.95}]
    assert fwd.target_lines(rows) == ["i8fp8/fa3_fp8: min 0.900 at a; target met at 1/2 shapes (missed: a 0.90 < 0.95)"]
    assert fwd.target_lines(rows, "g:") == ["g:i8fp8/fa3_fp8: min 0.970 at c; target met at 1/1 shapes"]


def test_accuracy_checks_compare_fp8_with_fa3():
    rows = [{"inputs": "transformer_like", "kernel": "i8fp8 (head q/k, tensor v), api", "cos": 0.99949},
            {"inputs": "transformer_like", "kernel": "fp8 (B,Hkv), api", "cos": 0.99807},
            {"inputs": "transformer_like", "kernel": "FA3 fp8 (B,Hkv)", "cos": 0.998071},
            {"inputs": "normal", "kernel": "FA3 fp8 (B,Hkv)", "cos": 0.5}]
    assert fwd.accuracy_lines(rows) == ["i8fp8 (head q/k, tensor v) cosine 0.99949 (< 0.9995)",
                                        "fp8 (B,Hkv) cosine 0.99807, FA3 fp8 0.99807 (equal within 0.0001)"]


def test_records_keep_benchmarks_md_within_its_budget(tmp_path, monkeypatch):
    """Both records at full size (every shape and its plot, every recorded accuracy call), measured in an
    environment of their own (their Environment lines stay on the page), assemble within MAX_LINES."""
    results = tmp_path / "results"
    shutil.copytree(common.RESULTS, results)
    env = {"gpu": "GPU", "driver": "1", "cuda": "13", "torch": "2", "triton": "3", "cudnn": 9, "date": "2099-01-01"}
    rows = [{"shape": backends.shape_label(*s), "fa3_fp8": 800.0, "target:i8fp8/fa3_fp8": 0.95} for s in fwd.SHAPES]
    png = tmp_path / "attention_fwd.png"
    png.write_bytes(b"png")
    fwd.SPEED_RECORD.write(rows, env, str(png), notes=fwd.speed_notes(["x"], fwd.target_lines(rows)),
                           results_dir=str(results))
    acc = [{"kernel": name, "cos": 0.999} for name in fwd.RECORDED]
    fwd.ACCURACY_RECORD.write(acc, env, notes=fwd.accuracy_notes(fwd.ACCURACY_SHAPE, ["a", "b"]),
                              results_dir=str(results))
    text = open(results / "attention_fwd.md").read()
    assert text.count("\n|---") == 1 and text.count("|---") == len(fwd.SPEED_RECORD.columns)
    assert "Reproduce: `PYTHONPATH=$PWD python bench/attention_fwd_bench.py --graph`" in text
    monkeypatch.setattr(assemble_benchmarks, "RESULTS", str(results))
    assert assemble_benchmarks.assemble().count("\n") <= MAX_LINES


def test_fa3_calls_are_flash_attn_func_with_kv_head_descales(monkeypatch):
    """The FA3 anchors call the installed build's own ``flash_attn_func``: bf16 plain, fp8 with the (B, Hkv)
    descales; none where no build imports."""
    import types

    from fmha_ops.ops import fa3

    got = []
    module = types.ModuleType("fake_fa3_interface")
    module.flash_attn_func = lambda *args, **kw: got.append((args, kw))
    monkeypatch.setitem(sys.modules, "fake_fa3_interface", module)
    monkeypatch.setattr(fa3, "BUILD", fa3.FA3Build("fake_fa3_interface", "fa3-fwd", {}))
    fa3.interface.cache_clear()  # the imported interface is memoized
    calls = backends.fa3_calls("q", "k", "v", True, ("q8", "k8", "v8", "qd", "kd", "vd"))
    calls["fa3_bf16"]()
    calls["fa3_fp8"]()
    assert got == [(("q", "k", "v"), {"causal": True}),
                   (("q8", "k8", "v8"), {"causal": True, "q_descale": "qd", "k_descale": "kd", "v_descale": "vd"})]
    fa3.interface.cache_clear()
    monkeypatch.setattr(fa3, "BUILD", fa3.FA3Build(None, "fa3-fwd", {}))
    assert backends.fa3_calls("q", "k", "v", False) == {}
