"""Forward attention benchmark: our 8-bit forwards through the public call against FlashAttention-3 and cuDNN fp8.

FlashAttention-3 (bf16 and fp8, its own ``flash_attn_func``) and cuDNN fp8 run in the same process; the accuracy of
the quantized forwards follows.

    python bench/attention_fwd_bench.py [--quick] [--shapes i,j] [--graph] [--budget SECONDS] [--no-accuracy]
                                        [--device cpu] [--out DIR] [--results DIR] [--no-record]
    python bench/attention_fwd_bench.py --sweep-only 64,128 [--sweep-shape B,H,N]

Shapes: ``SHAPES`` (B, Hq, Hkv, N, D, causal). Inputs arrive quantized (quantization is not timed, as with FA3):
``fp8`` e4m3 with (B, Hkv) descales (``quantize_qkv_fp8``, FA3's convention; cuDNN fp8 takes per-tensor descales
only and gets those), ``i8fp8`` int8 q/k with (B, Hkv) descales and fp8 v with one descale
(``quantize_i8fp8(..., qk_granularity="head", v_granularity="tensor")``) and ``i8fp8_block``, quantized as
``i8fp8_attention`` does (int8 q/k per 128-token block, fp8 v per channel). Every column of ours is the public call
``memory_efficient_attention``: ``api_<inputs>`` with the selector's pick (what a user gets, its op in
``api_<inputs>_op``) and ``op:<name>:<inputs>`` with each of our ops that takes the call forced by ``op=``
(``ours_fp8`` / ``ours_i8fp8``: the fastest of those). FA3 columns are its own ``flash_attn_func``
(``bench.backends.fa3_calls``), empty ('-') where no FA3 imports; so are cuDNN's where cudnn-frontend is missing.

Timing: TFLOP/s = 4*B*H*N^2*D / t, halved when causal. All columns of a shape are timed in interleaved rounds
(``bench.backends.interleaved``), each a CUDA-event median of back-to-back public calls, their host time included
(what a caller sees). ``--graph`` adds every column replayed from a CUDA graph (``g:`` keys): the kernels' time
without the host path, which at ~100 us kernels decides the back-to-back time. Ratios: ``RATIOS``; the issue's
targets per shape: ``targets``.

Accuracy (``accuracy_table``): against float32 attention of the bf16 inputs at 1x16384x16 D128, normal and
transformer-like inputs, the same public calls, FA3 fp8 on the same fp8 inputs as ours.

Writes attention_fwd.json/.png, i8fp8_accuracy.json (and attention_fwd_sweep.json with ``--sweep``) into --out,
and on CUDA (not with --quick or --no-record) the records attention_fwd.md (+ .png) and accuracy.md into
``--results`` (default bench/results/, what bench/assemble_benchmarks.py reads; shapes ``--budget`` leaves out are
named in the record). ``--device cpu`` is a smoke run (``CPU_SHAPES``, the Triton interpreter, wall-clock times)
through every code path a CPU has; FA3, cuDNN and the Gluon ops are absent there.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import backends  # noqa: E402
from bench.backends import api_call, fa3_calls, ratio, selected_op, shape_label, supporting_ops  # noqa: E402
from bench.common import (  # noqa: E402
    PREFILL_SHAPES,
    RESULTS,
    Record,
    attention_tflops,
    bar_plot,
    base_parser,
    capture_graph,
    environment,
    or_none,
    out_dir,
    print_table,
    time_ms,
    time_wall_ms,
    write_json,
)
from fmha_ops.kernels.triton.attention_fwd import FwdConfig, attention_forward  # noqa: E402
from fmha_ops.quant import quantize_fp8_tensor, quantize_i8fp8, quantize_qkv_fp8, random_hadamard  # noqa: E402
from fmha_ops.testing import error_report, normal_qkv, transformer_like  # noqa: E402
from fmha_ops.timing import called_once  # noqa: E402

#: B, Hq, Hkv, N, D, causal: the shapes of issue 36's table (the prefill anchors, GQA, D 256 causal, 3000 / 1000
#: tokens and a small causal batch where FA3's fp8 kernel is weak)
SHAPES = PREFILL_SHAPES[:3] + [(1, 64, 8, 16384, 128, False)] + PREFILL_SHAPES[3:] + [
    (2, 16, 16, 8192, 256, True),
    (3, 24, 8, 3000, 128, True),
    (8, 16, 16, 1000, 128, False),
    (16, 32, 8, 512, 64, True),
]
#: --quick: one long-sequence and one short-sequence shape (indices into SHAPES)
QUICK = (0, 8)
#: --device cpu: tiny shapes (partial tiles, GQA, causal) the Triton interpreter runs in seconds
CPU_SHAPES = [(1, 4, 2, 40, 64, True), (2, 2, 2, 33, 64, False)]
#: our fp8 ops and our i8fp8 ops, each forced with op= where it takes the call
OUR_FP8_OPS = backends.OUR_FP8_OPS
OUR_I8FP8_OPS = ("triton_i8fp8F", "gluon_ws_i8fp8F")
#: ratio column -> (numerator, denominators: the largest measured one is taken)
RATIOS = {
    "i8fp8/fa3_fp8": ("api_i8fp8", ("fa3_fp8",)),
    "i8fp8/fa3_bf16": ("api_i8fp8", ("fa3_bf16",)),
    "ours_fp8/fa3_fp8": ("ours_fp8", ("fa3_fp8",)),
    "api_fp8/fa3_fp8": ("api_fp8", ("fa3_fp8",)),
    "api_fp8/best": ("api_fp8", ("fa3_fp8", "ours_fp8")),
    "ours_fp8/cudnn_fp8": ("ours_fp8", ("cudnn_fp8",)),
}
#: the issue's accuracy targets: i8fp8's cosine on transformer-like inputs, and how far fp8's cosine may sit from
#: FA3 fp8's on the same inputs to count as equal
I8FP8_COSINE = 0.9995
FP8_COSINE_TOLERANCE = 1e-4
#: the accuracy problem (B, H, N, D) on CUDA and on a CPU
ACCURACY_SHAPE, CPU_ACCURACY_SHAPE = (1, 16, 16384, 128), (1, 2, 80, 64)
#: queries per chunk of the float32 reference
REFERENCE_CHUNK = 2048

SWEEP = {  # (head dim, causal) -> list of (block_m, block_n, num_warps, num_stages, extra options)
    (128, False): [(64, 128, 4, 3, {}), (64, 128, 4, 4, {}), (64, 128, 4, 2, {}), (64, 64, 4, 4, {}),
                   (64, 256, 4, 2, {}), (128, 128, 8, 3, {})],
    (128, True): [(64, 128, 4, 3, {}), (128, 64, 4, 3, {}), (64, 64, 4, 3, {}), (64, 128, 4, 4, {})],
    (64, False): [(128, 128, 4, 3, {}), (128, 128, 4, 4, {}), (64, 128, 4, 3, {}), (64, 256, 4, 3, {}),
                  (128, 256, 8, 3, {}), (64, 64, 4, 3, {}), (64, 128, 4, 2, {}), (64, 128, 4, 4, {}),
                  (64, 64, 4, 4, {}), (128, 128, 8, 3, {})],
    (64, True): [(64, 64, 4, 3, {}), (64, 128, 4, 3, {}), (64, 64, 4, 4, {}), (64, 32, 4, 3, {}),
                 (128, 64, 4, 3, {}), (128, 64, 8, 3, {}), (128, 128, 8, 3, {}), (64, 64, 4, 2, {})],
    (256, False): [(64, 64, 4, 2, {}), (64, 64, 4, 3, {}), (64, 128, 4, 2, {}), (128, 64, 8, 3, {})],
}


def _sage():
    try:
        from sageattention import sageattn

        return sageattn
    except Exception:  # noqa: BLE001 - optional package
        return None


def prepare(B, Hq, Hkv, N, D, causal, dist="normal", seed=0, device="cuda"):
    """bf16 q, k, v on ``device`` in BMHK layout from one of fmha_ops.testing's distributions."""
    make = normal_qkv if dist == "normal" else transformer_like
    return tuple(make((B, N, Hq, D), (B, N, Hkv, D), dtype=torch.bfloat16, device=device, seed=seed))


