"""The public API against the strongest installed kernels, same process: bf16 forward and backward through
``memory_efficient_attention`` next to SDPA cuDNN and FlashAttention-4, and fp8 with per-tensor descales next
to our fp8 kernels and cuDNN's fp8 forward.

    python bench/backends.py [--quick] [--out DIR] [--budget SECONDS] [--no-record]

TFLOP/s = 4*B*H*N^2*D / t, halved when causal; backward 2.5x that count. Every column is timed through
``memory_efficient_attention`` (``op=`` for the single-backend columns, the selector for ``api``) with CUDA
events (``do_bench`` median of a few calls, after one untimed call that JIT-compiles the configuration), the columns
of a group timed in turn in ``ROUNDS`` rounds, each column the median of its rounds.
Ratios: ``api/best`` = api / max(cuDNN, FA4) (bf16) and api / max(ours, cuDNN fp8) (fp8), where ours is the
fastest of our fp8 ops that take the call. Columns of a backend that is not installed are empty; shapes left
when ``--budget`` runs out are listed as not measured. Writes backends.json into --out and, on CUDA (not with
--quick or --no-record), the record bench/results/backends.md.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    PREFILL_SHAPES,
    Record,
    attention_tflops,
    base_parser,
    environment,
    environment_line,
    or_none,
    out_dir,
    print_table,
    time_ms,
    write_json,
)
import fmha_ops  # noqa: E402
from fmha_ops import attn_bias as ab  # noqa: E402
from fmha_ops.testing import normal_qkv  # noqa: E402

SHAPES = PREFILL_SHAPES + [(8, 16, 16, 1000, 128, False)]  # B, Hq, Hkv, N, D, causal; N = 1000: partial blocks
BACKWARD_FLOPS = 2.5  # backward FLOPs per forward FLOP
TARGET = 0.97  # api / best
#: do_bench windows (ms): short, since every configuration is compiled by one untimed call first
WARMUP_MS, REP_MS = 3, 15
#: rounds in which the columns of one group (forward, backward, fp8) are timed in turn; each column is the median of
#: its rounds. Timed once each, one after the other, the api and FA4 backward columns (the same kernels: fa4F's own
#: autograd) read 0.944x apart at 4x32/32x4096x128 causal on the H200: drift between columns, not selection
ROUNDS = 3
OUR_FP8_OPS = ("triton_fp8F", "gluon_fp8F", "gluon_ws_fp8F")
RATIOS = ("api/best", "api_bw/best", "api_fp8/best")

RECORD = Record(
    "backends", "Public API against cuDNN, FlashAttention-4 and cuDNN fp8 (TFLOP/s)",
    "PYTHONPATH=$PWD python bench/backends.py",
    {"shape": "B x Hq/Hkv x N x D", "api_op": "api op", "api": "api fwd", "cudnn": "cuDNN fwd", "fa4": "FA4 fwd",
     "api/best": "fwd api/best", "api_bw": "api bwd", "cudnn_bw": "cuDNN bwd", "fa4_bw": "FA4 bwd",
     "api_bw/best": "bwd api/best", "api_fp8_op": "fp8 api op", "api_fp8": "api fp8", "ours_fp8": "ours fp8",
     "cudnn_fp8": "cuDNN fp8", "api_fp8/best": "fp8 api/best", "api_fp8_out": "api fp8, fp8 out"})
COLUMNS = list(RECORD.columns)


def available(name: str) -> bool:
    """Whether the op ``name`` can run in this process (installed, importable, this arch)."""
    return fmha_ops.get_op(name).available() is None


def ratio(num: float | None, *dens: float | None) -> float | None:
    """``num / max(dens)`` over the measured denominators; None when ``num`` or every denominator is missing.

    >>> ratio(90.0, 100.0, None, 80.0)
    0.9
    """
    dens = [d for d in dens if d]
    return num / max(dens) if num and dens else None


def shape_label(b: int, hq: int, hkv: int, n: int, d: int, causal: bool) -> str:
    """``4x32/32x4096x128 causal``: the row label of one shape."""
    return f"{b}x{hq}/{hkv}x{n}x{d}{' causal' if causal else ''}"


def _mask(causal: bool):
    return ab.LowerTriangularFromBottomRightMask() if causal else None


def _time(fn: Callable[[], object]) -> float:
    return time_ms(fn, warmup=WARMUP_MS, rep=REP_MS)


def _compile(fn: Callable[[], object]) -> None:
    """One untimed call: with ``--compile-only`` it fills the JIT caches (Triton's, FA4's CuTe DSL cache) that a
    later timed run in another process reads."""
    fn()
    torch.cuda.synchronize()


#: what each column does with its call: ``_time`` (ms) or, with ``--compile-only``, ``_compile``
_RUN = {"call": _time}


def interleaved(fns: dict[str, Callable[[], object] | None],
                timer: Callable[[Callable[[], object]], float] | None = None) -> dict[str, float | None]:
    """Milliseconds per column: ``ROUNDS`` rounds timing every column once in turn with ``timer`` (default: this
    script's, CUDA-event medians; one round with ``--compile-only``), the median of each column's rounds; None for
    a column that is None or failed."""
    run = timer or _RUN["call"]
    got: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(1 if run is _compile else ROUNDS):
        for name, fn in fns.items():
            ms = or_none(lambda: run(fn)) if fn is not None else None
            if ms:
                got[name].append(ms)
    return {name: statistics.median(t) if t else None for name, t in got.items()}


def api_call(q, k, v, causal: bool, op=None, **kw) -> Callable[[], torch.Tensor]:
    """The public call a user makes: ``memory_efficient_attention`` on q/k/v (BMHK) with the bottom-right causal
    mask when ``causal``, ``op`` forced (None: the selector's pick) and ``kw`` (descales, ``scale``) passed on."""
    bias = _mask(causal)
    return lambda: fmha_ops.memory_efficient_attention(q, k, v, bias, op=op, **kw)


def supporting_ops(names, q, k, v, causal: bool, **kw) -> list[str]:
    """The ops of ``names`` that can run the call ``api_call(q, k, v, causal, **kw)`` here (``explain``'s
    verdicts: installed, this arch, and the call's dtypes, descales, mask and head dim supported)."""
    ok = {v_.op.NAME for v_ in fmha_ops.explain(q, k, v, _mask(causal), **kw).verdicts if v_.ok}
    return [name for name in names if name in ok]


def selected_op(q, k, v, causal: bool, **kw) -> str | None:
    """The op the selector picks for ``api_call(q, k, v, causal, **kw)`` (None: none can run it)."""
    selected = fmha_ops.explain(q, k, v, _mask(causal), **kw).selected
    return None if selected is None else selected.NAME


def fa3_interface():
    """FlashAttention-3's own interface module (the ``fa3-fwd`` wheel's ``fa3_fwd_interface``, or
    ``flash_attn_interface`` of a build from its ``hopper/``: ``fmha_ops.ops.fa3.BUILD``), or None where none
    imports."""
    from fmha_ops.ops import fa3
    from fmha_ops.ops.common import import_failure

    if fa3.BUILD.module is None or import_failure(fa3.BUILD.module):
        return None
    return fa3.interface()


def fa3_calls(q, k, v, causal: bool, fp8=None) -> dict[str, Callable[[], object]]:
    """FlashAttention-3's own ``flash_attn_func`` as a user calls it: ``fa3_bf16`` on bf16 q/k/v (B, N, H, D) and,
    given ``fp8`` = (q8, k8, v8, q_descale, k_descale, v_descale) (e4m3, float32 (B, Hkv) descales as
    ``quantize_qkv_fp8`` makes them), ``fa3_fp8``; {} where FA3 is not importable.

    Example
    -------
    >>> calls = fa3_calls(q, k, v, True, quantize_qkv_fp8(q, k, v))  # doctest: +SKIP
    >>> out = calls["fa3_fp8"]()  # FA3 3.0 returns out, or (out, lse) where its build does
    """
    fa3 = fa3_interface()
    if fa3 is None:
        return {}
    calls = {"fa3_bf16": lambda: fa3.flash_attn_func(q, k, v, causal=causal)}
    if fp8 is not None:
        q8, k8, v8, qd, kd, vd = fp8
        calls["fa3_fp8"] = lambda: fa3.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                                       v_descale=vd)
    return calls


def forward_columns(q, k, v, causal: bool) -> dict:
    """bf16 forward TFLOP/s: ``api`` (the selector's op, named in ``api_op``), ``cudnn``, ``fa4``, ``api/best``."""
    b, n, hq, d = q.shape

    def call(op):
        return api_call(q, k, v, causal, op)

    ms = interleaved({"api": call(None), "cudnn": call("sdpa_cudnnF"),
                      "fa4": call("fa4F") if available("fa4F") else None})
    row = {"api_op": selected_op(q, k, v, causal)}
    row.update({name: attention_tflops(b, hq, n, d, causal, t) for name, t in ms.items()})
    row["api/best"] = ratio(row["api"], row["cudnn"], row["fa4"])
    return row


def backward_columns(q, k, v, causal: bool) -> dict:
    """bf16 backward TFLOP/s (2.5x the forward count): ``api_bw`` (the pair the selector picks for a call that
    needs gradients), ``cudnn_bw``, ``fa4_bw``, ``api_bw/best``."""
    b, n, hq, d = q.shape
    bias = _mask(causal)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    grad = torch.randn_like(q)

    def backward(op):
        out = or_none(lambda: fmha_ops.memory_efficient_attention(qg, kg, vg, bias, op=op))
        return None if out is None else (lambda: torch.autograd.grad(out, (qg, kg, vg), grad, retain_graph=True))

    ms = interleaved({"api_bw": backward(None), "cudnn_bw": backward("sdpa_cudnnF"),
                      "fa4_bw": backward(("fa4F", "fa4B")) if available("fa4F") else None})
    row = {}
    for name, t in ms.items():
        flops = attention_tflops(b, hq, n, d, causal, t)
        row[name] = flops * BACKWARD_FLOPS if flops else None
    row["api_bw/best"] = ratio(row["api_bw"], row["cudnn_bw"], row["fa4_bw"])
    return row


def fp8_columns(q, k, v, causal: bool) -> dict:
    """fp8 (per-tensor descales, bf16 out) TFLOP/s: ``api_fp8``, ``ours_fp8`` (the fastest of OUR_FP8_OPS),
    ``cudnn_fp8``, ``api_fp8/best``; and ``api_fp8_out``, the API with the fp8 output option
    (``output_dtype=float8_e4m3fn``, in v's units)."""
    from fmha_ops.quant import quantize_fp8_tensor

    b, n, hq, d = q.shape
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8_tensor(t) for t in (q, k, v))
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)

    def call(op):
        return api_call(q8, k8, v8, causal, op, **kw)

    ms = interleaved({"api_fp8": call(None), "cudnn_fp8": call("cudnn_fp8F") if available("cudnn_fp8F") else None}
                     | {name: call(name) for name in OUR_FP8_OPS if available(name)})
    tflops = {name: attention_tflops(b, hq, n, d, causal, t) for name, t in ms.items()}
    ours = [tflops[name] for name in OUR_FP8_OPS if tflops.get(name)]
    row = {"api_fp8_op": or_none(lambda: selected_op(q8, k8, v8, causal, **kw)),
           "api_fp8": tflops["api_fp8"], "ours_fp8": max(ours, default=None), "cudnn_fp8": tflops["cudnn_fp8"]}
    row["api_fp8/best"] = ratio(row["api_fp8"], row["ours_fp8"], row["cudnn_fp8"])
    row["api_fp8_out"] = attention_tflops(b, hq, n, d, causal, or_none(lambda: _RUN["call"](
        api_call(q8, k8, v8, causal, output_dtype=torch.float8_e4m3fn, **kw))))
    return row


