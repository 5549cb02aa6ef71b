"""Selector regret computed offline from a tuning table, leave-one-out: each measured grid point is hidden from
the table in turn and every op measured there is estimated from the rest (``method``: "nearest", the op's model
scaled by measured / model at the nearest measured buckets of the same kind; "factor", the op's model scaled by
its one median measured / model factor). regret = t(op ranked first) / t(fastest op measured there) - 1.
``--measured selector.json``: also the regret the selector (``Selector.estimate`` on this table) would have on a
selector bench's measured prefill calls, data the table did not see.

    python bench/diagnostics/selector_offline.py [--table fmha_ops/tuning/NVIDIA_H200.json] [--measured JSON]

Needs no GPU: the points' problems are rebuilt from their bucket keys for the table's device (an sm90 H200).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from registry import Arch, Selector, TuningTable, TuningTables  # noqa: E402
from registry.select import host_points, nearest_host, nearest_ratio  # noqa: E402

from fmha_ops.dispatch import REGISTRY  # noqa: E402
from fmha_ops.problem import Problem  # noqa: E402

TABLE = os.path.join(os.path.dirname(__file__), "..", "..", "fmha_ops", "tuning", "NVIDIA_H200.json")
H200 = Arch("cuda", (9, 0), name="NVIDIA H200")
METHODS = ("nearest", "factor")


def problem_of(bucket: str, arch: Arch = H200) -> Problem | None:
    """The problem a tuning-grid bucket key describes (batch 1, all of batch x KV heads as heads); None for a key
    of another layout (windows, softcap)."""
    fields = bucket.split("|")
    if len(fields) != 10:
        return None
    dts, dims, bias, g, page, qkv, bh, q, k, grad = fields
    qd, kd, vd = (getattr(torch, name) for name in dts.split("/"))
    d, dv = (int(x) for x in dims[1:].split("/"))
    heads_kv, ratio, mq, mk = int(bh[2:]), int(g[1:]), int(q[1:]), int(k[1:])
    quantized = qd in (torch.int8, torch.float8_e4m3fn) or kd == torch.float8_e4m3fn
    return Problem(arch, qd, kd, vd, torch.bfloat16, 1, mq, mk, mq, heads_kv * ratio, heads_kv, d, dv, bias,
                   True, int(page[1:]), ("tensor",) * 3 if quantized else ("none",) * 3, qkv == "qkv1",
                   False, False, grad == "grad1", False, False)


def host_time(table: TuningTable, op, problem: Problem, hidden: str | None = None) -> float:
    """The op's host seconds at ``problem`` as the selector takes them: its host row of the problem's kind nearest
    in size (the row of bucket ``hidden`` left out), else its one measured host time, else its declared one."""
    rows = {b: t for b, t in table.host_timings.get(op.NAME, {}).items() if b != hidden}
    return nearest_host(problem, host_points(problem, rows)) or table.host.get(op.NAME) or op.host_time(problem)


def estimate(op, problem: Problem, rows: dict[str, float], factor: float | None, method: str,
             host: float) -> float | None:
    """The op's estimate at ``problem`` from the measured ``rows`` (its own bucket hidden) by ``method``, at least
    its host time ``host`` (``host_time``)."""
    model = op.estimate(problem)
    if model is None or not math.isfinite(model):
        return None
    fitted = nearest_ratio(op, problem, rows, factor) if method == "nearest" else None
    ratio = fitted[0] if fitted else factor
    return max(model * (ratio or 1.0), host)


def leave_one_out(table: TuningTable, method: str) -> list[dict]:
    """One row per bucket measured for two or more ops: the op ranked first with that bucket hidden, the fastest
    measured op, the regret."""
    buckets = sorted({b for rows in table.timings.values() for b in rows})
    out = []
    for bucket in buckets:
        problem = problem_of(bucket)
        if problem is None:
            continue
        # what a call costs back to back: the device time, at least the op's measured host time
        times = {name: max(rows[bucket], host_time(table, REGISTRY.get(name), problem))
                 for name, rows in table.timings.items() if bucket in rows}
        if len(times) < 2:
            continue
        ests = {}
        for name in times:
            op = REGISTRY.get(name)
            rows = {b: t for b, t in table.timings[name].items() if b != bucket}
            ratios = [t / m for b, t in rows.items() if (p := problem_of(b)) and (m := op.estimate(p))]
            e = estimate(op, problem, rows, statistics.median(ratios) if ratios else None, method,
                         host_time(table, op, problem, hidden=bucket))
            if e is not None:
                ests[name] = e
        if len(ests) < 2:
            continue
        picked, best = min(ests, key=ests.get), min(times, key=times.get)
        out.append({"bucket": bucket, "selected": picked, "best": best, "regret": times[picked] / times[best] - 1})
    return out


#: a selector bench prefill label: "prefill <dtype> B<b> N<n> H<hq>/<hkv> D<d>[ causal]"
_LABEL = re.compile(r"prefill (\S+) B(\d+) N(\d+) H(\d+)/(\d+) D(\d+)( causal)?$")
#: the selector bench's prefill dtypes: (q/k/v dtype, descale kind)
_DTYPES = {"bfloat16": (torch.bfloat16, "none"), "float16": (torch.float16, "none"),
           "fp8": (torch.float8_e4m3fn, "head"), "fp8_tensor": (torch.float8_e4m3fn, "tensor")}


def problem_of_label(label: str, arch: Arch = H200) -> Problem | None:
    """The problem of a selector bench prefill call's label (None for other calls: decode, backward, i8fp8)."""
    m = _LABEL.match(label)
    if not m or m.group(1) not in _DTYPES:
        return None
    dtype, descale = _DTYPES[m.group(1)]
    b, n, hq, hkv, d = (int(x) for x in m.groups()[1:6])
    return Problem(arch, dtype, dtype, dtype, torch.bfloat16, b, n, n, b * n, hq, hkv, d, d,
                   "causal_bottom_right" if m.group(7) else "none", True, 0, (descale,) * 3, False, False, False,
                   False, False, False)