def _graph_ms(fn):
    """Median ms of a CUDA-graph replay of ``fn()``: the GPU time, also where one eager call would be shorter
    than its host launch path (small shapes)."""
    return time_ms(capture_graph(fn).replay)


def sweep(out, dims=(64, 128, 256), shape=None):
    """Tile variants of the Triton kernel per (head dim, causal), each timed as a CUDA-graph replay; returns the
    best config per (D, causal) (the kernel's defaults, ``default_config``, come from these sweeps)."""
    rows = []
    best = {}
    for (D, causal), variants in SWEEP.items():
        if D not in dims:
            continue
        B, H, N = shape or {128: (4, 32, 4096), 64: (4, 16, 4096), 256: (4, 16, 4096)}[D]
        q, k, v = prepare(B, H, H, N, D, False)
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        xi = quantize_i8fp8(q, k, v) if (D, causal) in ((128, False), (64, False)) else None
        for bm, bn, w, s, extra in variants:
            cfg = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s, **extra)
            row = dict(D=D, causal=causal, cfg=json.dumps(cfg))
            ms = or_none(lambda: _graph_ms(lambda: attention_forward(
                q8, k8, v8, scale=D ** -0.5, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                config=FwdConfig(**cfg))))
            row["fp8"] = attention_tflops(B, H, N, D, causal, ms)
            if xi is not None and not extra:
                ms = or_none(lambda: _graph_ms(lambda: attention_forward(
                    xi.q, xi.k, xi.v, scale=1.0, causal=causal, q_descale=xi.q_descale, k_descale=xi.k_descale,
                    v_descale=xi.v_descale, config=FwdConfig(**cfg))))
                row["i8fp8"] = attention_tflops(B, H, N, D, causal, ms)
            print(row, flush=True)
            rows.append(row)
            key = (D, causal)
            if row["fp8"] and (key not in best or row["fp8"] > best[key][0]):
                best[key] = (row["fp8"], cfg)
    with open(os.path.join(out, "attention_fwd_sweep.json"), "w") as f:
        json.dump({"env": environment(), "rows": rows, "best": {f"{k[0]}_{k[1]}": v for k, v in best.items()}}, f,
                  indent=1)
    print_table(rows, ["D", "causal", "cfg", "fp8", "i8fp8"])
    return {k: v[1] for k, v in best.items()}


