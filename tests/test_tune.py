"""`python -m fmha_ops tune` on the CPU: it writes a table the selector then reads."""
import json

import pytest
import torch

import fmha_ops
from fmha_ops.dispatch import SELECTOR, TUNING_DIRS
from fmha_ops.tune import TableUpdate, decode_call, prefill_call, tune
from registry import TuningTable


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


def test_op_times_on_a_cpu_is_the_median_wall_time_for_both():
    from fmha_ops.timing import CPU_CALLS, op_times

    calls = []
    times = op_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, "cpu")
    assert set(times) == {"a", "b"} and all(d == h >= 0 for d, h in times.values())
    assert calls.count("a") == calls.count("b") == CPU_CALLS
    assert all(d is None for d, _ in op_times({"a": lambda: None}, "cpu", host_only=True).values())


def test_host_times_interleave_the_ops_in_rotated_rounds(monkeypatch):
    """On CUDA every round times each op in turn (first op rotated by one per round), HOST_CALLS calls each, and an
    op's host time is the median over the rounds: one slow round (a pause) does not move it."""
    from fmha_ops import timing

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # the timed functions launch nothing
    order, ticks = [], iter(range(1000))
    clock = {"t": 0.0}

    def fn(name):
        def call():
            order.append(name)
            clock["t"] += 1.0 if next(ticks) != 5 else 100.0  # one call of one round pauses
        return call

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["t"])
    host = timing.host_times({"a": fn("a"), "b": fn("b"), "c": fn("c")}, "cuda")
    n = timing.HOST_CALLS
    firsts = [order[i] for i in range(0, len(order), n)]
    assert len(order) == 3 * n * timing.HOST_ROUNDS
    assert firsts[:6] == ["a", "b", "c", "b", "c", "a"]
    assert host == {"a": pytest.approx(1.0), "b": pytest.approx(1.0), "c": pytest.approx(1.0)}


def test_tune_on_a_cpu_records_no_host_times(tmp_path):
    table = tune(str(tmp_path / "cpu.json"), quick=True, device="cpu")
    assert table.timings and table.host == {} and table.host_timings == {}
    data = json.loads((tmp_path / "cpu.json").read_text())
    assert data["host"] == {} and data["host_timings"] == {}


def test_table_update_writes_host_rows_per_bucket_from_one_run():
    """Host rows per (op, bucket); the op's median over its rows is its fallback; an op's rows of an earlier run
    are dropped at its first new row, other ops' rows and medians kept; a host-only result leaves device rows and
    calibration as they were."""
    old = TuningTable("NVIDIA H200", {}, {"triton_attnF": {"old": 1e-3}}, {"triton_attnF": 1.5},
                      host={"triton_attnF": 9e-5, "sdpa_flashF": 2e-5},
                      host_timings={"triton_attnF": {"old": 9e-5}, "sdpa_flashF": {"old": 2e-5}})
    update = TableUpdate(old, record_host=True)
    small = prefill_call(1, 64, 4, 2, 32, True, "float32", "cpu").problem()
    large = prefill_call(2, 128, 4, 4, 64, False, "float32", "cpu").problem()
    update.add(small, {"triton_attnF": (None, 1e-4)})
    update.add(large, {"triton_attnF": (None, 3e-4)})
    update.summarize()
    assert old.host_timings["triton_attnF"] == {small.bucket(): 1e-4, large.bucket(): 3e-4}
    assert old.host["triton_attnF"] == pytest.approx(2e-4)
    assert old.host_timings["sdpa_flashF"] == {"old": 2e-5} and old.host["sdpa_flashF"] == 2e-5
    assert old.timings == {"triton_attnF": {"old": 1e-3}} and old.calibration == {"triton_attnF": 1.5}


def test_host_only_tune_keeps_device_rows(tmp_path):
    path = str(tmp_path / "cpu.json")
    first = tune(path, quick=True, device="cpu")
    again = tune(path, quick=True, device="cpu", merge=path, host_only=True)
    assert again.timings == first.timings and again.calibration == first.calibration


