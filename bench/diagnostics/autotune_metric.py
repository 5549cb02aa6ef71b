"""Whether autotune's measurement and the selector bench's rank a call's ops alike: for each call, every op autotune
would time (supported, estimated within ``registry.select.AUTOTUNE_SPAN`` of the fastest) forced through
``memory_efficient_attention``, timed ``--repeats`` times by both methods on the same calls:

- autotune's (``fmha_ops.timing.calls_seconds``): rounds of back-to-back calls, each round timed from its first
  issue to its last completion (host and device overlapping, the inputs warm in L2);
- the bench's (``fmha_ops.timing.op_times``, as ``bench/selector.py`` and the tuning table time): max(device time
  with L2 evicted before each call, host time per call from interleaved rounds).

Per call and repeat: the op each method ranks first and the regret of autotune's pick under the bench's times
(``bench/selector.py``'s autotune mode reports that regret; 43% on a host-bound bf16 call in its last record).

    PYTHONPATH=$PWD python bench/diagnostics/autotune_metric.py [--out DIR] [--repeats 3]
"""
from __future__ import annotations

import os
import sys
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from bench import common  # noqa: E402
from fmha_ops.api import memory_efficient_attention  # noqa: E402
from fmha_ops.dispatch import REGISTRY, SELECTOR  # noqa: E402
from fmha_ops.timing import called_once, calls_seconds, op_times  # noqa: E402
from fmha_ops.tune import prefill_call  # noqa: E402
from registry.select import AUTOTUNE_SPAN  # noqa: E402

#: (B, N, Hq, Hkv, D, causal, dtype): bench/selector.py's host-bound prefill calls and its worst autotune rows
CALLS = ((32, 256, 16, 16, 64, True, "bfloat16"), (32, 256, 16, 16, 64, True, "fp8_tensor"),
         (64, 128, 16, 16, 64, False, "bfloat16"), (8, 768, 16, 16, 128, False, "fp8"))
#: device time (ms) each op's timed device calls fill (bench/selector.py's REP_MS)
REP_MS = 10.0


def contenders(call) -> dict:
    """{op name: the call forced to that op} for the ops autotune would time."""
    verdicts = [v for v in (SELECTOR.verdict(op, call.problem()) for op in REGISTRY.ops("fw")) if v.ok]
    fastest = min(v.estimate for v in verdicts if v.estimate is not None)
    return {v.op.NAME: partial(memory_efficient_attention, *call.args, op=v.op, **call.kwargs) for v in verdicts
            if v.estimate is None or v.estimate <= AUTOTUNE_SPAN * fastest}


def compare(call, repeats: int, device: str) -> list[dict]:
    """One row per repeat: each method's seconds per op (us), its first op, and autotune's regret by the bench."""
    fns = called_once(contenders(call), (torch.OutOfMemoryError, RuntimeError))
    rows = []
    for r in range(repeats):
        autotune = calls_seconds(fns, device)
        bench = {name: max(t for t in pair if t is not None) for name, pair in op_times(fns, device, REP_MS).items()}
        pick, best = min(autotune, key=autotune.get), min(bench, key=bench.get)
        rows.append({"call": call.label, "repeat": r, "autotune_us": {k: v * 1e6 for k, v in autotune.items()},
                     "bench_us": {k: v * 1e6 for k, v in bench.items()}, "autotune_pick": pick, "bench_pick": best,
                     "regret": bench[pick] / bench[best] - 1})
        print(f"{call.label} [{r}]: autotune {pick} ({autotune[pick] * 1e6:.1f} us), bench {best} "
              f"({bench[best] * 1e6:.1f} us), regret {rows[-1]['regret']:.1%}; autotune "
              + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in sorted(autotune.items(), key=lambda kv: kv[1]))
              + "; bench " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in sorted(bench.items(), key=lambda kv: kv[1])),
              flush=True)
    return rows


def main(argv=None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="times each call's ops are timed by both methods")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = CALLS[:1] if args.quick else CALLS
    rows = [row for b, n, hq, hkv, d, causal, dtype in shapes
            for row in compare(prefill_call(b, n, hq, hkv, d, causal, dtype if device == "cuda" else "float32",
                                            device), args.repeats, device)]
    print("json:", common.write_json(common.out_dir(args.out), "autotune_metric", rows))
    return rows


if __name__ == "__main__":
    main()
