"""Time one call the way the selector ranks ops: its device time and its host time, separately.

The selector ranks a GPU op by max(device time, host time per eager call) (``registry.select``): back to back,
a call costs whichever of the two is longer. ``call_times`` measures the two apart, so neither leaks into the
other:

- host: wall time per call of ``HOST_CALLS`` calls issued back to back (the GPU not waited on), median of
  ``HOST_ROUNDS`` rounds;
- device: CUDA events around each call while a sleep kernel holds the GPU until the host has issued every timed
  call (so no launch gap of the host enters a device time), the L2 cache evicted before each call by a read of a
  buffer larger than it (a cold cache, as a call between other layers sees it, holding only clean lines: zeroing
  a buffer instead leaves dirty lines whose write-back lands in the timed call); median over the calls.

Timing a ~100 us call with per-call events and no hold (``triton.testing.do_bench``) reads device time plus
whatever part of the host time the cache clear before it does not hide: the same call of the same op read
83-131 us across H200 runs, which no cost model can follow.
On a CPU both are the median wall time of 3 calls after an untimed one.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

#: back-to-back calls per host-time round, and rounds (the median is taken)
HOST_CALLS, HOST_ROUNDS = 8, 5
#: timed device calls: enough to fill ``rep_ms``, within these bounds
MIN_DEVICE_CALLS, MAX_DEVICE_CALLS = 5, 50
#: bytes read before each timed call to evict the inputs from L2 (the H200's L2 is 50 MB; do_bench's 256 MB)
EVICT_BYTES = 256 << 20
#: the hold covers the host's issue time of the timed calls this many times over (and is doubled, up to
#: ``HOLD_RETRIES`` times, when the host still finished after it)
HOLD_MARGIN, HOLD_RETRIES = 2.0, 3
#: host seconds to issue one cache eviction and two event records, on top of the call's own host time
ISSUE_OVERHEAD_S = 20e-6

_CYCLES_PER_S: list[float] = []


def call_times(fn: Callable[[], object], device: str, rep_ms: float = 20.0) -> tuple[float, float]:
    """(device seconds, host seconds) per call of ``fn``; see the module docstring for how each is taken.

    Example
    -------
    >>> device_s, host_s = call_times(lambda: memory_efficient_attention(q, k, v), "cuda")  # doctest: +SKIP
    >>> per_call = max(device_s, host_s)  # what back-to-back calls cost, what the selector ranks by
    """
    if device != "cuda":
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        return t, t
    import torch

    fn()
    torch.cuda.synchronize()
    host = _host_time(fn, torch)
    first = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first[0].record()
    fn()
    first[1].record()
    torch.cuda.synchronize()
    rough = first[0].elapsed_time(first[1]) * 1e-3  # an upper bound on the device time: host gaps included
    calls = max(MIN_DEVICE_CALLS, min(MAX_DEVICE_CALLS, int(rep_ms * 1e-3 / max(rough, 1e-6))))
    return _device_time(fn, torch, calls, HOLD_MARGIN * calls * (host + ISSUE_OVERHEAD_S)), host


def _host_time(fn, torch) -> float:
    rounds = []
    for _ in range(HOST_ROUNDS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        rounds.append((time.perf_counter() - t0) / HOST_CALLS)
    torch.cuda.synchronize()
    return statistics.median(rounds)


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
