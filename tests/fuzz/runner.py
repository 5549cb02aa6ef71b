"""Run fuzz cases isolated in forked workers and classify each outcome.

A case's ``body()`` builds its inputs (seeded from the case name), makes one public call and returns
``(result, check)``: ``check(result)`` is None when the result matches the float64 reference, else a
sentence; ``check`` None means no result is correct (the call should have raised).

Outcomes of an invalid call: "clear" (ValueError / TypeError / NotImplementedError whose message names
one of the case's argument names), "unclear" (any other exception, or a message naming none of them),
"crash" (the process died or hung), "lenient" (accepted with a result matching the reference),
"silent wrong" (accepted otherwise). Of a valid call: "correct", "wrong" (mismatch), "error" (raised),
"crash".

Workers are forked (the parent's imports are shared); each runs a batch of cases and streams one
result per case back through a pipe. A batch whose worker dies, or reports no result for CASE_TIMEOUT_S, is re-run one
case per worker, so a crash is pinned on the call that caused it (heap corruption can kill the process
a few calls later) and no other call is lost.
"""
from __future__ import annotations

import os
import pickle
import re
import select
import signal
import struct
import tempfile
import time
import traceback
import warnings
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

CLEAR_ERRORS = (ValueError, TypeError, NotImplementedError)
INVALID_OUTCOMES = ("clear", "unclear", "crash", "lenient", "silent wrong")
VALID_OUTCOMES = ("correct", "wrong", "error", "crash")
BATCH_SIZE = 40
CASE_TIMEOUT_S = 30.0  # a worker that reports nothing for this long is hung: killed, its batch re-run singly
DETAIL_CHARS = 300


@dataclass
class Case:
    """One public call. ``name`` is "function/base/argument/perturbation"; ``names`` are the argument
    names a clear error message must contain (one of them); ``valid`` marks calls that must succeed."""

    name: str
    body: Callable[[], tuple[Any, Callable[[Any], str | None] | None]]
    names: tuple[str, ...] = ()
    valid: bool = False

    @property
    def function(self) -> str:
        return self.name.split("/", 1)[0]


@dataclass
class Outcome:
    category: str
    detail: str = ""


@dataclass
class Results:
    cases: list[Case]
    outcomes: list[Outcome]
    seconds: float
    reruns: int = 0  # cases re-run one per worker after their batch crashed
    counts: dict[str, Counter] = field(default_factory=dict)

    def __post_init__(self) -> None:
        counts: dict[str, Counter] = defaultdict(Counter)
        for case, out in zip(self.cases, self.outcomes):
            counts[("valid " if case.valid else "invalid ") + case.function][out.category] += 1
        self.counts = dict(counts)

    def total(self, valid: bool) -> Counter:
        c: Counter = Counter()
        for key, n in self.counts.items():
            if key.startswith("valid ") == valid:
                c.update(n)
        return c

    def clear_rate(self) -> float:
        """Clear errors over the invalid calls not leniently accepted with a correct result."""
        inv = self.total(False)
        judged = sum(inv.values()) - inv["lenient"]
        return inv["clear"] / judged if judged else 1.0

    def failures(self, categories: Iterable[str]) -> list[tuple[Case, Outcome]]:
        cats = set(categories)
        return [(c, o) for c, o in zip(self.cases, self.outcomes) if o.category in cats]

    def table(self) -> str:
        lines = []
        for valid, cols in ((False, INVALID_OUTCOMES), (True, VALID_OUTCOMES)):
            head = f"{'valid' if valid else 'invalid'} calls"
            lines.append(f"{head:<40}{'calls':>7}" + "".join(f"{c:>14}" for c in cols))
            for key in sorted(k for k in self.counts if k.startswith("valid ") == valid):
                n = self.counts[key]
                lines.append(f"  {key.split(' ', 1)[1]:<38}{sum(n.values()):>7}" + "".join(f"{n[c]:>14}" for c in cols))
            t = self.total(valid)
            lines.append(f"  {'total':<38}{sum(t.values()):>7}" + "".join(f"{t[c]:>14}" for c in cols))
        lines.append(f"clear-error rate {100 * self.clear_rate():.2f}% (clear / invalid calls not leniently "
                     f"accepted); {len(self.cases)} calls in {self.seconds:.1f} s, {self.reruns} re-run singly")
        return "\n".join(lines)

    def report(self, limit: int = 60) -> str:
        bad = self.failures(("unclear", "crash", "silent wrong", "wrong", "error"))
        lines = [self.table()]
        if bad:
            lines.append(f"\n{len(bad)} calls not clear / not correct (first {min(limit, len(bad))}):")
            lines += [f"  [{o.category}] {c.name}: {o.detail}" for c, o in bad[:limit]]
        return "\n".join(lines)


def names_argument(message: str, names: Iterable[str]) -> bool:
    """Whether ``message`` mentions one of ``names`` as a whole identifier."""
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode())