# ---- speed ----------------------------------------------------------------------------------------------------

def _i8fp8_call(x) -> tuple[tuple, dict]:
    """(q, k, v) and the public call's keywords for ``quantize_i8fp8``'s output ``x``."""
    return (x.q, x.k, x.v), dict(scale=x.softmax_scale, q_descale=x.q_descale, k_descale=x.k_descale,
                                 v_descale=x.v_descale)


def shape_calls(q, k, v, causal: bool) -> tuple[dict[str, Callable[[], object]], dict[str, str | None]]:
    """Every timed column's call for one shape (name -> call; see the module docstring) and the selector's op per
    ``api_*`` column, from bf16 q (B, N, Hq, D), k / v (B, N, Hkv, D)."""
    fp8 = quantize_qkv_fp8(q, k, v)
    (qt, qtd), (kt, ktd), (vt, vtd) = (quantize_fp8_tensor(t) for t in (q, k, v))
    inputs = {  # inputs -> (q, k, v), the call's keywords, our ops to force
        "fp8": (fp8[:3], dict(q_descale=fp8[3], k_descale=fp8[4], v_descale=fp8[5]), OUR_FP8_OPS),
        "i8fp8": (*_i8fp8_call(quantize_i8fp8(q, k, v, qk_granularity="head", v_granularity="tensor")),
                  OUR_I8FP8_OPS),
        "i8fp8_block": (*_i8fp8_call(quantize_i8fp8(q, k, v)), OUR_I8FP8_OPS),
        "bf16": ((q, k, v), {}, ()),
    }
    calls = dict(fa3_calls(q, k, v, causal, fp8))
    selected = {}
    for kind, (args, kw, ours) in inputs.items():
        calls[f"api_{kind}"] = api_call(*args, causal, **kw)
        selected[f"api_{kind}_op"] = or_none(lambda: selected_op(*args, causal, **kw))
        for name in supporting_ops(ours, *args, causal, **kw):
            calls[f"op:{name}:{kind}"] = api_call(*args, causal, name, **kw)
    tensor_kw = dict(q_descale=qtd, k_descale=ktd, v_descale=vtd)
    if supporting_ops(("cudnn_fp8F",), qt, kt, vt, causal, **tensor_kw):
        calls["cudnn_fp8"] = api_call(qt, kt, vt, causal, "cudnn_fp8F", **tensor_kw)
    if supporting_ops(("sdpa_cudnnF",), q, k, v, causal):
        calls["cudnn_bf16"] = api_call(q, k, v, causal, "sdpa_cudnnF")
    return calls, selected


