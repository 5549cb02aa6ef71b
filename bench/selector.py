"""Selector regret: over calls between and outside the tuned buckets, how much slower is the op the selector picks than
the fastest op for that call? regret = t(selected) / t(best) - 1.

python bench/selector.py [--out DIR] [--quick] [--dtypes bfloat16,fp8_tensor] [--shapes 0,3] [--decode]
                         [--budget SECONDS] [--modes table,autotune,anchors] [--record-from DIR]

Forward calls (prefill of every dtype, decode) and, for the bf16 prefill calls, the backward op that a call needing
gradients gets (every backward op timed on the same forward output and LSE). Each supporting op is timed through
``memory_efficient_attention(op=...)`` (backward: its ``apply_bw``): one untimed call first (it JIT-compiles the
configuration), then the call's ops' host times in interleaved rounds and each op's device time
(``fmha_ops.timing.op_times``: the median of 9 rounds, each op in turn, so the selected and the fastest op are timed
under the same state of the host and one pause moves neither); an op's time per call is the larger of the two (back
to back, what a call costs; what the selector ranks by). Ops whose own estimate is over ``SKIP_FACTOR`` times the
best estimate are not timed. ``--budget``: calls left when it runs out are not measured (listed). Prints each call's
row as it is measured and the summary last; writes selector.json into --out after every call (a run cut short leaves
its rows) and, at the end, selector.png (regret per call) and the record bench/results/selector.md (regret per
selection mode and kind of call; not with --quick, --dtypes, --shapes or --no-record). ``--dtypes``: only the
prefill calls of these dtypes (no decode calls; default bfloat16, fp8, fp8_tensor and the decode calls);
``--shapes``: only these prefill shapes (indices into ``PREFILL_SHAPES``; no decode calls, no record); ``--decode``:
the decode calls only (no record).
``--compile-only --shard K/N`` in N parallel processes fills the JIT caches beforehand.

``--modes`` (each measured in turn, default all three): ``table``, the selection from the tuning table and cost
models; ``autotune``, the same calls, each first made once under ``fmha_ops.autotune()`` (its contenders timed at
its shape, in a fresh cache folder; a backward row's call with its backward, which times the forward and then the
backward ops) and the selection the one for the calls after it;
``anchors``, the forward benchmark's anchor shapes (``ANCHOR_SHAPES``, on and near the tuning grid), every prefill
dtype, selected from the table: how far the public call falls short of the fastest op forced through it.

``--record-from DIR``: no measurement; the record (and selector.png in --out) from the selector_<mode>.json files in
DIR (which may be read-only), with their environment: modes measured by separate runs (``--modes table,autotune
--no-record``, then ``--modes anchors --no-record``), their JSON files gathered into one folder, make one record.
"""
from __future__ import annotations

import csv
import json
import math
import os
import tempfile
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    RESULTS,
    Record,
    base_parser,
    environment,
    out_dir,
    print_table,
    write_json,
)

from fmha_ops.dispatch import SELECTOR  # noqa: E402
from fmha_ops.inputs import make_inputs  # noqa: E402
from fmha_ops.timing import called_once, op_times  # noqa: E402
from fmha_ops.tune import Call, decode_call, prefill_call  # noqa: E402

#: ops estimated slower than this many times the best estimate are not timed (math / reference paths)
SKIP_FACTOR = 4.0
#: device time (ms) the timed calls of one op fill, after the untimed compiling call
REP_MS = 10.0
PREFILL_DTYPES = ("bfloat16", "fp8", "fp8_tensor", "i8fp8")
#: the dtypes measured without --dtypes (i8fp8 has one supporting op: no choice to get wrong)
DEFAULT_DTYPES = ("bfloat16", "fp8", "fp8_tensor")


#: between the tuning grid's buckets (lengths 512 / 2048 / 8192, batch x KV heads 8..256) and outside them; the last
#: two host-bound (B32 N256: ~10 us of device work against 30-100 us of host time per call; B64 N128, where the table
#: took 38 us against sdpa_cudnnF's 26 on the H200)
PREFILL_SHAPES = ((8, 768, 16, 16, 128, False), (1, 6000, 32, 4, 64, False), (3, 3000, 32, 8, 128, True),
                  (32, 256, 16, 16, 64, True), (6, 1500, 24, 8, 128, False), (64, 128, 16, 16, 64, False))