def summary_lines(rows: list[dict]) -> list[str]:
    """One line per ratio column: its minimum over the measured shapes and the shape where it is reached."""
    lines = []
    for key in RATIOS:
        got = [(r[key], r["shape"]) for r in rows if r.get(key)]
        if got:
            low, where = min(got)
            lines.append(f"{key}: min {low:.3f} at {where} over {len(got)} shapes (target >= {TARGET})")
        else:
            lines.append(f"{key}: not measured")
    return lines


def notes(rows: list[dict], skipped: list[str]) -> str:
    """The record's notes: what the columns are, the minimum ratios, and the shapes the budget left out."""
    text = ("TFLOP/s = 4*B*H*N^2*D / t (halved when causal; backward 2.5x), CUDA events, median of "
            f"{ROUNDS} interleaved rounds, every column through "
            "`memory_efficient_attention` (`op=` for the single-backend columns). bwd: autograd through the pair "
            "the selector (api), SDPA cuDNN or (fa4F, fa4B) gives; fp8: per-tensor descales, bf16 out, ours = the "
            f"fastest of {', '.join(OUR_FP8_OPS)}; fp8 out: `output_dtype=float8_e4m3fn` (in v's units). "
            + "; ".join(summary_lines(rows)) + ".")
    if skipped:
        text += f" Not measured (time budget): {', '.join(skipped)}."
    return text