def test_tune_compile_only_runs_its_shard_and_writes_nothing(tmp_path, capsys):
    tune(str(tmp_path / "cpu.json"), quick=True, device="cpu", compile_only=True, shard=(1, 2))
    assert not (tmp_path / "cpu.json").exists()
    err = capsys.readouterr().err
    assert "[2/4]" in err and "[4/4]" in err and "[1/4]" not in err


def test_tune_budget_leaves_the_calls_after_it_unmeasured(tmp_path, capsys):
    table = tune(str(tmp_path / "cpu.json"), quick=True, device="cpu", budget=1e-9)
    assert table.timings == {} and json.loads((tmp_path / "cpu.json").read_text())["timings"] == {}
    assert "calls 1-4 not measured" in capsys.readouterr().err


def test_host_grid_is_the_small_prefill_kinds_and_the_decode_calls():
    from fmha_ops.tune import DECODE_SHAPES, HOST_DTYPES, HOST_PREFILL, host_grid

    made = host_grid("cpu")
    assert len(made) == len(HOST_DTYPES) * 12 + len(DECODE_SHAPES) * 11
    first = made[0]()
    assert first.label == f"prefill {HOST_DTYPES[0]} B{HOST_PREFILL[0]} N{HOST_PREFILL[1]} H16/16 D64"
    assert all(m().label.startswith("prefill fp8_tensor") for m in host_grid("cpu", ("fp8_tensor",))[:2])


def test_called_once_leaves_out_the_calls_that_raise_what_it_skips():
    from fmha_ops.timing import called_once

    def oom():
        raise torch.OutOfMemoryError("out of memory")

    seen = []
    ran = called_once({"ok": lambda: seen.append("ok"), "oom": oom}, (torch.OutOfMemoryError,),
                      lambda name, e: seen.append(name))
    assert list(ran) == ["ok"] and seen == ["ok", "oom"]
    with pytest.raises(ZeroDivisionError):
        called_once({"bad": lambda: 1 / 0}, (torch.OutOfMemoryError,))


def test_cli_host_only_refreshes_the_out_table_in_place(tmp_path, capsys):
    from fmha_ops.__main__ import main

    path = str(tmp_path / "cpu.json")
    assert main(["tune", "--quick", "--out", path]) == 0
    before = json.loads((tmp_path / "cpu.json").read_text())
    assert main(["tune", "--quick", "--host-only", "--budget", "60", "--out", path]) == 0
    after = json.loads((tmp_path / "cpu.json").read_text())
    assert after["timings"] == before["timings"] and "host timings" in capsys.readouterr().out
    assert main(["tune", "--quick", "--host-only", "--compile-only", "--shard", "0/2", "--out", path]) == 0


def test_keep_rows_replaces_only_the_buckets_a_run_measures(tmp_path):
    """A retune of some rows (``--keep-rows``): two runs over halves of the grid (``shard``) leave the op the rows
    of one run over the whole grid, and its rows of buckets neither run measures as they were; without it, the
    measured op's earlier rows are dropped."""
    measured = prefill_call(1, 64, 4, 2, 32, True, "float32", "cpu").problem().bucket()
    base = tmp_path / "base.json"
    TuningTable("cpu", {}, {"torch_referenceF": {"elsewhere": 7.0, measured: 99.0}, "kept_op": {"b": 1.0}},
                {"kept_op": 2.0}).save(str(base))
    whole = tune(str(tmp_path / "whole.json"), quick=True, device="cpu", ops=frozenset({"torch_referenceF"}))
    out = str(tmp_path / "cpu.json")
    for shard in ((0, 2), (1, 2)):
        table = tune(out, quick=True, device="cpu", ops=frozenset({"torch_referenceF"}), merge=str(base) if
                     shard[0] == 0 else out, shard=shard, keep_rows=True)
    rows = table.timings["torch_referenceF"]
    assert set(rows) == set(whole.timings["torch_referenceF"]) | {"elsewhere"}
    assert rows["elsewhere"] == 7.0 and rows[measured] != 99.0
    assert table.timings["kept_op"] == {"b": 1.0} and table.calibration["kept_op"] == 2.0
    dropped = tune(str(tmp_path / "drop.json"), quick=True, device="cpu", ops=frozenset({"torch_referenceF"}),
                   merge=str(base))
    assert "elsewhere" not in dropped.timings["torch_referenceF"]
    with pytest.raises(ValueError, match="merge"):
        tune(out, quick=True, device="cpu", keep_rows=True)


