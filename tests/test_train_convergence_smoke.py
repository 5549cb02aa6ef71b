"""CPU smoke test of bench/train_convergence.py at --tiny: every variant trains with finite losses,
writes its JSON and prints its table; sdpa's loss goes down over 20 steps (fixed seed, deterministic).
On a CPU the quantized variants run the reference forward op on the fp8 / int8 inputs."""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import train_convergence as tc  # noqa: E402


def _run(tmp_path, capsys, *argv):
    res = tc.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), *argv])
    return res, capsys.readouterr().out


def test_all_variants_tiny(tmp_path, capsys):
    res, out = _run(tmp_path, capsys, "--steps", "4", "--eval-every", "2")
    rows = {r["variant"]: r for r in res["rows"]}
    assert list(rows) == list(tc.VARIANTS)
    for r in res["results"]:
        assert r["steps_done"] == 4 and r["nan_step"] is None and r["stopped"] is None
        assert len(r["log"]) == 4 and all(math.isfinite(x["train_loss"]) and x["step_ms"] > 0 for x in r["log"])
        assert [e["step"] for e in r["evals"]] == [0, 2, 4]
        assert all(math.isfinite(e["val_loss"]) for e in r["evals"])
    # the quantized variants go through a forward op on fp8 / int8 inputs, and it changes the output
    for name, dtypes in (("fp8", "float8_e4m3fn/float8_e4m3fn/float8_e4m3fn"), ("i8fp8", "int8/int8/float8_e4m3fn")):
        r = next(x for x in res["results"] if x["variant"] == name)
        assert r["ops"]["fw_problem"].startswith(dtypes), r["ops"]
        assert 1e-3 < r["probe"]["fwd_rel_err"] < 0.1, r["probe"]
        assert math.isfinite(r["final_val_loss_sdpa_attn"])
    sdpa = next(x for x in res["results"] if x["variant"] == "sdpa")
    assert sdpa["probe"]["fwd_rel_err"] < 1e-2
    # same init and data: step-0 validation losses differ only by the attention's rounding; close after 4 steps
    v0 = {r["variant"]: r["evals"][0]["val_loss"] for r in res["results"]}
    assert abs(v0["fp8"] - v0["sdpa"]) < 1e-3 and abs(v0["i8fp8"] - v0["sdpa"]) < 1e-3
    assert abs(rows["fp8"]["val_ratio"] - 1) < 0.01 and abs(rows["i8fp8"]["val_ratio"] - 1) < 0.01
    assert "target" in rows["fp8"] and "target" not in rows["sdpa"]
    with open(res["json"]) as f:
        data = json.load(f)
    assert [r["variant"] for r in data["rows"]] == list(tc.VARIANTS)
    assert len(data["variants"][1]["log"]) == 4 and data["compare_step"] == 4
    assert os.path.exists(os.path.join(tmp_path, "train_convergence.md"))
    last = out.strip().splitlines()
    n = len(tc.VARIANTS)
    assert last[-n - 1].split()[:3] == ["variant", "steps", "val_loss"]
    assert [ln.split()[0] for ln in last[-n:]] == list(tc.VARIANTS)
    # the no-attention variant bounds any attention kernel's step speedup
    assert rows["noattn"]["target"].startswith("ceiling") and rows["noattn"]["speedup"] is not None
    assert all(r["ops"]["fw"] in out for r in res["results"])  # the selected forward ops are printed


def test_sdpa_loss_decreases(tmp_path, capsys):
    res, _ = _run(tmp_path, capsys, "--variants", "sdpa", "--steps", "20")
    r = res["results"][0]
    losses = [x["train_loss"] for x in r["log"]]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 0.3  # starts near uniform over bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert r["evals"][-1]["step"] == 20 and r["evals"][-1]["val_loss"] < r["evals"][0]["val_loss"] - 1.0


def test_data_order_and_init_are_fixed():
    train, _, info = tc.load_corpus(tc.sysconfig.get_paths()["stdlib"], 10)
    assert info["val_files"] > 0 and info["train_bytes"] > 4 * info["val_bytes"] > 0
    a, b = (tc.Batches(train, 2, 16, 0, 3, torch.device("cpu")) for _ in range(2))
    for step in range(3):
        x, y = a[step]
        assert torch.equal(x, b[step][0]) and torch.equal(x[:, 1:], y[:, :-1])
    torch.manual_seed(0)
    m1 = tc.GPT(1, 32, 2, 16)
    torch.manual_seed(0)
    m2 = tc.GPT(1, 32, 2, 16)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


def test_divergence_stops_and_is_reported(tmp_path, capsys):
    res, out = _run(tmp_path, capsys, "--variants", "sdpa,fp8", "--steps", "20", "--lr", "1e30", "--warmup", "1")
    for r in res["results"]:
        assert r["nan_step"] is not None and r["nan_step"] < 5 and "non-finite" in r["stopped"]
    assert "STOPPED" in out and res["rows"][1]["target"].startswith("missed: NaN/Inf")