def summarize(row: dict, prefix: str = "") -> None:
    """Add to ``row`` the fastest of our forced ops per input kind (``ours_fp8`` / ``ours_i8fp8`` and their
    ``_op``) and the ``RATIOS`` columns, over the TFLOP/s keys that start with ``prefix`` ("" or "g:")."""
    for kind in ("fp8", "i8fp8"):
        forced = {key.split(":")[-2]: row[key] for key in row
                  if key.startswith(f"{prefix}op:") and key.endswith(f":{kind}") and row[key]}
        best = max(forced, key=forced.get, default=None)
        row[f"{prefix}ours_{kind}"] = forced.get(best)
        row[f"{prefix}ours_{kind}_op"] = best
    for name, (num, dens) in RATIOS.items():
        row[prefix + name] = ratio(row.get(prefix + num), *(row.get(prefix + d) for d in dens))


def targets(B: int, Hq: int, Hkv: int, N: int, D: int, causal: bool) -> dict[str, float]:
    """The issue's speed targets for one shape: ratio column -> the least it must reach. i8fp8 (through the
    public call) >= 0.95x FA3 fp8 and >= 1.25x FA3 bf16 at N >= 2048, >= 1.1x FA3 bf16 at 1000 tokens; our fp8
    >= 1.0x FA3 fp8 at N >= 2048 (D 128 / 256), >= 0.9x below and >= 1.5x on short causal sequences (N <= 512)
    where FA3's fp8 kernel is weak; the public fp8 call within ``backends.TARGET`` of the best fp8 call."""
    got = {"api_fp8/best": backends.TARGET}
    if N >= 2048:
        got.update({"i8fp8/fa3_fp8": 0.95, "i8fp8/fa3_bf16": 1.25})
        if D in (128, 256):
            got["ours_fp8/fa3_fp8"] = 1.0
        return got
    if N >= 1000:
        got["i8fp8/fa3_bf16"] = 1.1
    got["ours_fp8/fa3_fp8"] = 1.5 if N <= 512 and causal else 0.9
    return got


def target_lines(rows: list[dict], prefix: str = "") -> list[str]:
    """Per ratio column with a target: its minimum and the shapes that miss their target (``prefix`` "g:": the
    CUDA-graph columns)."""
    lines = []
    for name in RATIOS:
        got = [(r[prefix + name], r["shape"]) for r in rows if r.get(prefix + name)]
        if not got:
            continue
        low, where = min(got)
        line = f"{prefix}{name}: min {low:.3f} at {where}"
        aimed = [(r[prefix + name], r["target:" + name], r["shape"]) for r in rows
                 if r.get(prefix + name) and r.get("target:" + name)]
        if aimed:
            missed = [f"{shape} {value:.2f} < {aim}" for value, aim, shape in aimed if value < aim]
            line += f"; target met at {len(aimed) - len(missed)}/{len(aimed)} shapes"
            line += f" (missed: {', '.join(missed)})" if missed else ""
        lines.append(line)
    return lines


def _cpu_ms(fn: Callable[[], object]) -> float:
    return time_wall_ms(fn, calls=1)