#: the shapes of the forward anchors in HARDWARE.md / BENCHMARKS.md (B, N, Hq, Hkv, D, causal)
ANCHOR_SHAPES = ((4, 4096, 32, 32, 128, False), (4, 4096, 32, 32, 128, True), (2, 16384, 16, 16, 128, True),
                 (1, 16384, 64, 8, 128, False), (4, 4096, 16, 16, 256, False), (3, 3000, 24, 8, 128, True),
                 (1, 9001, 40, 8, 128, False), (8, 1000, 16, 16, 128, False))
#: decode calls (B, cached keys, Hq, Hkv, page size (0: dense), KV); the last two host-bound (4 MB / 2 MB of K/V: ~1 us
#: at the H200's bandwidth against tens of us of host time)
DECODE_CALLS = ((2, 100000, 64, 8, 64, "bf16"), (48, 6000, 32, 8, 0, "bf16"), (200, 700, 32, 8, 64, "fp8"),
                (32, 3000, 32, 8, 0, "quantize"), (4, 512, 32, 8, 0, "bf16"), (4, 512, 32, 8, 16, "fp8"))
#: the dtype whose prefill calls also measure the backward selection
BACKWARD_DTYPE = "bfloat16"


def calls(device: str, quick: bool, dtypes: tuple[str, ...] | None = None,
          shapes: tuple[int, ...] | None = None, anchors: bool = False,
          decode: bool = False) -> list[tuple[str, object]]:
    """``(kind, make)`` pairs, kind "fw" or "bw", ``make()`` building the ``Call``: the prefill shapes of every
    dtype shape by shape (bf16 ones also as "bw"), then (unless ``dtypes`` or ``shapes``, indices into
    ``PREFILL_SHAPES``, is given) the decode calls; ``anchors``: the forward calls of ``ANCHOR_SHAPES`` only;
    ``decode``: the decode calls only."""
    if quick:
        small = (lambda: prefill_call(1, 100, 4, 2, 32, True, "float32", device))
        if anchors:
            return [("fw", small)]
        return [("fw", small), ("bw", small), ("fw", lambda: decode_call(3, 200, 4, 1, 32, 0, "bf16", device))]
    if anchors:
        return [("fw", lambda a=(*shape, dtype): prefill_call(*a, device))
                for shape in ANCHOR_SHAPES for dtype in dtypes or DEFAULT_DTYPES]
    out = []
    for shape in () if decode else PREFILL_SHAPES if shapes is None else [PREFILL_SHAPES[i] for i in shapes]:
        for dtype in dtypes or DEFAULT_DTYPES:
            make = (lambda a=(*shape, dtype): prefill_call(*a, device))
            out.append(("fw", make))
            if dtype == BACKWARD_DTYPE:
                out.append(("bw", make))
    if not dtypes and shapes is None:
        out += [("fw", lambda a=(b, length, hq, hkv, 128, page, kv): decode_call(*a, device))
                for b, length, hq, hkv, page, kv in DECODE_CALLS]
    return out


#: ``--compile-only``: each timed op's untimed call only (filling the JIT caches a later timed run reads);
#: ``autotune``: the mode being measured makes the forward selection under autotune
_RUN = {"compile_only": False, "autotune": False}
MODES = ("table", "autotune", "anchors")
#: (median, worst) regret each mode's calls should stay within (None: no bound): selected from the table, median <= 2%
#: and worst <= 15% off the grid; under autotune worst <= 3% from a call's second time on; at the anchors the public
#: call >= 0.98x the fastest op forced through it (regret <= 1 / 0.98 - 1)
TARGETS = {"table": (0.02, 0.15), "autotune": (None, 0.03), "anchors": (None, 1 / 0.98 - 1)}
#: what an op's first call may raise on a shape it cannot take here: the op is left out of the row
_SKIPPED = (torch.OutOfMemoryError, NotImplementedError, RuntimeError)