def held_out(table: TuningTable, measured: list[dict]) -> list[dict]:
    """One row per measured prefill call of a selector bench JSON (``rows``: label, ``times_us`` per op): the op
    ``Selector.estimate`` ranks first with ``table``, the fastest measured op, the regret."""
    with tempfile.TemporaryDirectory() as folder:
        table.save(os.path.join(folder, "table.json"))
        selector = Selector(REGISTRY, TuningTables([folder]))
        out = []
        for row in measured:
            problem = problem_of_label(row["call"])
            times = row["times_us"]
            if problem is None or len(times) < 2:
                continue
            ests = {name: selector.estimate(REGISTRY.get(name), problem)[0] for name in times}
            ests = {name: e for name, e in ests.items() if e is not None}
            picked, best = min(ests, key=ests.get), min(times, key=times.get)
            out.append({"call": row["call"], "selected": picked, "best": best,
                        "regret": times[picked] / times[best] - 1})
        return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default=TABLE)
    parser.add_argument("--measured", default=None, help="a selector bench's selector.json (held-out calls)")
    args = parser.parse_args(argv)
    table = TuningTable.load(args.table)
    summary = {}
    for method in METHODS:
        rows = leave_one_out(table, method)
        regrets = [r["regret"] for r in rows]
        worst = max(rows, key=lambda r: r["regret"])
        summary[method] = {"points": len(rows), "median": statistics.median(regrets), "worst": worst["regret"],
                           "misses_over_3pct": sum(r > 0.03 for r in regrets)}
        for r in sorted(rows, key=lambda r: -r["regret"])[:6]:
            print(f"{method:8s} {r['regret']:6.1%} {r['selected']:>16s} vs {r['best']:<16s} {r['bucket']}")
        inner = [r["regret"] for r in rows if "|q2048|" in r["bucket"]]
        summary[method]["interior_median"], summary[method]["interior_worst"] = statistics.median(inner), max(inner)
        print(f"{method}: {summary[method]}")
    if args.measured:
        with open(args.measured) as f:
            rows = held_out(table, json.load(f)["rows"])
        for r in rows:
            print(f"held-out {r['regret']:6.1%} {r['selected']:>16s} vs {r['best']:<16s} {r['call']}")
        regrets = [r["regret"] for r in rows]
        summary["held_out"] = {"calls": len(rows), "median": statistics.median(regrets), "worst": max(regrets)}
        print(f"held-out: {summary['held_out']}")
    return summary


if __name__ == "__main__":
    main()