def test_keep_rows_keeps_the_host_rows_of_buckets_not_measured():
    old = TuningTable("NVIDIA H200", {}, {}, {}, host={"triton_attnF": 9e-5},
                      host_timings={"triton_attnF": {"old": 9e-5}})
    update = TableUpdate(old, record_host=True, keep_rows=True)
    small = prefill_call(1, 64, 4, 2, 32, True, "float32", "cpu").problem()
    update.add(small, {"triton_attnF": (None, 1e-4)})
    update.summarize()
    assert old.host_timings["triton_attnF"] == {"old": 9e-5, small.bucket(): 1e-4}
    assert old.host["triton_attnF"] == pytest.approx(9.5e-5)


def test_cli_retunes_some_ops_rows_into_a_table(tmp_path, capsys):
    from fmha_ops.__main__ import main

    path = tmp_path / "cpu.json"
    TuningTable("cpu", {}, {"torch_referenceF": {"elsewhere": 7.0}}, {}).save(str(path))
    assert main(["tune", "--quick", "--ops", "torch_referenceF", "--merge", str(path), "--keep-rows",
                 "--shard", "0/2", "--out", str(path)]) == 0
    rows = json.loads(path.read_text())["timings"]["torch_referenceF"]
    assert rows["elsewhere"] == 7.0 and len(rows) == 3, rows  # the quick grid's calls 1 and 3 of 4
    assert "wrote" in capsys.readouterr().out


def test_grid_dtypes_pick_prefill_kinds_and_decode_apart():
    """``dtypes`` names prefill dtypes and "decode" (the decode calls alone: a tuning piece of its own); an unknown
    name raises, naming it."""
    from fmha_ops.tune import DECODE, DECODE_SHAPES, grid, host_grid

    decode = grid("cpu", dtypes=(DECODE,))
    assert len(decode) == len(DECODE_SHAPES) * 11 and len(host_grid("cpu", (DECODE,))) == len(decode)
    assert len(grid("cpu", dtypes=("bfloat16",))) == 36 and len(grid("cpu", dtypes=("bfloat16", DECODE))) == 36 + 55
    assert len(grid("cpu")) == 4 * 36 + 55
    with pytest.raises(ValueError, match=r"dtypes=\['bf16'\] not in the grid"):
        grid("cpu", dtypes=("bf16",))