def time_ops(fns: dict, device: str) -> dict[str, tuple[float, float]]:
    """(device seconds, host seconds) per ``fns[name]()`` (``fmha_ops.timing.op_times``: host times in interleaved
    rounds) after one untimed call each (JIT compilation, graph building; an op whose call raises is left out).
    With ``--compile-only`` the untimed calls alone (every op (1.0, 1.0))."""
    ran = called_once(fns, _SKIPPED, _print_skip)
    if _RUN["compile_only"]:
        return {name: (1.0, 1.0) for name in ran}
    return op_times(ran, device, REP_MS)


def _print_skip(name: str, e: BaseException) -> None:
    print(f"  [skip] {name}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")


def contenders(problem, kind: str) -> tuple[type | None, list, dict]:
    """The op the selector picks for ``problem``, the supporting ops worth timing (estimate within SKIP_FACTOR of
    the best estimate; the selected op always) and their estimates: what the selector ranked by (us, and its
    source) and the op's own uncalibrated model (us), kept with each row so calibrations can be derived from the
    measured times."""
    report = SELECTOR.explain(problem, kind)
    ok = [v for v in report.verdicts if v.ok]
    best = min((v.estimate for v in ok if v.estimate is not None), default=math.inf)
    keep = [v.op for v in ok if v.op is report.selected or v.estimate is None or v.estimate <= SKIP_FACTOR * best]
    estimates = {v.op.NAME: {"ranked_us": v.estimate and v.estimate * 1e6, "source": v.source,
                             "model_us": (v.op.estimate(problem) or 0.0) * 1e6} for v in ok if v.op in keep}
    return report.selected, keep, estimates


def measure_forward(call: Call, device: str) -> tuple[str, dict[str, tuple[float, float]], dict]:
    """(selected op name, (device, host) seconds per timed op, estimates per op as ``contenders`` gives) for one
    forward call."""
    from fmha_ops.api import memory_efficient_attention

    if _RUN["autotune"]:
        with SELECTOR.autotune():
            memory_efficient_attention(*call.args, **call.kwargs)  # the first call: autotune times the contenders
            selected, ops, estimates = contenders(call.problem(), "fw")
    else:
        selected, ops, estimates = contenders(call.problem(), "fw")
    fns = {op.NAME: partial(memory_efficient_attention, *call.args, op=op, **call.kwargs) for op in ops}
    return selected.NAME, time_ops(fns, device), estimates


def measure_backward(call: Call, device: str) -> tuple[str, dict[str, tuple[float, float]], dict]:
    """(selected backward op name, (device, host) seconds per timed backward op, estimates) for the call with
    gradients (``memory_efficient_attention`` on tensors that require them; under autotune made once with its
    backward first, which times its forward and backward ops): every backward op gets the same output, LSE and
    output gradient (from the forward the selector picks for the call with the LSE)."""
    from fmha_ops.api import memory_efficient_attention

    q, k, v, bias = call.args
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    inp = make_inputs(q, k, v, bias, **call.kwargs)
    inp.validate()
    problem = inp.problem()
    with SELECTOR.autotune(_RUN["autotune"]):
        if _RUN["autotune"]:
            memory_efficient_attention(q, k, v, bias, **call.kwargs).sum().backward()
        fw = SELECTOR.explain(inp.problem(needs_lse=True), "fw").selected
        selected, ops, estimates = contenders(problem, "bw")
    with torch.no_grad():
        out, lse = fw.apply(inp, True)
    grad = torch.randn_like(out)
    fns = {op.NAME: partial(op.apply_bw, inp, out, lse, grad) for op in ops}
    return selected.NAME, time_ops(fns, device), estimates