def speed_row(shape: tuple, device: str, graph: bool) -> dict:
    """One shape's row: TFLOP/s per column (``g:`` too with ``graph``), the selector's ops, ratios, targets."""
    B, Hq, Hkv, N, D, causal = shape
    q, k, v = prepare(B, Hq, Hkv, N, D, causal, device=device)
    calls, selected = shape_calls(q, k, v, causal)
    calls = called_once(calls, skip=(Exception,), report=lambda name, e: print(
        f"  [skip] {name}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", flush=True))
    timer = None if device == "cuda" else _cpu_ms
    f = lambda ms: attention_tflops(B, Hq, N, D, causal, ms)  # noqa: E731
    row = {"shape": shape_label(*shape), **selected}
    row.update({name: f(ms) for name, ms in backends.interleaved(calls, timer).items()})
    summarize(row)
    if graph and device == "cuda":
        replays = {name: or_none(lambda: capture_graph(fn).replay) for name, fn in calls.items()}
        row.update({f"g:{name}": f(ms) for name, ms in backends.interleaved(replays, timer).items()})
        summarize(row, "g:")
        del replays
    row.update({f"target:{name}": aim for name, aim in targets(*shape).items()})
    return row


#: the printed table's columns (with --graph, the g: ones follow)
TABLE = ["shape", "fa3_bf16", "fa3_fp8", "cudnn_fp8", "api_fp8", "api_fp8_op", "ours_fp8", "ours_fp8_op",
         "api_i8fp8", "api_i8fp8_op", "ours_i8fp8", "ours_i8fp8_op", "api_i8fp8_block", "api_bf16", "api_bf16_op",
         "cudnn_bf16", *RATIOS]
GRAPH_TABLE = ["shape", *(f"g:{c}" for c in ("fa3_bf16", "fa3_fp8", "cudnn_fp8", "api_fp8", "ours_fp8",
                                              "ours_fp8_op", "api_i8fp8", "ours_i8fp8", "ours_i8fp8_op",
                                              "api_i8fp8_block", "api_bf16", *RATIOS))]


def speed_table(out: str, shapes: list[tuple], device: str, graph: bool, deadline: float = float("inf")):
    """Rows of every shape in ``shapes`` begun before ``deadline`` (``time.perf_counter``), and the labels of the
    shapes left; prints the tables and the target lines, writes attention_fwd.json (after every shape: a run cut
    short keeps its rows) and attention_fwd.png."""
    rows, skipped = [], []
    for shape in shapes:
        if time.perf_counter() > deadline:
            skipped.append(shape_label(*shape))
            continue
        rows.append(speed_row(shape, device, graph))
        print("ROW", json.dumps({key: round(val, 3) if isinstance(val, float) else val
                                 for key, val in rows[-1].items()}), flush=True)
        write_json(out, "attention_fwd", rows)
        if device == "cuda":
            torch.cuda.empty_cache()
    if rows:
        print_table(rows, TABLE)
        if graph and device == "cuda":
            print_table(rows, GRAPH_TABLE)
    lines = target_lines(rows) + (target_lines(rows, "g:") if graph else [])
    for line in lines:
        print(line)
    if skipped:
        print(f"not measured (time budget): {', '.join(skipped)}")
    write_json(out, "attention_fwd", rows, {"not_measured": skipped, "targets": lines})
    bar_plot(out, "attention_fwd", rows, "shape",
             ["fa3_bf16", "fa3_fp8", "cudnn_fp8", "api_fp8", "ours_fp8", "api_i8fp8", "api_i8fp8_block", "api_bf16"],
             "TFLOP/s", "attention forward")
    return rows, skipped, lines


# ---- accuracy -------------------------------------------------------------------------------------------------

def _output(res) -> torch.Tensor:
    """The output of a call that returns it alone or first in a tuple (FA3 builds returning (out, lse))."""
    return res[0] if isinstance(res, tuple) else res


def _reference(q, k, v) -> torch.Tensor:
    """float32 non-causal attention of bf16 q / k / v (BMHK, Hq == Hkv) in chunks of queries: (B, N, H, D)."""
    B, N, H, D = q.shape
    ref = torch.empty(B, N, H, D, device=q.device)
    kf, vf = k.float().permute(0, 2, 3, 1), v.float().permute(0, 2, 1, 3)
    for s0 in range(0, N, REFERENCE_CHUNK):
        s = (q[:, s0:s0 + REFERENCE_CHUNK].float().permute(0, 2, 1, 3) @ kf) * D ** -0.5
        ref[:, s0:s0 + REFERENCE_CHUNK] = (torch.softmax(s, -1) @ vf).permute(0, 2, 1, 3)
    return ref


