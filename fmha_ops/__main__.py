"""``python -m fmha_ops [info|explain|tune|merge] [options]`` (``--help`` after a command lists its options).

info (default): the arch, the ops available here, the others grouped under the reason they cannot run,
and one sample call routed through the selector with the op chosen and its time.
explain: the selector's verdict for one shape, e.g.
``python -m fmha_ops explain --shape 4,4096,32,4096,8,128 --dtype bfloat16 --causal``.
tune: time every available op on the tuning grid and write this GPU's timing table
(default ``$FMHA_OPS_TUNING_DIR/<device>.json``, else ``./fmha_ops_tuning/<device>.json``; <device> is the GPU's
name with underscores, one name per card: ``NVIDIA_H100`` for the H100 SXM's "NVIDIA H100 80GB HBM3");
``tune --host-only --out TABLE`` re-times only the table's host rows (seconds, not minutes; a TABLE not there yet
gets host rows only);
``tune --ops fa3F --dtypes bfloat16 --merge TABLE --keep-rows --out TABLE`` re-times those ops' rows of those
calls only, keeping every other row (``--shard K/N`` splits such a retune over runs). Without a GPU, tune
says so and stops (``tune --quick`` still runs its few tiny calls on the CPU: a smoke test).
A table can be built in pieces that each fit a short GPU session (``--dtypes bfloat16``, ``--dtypes decode``,
``--ops``, ``--shard``, ``--host-only``, each to its own file);
merge: ``python -m fmha_ops merge --out TABLE PIECE...`` joins them (no GPU needed).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

import fmha_ops
from fmha_ops.dispatch import REGISTRY, SELECTOR
from registry import TuningTable, TuningTables, current_arch, merge_tables, table_device


def _sample(device: str, dtype: torch.dtype, b: int, mq: int, hq: int, mk: int, hkv: int, d: int, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, mq, hq, d, generator=g).to(device, dtype)
    k = torch.randn(b, mk, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(b, mk, hkv, d, generator=g).to(device, dtype)
    return q, k, v


def info() -> int:
    arch = current_arch()
    print(f"fmha_ops on {arch}; torch {torch.__version__}")
    if arch.kind != "cpu":
        print(table_line(arch.name, SELECTOR.tables))
    header = ("op", "kind", "archs", "aliases")
    rows, unavailable = [], {}
    for op in REGISTRY.ops():
        why = op.available()
        if why is None:
            rows.append((op.NAME, op.KIND, ",".join(op.ARCHS), ",".join(REGISTRY.aliases(op))))
        else:
            unavailable.setdefault(why, []).append(op.NAME)
    print(f"\navailable here ({len(rows)} ops):")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if unavailable:
        print(f"\nnot available here ({sum(len(v) for v in unavailable.values())} ops), by reason:")
        for why, names in sorted(unavailable.items(), key=lambda item: (-len(item[1]), item[0])):
            print(f"  {why}\n      {', '.join(names)}")
    if arch.kind == "cpu":
        device, dtype, shape = "cpu", torch.float32, (1, 256, 8, 256, 2, 64)
    else:
        device, dtype, shape = "cuda", torch.bfloat16, (4, 4096, 32, 4096, 8, 128)
    q, k, v = _sample(device, dtype, *shape)
    bias = fmha_ops.LowerTriangularMask()
    report = fmha_ops.explain(q, k, v, bias)
    print(f"\nsample call: q {tuple(q.shape)} k/v {tuple(k.shape)} {dtype} causal on {device} (the ops available "
          f"here)")
    print(dataclasses.replace(report, verdicts=[v for v in report.verdicts if v.unavailable is None]))
    fmha_ops.memory_efficient_attention(q, k, v, bias)
    t_ms = _time_ms(lambda: fmha_ops.memory_efficient_attention(q, k, v, bias), device)
    print(f"ran {report.selected.NAME}: {t_ms:.3f} ms")
    return 0


def table_line(device: str, tables: TuningTables) -> str:
    """What the selector ranks by on the GPU named ``device``: its tuning table (ops measured), or the cost models.

    Example: ``table_line("NVIDIA H100 80GB HBM3", SELECTOR.tables)`` -> "tuning table: NVIDIA H100, 15 ops measured".
    """
    table = tables.table(device)
    if table:
        return f"tuning table: {table.device}, {len(table.timings)} ops measured (others: models x its median factor)"
    return (f"tuning table: none for {device!r}: ops ranked by cost models fitted on the H200 "
            f"(python -m fmha_ops tune writes this GPU's table)")


def _time_ms(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, return_mode="median"))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[2] * 1e3


def explain(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m fmha_ops explain")
    p.add_argument("--shape", default="1,128,8,128,8,64", help="B,Mq,Hq,Mk,Hkv,K")
    p.add_argument("--dtype", default="bfloat16", help="float16|bfloat16|float32|float8_e4m3fn|i8fp8")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--partial", action="store_true", help="the call needs the LSE")
    p.add_argument("--kind", default="fw", choices=("fw", "bw"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    b, mq, hq, mk, hkv, d = (int(x) for x in a.shape.split(","))
    extra = {}
    if a.dtype in ("float16", "bfloat16", "float32"):
        q, k, v = _sample(a.device, getattr(torch, a.dtype), b, mq, hq, mk, hkv, d)
    else:
        q, k, v = _sample(a.device, torch.float32, b, mq, hq, mk, hkv, d)
        f8 = torch.float8_e4m3fn
        qk_dtype = torch.int8 if a.dtype == "i8fp8" else f8
        q, k, v = q.to(qk_dtype), k.to(qk_dtype), v.to(f8)
        one = torch.ones(1, device=a.device)
        extra = {"q_descale": one, "k_descale": one, "v_descale": one}
    bias = fmha_ops.LowerTriangularFromBottomRightMask() if a.causal else None
    print(fmha_ops.explain(q, k, v, bias, partial=a.partial, kind=a.kind, **extra))
    return 0


def tune(argv: list[str]) -> int:
    import os

    from fmha_ops.tune import tune as run_tune

    p = argparse.ArgumentParser(prog="python -m fmha_ops tune")
    p.add_argument("--out", default=None, help="table path (JSON)")
    p.add_argument("--quick", action="store_true", help="a few tiny calls (smoke test)")
    p.add_argument("--ops", default=None, help="comma-separated op names: measure only these")
    p.add_argument("--merge", default=None, help="start from this table (JSON); keep its other ops' timings")
    p.add_argument("--dtypes", default=None,
                   help="comma-separated: only the grid calls of these prefill dtypes (bfloat16, fp8, fp8_tensor, "
                        "i8fp8) and, named 'decode', the decode calls")
    p.add_argument("--host-only", action="store_true",
                   help="re-time only the host rows (the host grid) of the --merge table (default: --out where it "
                        "exists, else a table of host rows only)")
    p.add_argument("--budget", type=float, default=0.0, help="seconds; calls left after it are not measured")
    p.add_argument("--compile-only", action="store_true",
                   help="run every timed op once, untimed (fills the JIT caches), and write nothing")
    p.add_argument("--shard", default="0/1",
                   help="K/N: only every N-th call from the K-th (parallel --compile-only processes, or a retune "
                        "split over runs with --keep-rows)")
    p.add_argument("--keep-rows", action="store_true",
                   help="with --merge: replace the --ops' rows only in the buckets this run measures, keep the others")
    a = p.parse_args(argv)
    if not torch.cuda.is_available() and not a.quick:
        print("python -m fmha_ops tune measures the ops of a GPU, and torch sees none here "
              "(torch.cuda.is_available() is False); run it on the GPU to tune (tune --quick runs a CPU smoke test)",
              file=sys.stderr)
        return 2
    name = table_device(current_arch().name).replace(" ", "_")
    out = a.out or os.path.join(os.environ.get("FMHA_OPS_TUNING_DIR") or "fmha_ops_tuning", f"{name}.json")
    ops = frozenset(n.strip() for n in a.ops.split(",") if n.strip()) if a.ops else None
    dtypes = tuple(a.dtypes.split(",")) if a.dtypes else None
    merge = a.merge or (out if a.host_only and os.path.exists(out) else None)
    shard = tuple(int(x) for x in a.shard.split("/"))
    table = run_tune(out, quick=a.quick, ops=ops, merge=merge, dtypes=dtypes, host_only=a.host_only,
                     budget=a.budget, compile_only=a.compile_only, shard=shard, keep_rows=a.keep_rows)
    if a.compile_only:
        return 0
    n = sum(len(v) for v in table.timings.values())
    n_host = sum(len(v) for v in table.host_timings.values())
    print(f"wrote {n} timings and {n_host} host timings for {len(table.timings)} ops to {out}; calibration: "
          + ", ".join(f"{k}={v:.2f}" for k, v in sorted(table.calibration.items())) + "; host us: "
          + ", ".join(f"{k}={v * 1e6:.0f}" for k, v in sorted(table.host.items())))
    return 0


def merge(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m fmha_ops merge",
                                description="join tuning-table pieces of one GPU (later pieces' rows first)")
    p.add_argument("--out", required=True, help="the joined table (JSON)")
    p.add_argument("pieces", nargs="+", help="tables written by tune runs, in grid order; the host-only run last")
    a = p.parse_args(argv)
    table = merge_tables([TuningTable.load(path) for path in a.pieces])
    table.save(a.out)
    n = sum(len(v) for v in table.timings.values())
    print(f"wrote {n} timings of {len(table.timings)} ops and host rows of {len(table.host_timings)} ops "
          f"({table.device}) to {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd, rest = (argv[0], argv[1:]) if argv else ("info", [])
    if cmd in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0
    if cmd == "info":
        return info()
    if cmd == "explain":
        return explain(rest)
    if cmd == "tune":
        return tune(rest)
    if cmd == "merge":
        return merge(rest)
    print(f"unknown command {cmd!r}; use: python -m fmha_ops [info | explain | tune | merge] (--help for more)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