def regret_row(label: str, selected: str, measured: dict[str, tuple[float, float]]) -> dict:
    """One table row from (device, host) seconds per op: the selected and the fastest op, their times per call
    back to back (us; the larger of device and host time) and the regret (None when the selected op was not
    timed).

    >>> regret_row("c", "a", {"a": (2e-6, 1e-6), "b": (1e-6, 1.5e-6)})["regret"]
    0.33333333333333326
    """
    times = {k: max(v) for k, v in measured.items()}
    best = min(times, key=times.get)
    t_sel = times.get(selected)
    return {"call": label, "selected": selected, "best": best, "t_sel_us": t_sel and t_sel * 1e6,
            "t_best_us": times[best] * 1e6, "regret": (t_sel / times[best] - 1) if t_sel else None,
            "times_us": {k: v * 1e6 for k, v in times.items()},
            "device_us": {k: v[0] * 1e6 for k, v in measured.items()},
            "host_us": {k: v[1] * 1e6 for k, v in measured.items()}}


def summarize(rows: list[dict]) -> dict:
    """Median and worst regret over the rows with a regret, and how many rows had none."""
    regrets = [r["regret"] for r in rows if r["regret"] is not None]
    return {"median_regret": statistics.median(regrets) if regrets else None,
            "worst_regret": max(regrets) if regrets else None,
            "calls": len(rows), "unmeasured_selected": sum(r["regret"] is None for r in rows)}


#: what each mode's rows are, for the record's table
MODE_LABELS = {"table": "off the grid / table", "autotune": "off the grid / autotune", "anchors": "anchors / table"}
RECORD = Record(
    "selector", "Selector regret", "PYTHONPATH=$PWD python bench/selector.py",
    {"kind": "kind of call", **{label: label for label in MODE_LABELS.values()}})


def by_kind(groups: list[dict]) -> list[dict]:
    """The record's table: one row per kind of call (in the order ``groups`` first gives it), one cell per mode
    (``MODE_LABELS``) saying "median / worst regret (calls; worst call: selected vs fastest)" of that group.
    ``groups``: per (mode label, kind of call) its ``calls``, ``median``, ``worst`` and ``worst_call`` texts.

    >>> by_kind([{"mode": "anchors / table", "kind": "prefill fp8", "calls": 8, "median": "0.0%",
    ...           "worst": "5.0%", "worst_call": "B8 N1000: a vs b"}])[0]["anchors / table"]
    '0.0% / 5.0% (8; B8 N1000: a vs b)'
    """
    rows: dict[str, dict] = {}
    for g in groups:
        worst_call = "" if g["worst_call"] == "-" else f"; {g['worst_call']}"
        rows.setdefault(g["kind"], {"kind": g["kind"]})[g["mode"]] = (
            f"{g['median']} / {g['worst']} ({g['calls']}{worst_call})")
    return list(rows.values())


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def target_text(mode: str, summary: dict) -> str:
    """``summary``'s median and worst regret with ``TARGETS[mode]`` beside them.

    >>> target_text("autotune", {"median_regret": 0.0, "worst_regret": 0.05})
    'median 0.0%, worst 5.0% (target <= 3.0%: missed)'
    """
    parts = []
    for label, value, bound in zip(("median", "worst"), (summary["median_regret"], summary["worst_regret"]),
                                   TARGETS[mode]):
        verdict = "" if bound is None or value is None else f" (target <= {bound:.1%}: " + (
            "met)" if value <= bound else "missed)")
        parts.append(f"{label} {_pct(value)}{verdict}")
    return ", ".join(parts)


#: every call's row of the record: its selection mode, the op selected and the fastest op, their times and the regret
CALLS_FILE = "selector_calls.csv"
CALL_COLUMNS = ("mode", "call", "selected", "best", "t_sel_us", "t_best_us", "regret")


def write_calls(runs: dict[str, list[dict]], results_dir: str) -> str:
    """``CALLS_FILE`` in ``results_dir``: one line per measured call of ``runs`` (mode -> rows), ``CALL_COLUMNS``
    (times in us per call, the regret as a fraction; empty where the selected op was not timed)."""
    path = os.path.join(results_dir, CALLS_FILE)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(CALL_COLUMNS)
        for mode, rows in runs.items():
            for r in rows:
                out.writerow([MODE_LABELS[mode]] + [_cell(r[c]) for c in CALL_COLUMNS[1:]])
    return path


