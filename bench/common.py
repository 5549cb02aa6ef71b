"""The harness every record-producing benchmark in ``bench/`` shares.

* timing: :func:`time_ms` (CUDA events, ``triton.testing.do_bench`` median), :func:`time_graph_ms` (the same over
  replays of a captured CUDA graph), :func:`time_clean_l2_ms` (each call after a read-only L2 eviction),
  :func:`host_us` (host wall time per call of back-to-back calls), :func:`time_wall_ms` (wall time, for CPUs),
  :func:`device_ms` (one of those by device) and :class:`StepTimer` (marks around a piece of work);
* the environment: :func:`environment` (GPU, driver, CUDA, torch, triton, cuDNN, date) and :func:`environment_line`;
* output: :func:`print_table` (stdout), :func:`write_json` and :func:`bar_plot` (into ``--out``, default ``$OUT`` or
  ``bench/out``) and :func:`write_record`, which writes the benchmark's table whole to ``bench/results/<name>.md``,
  from which ``bench/assemble_benchmarks.py`` builds BENCHMARKS.md (a :class:`Record` declares a benchmark's table);
* attention helpers: ``PREFILL_SHAPES``, :func:`attention_tflops`, :func:`sdpa` (torch SDPA pinned to one backend) and
  :func:`or_none` (a failing variant becomes an empty cell).

Scripts under ``bench/diagnostics/`` (compile reports, probes) use the same harness but write no record.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

#: prefill shapes (B, Hq, Hkv, N, D, causal) that the forward benchmark (bench/attention_fwd_bench.py) and the
#: public API's comparison with other backends (bench/backends.py) both time; each adds its own
PREFILL_SHAPES = [
    (4, 32, 32, 4096, 128, False),
    (4, 32, 32, 4096, 128, True),
    (2, 16, 16, 16384, 128, False),
    (4, 16, 16, 4096, 64, False),
    (4, 16, 16, 4096, 256, False),
]

def out_dir(arg: str | None = None) -> str:
    path = arg or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out")
    os.makedirs(path, exist_ok=True)
    return path

def base_parser(description: str) -> argparse.ArgumentParser:
    """``--out`` (JSON/PNG folder), ``--quick`` (fewer shapes) and ``--no-record`` (leave bench/results alone)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None, help="folder for JSON/PNG (default $OUT or bench/out)")
    p.add_argument("--quick", action="store_true", help="fewer shapes, for a smoke run")
    p.add_argument("--no-record", action="store_true", help="do not write the record into bench/results/")
    return p

