"""registry.Selector with a fresh Registry and dummy ops: ranking, determinism, memoization, overrides
(op=, use_ops, environment), errors, explain; TuningTable / TuningTables."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest

from registry import Arch, NoSupportedOpError, Op, Registry, Selector, TuningTable, TuningTables
from registry.select import Report

CPU = Arch("cpu")


@dataclass(frozen=True)
class Prob:
    arch: Arch = CPU
    size: int = 1
    flavor: str = "plain"

    def bucket(self) -> str:
        return f"s{self.size}|{self.flavor}"

    def __str__(self) -> str:
        return f"P(size={self.size}, {self.flavor})"


def op(name, kind="fw", est=None, priority=0, archs=("cpu",), refuse=(), aliases=(), legacy=(), requires=(),
       calibrated_as=None):
    """Dummy op: estimate ``est`` (a number, a callable of the problem, or None) and refuses flavors in ``refuse``."""

    def not_supported_reasons(cls, p):
        return [f"flavor {p.flavor} not supported"] if p.flavor in refuse else []

    def estimate(cls, p):
        return est(p) if callable(est) else est

    ns = dict(NAME=name, KIND=kind, ARCHS=tuple(archs), PRIORITY=priority, ALIASES=tuple(aliases),
              LEGACY_ALIASES=tuple(legacy), REQUIRES=tuple(requires), CALIBRATED_AS=calibrated_as,
              not_supported_reasons=classmethod(not_supported_reasons), estimate=classmethod(estimate))
    return type(f"Op_{name}", (Op,), ns)


def make_selector(*ops, tables=None, prefix="FMHA_OPS"):
    reg = Registry()
    for o in ops:
        reg.register(o)
    return Selector(reg, tables or TuningTables([]), env_prefix=prefix)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("FMHA_OPS_FORCE", "FMHA_OPS_DISABLE", "FMHA_OPS_LOG"):
        monkeypatch.delenv(var, raising=False)


def write_table(folder, device, timings, name="t.json"):
    os.makedirs(folder, exist_ok=True)
    TuningTable(device, {"torch": "x"}, timings).save(os.path.join(folder, name))


# ---- ranking -------------------------------------------------------------------------------------------

def test_lowest_model_estimate_wins():
    a, b, c = op("aF", est=3e-6), op("bF", est=1e-6), op("cF", est=2e-6)
    sel = make_selector(a, b, c)
    assert sel.select("k", lambda: Prob()) is b
    r = sel.explain(Prob())
    assert [v.op for v in r.verdicts] == [b, c, a]
    assert all(v.source == "model" for v in r.verdicts)


def test_table_beats_model_beats_priority(tmp_path):
    fast_model = op("fastModelF", est=1e-6)
    tabled = op("tabledF", est=5e-6)  # model says slow, the table says fastest
    prio = op("prioF", est=None, priority=1000)  # no estimate: ranks after every estimated op
    write_table(str(tmp_path), "cpu", {"tabledF": {"s1|plain": 0.5e-6}})
    sel = make_selector(fast_model, tabled, prio, tables=TuningTables([str(tmp_path)]))
    r = sel.explain(Prob())
    assert [(v.op, v.source, v.estimate) for v in r.verdicts] == [
        (tabled, "table", 0.5e-6), (fast_model, "model", 1e-6), (prio, "priority", None)]
    assert r.selected is tabled
    # another bucket: no table row -> the model decides
    assert sel.explain(Prob(size=2)).selected is fast_model
    # a table row slower than another op's model estimate loses (the table overrides only its own op's model)
    write_table(str(tmp_path), "cpu", {"tabledF": {"s1|plain": 9e-6}})
    sel.tables.reload()
    r = sel.explain(Prob())
    assert r.selected is fast_model and r.verdicts[1].source == "table" and r.verdicts[1].estimate == 9e-6


def test_unmeasured_op_gets_the_device_median_calibration(tmp_path):
    """A new op's raw estimate is scaled like its measured neighbours', not compared raw against them."""
    measured = op("measuredF", est=1e-6)  # calibrated 2x: real time 2e-6
    other = op("otherF", est=1e-6)  # calibrated 4x
    newcomer = op("newF", est=1.5e-6)  # not in the table: gets the median factor 3x -> 4.5e-6
    os.makedirs(tmp_path, exist_ok=True)
    TuningTable("cpu", {"torch": "x"}, {}, calibration={"measuredF": 2.0, "otherF": 4.0}).save(
        os.path.join(tmp_path, "t.json"))
    sel = make_selector(measured, other, newcomer, tables=TuningTables([str(tmp_path)]))
    r = sel.explain(Prob())
    assert [(v.op, v.source) for v in r.verdicts] == [
        (measured, "calibrated model"), (other, "calibrated model"), (newcomer, "calibrated model")]
    assert r.verdicts[2].estimate == pytest.approx(4.5e-6)
    # no table for the device: raw models
    assert make_selector(measured, newcomer).explain(Prob()).selected is measured
    assert make_selector(measured, newcomer).explain(Prob()).verdicts[0].source == "model"


def test_an_op_calibrated_as_another_takes_its_factor(tmp_path):
    """An op the table has not measured but that runs another op's kernels (``CALIBRATED_AS``) is scaled by that
    op's factor, not the device-wide median; its own factor, once measured, wins; a stand-in the table lacks falls
    back to the median."""
    measured = op("kernelsF", est=1e-6)  # calibrated 1x
    other = op("otherF", est=1e-6)  # calibrated 5x: the median 3x
    route = op("routeF", est=1e-6, calibrated_as="kernelsF")
    lost = op("lostF", est=1e-6, calibrated_as="missingF")
    os.makedirs(tmp_path, exist_ok=True)
    path = os.path.join(tmp_path, "t.json")
    TuningTable("cpu", {"torch": "x"}, {}, calibration={"kernelsF": 1.0, "otherF": 5.0}).save(path)
    sel = make_selector(measured, other, route, lost, tables=TuningTables([str(tmp_path)]))
    estimates = {v.op.NAME: v.estimate for v in sel.explain(Prob()).verdicts}
    assert estimates["routeF"] == pytest.approx(1e-6) and estimates["lostF"] == pytest.approx(3e-6)
    TuningTable("cpu", {"torch": "x"}, {}, calibration={"kernelsF": 1.0, "otherF": 5.0, "routeF": 2.0}).save(path)
    sel.tables.reload()
    assert {v.op.NAME: v.estimate for v in sel.explain(Prob()).verdicts}["routeF"] == pytest.approx(2e-6)


def test_priority_ranks_ops_without_estimates():
    lo, hi = op("loF", priority=-5), op("hiF", priority=7)
    sel = make_selector(lo, hi)
    assert sel.select("k", lambda: Prob()) is hi
    nan = op("nanF", est=float("nan"), priority=1)
    inf = op("infF", est=float("inf"), priority=2)
    sel = make_selector(lo, nan, inf)
    r = sel.explain(Prob())
    assert r.selected is inf and [v.source for v in r.verdicts] == ["priority"] * 3  # non-finite -> no estimate


def test_tie_break_priority_then_name_independent_of_registration_order():
    ops = [op("zetaF", est=1e-6), op("alphaF", est=1e-6), op("midF", est=1e-6, priority=1), op("betaF", est=1e-6)]
    names = []
    for order in (ops, ops[::-1], [ops[2], ops[0], ops[3], ops[1]]):
        sel = make_selector(*order)
        names.append([v.op.NAME for v in sel.explain(Prob()).verdicts])
    assert names[0] == ["midF", "alphaF", "betaF", "zetaF"]
    assert names[0] == names[1] == names[2]


H200 = Arch("cuda", (9, 0), name="NVIDIA H200")


def gpu_op(name, est, host_us):
    """A dummy CUDA op that counts as available on this machine, with host time ``host_us`` per call."""
    o = op(name, est=est, archs=("cuda>=9.0",))
    o.HOST_US = host_us
    o.available = classmethod(lambda cls: None)
    return o


def test_gpu_ops_rank_by_the_larger_of_device_and_host_time():
    """A tiny problem runs at the pace of the host: the op with the cheaper launch path wins there; a large one
    is ranked by device time; ties on host time break on device time; on a CPU host time is not added."""
    kernel = gpu_op("kernelF", est=lambda p: 5e-6 * p.size, host_us=60.0)  # fast kernel, slow launch path
    library = gpu_op("libraryF", est=lambda p: 8e-6 * p.size, host_us=20.0)
    sel = make_selector(kernel, library)
    r = sel.explain(Prob(arch=H200))
    assert [(v.op, v.estimate, v.source, v.device_estimate) for v in r.verdicts] == [
        (library, pytest.approx(20e-6), "model, host-bound", pytest.approx(8e-6)),
        (kernel, pytest.approx(60e-6), "model, host-bound", pytest.approx(5e-6))]
    big = sel.explain(Prob(arch=H200, size=100))
    assert big.selected is kernel and all(v.source == "model" for v in big.verdicts)
    twin = gpu_op("twinF", est=lambda p: 3e-6 * p.size, host_us=60.0)
    assert make_selector(kernel, twin).explain(Prob(arch=H200)).selected is twin  # same host time: faster kernel
    cpu_kernel, cpu_library = op("cpuKernelF", est=5e-6), op("cpuLibraryF", est=8e-6)
    cpu_kernel.HOST_US, cpu_library.HOST_US = 60.0, 20.0
    assert make_selector(cpu_kernel, cpu_library).explain(Prob()).selected is cpu_kernel


def test_a_tables_measured_host_time_replaces_the_declared_one(tmp_path):
    """The table's ``host`` entry (host seconds per call measured through the API) ranks a small call in place of
    HOST_US; it survives a save / load; ops the table did not time keep their declared host time."""
    kernel = gpu_op("kernelF", est=lambda p: 5e-6 * p.size, host_us=10.0)
    library = gpu_op("libraryF", est=lambda p: 8e-6 * p.size, host_us=20.0)
    declared = make_selector(kernel, library).explain(Prob(arch=H200))
    assert declared.selected is kernel  # max(5, 10) us vs max(8, 20) us: the declared host times
    TuningTable("NVIDIA H200", {"torch": "x"}, host={"kernelF": 30e-6}).save(str(tmp_path / "t.json"))
    tables = TuningTables([str(tmp_path)])
    assert tables.host_time("NVIDIA H200", "kernelF") == pytest.approx(30e-6)
    assert tables.host_time("NVIDIA H200", "libraryF") is None and tables.host_time("cpu", "kernelF") is None
    report = make_selector(kernel, library, tables=tables).explain(Prob(arch=H200))
    assert report.selected is library  # max(5, 30) us vs max(8, 20) us
    measured = {v.op: v for v in report.verdicts}
    assert measured[kernel].estimate == pytest.approx(30e-6) and measured[kernel].source.endswith("host-bound")
    assert measured[library].estimate == pytest.approx(20e-6)


def test_unsupported_and_unavailable_rank_last_and_never_win():
    bad = op("badF", est=1e-9, refuse=("plain",))
    missing = op("missingF", est=1e-9, requires=("fmha_ops_no_such_module_xyz",))
    gpu = op("gpuOnlyF", est=1e-9, archs=("cuda>=9.0",))
    ok = op("okF", est=1.0)
    sel = make_selector(bad, missing, gpu, ok)
    r = sel.explain(Prob())
    assert r.selected is ok and r.verdicts[0].op is ok
    assert all(not v.ok and v.estimate is None for v in r.verdicts[1:])


def test_arch_mismatch_is_a_reason():
    cpu_op = op("cpuF", est=1e-6)
    sel = make_selector(cpu_op)
    gpu_problem = Prob(arch=Arch("cuda", (9, 0), name="NVIDIA H200"))
    v = sel.verdict(cpu_op, gpu_problem)
    assert v.unavailable is None
    assert v.reasons == ("runs on cpu; the inputs are on cuda sm90 (NVIDIA H200)",)
    with pytest.raises(NoSupportedOpError, match="cpuF: runs on cpu"):
        sel.select("gpu", lambda: gpu_problem)


def test_selection_within_kind():
    fw, bw = op("xF", est=2.0), op("xB", kind="bw", est=1.0)
    sel = make_selector(fw, bw)
    assert sel.select("k", lambda: Prob(), "fw") is fw
    assert sel.select("k", lambda: Prob(), "bw") is bw


# ---- memoization ---------------------------------------------------------------------------------------

def test_memoized_per_key_make_problem_called_once():
    estimates = []
    a = op("aF", est=lambda p: estimates.append(p) or 1e-6)
    sel = make_selector(a, op("bF", est=2e-6))
    calls = []

    def make(size):
        def f():
            calls.append(size)
            return Prob(size=size)
        return f

    for _ in range(5):
        assert sel.select(("sig", 1), make(1)) is a
    assert calls == [1] and len(estimates) == 1
    sel.select(("sig", 2), make(2))
    sel.select(("sig", 2), make(2))
    sel.select(("sig", 1), make(1))
    assert calls == [1, 2]
    sel.select(("sig", 1), make(1), op="bF")  # a different override is a different memo key
    sel.select(("sig", 1), make(1), op="bF")
    assert calls == [1, 2, 1]
    with sel.use_ops("aF"):  # so is a scope
        sel.select(("sig", 1), make(1))
        sel.select(("sig", 1), make(1))
    assert calls == [1, 2, 1, 1]
    sel.clear()
    sel.select(("sig", 1), make(1))
    assert calls == [1, 2, 1, 1, 1]


def test_errors_are_not_memoized():
    sel = make_selector(op("aF", refuse=("bad",)))
    calls = []
    for _ in range(2):
        with pytest.raises(NoSupportedOpError):
            sel.select("k", lambda: calls.append(1) or Prob(flavor="bad"))
    assert len(calls) == 2


# ---- op= -------------------------------------------------------------------------------------------------

def test_op_argument_forms():
    a = op("aF", est=1.0, aliases=("a_alias",))
    b = op("bF", est=9.0, legacy=("b_old",))
    ab_ = op("aB", kind="bw", est=1.0)
    sel = make_selector(a, b, ab_)
    p = lambda: Prob()  # noqa: E731
    assert sel.select("k", p) is a
    assert sel.select("k", p, op=b) is b
    assert sel.select("k", p, op="bF") is b
    assert sel.select("k", p, op="a_alias") is a
    with pytest.warns(FutureWarning, match="'b_old' is a legacy alias; use 'bF'"):
        assert sel.select("k2", p, op="b_old") is b
    assert sel.select("k", p, "fw", op=(b, ab_)) is b
    assert sel.select("k", p, "bw", op=(b, ab_)) is ab_
    assert sel.select("k", p, "bw", op=(b, None)) is ab_  # None half: selector chooses
    assert sel.resolve(None, "fw") is None


@pytest.mark.parametrize("bad,msg", [
    ("nosuchF", r"op='nosuchF' is not a registered op; registered: aB, aF"),
    (3, r"op=3 is not an op class, op name or \(FwOp, BwOp\) tuple"),
    (object, r"is not an op class"),
    (("aF",), r"a tuple must be \(FwOp, BwOp\)"),
    ("aB", r"op='aB' is a bw op; a fw op is needed here"),
])
def test_op_argument_errors(bad, msg):
    sel = make_selector(op("aF"), op("aB", kind="bw"))
    with pytest.raises(ValueError, match=msg):
        sel.select("k", lambda: Prob(), "fw", op=bad)


def test_forced_op_that_cannot_run_raises_never_falls_back():
    slow_ok = op("okF", est=1.0)
    picky = op("pickyF", est=1e-9, refuse=("plain",))
    missing = op("missingF", requires=("fmha_ops_no_such_module_xyz",))
    sel = make_selector(slow_ok, picky, missing)
    with pytest.raises(NoSupportedOpError) as e:
        sel.select("k", lambda: Prob(), op=picky)
    assert isinstance(e.value, ValueError)
    assert str(e.value) == "op='pickyF' cannot run this call: flavor plain not supported\n  problem: P(size=1, plain)"
    with pytest.raises(ValueError, match=r"op='missingF' cannot run this call: unavailable: package "
                                         r"'fmha_ops_no_such_module_xyz' is not installed"):
        sel.select("k", lambda: Prob(), op="missingF")
    r = sel.explain(Prob(), op="pickyF")
    assert r.selected is None and [v.op for v in r.verdicts] == [picky] and "forced by op='pickyF'" in r.note


# ---- use_ops ---------------------------------------------------------------------------------------------

def test_use_ops_restricts_forces_nests_and_restores():
    a, b, c = op("aF", est=1.0), op("bF", est=2.0), op("cF", est=3.0, refuse=("plain",))
    bw = op("aB", kind="bw", est=1.0)
    sel = make_selector(a, b, c, bw)
    p = lambda: Prob()  # noqa: E731
    assert sel.select("k", p) is a
    with sel.use_ops("bF", "cF"):
        assert sel.select("k", p) is b
        assert [v.op for v in sel.explain(Prob()).verdicts] == [b, c]
        with pytest.raises(NoSupportedOpError, match="no bw op supports"):
            sel.select("k", p, "bw")
        with sel.use_ops(exclude=["bF"]):  # inner scope narrows the outer one: only cF is left, and it refuses
            with pytest.raises(NoSupportedOpError, match="cF: flavor plain"):
                sel.select("k", p)
        with sel.use_ops("aF", "bF"):  # allowed sets intersect: {bF}
            assert sel.select("k", p) is b
        assert sel.select("k", p) is b  # restored
        with sel.use_ops(c):  # one op: forced; it cannot run -> error naming it, no fallback
            with pytest.raises(NoSupportedOpError, match=r"(?s)restricted by use_ops to \['cF'\].*cF: flavor plain"):
                sel.select("k", p)
        assert sel.select("k", p) is b
    assert sel.select("k", p) is a
    with sel.use_ops(exclude=[a, "bF"]):
        with pytest.raises(NoSupportedOpError, match="excluded"):
            sel.select("k", p)
    with sel.use_ops("aF", "aB"):  # ops of both kinds in one scope
        assert sel.select("k", p, "fw") is a and sel.select("k", p, "bw") is bw
    assert sel.select("k", p) is a


def test_use_ops_restores_after_exception():
    a, b = op("aF", est=1.0), op("bF", est=2.0)
    sel = make_selector(a, b)
    with pytest.raises(RuntimeError):
        with sel.use_ops("bF"):
            raise RuntimeError
    assert sel.select("k", lambda: Prob()) is a


def test_use_ops_unknown_name_raises():
    sel = make_selector(op("aF"))
    with pytest.raises(ValueError, match="'zzF' is not a registered op"):
        with sel.use_ops("zzF"):
            pass


def test_op_argument_beats_use_ops():
    a, b = op("aF", est=1.0), op("bF", est=2.0)
    sel = make_selector(a, b)
    with sel.use_ops("aF"):
        assert sel.select("k", lambda: Prob(), op="bF") is b


# ---- environment -----------------------------------------------------------------------------------------

def test_env_force_per_kind(monkeypatch):
    a, b, ab_, bb = op("aF", est=1.0), op("bF", est=2.0), op("aB", kind="bw", est=1.0), op("bB", kind="bw", est=2.0)
    sel = make_selector(a, b, ab_, bb)
    assert sel.select("k", lambda: Prob()) is a
    monkeypatch.setenv("FMHA_OPS_FORCE", "bF")
    assert sel.select("k", lambda: Prob()) is a  # not re-read until refresh_env
    sel.refresh_env()
    assert sel.select("k", lambda: Prob()) is b
    assert sel.select("k", lambda: Prob(), "bw") is ab_  # no bw op forced
    assert "forced by FMHA_OPS_FORCE" in sel.explain(Prob()).note
    monkeypatch.setenv("FMHA_OPS_FORCE", "bF,bB")
    sel.refresh_env()
    assert sel.select("k", lambda: Prob(), "bw") is bb


def test_env_force_names_with_spaces(monkeypatch):
    a, b, bb = op("aF", est=1.0), op("bF", est=2.0), op("bB", kind="bw", est=2.0)
    sel = make_selector(a, b, bb)
    monkeypatch.setenv("FMHA_OPS_FORCE", "bF, bB")
    sel.refresh_env()
    assert sel.select("k", lambda: Prob()) is b
    assert sel.select("k", lambda: Prob(), "bw") is bb


def test_env_forced_op_that_cannot_run_raises(monkeypatch):
    a, picky = op("aF", est=1.0), op("pickyF", refuse=("plain",))
    sel = make_selector(a, picky)
    monkeypatch.setenv("FMHA_OPS_FORCE", "pickyF")
    sel.refresh_env()
    with pytest.raises(NoSupportedOpError, match=r"(?s)forced by FMHA_OPS_FORCE.*pickyF: flavor plain not supported"):
        sel.select("k", lambda: Prob())


def test_env_disable(monkeypatch):
    a, b = op("aF", est=1.0, aliases=("a_alias",)), op("bF", est=2.0)
    sel = make_selector(a, b)
    monkeypatch.setenv("FMHA_OPS_DISABLE", "aF")
    sel.refresh_env()
    assert sel.select("k", lambda: Prob()) is b
    monkeypatch.setenv("FMHA_OPS_DISABLE", "a_alias")  # by alias
    sel.refresh_env()
    assert sel.select("k", lambda: Prob()) is b
    monkeypatch.setenv("FMHA_OPS_DISABLE", " aF , bF ")
    sel.refresh_env()
    with pytest.raises(NoSupportedOpError, match=r"excluded: \['aF', 'bF'\]"):
        sel.select("k", lambda: Prob())
    monkeypatch.delenv("FMHA_OPS_DISABLE")
    sel.refresh_env()
    assert sel.select("k", lambda: Prob()) is a


def test_env_log(monkeypatch, capsys):
    a = op("aF", est=1.0)
    sel = make_selector(a)
    sel.select("k0", lambda: Prob())
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("FMHA_OPS_LOG", "1")
    sel.refresh_env()
    sel.select("k", lambda: Prob(size=3))
    sel.select("k", lambda: Prob(size=3))  # memo hit: logged once
    assert capsys.readouterr().err == "[fmha_ops] fw P(size=3, plain) -> aF\n"
    monkeypatch.setenv("FMHA_OPS_LOG", "0")
    sel.refresh_env()
    sel.select("k", lambda: Prob(size=3))
    assert capsys.readouterr().err == ""


def test_env_prefix_isolated(monkeypatch):
    a, b = op("aF", est=1.0), op("bF", est=2.0)
    monkeypatch.setenv("MYSEL_FORCE", "bF")
    assert make_selector(a, b, prefix="MYSEL").select("k", lambda: Prob()) is b
    assert make_selector(a, b).select("k", lambda: Prob()) is a


# ---- errors and explain ---------------------------------------------------------------------------------

def test_no_op_error_lists_every_op_with_reasons():
    sel = make_selector(op("aF", refuse=("odd",)), op("bF", requires=("fmha_ops_no_such_module_xyz",)),
                        op("cF", archs=("cuda>=9.0",)), op("dB", kind="bw"))
    with pytest.raises(NoSupportedOpError) as e:
        sel.select("k", lambda: Prob(flavor="odd"))
    lines = str(e.value).splitlines()
    assert lines[0] == "no fw op supports this call: P(size=1, odd)"
    assert "  aF: flavor odd not supported" in lines
    assert "  bF: unavailable: package 'fmha_ops_no_such_module_xyz' is not installed" in lines
    assert any(line.startswith("  cF: unavailable: needs") or line.startswith("  cF: runs on") for line in lines)
    assert not any("dB" in line for line in lines)
    assert len(lines) == 4


def test_explain_report_content(tmp_path):
    write_table(str(tmp_path), "cpu", {"tabF": {"s1|plain": 3e-6}})
    tab, mod, pri = op("tabF", est=1.0), op("modF", est=5e-6), op("priF")
    bad = op("badF", refuse=("plain",))
    sel = make_selector(tab, mod, pri, bad, tables=TuningTables([str(tmp_path)]))
    r = sel.explain(Prob())
    assert isinstance(r, Report) and r.selected is tab and r.kind == "fw"
    text = str(r)
    assert text.splitlines()[0] == "problem: P(size=1, plain)"
    assert "* tabF  supported  estimate 3.0 us (table)" in text
    assert "  modF  supported  estimate 5.0 us (model)" in text
    assert "  priF  supported  estimate - (priority)" in text
    assert "  badF  no: flavor plain not supported" in text
    assert text.splitlines()[-1] == "selected: tabF"
    assert [v.op.NAME for v in r.verdicts] == ["tabF", "modF", "priF", "badF"]
    none = make_selector(bad).explain(Prob())
    assert none.selected is None and str(none).splitlines()[-1] == "selected: None"


# ---- tuning tables -------------------------------------------------------------------------------------

def test_tuning_table_save_load_lookup(tmp_path):
    t = TuningTable("NVIDIA H200", {"torch": "2.11"})
    t.record("aF", "b1", 1.5e-5)
    t.record("aF", "b2", 2)
    t.record("bF", "b1", 3e-6)
    path = str(tmp_path / "sub" / "h200.json")
    t.save(path)
    data = json.load(open(path))
    assert data["device"] == "NVIDIA H200" and data["timings"]["aF"]["b2"] == 2.0
    u = TuningTable.load(path)
    assert u == t
    assert u.lookup("aF", "b1") == 1.5e-5 and u.lookup("aF", "zz") is None and u.lookup("zzF", "b1") is None


def test_tuning_tables_device_filter_and_override(tmp_path):
    d1, d2 = str(tmp_path / "shipped"), str(tmp_path / "user")
    write_table(d1, "NVIDIA H200", {"aF": {"b": 1.0, "c": 2.0}}, "a.json")
    write_table(d1, "NVIDIA H100", {"aF": {"b": 9.0}}, "b.json")
    write_table(d2, "NVIDIA H200", {"aF": {"b": 0.5}, "bF": {"b": 4.0}}, "c.json")
    tables = TuningTables([d1, "", str(tmp_path / "missing"), d2])
    assert tables.lookup("NVIDIA H200", "aF", "b") == 0.5  # later folder overrides
    assert tables.lookup("NVIDIA H200", "aF", "c") == 2.0  # merged
    assert tables.lookup("NVIDIA H200", "bF", "b") == 4.0
    assert tables.lookup("NVIDIA H100", "aF", "b") == 9.0
    assert tables.lookup("cpu", "aF", "b") is None
    write_table(d2, "NVIDIA H200", {"aF": {"b": 0.25}}, "c.json")
    assert tables.lookup("NVIDIA H200", "aF", "b") == 0.5  # cached until reload
    tables.reload()
    assert tables.lookup("NVIDIA H200", "aF", "b") == 0.25


def test_selector_ignores_tables_of_other_devices(tmp_path):
    write_table(str(tmp_path), "NVIDIA H200", {"bF": {"s1|plain": 1e-9}})
    a, b = op("aF", est=1e-6), op("bF", est=2e-6)
    sel = make_selector(a, b, tables=TuningTables([str(tmp_path)]))
    assert sel.select("k", lambda: Prob()) is a
    h200 = Arch("cuda", (9, 0), name="NVIDIA H200")
    a2, b2 = op("aF", est=1e-6, archs=("cuda>=9.0", "cpu")), op("bF", est=2e-6, archs=("cuda>=9.0", "cpu"))
    sel = make_selector(a2, b2, tables=TuningTables([str(tmp_path)]))
    r = sel.explain(Prob(arch=h200))
    assert r.selected is b2 and r.verdicts[0].source == "table"


@dataclass(frozen=True)
class GradProb(Prob):
    needs_grad: bool = False


def test_calls_needing_gradients_rank_forward_plus_backward():
    """A forward with its own slow backward loses to a slightly slower forward paired with a fast bw op when the
    call needs gradients, and wins when it does not; explain says which backward was counted."""
    own = op("ownF", est=1.0)
    own.backward_estimate = classmethod(lambda cls, p: 10.0)
    paired = op("pairedF", est=2.0)
    sel = make_selector(own, paired, op("slowB", kind="bw", est=9.0), op("fastB", kind="bw", est=3.0))
    assert sel.explain(GradProb()).selected is own
    rep = sel.explain(GradProb(needs_grad=True))
    assert rep.selected is paired
    est = {v.op.NAME: (v.estimate, v.source) for v in rep.verdicts}
    assert est["pairedF"][0] == 5.0 and "fastB" in est["pairedF"][1]
    assert est["ownF"][0] == 11.0 and "its own" in est["ownF"][1]
    # without a usable bw op the paired forward's estimate stands alone
    alone = make_selector(own, paired)
    assert alone.explain(GradProb(needs_grad=True)).selected is paired


def test_backward_models_take_no_median_calibration(tmp_path):
    """The tables time forward ops: an unmeasured forward takes their median factor, a backward op none."""
    path = tmp_path / "t.json"
    TuningTable("cpu", {"torch": "x"}, {}, calibration={"a": 2.0, "b": 4.0}).save(str(path))
    tables = TuningTables([str(tmp_path)])
    assert tables.calibration("cpu", "a") == 2.0 and tables.calibration("cpu", "new") == 3.0
    assert tables.calibration("cpu", "new", median_fallback=False) is None


def test_host_bound_estimates_within_the_tie_margin_go_to_the_least_device_time():
    """Two host-bound ops predicted within TIE_MARGIN: the one with less device time wins whichever host time
    came out lower (its source says so); outside the margin the lower estimate wins; device-bound rankings, where
    estimate and device time agree, are unchanged."""
    from registry.select import TIE_MARGIN

    light = gpu_op("lightF", est=5e-6, host_us=100.0)  # 100 us host-bound, 5 us on the device
    heavy = gpu_op("heavyF", est=60e-6, host_us=100.0 / (1 + TIE_MARGIN / 2))  # ~97.6 us host-bound, 60 us device
    r = make_selector(heavy, light).explain(Prob(arch=H200))
    assert [v.op for v in r.verdicts] == [light, heavy]
    assert r.verdicts[0].source.startswith("model, host-bound; tie within 5% of heavyF's estimate")
    assert make_selector(heavy, light).select("k", lambda: Prob(arch=H200)) is light
    cheap = gpu_op("cheapF", est=60e-6, host_us=100.0 / (1 + 2 * TIE_MARGIN))  # ~91 us: outside the margin
    assert make_selector(cheap, light).explain(Prob(arch=H200)).selected is cheap
    a, b = op("aF", est=1.00e-3), op("bF", est=1.02e-3)  # device-bound (CPU): the lower estimate
    assert make_selector(b, a).explain(Prob()).selected is a
