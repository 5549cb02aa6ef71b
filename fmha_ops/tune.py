"""``python -m fmha_ops tune``: time every available op on a grid of shape buckets and write the
timing table the selector reads (keyed by device name and software versions).

Each grid point is one call (``Call``); every fw op that is available and supports it is timed
through ``memory_efficient_attention(op=...)`` (so dispatch overhead counts), except ops whose own
estimate is over ``SKIP_FACTOR`` times the best estimate (the reference and math paths on large
shapes). The table's timings are device times; its ``host`` entry holds each op's host time per call
(median over the grid; ``timing.call_times`` takes the two apart). Between the measured buckets the
selector scales an op's model by measured / model at the nearest measured buckets of the call's kind;
the table also stores, per op, the median of measured / cost-model time, which scales the op's model
for calls of kinds the grid did not measure.
"""
from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from registry import TuningTable, current_arch, fp8_dtype

from . import attn_bias as ab
from .api import memory_efficient_attention
from .dispatch import REGISTRY, SELECTOR
from .inputs import make_inputs
from .timing import call_times

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


def prefill_call(b: int, n: int, hq: int, hkv: int, d: int, causal: bool, dtype: str, device: str,
                 seed: int = 0) -> Call:
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, n, hq, d, generator=g).to(device, torch.bfloat16)
    k = torch.randn(b, n, hkv, d, generator=g).to(device, torch.bfloat16)
    v = torch.randn(b, n, hkv, d, generator=g).to(device, torch.bfloat16)
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
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, 1, hq, d, generator=g).to(device, torch.bfloat16)
    k = torch.randn(b, length, hkv, d, generator=g).to(device, torch.bfloat16)
    v = torch.randn(b, length, hkv, d, generator=g).to(device, torch.bfloat16)
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


def grid(device: str, quick: bool = False, dtypes: tuple[str, ...] | None = None) -> list[Callable[[], Call]]:
    """The tuning grid: prefill (dtypes x head dims x causal x GQA x size; fp8 with per-(batch, head) and
    per-tensor descales) and decode (KV dtype x paging x batch/length). ``quick``: a handful of tiny calls
    (CPU, tests); ``dtypes``: only the prefill calls of these ``PREFILL_DTYPES`` (no decode calls)."""
    if quick:
        return [lambda: prefill_call(1, 64, 4, 2, 32, True, "float32", device),
                lambda: prefill_call(2, 128, 4, 4, 64, False, "float32", device),
                lambda: decode_call(2, 96, 4, 2, 32, 0, "bf16", device),
                lambda: decode_call(2, 96, 4, 2, 32, 16, "bf16", device)]
    calls = []
    for dtype in dtypes or PREFILL_DTYPES:
        for d in (64, 128, 256):
            for b, n, h in ((16, 512, 16), (4, 2048, 32), (2, 8192, 16)):
                for causal in (False, True):
                    for hkv in (h, h // 4):
                        calls.append(lambda a=(b, n, h, hkv, d, causal, dtype): prefill_call(*a, device))
    if dtypes:
        return calls
    for b, length, hq, hkv in ((1, 131072, 64, 8), (8, 32768, 32, 8), (64, 4096, 32, 8), (128, 1024, 32, 8),
                               (16, 512, 32, 32)):
        for kv in ("bf16", "fp8", "quantize"):
            for page in (0, 16, 64, 256):
                if kv == "fp8" and page == 0:
                    continue
                calls.append(lambda a=(b, length, hq, hkv, 128, page, kv): decode_call(*a, device))
    return calls


def time_call(call: Callable[[], object], device: str, rep_ms: float = REP_MS) -> float:
    """Seconds per call back to back: the larger of the call's device time and its host time
    (``timing.call_times``), what the selector ranks an op by."""
    return max(call_times(call, device, rep_ms))


def measure(call: Call, device: str, ops: frozenset[str] | None = None) -> dict[str, tuple[float, float]]:
    """(device seconds, host seconds) per supporting op for one call (``timing.call_times``; hopeless ops by their
    own estimate are skipped); ``ops``: time only the ops of these names."""
    problem = call.problem()
    verdicts = [SELECTOR.verdict(op, problem) for op in REGISTRY.ops("fw") if ops is None or op.NAME in ops]
    ok = [v for v in verdicts if v.ok]
    models = {v.op: v.op.estimate(problem) for v in ok}
    best = min((m for m in models.values() if m is not None), default=math.inf)
    times = {}
    for v in ok:
        if models[v.op] is not None and models[v.op] > SKIP_FACTOR * best:
            continue
        try:
            times[v.op.NAME] = call_times(lambda: memory_efficient_attention(*call.args, op=v.op, **call.kwargs),
                                          device, REP_MS)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    return times


def tune(out: str, quick: bool = False, device: str | None = None, ops: frozenset[str] | None = None,
         merge: str | None = None, dtypes: tuple[str, ...] | None = None) -> TuningTable:
    """Time the grid and write the table to ``out`` (every 10 calls too, so a cut run keeps what it measured).
    ``ops``: measure only these op names; ``merge``: start from the table at that path (its other ops'
    timings and calibration are kept, the measured ones replaced); ``dtypes``: only these prefill dtypes.

    Example
    -------
    >>> tune("H200_fp8.json", ops=frozenset({"gluon_fp8F"}), dtypes=("fp8_tensor",))  # doctest: +SKIP
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    arch = current_arch(device)
    versions = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    table = TuningTable(arch.name, versions)
    if merge:
        table = TuningTable.load(merge)
        for name in ops or ():
            table.timings.pop(name, None)
    base_calibration, base_host = dict(table.calibration), dict(table.host)
    ratios: dict[str, list[float]] = {}
    hosts: dict[str, list[float]] = {}

    def summarize() -> None:
        table.calibration = base_calibration | {name: statistics.median(r) for name, r in ratios.items()}
        if device == "cuda":  # on a CPU the host time is the call's whole time: nothing to rank by apart
            table.host = base_host | {name: statistics.median(h) for name, h in hosts.items()}

    points = grid(device, quick, dtypes)
    for i, make in enumerate(points):
        call = make()
        problem = call.problem()
        times = measure(call, device, ops)
        for name, (seconds, host) in times.items():
            table.record(name, problem.bucket(), seconds)
            hosts.setdefault(name, []).append(host)
            model = REGISTRY.get(name).estimate(problem)
            if model:
                ratios.setdefault(name, []).append(seconds / model)
        best = min(times, key=lambda name: max(times[name])) if times else "-"
        sys.stderr.write(f"\r[{i + 1}/{len(points)}] {call.label:<48} best {best}\033[K")
        del call
        if i % 10 == 9:  # keep what was measured if the run is cut short
            summarize()
            table.save(out)
    sys.stderr.write("\n")
    summarize()
    table.save(out)
    SELECTOR.tables.reload()
    SELECTOR.clear()
    return table