def execute(case: Case) -> Outcome:
    """Run one case in this process and classify it (a crash kills the process instead)."""
    torch.manual_seed(seed_of(case.name))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result, check = case.body()
            verdict = None if check is None else check(result)
    except Exception as e:  # noqa: BLE001  (classifying every exception is the point)
        msg = f"{type(e).__name__}: {e}"
        where = _origin(e)
        detail = (msg.splitlines()[0] if msg else "")[:DETAIL_CHARS] + (f" [at {where}]" if where else "")
        if case.valid:
            return Outcome("error", detail)
        clear = isinstance(e, CLEAR_ERRORS) and names_argument(str(e), case.names)
        return Outcome("clear" if clear else "unclear", detail)
    if case.valid:
        return Outcome("wrong", verdict) if verdict else Outcome("correct")
    if check is None:
        return Outcome("silent wrong", "accepted")
    return Outcome("silent wrong", verdict) if verdict else Outcome("lenient")


def _origin(e: BaseException) -> str:
    """file:line of the innermost frame of the traceback inside the package (or the innermost frame)."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "/fmha_ops/" in f.filename or "/registry/" in f.filename]
    f = (ours or frames or [None])[-1]
    return "" if f is None else f"{os.path.basename(f.filename)}:{f.lineno}"


# ---- forked execution ---------------------------------------------------------------------------------

@dataclass
class _Worker:
    pid: int
    fd: int
    batch: list[int]
    deadline: float
    stderr_path: str
    buf: bytes = b""
    got: dict[int, Outcome] = field(default_factory=dict)


def _child(cases: list[Case], batch: list[int], wfd: int, stderr_path: str) -> None:
    try:
        err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(err, 2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        torch.set_num_threads(1)
        for i in batch:
            data = pickle.dumps((i, execute(cases[i])))
            os.write(wfd, struct.pack("<I", len(data)) + data)
    finally:
        os._exit(0)


def _spawn(cases: list[Case], batch: list[int]) -> _Worker:
    rfd, wfd = os.pipe()
    fd, stderr_path = tempfile.mkstemp(prefix="fuzz_stderr_")
    os.close(fd)
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        _child(cases, batch, wfd, stderr_path)
    os.close(wfd)
    return _Worker(pid, rfd, batch, time.monotonic() + CASE_TIMEOUT_S, stderr_path)


def _drain(w: _Worker) -> bool:
    """Read what the worker wrote (each result extends its deadline); False at end of stream."""
    chunk = os.read(w.fd, 1 << 16)
    w.buf += chunk
    if chunk:
        w.deadline = time.monotonic() + CASE_TIMEOUT_S
    while len(w.buf) >= 4:
        (n,) = struct.unpack("<I", w.buf[:4])
        if len(w.buf) < 4 + n:
            break
        i, out = pickle.loads(w.buf[4:4 + n])
        w.got[i] = out
        w.buf = w.buf[4 + n:]
    return bool(chunk)


def _death(w: _Worker, status: int | None) -> str:
    if status is None:
        why = "timed out (killed)"
    elif os.WIFSIGNALED(status):
        why = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        why = f"exited with status {os.WEXITSTATUS(status)} before reporting"
    try:
        with open(w.stderr_path, errors="replace") as f:
            tail = [ln.strip() for ln in f.read().splitlines() if ln.strip()][-2:]
    except OSError:
        tail = []
    return why + (f" ({' | '.join(tail)[:DETAIL_CHARS]})" if tail else "")


def run(cases: list[Case], workers: int = 2, batch_size: int = BATCH_SIZE) -> Results:
    """Execute every case in forked workers (``workers`` at a time) and classify it."""
    start = time.monotonic()
    outcomes: dict[int, Outcome] = {}
    pending = [list(range(i, min(i + batch_size, len(cases)))) for i in range(0, len(cases), batch_size)]
    pending.reverse()
    active: dict[int, _Worker] = {}
    reruns = 0
    while pending or active:
        while pending and len(active) < workers:
            w = _spawn(cases, pending.pop())
            active[w.fd] = w
        now = time.monotonic()
        wait = max(0.0, min(w.deadline for w in active.values()) - now)
        ready, _, _ = select.select(list(active), [], [], wait)
        finished: list[tuple[_Worker, int | None]] = []
        for fd in ready:
            w = active[fd]
            if not _drain(w):
                _, status = os.waitpid(w.pid, 0)
                finished.append((w, status))
        now = time.monotonic()
        for w in list(active.values()):
            if w.deadline <= now and all(w is not f for f, _ in finished):
                os.kill(w.pid, signal.SIGKILL)
                os.waitpid(w.pid, 0)
                finished.append((w, None))
        for w, status in finished:
            del active[w.fd]
            os.close(w.fd)
            clean = status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
            if clean and len(w.got) == len(w.batch):
                outcomes.update(w.got)
            elif len(w.batch) > 1:  # pin the crasher: every call of the batch again, one per worker
                reruns += len(w.batch)
                pending.extend([i] for i in reversed(w.batch))
            else:
                got = w.got.get(w.batch[0]) if clean else None
                outcomes[w.batch[0]] = got or Outcome("crash", _death(w, status))
            os.unlink(w.stderr_path)
    return Results(cases, [outcomes[i] for i in range(len(cases))], time.monotonic() - start, reruns)
