"""Time calls the way the selector ranks ops: their device time and their host time, separately.

The selector ranks a GPU op by max(device time, host time per eager call) (``registry.select``): back to back,
a call costs whichever of the two is longer. ``op_times`` measures the two apart for the ops of one call, so
neither leaks into the other:

- host (``host_times``): the ops' calls in interleaved rounds: in each of ``HOST_ROUNDS`` rounds every op in turn
  (the order rotated by one op per round) issues ``HOST_CALLS`` calls back to back, the GPU not waited on; an op's
  host time is the median over the rounds of its wall time per call. Interleaving puts every op of the call
  under the same drift of the host (between runs one ~100 us call's host time moved up to 2x on the H200: 100 vs
  241 us for triton_fp8F), and the median of 9 rounds stands while up to 4 of them are hit by a pause (a garbage
  collection, a scheduler tick): the order of two ops then follows their own costs, not when each was timed;
- device (``device_time``): CUDA events around each call while a sleep kernel holds the GPU until the host has
  issued every timed call (so no launch gap of the host enters a device time), the L2 cache evicted before each
  call by a read of a buffer larger than it (a cold cache, as a call between other layers sees it, holding only
  clean lines: zeroing a buffer instead leaves dirty lines whose write-back lands in the timed call); median over
  the calls.

Timing a ~100 us call with per-call events and no hold (``triton.testing.do_bench``) reads device time plus
whatever part of the host time the cache clear before it does not hide: the same call of the same op read
83-131 us across H200 runs, which no cost model can follow.
On a CPU both are the median wall time of ``CPU_CALLS`` calls (each op called once before).
"""
from __future__ import annotations

import math
import statistics
import time
import warnings
from typing import Callable

#: back-to-back calls per host-time round, and interleaved rounds (the median is taken): 9 x 8 calls of a
#: ~150 us call are ~11 ms per op
HOST_CALLS, HOST_ROUNDS = 8, 9
#: timed device calls: enough to fill ``rep_ms``, within these bounds
MIN_DEVICE_CALLS, MAX_DEVICE_CALLS = 5, 50
#: bytes read before each timed call to evict the inputs from L2 (the H200's L2 is 50 MB; do_bench's 256 MB)
EVICT_BYTES = 256 << 20
#: the hold covers the host's issue time of the timed calls this many times over (and is doubled, up to
#: ``HOLD_RETRIES`` times, when the host still finished after it)
HOLD_MARGIN, HOLD_RETRIES = 2.0, 3
#: host seconds to issue one cache eviction and two event records, on top of the call's own host time
ISSUE_OVERHEAD_S = 20e-6
#: timed calls per op on a CPU (the median is taken)
CPU_CALLS = 3

_CYCLES_PER_S: list[float] = []


def called_once(fns: dict[str, Callable[[], object]], skip: tuple[type[BaseException], ...] = (),
                report: Callable[[str, BaseException], object] | None = None) -> dict[str, Callable[[], object]]:
    """The ``fns`` (name -> call) after their first call (JIT compilation, graph building: what ``op_times`` needs
    done), less those whose call raised one of ``skip`` (``report(name, error)`` told; CUDA's cached memory freed)."""
    ran = {}
    for name, fn in fns.items():
        try:
            fn()
        except skip as e:
            if report is not None:
                report(name, e)
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        ran[name] = fn
    return ran


def op_times(fns: dict[str, Callable[[], object]], device: str, rep_ms: float = 20.0,
             host_only: bool = False) -> dict[str, tuple[float | None, float]]:
    """(device seconds, host seconds) per call of each of ``fns`` (name -> call), each already called once (JIT
    compilation, graph building): the host times from interleaved rounds (``host_times``), then each device time
    (``device_time``; None with ``host_only``). See the module docstring for how each is taken.

    Example
    -------
    >>> times = op_times({"a": lambda: memory_efficient_attention(q, k, v, op="a"), ...}, "cuda")  # doctest: +SKIP
    >>> per_call = {name: max(t) for name, t in times.items()}  # what back-to-back calls cost: the selector's rank
    """
    host = host_times(fns, device)
    if device != "cuda":
        return {name: (None if host_only else t, t) for name, t in host.items()}
    return {name: (None if host_only else device_time(fn, rep_ms, host[name]), host[name])
            for name, fn in fns.items()}