def main(argv=None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.0, help="seconds; shapes left after it are not measured")
    parser.add_argument("--shapes", default=None, help="comma list of indices into SHAPES (default: all)")
    parser.add_argument("--compile-only", action="store_true",
                        help="run every column's call once, untimed (fills the JIT caches), and write nothing")
    args = parser.parse_args(argv)
    _RUN["call"] = _compile if args.compile_only else _time
    t_end = time.perf_counter() + args.budget if args.budget else float("inf")
    rows, skipped = [], []
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    for B, Hq, Hkv, N, D, causal in shapes[:2] if args.quick else shapes:
        label = shape_label(B, Hq, Hkv, N, D, causal)
        if time.perf_counter() > t_end:
            skipped.append(label)
            continue
        q, k, v = normal_qkv((B, N, Hq, D), (B, N, Hkv, D), dtype=torch.bfloat16, device="cuda")
        row = {"shape": label}
        for columns in (forward_columns, backward_columns, fp8_columns):
            row.update(columns(q, k, v, causal))
        print("ROW " + "  ".join(f"{c}={row.get(c) if not isinstance(row.get(c), float) else round(row[c], 3)}"
                                 for c in COLUMNS), flush=True)
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    if args.compile_only:
        return {"rows": rows, "not_measured": skipped}
    if rows:
        print_table(rows, COLUMNS)
    for line in summary_lines(rows):
        print(line)
    if skipped:
        print(f"not measured (budget {args.budget:.0f} s): {', '.join(skipped)}")
    print(environment_line())
    write_json(out_dir(args.out), "backends", rows, {"not_measured": skipped})
    result = {"rows": rows, "not_measured": skipped}
    if rows and not (args.quick or args.no_record):
        result["record"] = RECORD.write(rows, environment(), notes=notes(rows, skipped))
        print("record:", result["record"])
    return result


if __name__ == "__main__":
    main()
