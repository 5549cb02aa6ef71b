"""Shared benchmark plumbing: CUDA-event timing, CUDA-graph timing, environment record,
table printing, JSON and PNG output.

Every benchmark in ``bench/`` times with ``triton.testing.do_bench`` (CUDA events, median)
and writes ``<name>.json`` and ``<name>.png`` into ``--out`` (default ``$OUT`` or ``bench/out``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from typing import Callable, Sequence

import torch

def out_dir(arg: str | None = None) -> str:
    path = arg or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out")
    os.makedirs(path, exist_ok=True)
    return path

def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None, help="folder for JSON/PNG (default $OUT or bench/out)")
    p.add_argument("--quick", action="store_true", help="fewer shapes, for a smoke run")
    return p

def environment() -> dict:
    """Date, GPU and software versions to store next to every result."""
    env = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["sm_count"] = props.multi_processor_count
        env["capability"] = f"{props.major}.{props.minor}"
    return env

def time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds, CUDA events via ``triton.testing.do_bench``."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))

_EVICT: list = []


def time_clean_l2_ms(fn: Callable[[], object], warmup: int = 10, rep: int = 60) -> float:
    """Median time of ``fn()`` in milliseconds (CUDA events around each call), each call after a read-only L2
    eviction: a sum over a 256 MB buffer leaves only clean lines in the L2. do_bench evicts by zeroing a buffer
    instead, and the dirty lines that leaves are written back to DRAM during the timed call (~9 us on the H200,
    bench/results/decode.md step 12), a fixed cost that weighs more on shorter calls."""
    if not _EVICT:
        _EVICT.append(torch.ones(64 * 2 ** 20, device="cuda", dtype=torch.float32))
    buf = _EVICT[0]
    events = []
    for i in range(warmup + rep):
        buf.sum()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in events[warmup:])
    return times[len(times) // 2]


def capture_graph(fn: Callable[[], object], warmup_iters: int = 3) -> torch.cuda.CUDAGraph:
    """Capture ``fn()`` into a CUDA graph (after warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup_iters):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g

def graph_num_nodes(g: torch.cuda.CUDAGraph) -> int:
    """Number of kernel nodes in a captured graph (0 means the capture recorded nothing)."""
    try:

        from cuda.bindings import runtime as cudart  # type: ignore

        raw = g.raw_cuda_graph()
        err, _, n = cudart.cudaGraphGetNodes(raw, 0)
        return int(n)
    except Exception:
        return -1

def time_graph_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> tuple[float, torch.cuda.CUDAGraph]:
    """Median replay time of ``fn`` captured in a CUDA graph, and the graph."""
    g = capture_graph(fn)
    return time_ms(g.replay, warmup=warmup, rep=rep), g

def print_table(rows: Sequence[dict], columns: Sequence[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))

def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)

def write_json(path_dir: str, name: str, rows: Sequence[dict], extra: dict | None = None) -> str:
    path = os.path.join(path_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"env": environment(), "rows": list(rows), **(extra or {})}, f, indent=1)
    return path

def bar_plot(path_dir: str, name: str, rows: Sequence[dict], label_key: str, series: Sequence[str],
             ylabel: str, title: str) -> str | None:
    """Grouped bar chart: one group per row (``label_key``), one bar per series key."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    n = len(series)
    width = 0.8 / max(n, 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) * max(n, 1) * 0.5), 4.5))
    for i, s in enumerate(series):
        xs = [j + i * width for j in range(len(rows))]
        ys = [r.get(s) or 0.0 for r in rows]
        ax.bar(xs, ys, width=width, label=s)
    ax.set_xticks([j + width * (n - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels([str(r[label_key]) for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(path_dir, f"{name}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