#: the accuracy calls the record shows (transformer-like inputs), in this order; the JSON has every call
RECORDED = ("i8fp8 (head q/k, tensor v), api", "i8fp8 (block q/k, channel v), api", "fp8 (B,Hkv), api",
            "FA3 fp8 (B,Hkv)", "fp8 (Hadamard q/k, B,Hkv), api", "cuDNN fp8 (per tensor)", "bf16, api", "FA3 bf16")


def accuracy_calls(q, k, v) -> dict[str, Callable[[], object]]:
    """name -> call for the accuracy table (non-causal, bf16 q / k / v of one head count): the public call on each
    quantization (the selector's pick; our ops that take it forced, as ``<quantization>, <op>``), FA3 on the same
    fp8 inputs, cuDNN fp8 per tensor, one research variant of the Triton kernel (fp16 PV), SageAttention if
    installed."""
    D = q.shape[-1]
    fp8 = quantize_qkv_fp8(q, k, v)
    quantized = {  # name -> (q, k, v), keywords, our ops to force
        "i8fp8 (head q/k, tensor v)": (*_i8fp8_call(quantize_i8fp8(q, k, v, qk_granularity="head",
                                                                    v_granularity="tensor")), OUR_I8FP8_OPS),
        "i8fp8 (block q/k, channel v)": (*_i8fp8_call(quantize_i8fp8(q, k, v)), ()),
        "i8fp8 (head q/k, channel v)": (*_i8fp8_call(quantize_i8fp8(q, k, v, qk_granularity="head")), ()),
        "fp8 (B,Hkv)": (fp8[:3], dict(q_descale=fp8[3], k_descale=fp8[4], v_descale=fp8[5]), OUR_FP8_OPS),
    }
    for name, x in (("fp8 (block q/k, B,Hkv v)", quantize_qkv_fp8(q, k, v, qk_granularity="block")),
                    ("fp8 (Hadamard q/k, B,Hkv)", quantize_qkv_fp8(q, k, v, rotation=random_hadamard(D,
                                                                                                   device=q.device)))):
        quantized[name] = (x[:3], dict(q_descale=x[3], k_descale=x[4], v_descale=x[5]), ())
    (qt, qtd), (kt, ktd), (vt, vtd) = (quantize_fp8_tensor(t) for t in (q, k, v))
    quantized["fp8 (per tensor)"] = ((qt, kt, vt), dict(q_descale=qtd, k_descale=ktd, v_descale=vtd), ())
    runs = {}
    for name, (args, kw, ours) in quantized.items():
        runs[f"{name}, api"] = api_call(*args, False, **kw)
        for op in supporting_ops(ours, *args, False, **kw):
            runs[f"{name}, {op}"] = api_call(*args, False, op, **kw)
    blocks = quantize_i8fp8(q, k, v)
    runs["i8fp8 (block q/k, channel v), fp16 PV"] = lambda: attention_forward(
        blocks.q, blocks.k, blocks.v, scale=1.0, q_descale=blocks.q_descale, k_descale=blocks.k_descale,
        v_descale=blocks.v_descale, pv_fp8=False)[0]
    fa3 = fa3_calls(q, k, v, False, fp8)
    if "fa3_fp8" in fa3:
        runs["FA3 fp8 (B,Hkv)"] = fa3["fa3_fp8"]
    if supporting_ops(("cudnn_fp8F",), qt, kt, vt, False, q_descale=qtd, k_descale=ktd, v_descale=vtd):
        runs["cuDNN fp8 (per tensor)"] = api_call(qt, kt, vt, False, "cudnn_fp8F", q_descale=qtd, k_descale=ktd,
                                                  v_descale=vtd)
    runs["bf16, api"] = api_call(q, k, v, False)
    if "fa3_bf16" in fa3:
        runs["FA3 bf16"] = fa3["fa3_bf16"]
    sage = _sage()
    if sage is not None:
        ks = k.clone()
        runs["SageAttention 1.0.6"] = lambda: sage(q, ks, v, tensor_layout="NHD")
    return runs


