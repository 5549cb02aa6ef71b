"""``python -m fmha_ops tune``: time every available op on a grid of shape buckets and write the
timing table the selector reads (keyed by device name and software versions).

Each grid point is one call (``Call``); every fw op that is available and supports it is timed
through ``memory_efficient_attention(op=...)`` (so dispatch overhead counts), except ops whose own
estimate is over ``SKIP_FACTOR`` times the best estimate (the reference and math paths on large
shapes). ``timing.op_times`` takes each op's device time and host time per call apart (the host times of a
call's ops in interleaved rounds). The table's ``timings`` are device times per bucket; ``host_timings`` the
host times per bucket, ``host`` each op's median over its host rows (the selector's host time for calls of a
kind without a row). An op's host rows in a table come from one run: host times of the same call moved up to 2x
between H200 runs, so rows of two runs would rank ops by when each was timed. Between the measured buckets the
selector scales an op's model by measured / model at the nearest measured buckets of the call's kind;
the table also stores, per op, the median of measured / cost-model time, which scales the op's model
for calls of kinds the grid did not measure.

``host_only`` re-times only the host rows, on ``host_grid`` (the calls where host time can decide): the full grid
is 199 calls of 1-7 ops (~580 op timings), each filling ``REP_MS`` of device time after the op's first call,
which JIT-compiles a new configuration (1-3 s; FA4 ~2 s): far over a few minutes on a bare H200. The host grid's
79 calls of small sizes (~220 op timings, each 9 x 8 calls of ~100 us) take tens of seconds once their kernels
are compiled (``compile_only`` shards fill the caches in parallel processes).
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from registry import TuningTable, current_arch, fp8_dtype, table_device

from . import attn_bias as ab
from .api import memory_efficient_attention
from .dispatch import REGISTRY, SELECTOR
from .inputs import make_inputs
from .timing import called_once, op_times

SKIP_FACTOR = 20.0
REP_MS = 20.0  # device time per op and call (ms) the timed calls fill


@dataclass
class Call:
    """One benchmarked call: positional args and keyword args of memory_efficient_attention."""

    label: str
    args: tuple
    kwargs: dict = field(default_factory=dict)

    def problem(self):
        q, k, v, bias = self.args
        inp = make_inputs(q, k, v, bias, **self.kwargs)
        inp.validate()
        return inp.problem()


def _randn(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """bf16 normal values drawn on the generator's device (a decode call's 300M-element cache: ~5 s on a host
    core, milliseconds on the GPU)."""
    return torch.randn(shape, generator=g, device=g.device).to(torch.bfloat16)


def prefill_call(b: int, n: int, hq: int, hkv: int, d: int, causal: bool, dtype: str, device: str,
                 seed: int = 0) -> Call:
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = _randn((b, n, hq, d), g), _randn((b, n, hkv, d), g), _randn((b, n, hkv, d), g)
    bias = ab.LowerTriangularFromBottomRightMask() if causal else None
    label = f"prefill {dtype} B{b} N{n} H{hq}/{hkv} D{d}{' causal' if causal else ''}"
    if dtype in ("float16", "bfloat16", "float32"):
        t = getattr(torch, dtype)
        return Call(label, (q.to(t), k.to(t), v.to(t), bias))
    f8 = fp8_dtype(current_arch(device))
    if dtype == "fp8_tensor":  # one descale per tensor (the kind cuDNN's fp8 attention takes)
        from .quant import quantize_fp8_tensor

        (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8_tensor(t, f8) for t in (q, k, v))
        return Call(label, (q8, k8, v8, bias), dict(q_descale=qd, k_descale=kd, v_descale=vd))
    if dtype == "fp8":
        from .quant import quantize_qkv_fp8

        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v, dtype=f8)
        return Call(label, (q8, k8, v8, bias), dict(q_descale=qd, k_descale=kd, v_descale=vd))
    from .quant import quantize_i8fp8

    r = quantize_i8fp8(q, k, v, fp8_dtype=f8)
    return Call(label, (r.q, r.k, r.v, bias), dict(q_descale=r.q_descale, k_descale=r.k_descale,
                                                     v_descale=r.v_descale, scale=r.softmax_scale))


def decode_call(b: int, length: int, hq: int, hkv: int, d: int, page: int, kv: str, device: str,
                seed: int = 0) -> Call:
    """One new token per sequence against ``length`` cached keys: dense BMHK (page 0) or paged;
    kv "bf16", "fp8" (a prebuilt fp8 cache) or "quantize" (quantize_kv_to_fp8=True)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = _randn((b, 1, hq, d), g), _randn((b, length, hkv, d), g), _randn((b, length, hkv, d), g)
    label = f"decode {kv} B{b} L{length} H{hq}/{hkv} D{d} page{page}"
    kwargs: dict = {"quantize_kv_to_fp8": True} if kv == "quantize" else {}
    if page == 0 and kv != "fp8":
        return Call(label, (q, k, v, None), kwargs)
    from .kv_cache import build_fp8_paged_cache, paged_from_dense

    page = page or length
    if kv == "fp8":
        kc, vc, ks, vs, table = build_fp8_paged_cache(k, v, page, fp8_dtype(current_arch(device)))
        kwargs = dict(k_descale=ks.flatten(0, 1)[None], v_descale=vs.flatten(0, 1)[None])
    else:
        (kc, vc), table = paged_from_dense([k, v], page)
    bias = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
        [1] * b, table.shape[1] * page, [length] * b, device=device).make_paged(table, page)
    return Call(label, (q.view(1, b, hq, d), kc.flatten(0, 1)[None], vc.flatten(0, 1)[None], bias), kwargs)