def host_times(fns: dict[str, Callable[[], object]], device: str) -> dict[str, float]:
    """Host seconds per call of each of ``fns``: on CUDA the median over ``HOST_ROUNDS`` interleaved rounds of
    ``HOST_CALLS`` back-to-back calls (the GPU not waited on inside a round); on a CPU the median wall time of
    ``CPU_CALLS`` calls."""
    names = list(fns)
    if not names or device != "cuda":
        return {name: statistics.median(_wall(fns[name], 1) for _ in range(CPU_CALLS)) for name in names}
    import torch

    rounds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(HOST_ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            torch.cuda.synchronize()
            rounds[name].append(_wall(fns[name], HOST_CALLS))
    torch.cuda.synchronize()
    return {name: statistics.median(times) for name, times in rounds.items()}


def _wall(fn: Callable[[], object], calls: int) -> float:
    """Wall seconds per call of ``calls`` back-to-back calls of ``fn``."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def device_time(fn: Callable[[], object], rep_ms: float, host_s: float) -> float:
    """Device seconds per call of ``fn`` on CUDA (``fn`` already called once; ``host_s``: its host time, which
    sizes the hold): the median event time of enough calls to fill ``rep_ms``."""
    import torch

    first = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first[0].record()
    fn()
    first[1].record()
    torch.cuda.synchronize()
    rough = first[0].elapsed_time(first[1]) * 1e-3  # an upper bound on the device time: host gaps included
    calls = max(MIN_DEVICE_CALLS, min(MAX_DEVICE_CALLS, int(rep_ms * 1e-3 / max(rough, 1e-6))))
    return _device_time(fn, torch, calls, HOLD_MARGIN * calls * (host_s + ISSUE_OVERHEAD_S))


def _device_time(fn, torch, calls: int, hold_s: float) -> float:
    """Median event time of ``calls`` calls issued while a sleep kernel of ``hold_s`` holds the GPU; the hold is
    doubled and the calls retimed while the sleep ended before the host had issued them all."""
    evict = torch.ones(EVICT_BYTES // 4, dtype=torch.float32, device="cuda")
    for _ in range(HOLD_RETRIES + 1):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
        released = torch.cuda.Event()
        torch.cuda._sleep(int(hold_s * _cycles_per_second(torch)))
        released.record()
        for s, e in zip(starts, ends):
            evict.sum()
            s.record()
            fn()
            e.record()
        held = not released.query()  # the GPU was still asleep when the last call was issued
        torch.cuda.synchronize()
        if held:
            break
        hold_s *= 2
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e-3


def _cycles_per_second(torch) -> float:
    """The sleep kernel's clock, measured once per process (cycles of ``torch.cuda._sleep`` per second)."""
    if not _CYCLES_PER_S:
        cycles = 1 << 24
        torch.cuda._sleep(cycles)  # the first launch loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        _CYCLES_PER_S.append(cycles / (start.elapsed_time(end) * 1e-3))
    return _CYCLES_PER_S[0]


#: autotune's timing of a call's ops on the caller's inputs: untimed calls first (JIT compilation, graph and
#: workspace caches), then ``TUNE_ROUNDS`` rounds, each op in turn (the order rotated by one op per round) making as
#: many back-to-back calls as fill ``TUNE_ROUND_S`` (within ``TUNE_CALLS``); an op's median round counts. A 1 ms call:
#: 2 + 5 x 3 calls (~17 ms); a 100 us call: 2 + 5 x 20 (~10 ms), enough that a scheduler tick does not decide it
WARM_CALLS, TUNE_ROUNDS, TUNE_CALLS, TUNE_ROUND_S = 2, 5, (3, 32), 2e-3


def calls_seconds(fns: dict[str, Callable[[], object]], device: str) -> dict[str, float]:
    """Seconds per call of each of ``fns`` (name -> call) called back to back, as a caller's loop sees it: the larger
    of the host's time to issue a call and the device's time to run it. Each round of an op starts on an idle device
    and is timed from its first call's issue to its last call's completion (CUDA events; on a CPU the wall clock);
    rounds interleave the ops, so a drift of the host moves them all. Each op is called ``WARM_CALLS`` times first;
    the second of those sizes its rounds.

    Example
    -------
    >>> calls_seconds({"fa3F": lambda: memory_efficient_attention(q, k, v, op="fa3F"), ...}, "cuda")  # doctest: +SKIP
    {'fa3F': 0.000412, ...}
    """
    if device == "cuda":
        import torch

        def round_seconds(fn, calls: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3 / calls
    else:
        def round_seconds(fn, calls: int) -> float:
            return _wall(fn, calls)

    sizes = {}
    for name, fn in fns.items():
        fn()
        sizes[name] = max(TUNE_CALLS[0], min(TUNE_CALLS[1], math.ceil(TUNE_ROUND_S / max(round_seconds(fn, 1), 1e-9))))
    names = list(fns)
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(TUNE_ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rounds[name].append(round_seconds(fns[name], sizes[name]))
    return {name: statistics.median(times) for name, times in rounds.items()}


def autotune_seconds(ops, timed_call: Callable[[type], Callable[[], object]], device: str) -> dict[str, float]:
    """Autotune's measurement of one call (``registry.select`` decides which ``ops`` to time and keeps the seconds):
    {op NAME: seconds per back-to-back call} (``calls_seconds``) of ``timed_call(op)``, the caller's repeated call of
    ``op`` on its own inputs, without gradients. The caller builds that call as repeated calls will run it (a launch
    or decode plan skips host work the op's ``apply`` redoes per call, ~50 us for a Triton op, and timing ``apply``
    would rank such ops behind ops without that work). An op whose call raises is left out with a warning naming it
    and the error (the selector ranks it by its estimate). {} where nothing may be timed: under a CUDA-graph capture
    on ``device`` (the timed calls would be captured). Ops only read their inputs, so timing leaves the caller's
    tensors as they were.

    Example
    -------
    >>> measure = lambda ops: autotune_seconds(ops, lambda op: functools.partial(op.apply, inp, False), "cpu")
    >>> SELECTOR.select(sig, lambda: make_problem(inp, False), "fw", None, measure)  # doctest: +SKIP
    """
    import torch

    if device == "cuda" and torch.cuda.is_current_stream_capturing():
        return {}
    with torch.no_grad():
        fns = {}
        for op in ops:
            try:
                fn = timed_call(op)
                fn()  # the first call compiles and raises what the op cannot do here
            except Exception as e:  # noqa: BLE001  (reported, and the op ranked by its estimate)
                warnings.warn(f"fmha_ops autotune: {op.NAME} raised while timed, so it is ranked by its "
                              f"estimate: {type(e).__name__}: {e}", stacklevel=2)
                continue
            fns[op.NAME] = fn
        return calls_seconds(fns, device) if fns else {}