def test_tune_keys_the_table_by_the_cards_name(tmp_path, monkeypatch):
    """On an H100 SXM ("NVIDIA H100 80GB HBM3") tune writes the table of device "NVIDIA H100", which the selector
    finds from the driver's name; a host-only run without a table starts one of host rows alone (a piece)."""
    from fmha_ops import tune as tune_module
    from registry import Arch

    h100_sxm = Arch("cuda", (9, 0), name="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(tune_module, "current_arch", lambda device=None: h100_sxm)
    table = tune(str(tmp_path / "t.json"), quick=True, device="cpu")
    assert table.device == json.loads((tmp_path / "t.json").read_text())["device"] == "NVIDIA H100"
    host = tune(str(tmp_path / "host.json"), quick=True, device="cpu", host_only=True)
    assert host.device == "NVIDIA H100" and host.timings == {} and host.calibration == {}


def test_merge_tables_joins_pieces_rows_later_first_host_rows_of_one_run():
    """Device rows bucket by bucket (a later piece's over an earlier one's); an op's host rows whole from the last
    piece that has any, its host median from them; its calibration from the piece with most of its rows; pieces of
    two cards or none raise."""
    from registry import merge_tables

    bf16 = TuningTable("NVIDIA H100", {"torch": "1"}, {"fa3F": {"a": 1.0, "b": 2.0, "c": 4.0}, "sdpaF": {"a": 3.0}},
                       {"fa3F": 0.8, "sdpaF": 1.1}, {"fa3F": 5e-5}, {"fa3F": {"a": 4e-5, "b": 6e-5}})
    decode = TuningTable("NVIDIA H100", {"torch": "2"}, {"fa3F": {"b": 2.5, "d": 9.0}}, {"fa3F": 3.0},
                         {"fa3F": 7e-5}, {"fa3F": {"d": 7e-5}})
    host = TuningTable("NVIDIA H100 80GB HBM3", {}, {}, {}, {"sdpaF": 2e-5},
                       {"sdpaF": {"a": 1e-5, "b": 3e-5}})
    merged = merge_tables([bf16, decode, host])
    assert merged.device == "NVIDIA H100" and merged.versions == {}
    assert merged.timings == {"fa3F": {"a": 1.0, "b": 2.5, "c": 4.0, "d": 9.0}, "sdpaF": {"a": 3.0}}
    assert merged.calibration == {"fa3F": 0.8, "sdpaF": 1.1}
    assert merged.host_timings == {"fa3F": {"d": 7e-5}, "sdpaF": {"a": 1e-5, "b": 3e-5}}
    assert merged.host == {"fa3F": 7e-5, "sdpaF": pytest.approx(2e-5)}
    with pytest.raises(ValueError, match="different devices"):
        merge_tables([bf16, TuningTable("NVIDIA H200")])
    with pytest.raises(ValueError, match="no pieces"):
        merge_tables([])


def test_merge_command_writes_one_table(tmp_path, capsys):
    from fmha_ops.__main__ import main

    TuningTable("NVIDIA H100", {}, {"fa3F": {"a": 1.0}}, {"fa3F": 0.9}).save(str(tmp_path / "p1.json"))
    TuningTable("NVIDIA H100", {}, {"fa3F": {"b": 2.0}}).save(str(tmp_path / "p2.json"))
    assert main(["merge", "--out", str(tmp_path / "NVIDIA_H100.json"), str(tmp_path / "p1.json"),
                 str(tmp_path / "p2.json")]) == 0
    assert TuningTable.load(str(tmp_path / "NVIDIA_H100.json")).timings == {"fa3F": {"a": 1.0, "b": 2.0}}
    assert "wrote 2 timings of 1 ops" in capsys.readouterr().out


def test_shipped_tables_are_keyed_by_their_card_and_named_in_the_docs():
    """Each table in fmha_ops/tuning/ is keyed by its card's name (``table_device``), in the file the tune command
    names after it, holds only registered ops, and README.md and DESIGN.md name it (which GPUs have a table)."""
    import os

    from fmha_ops.dispatch import REGISTRY
    from registry import table_device

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    docs = [open(os.path.join(root, name)).read() for name in ("README.md", "DESIGN.md")]
    files = sorted(f for f in os.listdir(TUNING_DIRS[0]) if f.endswith(".json"))
    assert files
    for name in files:
        table = TuningTable.load(os.path.join(TUNING_DIRS[0], name))
        assert table_device(table.device) == table.device and name == table.device.replace(" ", "_") + ".json"
        assert all(REGISTRY.get(op) for op in table.timings)
        assert all(f"`{name}`" in doc for doc in docs), f"README.md and DESIGN.md do not name {name}"


def test_info_says_which_table_ranks_the_ops(tmp_path):
    """``info`` names the GPU's tuning table (the H100 SXM's is keyed "NVIDIA H100") or says the H200-fitted models
    rank the ops."""
    from fmha_ops.__main__ import table_line
    from registry import TuningTables

    TuningTable("NVIDIA H100", {}, {"fa3F": {"a": 1.0}}).save(str(tmp_path / "NVIDIA_H100.json"))
    tables = TuningTables([str(tmp_path)])
    assert table_line("NVIDIA H100 80GB HBM3", tables).startswith("tuning table: NVIDIA H100, 1 ops measured")
    assert "none for 'NVIDIA H100 PCIe': ops ranked by cost models fitted on the H200" in table_line(
        "NVIDIA H100 PCIe", tables)


def test_host_only_cli_without_a_table_writes_a_piece(tmp_path, capsys):
    from fmha_ops.__main__ import main

    path = tmp_path / "host.json"
    assert main(["tune", "--quick", "--host-only", "--out", str(path)]) == 0
    assert TuningTable.load(str(path)).timings == {}