PREFILL_DTYPES = ("bfloat16", "fp8", "fp8_tensor", "i8fp8")
#: the name ``dtypes`` takes for the grid's decode calls (a tuning run of the decode ops alone)
DECODE = "decode"
#: the grid's decode shapes: (batch, cached keys, query heads, KV heads), head dim 128
DECODE_SHAPES = ((1, 131072, 64, 8), (8, 32768, 32, 8), (64, 4096, 32, 8), (128, 1024, 32, 8), (16, 512, 32, 32))


def _parts(dtypes: tuple[str, ...] | None, default: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
    """The prefill dtypes and whether the decode calls are in for a grid's ``dtypes`` (None: ``default`` and decode)."""
    if dtypes is None:
        return default, True
    unknown = sorted(set(dtypes) - set(PREFILL_DTYPES) - {DECODE})
    if unknown:
        raise ValueError(f"dtypes={unknown} not in the grid; choose from {PREFILL_DTYPES + (DECODE,)}")
    return tuple(d for d in dtypes if d != DECODE), DECODE in dtypes


def grid(device: str, quick: bool = False, dtypes: tuple[str, ...] | None = None) -> list[Callable[[], Call]]:
    """The tuning grid: prefill (dtypes x head dims x causal x GQA x size; fp8 with per-(batch, head) and
    per-tensor descales) and decode (KV dtype x paging x batch/length). ``quick``: a handful of tiny calls
    (CPU, tests); ``dtypes``: only the prefill calls of these ``PREFILL_DTYPES``, and the decode calls only when
    it names ``DECODE`` (``("decode",)``: the decode calls alone)."""
    if quick:
        return [lambda: prefill_call(1, 64, 4, 2, 32, True, "float32", device),
                lambda: prefill_call(2, 128, 4, 4, 64, False, "float32", device),
                lambda: decode_call(2, 96, 4, 2, 32, 0, "bf16", device),
                lambda: decode_call(2, 96, 4, 2, 32, 16, "bf16", device)]
    prefill, decode = _parts(dtypes, PREFILL_DTYPES)
    calls = []
    for dtype in prefill:
        for d in (64, 128, 256):
            for b, n, h in ((16, 512, 16), (4, 2048, 32), (2, 8192, 16)):
                for causal in (False, True):
                    for hkv in (h, h // 4):
                        calls.append(lambda a=(b, n, h, hkv, d, causal, dtype): prefill_call(*a, device))
    for b, length, hq, hkv in DECODE_SHAPES if decode else ():
        calls += decode_calls(b, length, hq, hkv, device)
    return calls


def decode_calls(b: int, length: int, hq: int, hkv: int, device: str) -> list[Callable[[], Call]]:
    """One decode shape's calls: KV dtype ("bf16", "fp8", "quantize") x paging (dense, pages of 16 / 64 / 256)."""
    return [lambda a=(b, length, hq, hkv, 128, page, kv): decode_call(*a, device)
            for kv in ("bf16", "fp8", "quantize") for page in (0, 16, 64, 256) if not (kv == "fp8" and page == 0)]


#: ``host_grid``'s prefill size (batch, length, heads): the grid's smallest, where the fastest op's device time
#: (41-167 us on the H200) is under the ops' host times (100-241 us); on larger sizes device time decides
HOST_PREFILL = (16, 512, 16)
#: ``host_grid``'s prefill dtypes, first the one whose host-bound calls missed most (fp8: 62-71% regret ranked by one
#: host time per op); i8fp8 has one op on CUDA (no choice), and fp8's per-(batch, head) calls share their buckets
#: with the per-tensor ones, which every fp8 op takes
HOST_DTYPES = ("fp8_tensor", "bfloat16")


def host_grid(device: str, dtypes: tuple[str, ...] | None = None) -> list[Callable[[], Call]]:
    """The calls ``tune(host_only=True)`` times: every prefill kind of ``HOST_DTYPES`` (head dims x causal x GQA)
    at ``HOST_PREFILL``, then every decode call of the grid (their device times, 35-270 us for their K/V bytes at
    ~4 TB/s, are near their host times; the split count, and so the launches, follows the cache length). ``dtypes``:
    these prefill dtypes only, the decode calls only when it names ``DECODE``."""
    b, n, h = HOST_PREFILL
    prefill, decode = _parts(dtypes, HOST_DTYPES)
    calls = [lambda a=(b, n, h, hkv, d, causal, dtype): prefill_call(*a, device)
             for dtype in prefill for d in (64, 128, 256) for causal in (False, True) for hkv in (h, h // 4)]
    for shape in DECODE_SHAPES if decode else ():
        calls += decode_calls(*shape, device)
    return calls


def measure(call: Call, device: str, ops: frozenset[str] | None = None, host_only: bool = False,
            compile_only: bool = False) -> dict[str, tuple[float | None, float]]:
    """(device seconds, host seconds) per supporting op for one call (``timing.op_times``: the ops' host times in
    interleaved rounds; hopeless ops by their own estimate are skipped, ops that run out of memory dropped);
    ``ops``: time only the ops of these names; ``host_only``: device seconds None; ``compile_only``: each op's
    first call only (JIT compilation), nothing timed (empty)."""
    problem = call.problem()
    verdicts = [SELECTOR.verdict(op, problem) for op in REGISTRY.ops("fw") if ops is None or op.NAME in ops]
    ok = [v for v in verdicts if v.ok]
    models = {v.op: v.op.estimate(problem) for v in ok}
    best = min((m for m in models.values() if m is not None), default=math.inf)
    fns = called_once({v.op.NAME: partial(memory_efficient_attention, *call.args, op=v.op, **call.kwargs)
                       for v in ok if models[v.op] is None or models[v.op] <= SKIP_FACTOR * best},
                      (torch.OutOfMemoryError,))
    return {} if compile_only else op_times(fns, device, REP_MS, host_only)


@dataclass
class TableUpdate:
    """What one tune run writes into ``table``: device rows and measured / model ratios, host rows (an op's rows of
    earlier runs dropped at its first new one: rows of one run), and from them each op's calibration and median
    host time (``summarize``). ``record_host`` False: no host rows (on a CPU the host time is the call's whole
    time, nothing to rank by apart). ``keep_rows``: an op's host rows of earlier runs are replaced bucket by bucket,
    those of buckets this run does not measure kept (a retune of some rows, split over runs or cut by its budget)."""

    table: TuningTable
    record_host: bool
    keep_rows: bool = False
    ratios: dict[str, list[float]] = field(default_factory=dict)
    fresh_host: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._calibration, self._host = dict(self.table.calibration), dict(self.table.host)

    def add(self, problem, times: dict[str, tuple[float | None, float]]) -> None:
        """Record one call's ``measure`` result (device seconds None: host time only)."""
        bucket = problem.bucket()
        for name, (seconds, host) in times.items():
            if seconds is not None:
                self.table.record(name, bucket, seconds)
                model = REGISTRY.get(name).estimate(problem)
                if model:
                    self.ratios.setdefault(name, []).append(seconds / model)
            if self.record_host:
                if name not in self.fresh_host:
                    if not self.keep_rows:
                        self.table.host_timings.pop(name, None)
                    self.fresh_host.add(name)
                self.table.record_host(name, bucket, host)

    def summarize(self) -> None:
        t = self.table
        t.calibration = self._calibration | {name: statistics.median(r) for name, r in self.ratios.items()}
        t.host = self._host | {name: statistics.median(t.host_timings[name].values()) for name in self.fresh_host}


def tune(out: str, quick: bool = False, device: str | None = None, ops: frozenset[str] | None = None,
         merge: str | None = None, dtypes: tuple[str, ...] | None = None, host_only: bool = False,
         budget: float = 0.0, compile_only: bool = False, shard: tuple[int, int] = (0, 1),
         keep_rows: bool = False) -> TuningTable:
    """Time the grid and write the table to ``out`` (every 10 calls too, so a cut run keeps what it measured).
    ``ops``: measure only these op names; ``merge``: start from the table at that path (its other ops'
    timings and calibration are kept, the measured ops' rows replaced); ``dtypes``: only these prefill dtypes (and
    the decode calls where it names ``DECODE``); ``host_only``: re-time only the host rows, on ``host_grid``
    (``quick``: the quick grid), of the ``merge`` table, else into a table of host rows alone (a piece for
    ``registry.merge_tables``); the table is keyed by ``table_device`` of the GPU's name;
    ``budget``: seconds after which no further call is measured; ``shard``: only every ``shard[1]``-th call from the
    ``shard[0]``-th; ``compile_only``: each op's first call only (parallel processes filling the JIT caches), nothing
    written; ``keep_rows`` (with ``merge``): the measured ops' rows are replaced only in the buckets this run
    measures, their other rows kept (so a retune split by ``dtypes`` / ``shard`` over several runs, or cut by its
    ``budget``, loses none; their calibration comes from this run's rows).

    Example
    -------
    >>> tune("H200_fp8.json", ops=frozenset({"gluon_fp8F"}), dtypes=("fp8_tensor",))  # doctest: +SKIP
    >>> tune("H200.json", merge="H200.json", host_only=True, budget=60)  # doctest: +SKIP
    >>> tune("H100_decode.json", dtypes=("decode",))  # doctest: +SKIP
    >>> tune("H200.json", merge="H200.json", ops=frozenset({"fa3F"}), dtypes=("bfloat16",),
    ...      keep_rows=True)  # doctest: +SKIP
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    table = TuningTable.load(merge) if merge else TuningTable(table_device(current_arch(device).name), _versions())
    if keep_rows and not merge:
        raise ValueError("keep_rows keeps the rows of a table: give merge=<its path>")
    if merge and not host_only and not keep_rows:
        for name in ops or ():
            table.timings.pop(name, None)
    update = TableUpdate(table, record_host=device == "cuda", keep_rows=keep_rows)
    points = host_grid(device, dtypes) if host_only and not quick else grid(device, quick, dtypes)
    start, (k, n) = time.perf_counter(), shard
    for i, make in enumerate(points):
        if i % n != k:
            continue
        if budget and time.perf_counter() - start > budget:
            sys.stderr.write(f"\ntime budget spent: calls {i + 1}-{len(points)} not measured")
            break
        call = make()
        times = measure(call, device, ops, host_only, compile_only)
        update.add(call.problem(), times)
        best = min(times, key=lambda name: max(t or 0.0 for t in times[name])) if times else "-"
        sys.stderr.write(f"\r[{i + 1}/{len(points)}] {call.label:<48} best {best}\033[K")
        del call
        if i % 10 == 9 and not compile_only:  # keep what was measured if the run is cut short
            update.summarize()
            table.save(out)
    sys.stderr.write("\n")
    if compile_only:
        return table
    update.summarize()
    table.save(out)
    SELECTOR.tables.reload()
    SELECTOR.clear()
    return table


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    return versions