def accuracy_lines(rows: list[dict]) -> list[str]:
    """The issue's accuracy checks on the transformer-like rows: i8fp8's cosine against ``I8FP8_COSINE``, and
    our fp8 cosine against FA3 fp8's on the same inputs."""
    cos = {r["kernel"]: r["cos"] for r in rows if r["inputs"] == "transformer_like"}
    lines = []
    i8 = cos.get("i8fp8 (head q/k, tensor v), api")
    if i8 is not None:
        lines.append(f"i8fp8 (head q/k, tensor v) cosine {i8:.5f} ({'>=' if i8 >= I8FP8_COSINE else '<'} "
                     f"{I8FP8_COSINE})")
    ours, fa3 = cos.get("fp8 (B,Hkv), api"), cos.get("FA3 fp8 (B,Hkv)")
    if ours is not None and fa3 is not None:
        same = abs(ours - fa3) <= FP8_COSINE_TOLERANCE
        lines.append(f"fp8 (B,Hkv) cosine {ours:.5f}, FA3 fp8 {fa3:.5f} ({'equal' if same else 'differ'} within "
                     f"{FP8_COSINE_TOLERANCE:g})")
    return lines


def accuracy_table(out: str, device: str):
    """Error of every ``accuracy_calls`` call against float32 attention, on normal and transformer-like inputs;
    prints the table and ``accuracy_lines``, writes i8fp8_accuracy.json."""
    B, H, N, D = ACCURACY_SHAPE if device == "cuda" else CPU_ACCURACY_SHAPE
    rows = []
    for dist in ("normal", "transformer_like"):
        q, k, v = prepare(B, H, H, N, D, False, dist, seed=7, device=device)
        ref = _reference(q, k, v)
        for name, fn in accuracy_calls(q, k, v).items():
            o = or_none(lambda: _output(fn()))
            if o is None:
                continue
            e = error_report(o, ref)
            rows.append(dict(inputs=dist, kernel=name, mae=e["mae"], max=e["max"], cos=e["cos"], rel=e["rel"]))
            print(rows[-1], flush=True)
        del q, k, v, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, ["inputs", "kernel", "mae", "max", "cos", "rel"])
    lines = accuracy_lines(rows)
    for line in lines:
        print(line)
    write_json(out, "i8fp8_accuracy", rows, {"shape": [B, H, N, D], "checks": lines})
    return rows, lines


# ---- records --------------------------------------------------------------------------------------------------

COMMAND = "PYTHONPATH=$PWD python bench/attention_fwd_bench.py --graph"
SPEED_RECORD = Record(
    "attention_fwd", "Forward attention (prefill) against FlashAttention-3 and cuDNN fp8", COMMAND,
    {"shape": "B x Hq/Hkv x N x D", "fa3_bf16": "FA3 bf16", "fa3_fp8": "FA3 fp8", "cudnn_fp8": "cuDNN fp8",
     "ours_fp8": "ours fp8", "api_fp8": "api fp8", "api_fp8_op": "api fp8 op", "api_i8fp8": "api i8fp8",
     "api_i8fp8_op": "api i8fp8 op", "api_i8fp8_block": "i8fp8, block scales",
     "i8fp8/fa3_fp8": "i8fp8 / FA3 fp8", "i8fp8/fa3_bf16": "i8fp8 / FA3 bf16", "ours_fp8/fa3_fp8": "fp8 / FA3 fp8",
     "api_fp8/best": "api fp8 / best", "g:i8fp8/fa3_fp8": "graphs: i8fp8 / FA3 fp8",
     "g:i8fp8/fa3_bf16": "graphs: i8fp8 / FA3 bf16", "g:ours_fp8/fa3_fp8": "graphs: fp8 / FA3 fp8"})
ACCURACY_RECORD = Record(
    "accuracy", "Accuracy of the quantized forward", COMMAND,
    {"kernel": "call", "cos": "cosine", "mae": "mean abs err", "max": "max abs err", "rel": "rel L2 err"})


