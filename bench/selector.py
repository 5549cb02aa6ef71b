"""Selector regret: over calls between and outside the tuned buckets, how much slower is the op the
selector picks than the fastest op for that call? regret = t(selected) / t(best) - 1.

    python bench/selector.py [--out DIR] [--quick] [--dtypes bfloat16,fp8_tensor]

Prints a table, writes selector.json and selector.png (regret per call) into --out and the record
bench/results/selector.md (regret per kind of call; not with --quick, --dtypes or --no-record).
``--dtypes``: only the prefill calls of these dtypes (no decode calls), for a shorter run.
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    Record,
    base_parser,
    environment,
    out_dir,
    print_table,
    write_json,
)

import fmha_ops  # noqa: E402
from fmha_ops.tune import decode_call, measure, prefill_call  # noqa: E402


PREFILL_DTYPES = ("bfloat16", "fp8", "fp8_tensor", "i8fp8")


def calls(device: str, quick: bool, dtypes: tuple[str, ...] | None = None):
    if quick:
        return [lambda: prefill_call(1, 100, 4, 2, 32, True, "float32", device),
                lambda: decode_call(3, 200, 4, 1, 32, 0, "bf16", device)]
    out = []
    for dtype in dtypes or PREFILL_DTYPES:
        for b, n, h, hkv, d, causal in ((8, 768, 16, 16, 128, False), (3, 3000, 32, 8, 128, True),
                                        (1, 6000, 32, 4, 64, False), (2, 12000, 16, 16, 128, True),
                                        (1, 20000, 8, 8, 256, False), (32, 256, 16, 16, 64, True),
                                        (6, 1500, 24, 8, 128, False)):
            out.append(lambda a=(b, n, h, hkv, d, causal, dtype): prefill_call(*a, device))
    if dtypes:
        return out
    for b, length, hq, hkv, page, kv in ((2, 100000, 64, 8, 64, "bf16"), (12, 20000, 32, 8, 16, "bf16"),
                                        (48, 6000, 32, 8, 0, "bf16"), (96, 1500, 32, 4, 256, "bf16"),
                                        (200, 700, 32, 8, 64, "fp8"), (4, 50000, 32, 8, 64, "fp8"),
                                        (32, 3000, 32, 8, 0, "quantize"), (1, 250000, 64, 8, 256, "bf16")):
        out.append(lambda a=(b, length, hq, hkv, 128, page, kv): decode_call(*a, device))
    return out


RECORD = Record(
    "selector", "Selector regret", "PYTHONPATH=$PWD python bench/selector.py",
    {"kind": "kind of call", "calls": "calls", "median": "median regret", "worst": "worst regret",
     "worst_call": "worst call: selected vs fastest"})


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def record(rows: list[dict], env: dict, png: str | None = None) -> str:
    """Write bench/results/selector.md: regret per kind of call (the label's first two words) from main's rows."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(" ".join(r["call"].split()[:2]), []).append(r)
    table = []
    for name, members in groups.items():
        regrets = [r["regret"] for r in members if r["regret"] is not None]
        worst = max(members, key=lambda r: -1 if r["regret"] is None else r["regret"])
        table.append({"kind": name, "calls": len(members),
                      "median": _pct(statistics.median(regrets)) if regrets else "-",
                      "worst": _pct(worst["regret"]),
                      "worst_call": (f"{worst['call'].split(' ', 2)[-1]}: {worst['selected']} vs {worst['best']}"
                                     if worst["regret"] else "-")})
    regrets = [r["regret"] for r in rows if r["regret"] is not None]
    notes = (f"All {len(rows)} calls: median regret {_pct(statistics.median(regrets))}, worst "
             f"{_pct(max(regrets))}; regret = t(selected) / t(fastest supporting op) - 1, calls between and outside "
             "the tuned buckets (other lengths, batch sizes, GQA ratios, head dims).")
    return RECORD.write(table, env, png, notes)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default=None, help=f"comma list of {', '.join(PREFILL_DTYPES)}: prefill only")
    args = parser.parse_args()
    dtypes = tuple(args.dtypes.split(",")) if args.dtypes else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for make in calls(device, args.quick, dtypes):
        call = make()
        times = measure(call, device)
        selected = fmha_ops.explain(*call.args, **call.kwargs).selected.NAME
        best = min(times, key=times.get)
        t_sel = times.get(selected)
        rows.append({"call": call.label, "selected": selected, "best": best, "t_sel_us": t_sel and t_sel * 1e6,
                     "t_best_us": times[best] * 1e6, "regret": (t_sel / times[best] - 1) if t_sel else None,
                     "times_us": {k: v * 1e6 for k, v in times.items()}})
        del call
    print_table(rows, ["call", "selected", "best", "t_sel_us", "t_best_us", "regret"])
    regrets = [r["regret"] for r in rows if r["regret"] is not None]
    summary = {"median_regret": statistics.median(regrets), "worst_regret": max(regrets),
               "unmeasured_selected": sum(r["regret"] is None for r in rows)}
    print(f"median regret {summary['median_regret']:.1%}, worst {summary['worst_regret']:.1%} "
          f"({len(regrets)} calls); env {environment()}")
    d = out_dir(args.out)
    write_json(d, "selector", rows, {"summary": summary})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4.5))
        ax.bar(range(len(rows)), [100 * (r["regret"] or 0) for r in rows])
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["call"] for r in rows], rotation=75, ha="right", fontsize=6)
        ax.set_ylabel("regret (%)")
        ax.set_title(f"selector regret: median {summary['median_regret']:.1%}, worst {summary['worst_regret']:.1%}")
        fig.tight_layout()
        fig.savefig(os.path.join(d, "selector.png"), dpi=120)
    except ImportError:
        pass
    if not (args.no_record or args.quick or dtypes):
        print("record:", record(rows, environment(), os.path.join(d, "selector.png")))


if __name__ == "__main__":
    main()