def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Date, GPU, driver and software versions to store next to every result."""
    env = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
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
        env["driver"] = _driver_version()
    return env


def environment_line(env: dict | None = None) -> str:
    """One line: ``GPU, driver, CUDA, torch, triton, cuDNN, date`` of ``env`` (default: this machine's)."""
    env = env or environment()
    return (f"{env.get('gpu') or 'CPU only'}, driver {env.get('driver') or '-'}, CUDA {env.get('cuda') or '-'}, "
            f"torch {env['torch']}, triton {env.get('triton') or '-'}, cuDNN {env.get('cudnn') or '-'}, "
            f"{env['date']}")

def time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds, CUDA events via ``triton.testing.do_bench``."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))

class StepTimer:
    """Start/end marks around a piece of work: CUDA events (GPU timeline) or perf_counter (CPU). ``ms`` waits for
    the end mark."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def ms(self, start, end) -> float:
        if not self.cuda:
            return (end - start) * 1e3
        end.synchronize()
        return start.elapsed_time(end)


def device_ms(fn: Callable[[], object], device: str = "cuda") -> float:
    """Median time of ``fn()`` in milliseconds on ``device``: :func:`time_ms` on CUDA; elsewhere (the CPU smoke runs
    of the benchmarks) :func:`time_wall_ms` after one warm-up call."""
    if torch.device(device).type == "cuda":
        return time_ms(fn)
    fn()
    return time_wall_ms(fn)


_EVICT: list = []


def time_clean_l2_ms(fn: Callable[[], object], warmup: int = 10, rep: int = 60) -> float:
    """Median time of ``fn()`` in milliseconds (CUDA events around each call), each call after a read-only L2
    eviction: a sum over a 256 MB buffer leaves only clean lines in the L2. do_bench evicts by zeroing a buffer
    instead, and the dirty lines that leaves are written back to DRAM during the timed call (~9 us on the H200), a
    fixed cost that weighs more on shorter calls."""
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


def host_us(fn: Callable[[], object], iters: int = 1000, warmup: int = 50) -> float:
    """Host wall time per call of ``fn()`` in microseconds: ``iters`` back-to-back calls after ``warmup`` calls,
    ``time.perf_counter`` around the calls only (on CUDA one synchronize before and one after, outside the timing).
    Where the GPU work of a call is shorter than its host path this is the time a call costs its caller."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def time_wall_ms(fn: Callable[[], object], calls: int = 3) -> float:
    """Median wall time of ``calls`` calls of ``fn()`` in milliseconds, each on its own (on a CPU, where there are
    no CUDA events to time with)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


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

def attention_tflops(B: int, H: int, N: int, D: int, causal: bool, ms: float | None) -> float | None:
    """TFLOP/s of a forward attention over ``N`` queries and ``N`` keys: 4*B*H*N^2*D / t, halved when causal;
    None when ``ms`` is None (the variant did not run)."""
    if not ms:
        return None
    return 4 * B * H * N * N * D / (ms * 1e-3) / 1e12 / (2 if causal else 1)


def sdpa(backend: str) -> Callable:
    """``run(q, k, v, causal, gqa)``: torch SDPA on BHMK tensors pinned to ``backend``, a ``SDPBackend`` name
    (``"CUDNN_ATTENTION"``, ``"FLASH_ATTENTION"``, ``"EFFICIENT_ATTENTION"``, ``"MATH"``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = getattr(SDPBackend, backend)

    def run(q, k, v, causal: bool, gqa: bool):
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return run


def or_none(fn: Callable[[], object]):
    """``fn()``, or None (and one logged line) if it raises: a variant that cannot run becomes an empty cell."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - any failure of an optional variant is reported, not fatal
        print(f"  [skip] {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        return None


def print_table(rows: Sequence[dict], columns: Sequence[str]) -> None:
    widths = {c: max([len(c), *(len(fmt_cell(r.get(c))) for r in rows)]) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(fmt_cell(r.get(c)).rjust(widths[c]) for c in columns))

def fmt_cell(v) -> str:
    """A table cell's text: floats to 4 significant digits, None as ``-``, anything else as ``str``."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)

def markdown_table(rows: Sequence[dict], columns: Sequence[str], labels: Sequence[str] | None = None) -> str:
    """A markdown table of ``rows`` (dicts) over ``columns`` (keys), headed by ``labels`` (default the keys);
    floats to 4 significant digits, missing values as ``-``. Text columns are left-aligned, the rest right."""
    labels = list(labels or columns)
    numeric = [any(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) for r in rows)
               for c in columns]
    lines = ["| " + " | ".join(labels) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(fmt_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_record(name: str, title: str, command: str, body: str, env: dict | None = None,
                 png: str | None = None, results_dir: str = RESULTS) -> str:
    """Write the record ``<results_dir>/<name>.md`` (default ``bench/results/``): a ``## title`` heading, the
    environment line, the command that reproduces it, the ``body`` (its table and one-line notes) and, if ``png``
    names a plot that exists, that plot copied to ``<results_dir>/<name>.png`` and linked. Returns the path."""
    os.makedirs(results_dir, exist_ok=True)
    parts = [f"## {title}", "", f"Environment: {environment_line(env)}.", "", f"Reproduce: `{command}`", "",
             body.strip()]
    if png and os.path.exists(png):
        target = os.path.join(results_dir, f"{name}.png")
        if os.path.abspath(png) != os.path.abspath(target):
            shutil.copyfile(png, target)
        parts += ["", f"![{title}](bench/results/{name}.png)"]
    path = os.path.join(results_dir, f"{name}.md")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")
    return path


@dataclass(frozen=True)
class Record:
    """What one benchmark writes to ``bench/results/<name>.md``: its title, the command that reproduces it, its
    table's columns (row key -> column label, in order) and the notes under the table."""

    name: str
    title: str
    command: str
    columns: Mapping[str, str]
    notes: str = ""

    def write(self, rows: Sequence[dict], env: dict | None = None, png: str | None = None,
              notes: str | None = None, results_dir: str = RESULTS) -> str:
        """Write the record of ``rows`` (``notes`` replaces the default notes); returns the path."""
        body = markdown_table(rows, list(self.columns), list(self.columns.values()))
        text = self.notes if notes is None else notes
        return write_record(self.name, self.title, self.command, body + ("\n\n" + text if text else ""), env, png,
                            results_dir)


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