def speed_notes(skipped: list[str], lines: list[str]) -> str:
    text = ("TFLOP/s = 4*B*H*N^2*D / t, halved when causal; inputs already quantized. FA3 = its own "
            "`flash_attn_func` (`fa3-fwd` wheel), fp8 with (B, Hkv) descales; cuDNN fp8 per tensor (all it takes); "
            "ours through `memory_efficient_attention`: api = the selector's op, ours fp8 = the fastest of "
            f"{', '.join(OUR_FP8_OPS)} forced with `op=`; i8fp8: int8 q/k with (B, Hkv) descales, fp8 v per tensor "
            "(block scales: `i8fp8_attention`'s quantization). CUDA-event medians of back-to-back calls in "
            f"{backends.ROUNDS} interleaved rounds (host time included); graphs: the same calls replayed from CUDA "
            "graphs (kernel time). Best = max(FA3 fp8, ours fp8). " + "; ".join(lines) + ".")
    if skipped:
        text += f" Not measured (time budget): {', '.join(skipped)}."
    return text


def accuracy_notes(shape: tuple, lines: list[str]) -> str:
    B, H, N, D = shape
    return (f"B={B}, H={H}, N={N}, D={D}, non-causal, transformer-like inputs (`fmha_ops.testing.transformer_like`; "
            "normal inputs and every forced op in i8fp8_accuracy.json), against float32 attention of the bf16 "
            "inputs; public calls (api: the selector's op), FA3's own `flash_attn_func` on the same fp8 inputs as "
            "ours; Hadamard: `rotation=random_hadamard(D)`. "
            + "; ".join(lines) + ".")


def main(argv=None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--shapes", default=None, help="comma list of indices into SHAPES (default: all)")
    p.add_argument("--graph", action="store_true", help="also time every column replayed from a CUDA graph")
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds from the start; shapes (and the accuracy table) left after it are not measured")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"),
                   help="cpu: a smoke run on tiny shapes (the Triton interpreter)")
    p.add_argument("--sweep", action="store_true", help="first time the Triton kernel's tile variants (JSON only)")
    p.add_argument("--sweep-only", default=None, help="comma list of head dims: run only their sweep, then stop")
    p.add_argument("--sweep-shape", default=None, help="B,H,N for --sweep-only (default 4,32,4096 at D128, 4,16,4096)")
    p.add_argument("--no-accuracy", action="store_true")
    p.add_argument("--results", default=RESULTS,
                   help="folder the records go to (default bench/results; on a remote machine one under --out)")
    args = p.parse_args(argv)
    deadline = time.perf_counter() + args.budget if args.budget else float("inf")
    out = out_dir(args.out)
    env = environment()
    print(env)
    if args.sweep_only:
        shape = tuple(int(x) for x in args.sweep_shape.split(",")) if args.sweep_shape else None
        return {"sweep": sweep(out, tuple(int(d) for d in args.sweep_only.split(",")), shape)}
    result = {}
    if args.sweep:
        result["sweep"] = or_none(lambda: sweep(out))
    if args.device == "cpu":
        shapes = CPU_SHAPES
    elif args.shapes:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    else:
        shapes = [SHAPES[i] for i in QUICK] if args.quick else SHAPES
    if args.graph and args.device == "cpu":
        print("--graph: no CUDA graphs on a CPU, the event-timed columns only")
    rows, skipped, lines = speed_table(out, shapes, args.device, args.graph, deadline)
    result.update(rows=rows, not_measured=skipped, targets=lines)
    record = args.device == "cuda" and not (args.no_record or args.quick)
    if record and rows:
        result["record"] = SPEED_RECORD.write(rows, env, os.path.join(out, "attention_fwd.png"),
                                              notes=speed_notes(skipped, lines), results_dir=args.results)
        print("record:", result["record"])
    if not args.no_accuracy and time.perf_counter() > deadline:
        print("accuracy table not measured (time budget)")
    elif not args.no_accuracy:
        arows, alines = accuracy_table(out, args.device)
        result.update(accuracy=arows, accuracy_checks=alines)
        shown = [r for name in RECORDED for r in arows if r["kernel"] == name and r["inputs"] == "transformer_like"]
        if record and shown:
            result["accuracy_record"] = ACCURACY_RECORD.write(shown, env, notes=accuracy_notes(ACCURACY_SHAPE, alines),
                                                              results_dir=args.results)
            print("record:", result["accuracy_record"])
    return result


if __name__ == "__main__":
    main()