def _cell(value) -> str:
    """A CSV cell: text as is, a number to 4 significant digits, None empty."""
    if value is None:
        return ""
    return value if isinstance(value, str) else f"{value:.4g}"


def record(runs: dict[str, list[dict]], env: dict, png: str | None = None, skipped: tuple[str, ...] = ()) -> str:
    """Write bench/results/selector.md: regret per mode (``MODES``) and kind of call (the label's first two words)
    from ``runs`` (mode -> rows), and every call's selected and fastest op with both times into ``CALLS_FILE`` beside
    it; ``skipped``: the calls the time budget left out."""
    table = []
    for mode, rows in runs.items():
        groups: dict[str, list[dict]] = {}
        for r in rows:
            groups.setdefault(" ".join(r["call"].split()[:2]), []).append(r)
        for name, members in groups.items():
            regrets = [r["regret"] for r in members if r["regret"] is not None]
            worst = max(members, key=lambda r: -1 if r["regret"] is None else r["regret"])
            table.append({"mode": MODE_LABELS[mode], "kind": name, "calls": len(members),
                          "median": _pct(statistics.median(regrets)) if regrets else "-",
                          "worst": _pct(worst["regret"]),
                          "worst_call": (f"{worst['call'].split(' ', 2)[-1]}: {worst['selected']} vs {worst['best']}"
                                         if worst["regret"] else "-")})
    overall = "; ".join(f"{MODE_LABELS[m]}: {target_text(m, summarize(rows))}" for m, rows in runs.items())
    notes = (f"{overall}. Cells: median / worst regret (calls; the worst call: selected vs fastest op). Regret = "
             "t(selected) / t(fastest supporting op) - 1, t = max(device, host time) per call "
             "(host: median of 9 rounds interleaving the call's ops). Off the grid: calls between and outside the "
             "tuned buckets (other lengths, batch sizes, GQA ratios, head dims), decode included; backward rows: the "
             "backward op a bf16 call with gradients gets, against every backward op on the same output and LSE. "
             "Autotune: each call made once under fmha_ops.autotune() first (backward rows: with its backward). "
             "Anchors: the forward anchors (1000-16384 tokens, GQA 1-8, head dims 128 and 256), every op forced "
             "through the public call.")
    if skipped:
        notes += f" Not measured (time budget): {len(skipped)} calls, from {skipped[0]}."
    write_calls(runs, RESULTS)
    notes += f" Every call's selected and fastest op with both times: bench/results/{CALLS_FILE}."
    return RECORD.write(by_kind(table), env, png, notes)


def plot(d: str, runs: dict[str, list[dict]]) -> str | None:
    """selector.png: regret per call (bars), one panel per mode, in ``d``; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 4.0 * len(runs)), squeeze=False)
    for ax, (mode, rows) in zip(axes[:, 0], runs.items()):
        summary = summarize(rows)
        ax.bar(range(len(rows)), [100 * (r["regret"] or 0) for r in rows])
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["call"] for r in rows], rotation=75, ha="right", fontsize=6)
        ax.set_ylabel("regret (%)")
        ax.set_title(f"{MODE_LABELS[mode]}: median {_pct(summary['median_regret'])}, "
                     f"worst {_pct(summary['worst_regret'])}", fontsize=9)
    fig.tight_layout()
    path = os.path.join(d, "selector.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def measure_mode(mode: str, args, device: str, d: str) -> tuple[list[dict], list[str]]:
    """(rows, calls left unmeasured by the budget) of one mode; rows also written to selector_<mode>.json in ``d``
    after every call (a run cut by a time limit leaves its rows)."""
    _RUN["autotune"] = mode == "autotune"
    dtypes = tuple(args.dtypes.split(",")) if args.dtypes else None
    shapes = tuple(int(i) for i in args.shapes.split(",")) if args.shapes else None
    shard, shards = (int(x) for x in args.shard.split("/"))
    t_start = time.perf_counter()
    rows, skipped = [], []
    for i, (kind, make) in enumerate(calls(device, args.quick, dtypes, shapes, mode == "anchors", args.decode)):
        if i % shards != shard:
            continue
        call = make()
        label = call.label if kind == "fw" else "backward " + call.label.split(" ", 1)[1]
        if args.budget and time.perf_counter() - t_start > args.budget:
            skipped.append(label)
            continue
        selected, times, estimates = (measure_forward if kind == "fw" else measure_backward)(call, device)
        if args.compile_only:
            continue
        if times:
            rows.append(regret_row(label, selected, times) | {"estimates": estimates})
            r = rows[-1]
            print(f"[{mode}] {label}: {selected} vs {r['best']} regret {_pct(r['regret'])} "
                  f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
            write_json(d, f"selector_{mode}", rows, {"summary": summarize(rows) | {"partial": True}})
        del call
    if not args.compile_only:
        write_json(d, f"selector_{mode}", rows, {"summary": summarize(rows) | {"not_measured": skipped}})
    return rows, skipped


def load_runs(d: str) -> tuple[dict[str, list[dict]], tuple[str, ...], dict]:
    """(mode -> rows, calls left unmeasured, environment) from the selector_<mode>.json files in ``d`` (``MODES``
    order; the environment of the first one found; {} where there is none)."""
    runs, skipped, env = {}, [], None
    for mode in MODES:
        path = os.path.join(d, f"selector_{mode}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            data = json.load(f)
        runs[mode] = data["rows"]
        skipped += data.get("summary", {}).get("not_measured", [])
        env = env or data.get("env")
    return runs, tuple(skipped), env or {}


def main(argv=None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default=None, help=f"comma list of {', '.join(PREFILL_DTYPES)}: prefill only")
    parser.add_argument("--shapes", default=None, help="comma list of indices into PREFILL_SHAPES: prefill only")
    parser.add_argument("--decode", action="store_true", help="the decode calls only (no record)")
    parser.add_argument("--budget", type=float, default=0.0,
                        help="seconds per mode; calls left after it are not measured")
    parser.add_argument("--shard", default="0/1", help="K/N: only every N-th call from the K-th (for --compile-only)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--compile-only", action="store_true",
                        help="run every timed op once, untimed (fills the JIT caches), and write nothing")
    parser.add_argument("--record-from", default=None, metavar="DIR",
                        help="measure nothing: write the record from DIR's selector_<mode>.json files")
    args = parser.parse_args(argv)
    if args.record_from:
        runs, skipped, env = load_runs(args.record_from)
        if not runs:
            parser.error(f"--record-from {args.record_from}: no selector_<mode>.json there")
        print("record:", record(runs, env, plot(out_dir(args.out), runs), skipped))
        return {"runs": runs, "skipped": list(skipped)}
    _RUN["compile_only"] = args.compile_only
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes {','.join(unknown)}: not a mode; modes: {', '.join(MODES)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    d = out_dir(args.out)
    runs, skipped = {}, []
    previous = os.environ.get("FMHA_OPS_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:  # autotune starts from no measurement
        os.environ["FMHA_OPS_CACHE_DIR"] = cache
        SELECTOR.refresh_env()
        try:
            for mode in modes:
                runs[mode], left = measure_mode(mode, args, device, d)
                skipped += left
        finally:
            if previous is None:
                os.environ.pop("FMHA_OPS_CACHE_DIR")
            else:
                os.environ["FMHA_OPS_CACHE_DIR"] = previous
            SELECTOR.refresh_env()
    if args.compile_only:
        return {"runs": {}}
    runs = {mode: rows for mode, rows in runs.items() if rows}
    png = plot(d, runs) if runs else None
    if runs and not (args.no_record or args.quick or args.dtypes or args.shapes or args.decode):
        print("record:", record(runs, environment(), png, tuple(skipped)))
    for mode, rows in runs.items():
        summary = summarize(rows)
        print_table(rows, ["call", "selected", "best", "t_sel_us", "t_best_us", "regret"])
        print(f"{mode}: {target_text(mode, summary)} over {summary['calls'] - summary['unmeasured_selected']} calls",
              flush=True)
    return {"runs": runs, "skipped": skipped}


if __name__ == "__main__":
    main()
