"""Host time per call of every public entry point against calling the chosen backend directly, CPU and GPU.

Tiny shapes, so the host path sets the pace. Per entry point three columns, microseconds per call:
``ours`` (the public function), ``direct`` (the op the selector chose, called without our call path: its launch
plan (``launcher``) made once and run on the call's tensors; an SDPA op's makes the BHMK views its aten function
takes, as any caller with BMHK tensors must) and ``SDPA`` (``torch.nn.functional.scaled_dot_product_attention`` on BHMK tensors, where a float call has
one); merge_attentions' direct is its kernel's launch on CUDA, its torch arithmetic on the parts (stacked in the
call) on the CPU.
fp8_attention / i8fp8_attention's direct is the same launches ours makes: ``quantize_smooth`` (on CUDA the two
fused quantization launches), ``make_inputs`` and the forward op's launcher; forward + backward runs those and the
backward op's launcher on the dequantized inputs under the smallest autograd.Function (``_DirectQuantized``), as
training on the bare kernels must, so both sides pay torch's autograd engine (as the SDPA rows' direct does).
``overhead`` is ours - direct; the target is max(25% of direct, 5 us), and on the CPU ours <= 2x SDPA for the tiny
float32 call. Each cell is the median of ``--rounds`` interleaved rounds of ``--iters`` back-to-back calls
(``bench.common.host_us``); rows print as measured. The CPU rows run first (one thread), then, where CUDA is
present, the GPU rows and the fp8 short-sequence shapes through ``flash_attn_func`` against cuDNN bf16 SDPA
(TFLOP/s, same run).

Writes host_time_<cpu|gpu>.json and .png into --out and the table to bench/results/host_time.md (with GPU rows) or
host_time_cpu.md (not with --quick or --no-record).

    PYTHONPATH=$PWD python bench/host_time.py [--device all|cpu|cuda] [--iters 300] [--rounds 7] [--out DIR]
        [--profile [N]]

``--profile`` then prints, for each row outside its target, where ours and direct spend their host time: the
``PROFILE_TOP`` functions with the most own time under cProfile over N calls of each (torch's C functions by name,
so a slower kernel launch and Python work on the call path show apart).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fmha_ops  # noqa: E402
from bench import common  # noqa: E402
from fmha_ops import attn_bias as ab  # noqa: E402
from fmha_ops.dispatch import SELECTOR  # noqa: E402
from fmha_ops.inputs import Inputs, make_inputs  # noqa: E402
from fmha_ops.ops.sdpa import _SdpaOp  # noqa: E402
from fmha_ops.testing import normal_qkv  # noqa: E402
from fmha_ops.validation import make_problem  # noqa: E402

COMMAND = "PYTHONPATH=$PWD python bench/host_time.py"
CPU_SHAPE = (1, 16, 2, 16)  # B, M, H, D: the tiny float32 causal call
GPU_SHAPE = (1, 128, 1, 64)
SHORT_SEQUENCES = ((8, 1000, 16, 16, 128, False), (16, 512, 32, 8, 64, True))  # B, M, Hq, Hkv, D, causal
TARGET_FRACTION, TARGET_US = 0.25, 5.0
CPU_SDPA_RATIO = 2.0  # the tiny CPU call: at most this many times torch SDPA's host time

Call = Callable[[], object]


def _bhmk(*ts):
    return [t.transpose(1, 2) for t in ts]


def _selected(inp, kind="fw", needs_lse=False):
    """The op the selector picks for ``inp`` (as the public call would)."""
    return SELECTOR.select(("host_time", kind, inp.signature(needs_lse)), lambda: make_problem(inp, needs_lse), kind)


def _direct(inp, needs_lse=False) -> tuple[str, Call]:
    """(op name, a call of that op without our call path: its launch plan for calls laid out like ``inp``
    (``launcher``), made once, run on the call's tensors; an SDPA op's makes the BHMK views its aten function
    takes, as any caller with BMHK tensors must)."""
    op = _selected(inp, needs_lse=needs_lse)
    run = op.launcher(inp, needs_lse)
    tensors = (inp.query, inp.key, inp.value, inp.attn_bias, inp.q_descale, inp.k_descale, inp.v_descale, inp.sinks)
    return op.NAME, lambda: run(*tensors)


def _sdpa(q, k, v, causal) -> Call:
    qt, kt, vt = _bhmk(q, k, v)
    gqa = qt.shape[1] != kt.shape[1]
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)


def _merge_direct(parts, lses) -> tuple[str, Call]:
    """(backend, merge_attentions' backend called directly): on CUDA the merge kernel's launch on the parts, else
    its arithmetic in plain torch on the parts, stacked in the call (the lists are what both calls get)."""
    if parts[0].is_cuda:
        from fmha_ops.kernels.triton.merge import merge_parts

        return "triton merge", lambda: merge_parts(parts, lses, parts[0].dtype, True)

    def run():
        attn, lse = torch.stack(parts), torch.stack(lses)
        lse_t = lse.movedim(-1, 2)
        top = lse_t.amax(0)
        w = torch.exp(lse_t - top)
        total = w.sum(0)
        return (w[..., None] * attn).sum(0) / total[..., None], (top + torch.log(total)).movedim(1, -1)
    return "torch", run


def cases(device: str) -> list[tuple[str, str, Call, Call | None, Call | None]]:
    """(entry point, op, ours, direct, SDPA) per row."""
    cpu = device == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    shape = CPU_SHAPE if cpu else GPU_SHAPE
    q, k, v = normal_qkv(shape, shape, dtype=dtype, device=device)
    causal = ab.LowerTriangularMask()
    rows = []

    def row(label, ours, inp, needs_lse=False, sdpa=None):
        name, direct = _direct(inp, needs_lse)
        rows.append((label, name, ours, direct, sdpa))

    row("memory_efficient_attention causal", lambda: fmha_ops.memory_efficient_attention(
        q, k, v, causal), make_inputs(q, k, v, causal), sdpa=_sdpa(q, k, v, True))
    with torch.no_grad():
        row("memory_efficient_attention_forward", lambda: fmha_ops.memory_efficient_attention_forward(q, k, v, causal),
            make_inputs(q, k, v, causal), sdpa=_sdpa(q, k, v, True))
    rows.append(_training_row(q, k, v, causal))
    row("memory_efficient_attention_partial", lambda: fmha_ops.memory_efficient_attention_partial(q, k, v),
        make_inputs(q, k, v, output_dtype=torch.float32, is_partial=True), needs_lse=True)
    parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, s], v[:, s]) for s in (slice(0, 7), slice(7, None))]
    outs, lses = [o for o, _ in parts], [lse for _, lse in parts]
    merge_backend, merge_direct = _merge_direct(outs, lses)
    rows.append(("merge_attentions (2 parts)", merge_backend, lambda: fmha_ops.merge_attentions(outs, lses),
                 merge_direct, None))
    br = ab.LowerTriangularFromBottomRightMask()
    row("flash_attn_func causal", lambda: fmha_ops.flash_attn_func(q, k, v, causal=True), make_inputs(q, k, v, br),
        sdpa=_sdpa(q, k, v, True))
    m = shape[1]
    cu = torch.tensor([0, m // 2, m], dtype=torch.int32, device=device)
    packed = [t[0] for t in (q, k, v)]
    varlen = ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens([m // 2, m - m // 2], device=device)
    row("flash_attn_varlen_func causal", lambda: fmha_ops.flash_attn_varlen_func(*packed, cu, cu, m, m, causal=True),
        make_inputs(q, k, v, varlen))
    if not cpu:
        with fmha_ops.use_ops("sdpa_cudnnF"):
            row("memory_efficient_attention op=sdpa_cudnnF", lambda: fmha_ops.memory_efficient_attention(
                q, k, v, causal, op="sdpa_cudnnF"), make_inputs(q, k, v, causal), sdpa=_sdpa(q, k, v, True))
        f8 = torch.float8_e4m3fn
        q8, k8, v8 = (t.to(f8) for t in (q, k, v))
        one = torch.ones(1, device=device)
        row("flash_attn_func fp8 + descales", lambda: fmha_ops.flash_attn_func(
            q8, k8, v8, causal=True, q_descale=one, k_descale=one, v_descale=one),
            make_inputs(q8, k8, v8, br, q_descale=one, k_descale=one, v_descale=one))
        rows += _quantized_rows(q, k, v)
        rows += _kvcache_rows(device)
    return rows


KV_SHAPE = (4, 512, 8, 2, 128, 64)  # B, cache length, Hq, Hkv, D, page size: one decode step, host-bound


def _kvcache_rows(device) -> list:
    """flash_attn_with_kvcache paged decode (bf16 cache, with a one-token append, fp8 cache) against the selected
    decode op's launch (``decode_launcher``) into a new output (ours returns one), after the append kernel where the
    call appends. Both sides bind the same decoder: no LSE, the call's lengths plus the appended tokens as the
    launch's offset."""
    from fmha_ops.flash_attn_interface import flash_attn_with_kvcache
    from fmha_ops.kvcache_call import kvcache_call
    from fmha_ops.kernels.triton.kv_append import kv_append
    from fmha_ops.kv_cache import build_fp8_paged_cache, paged_from_dense

    b, length, hq, hkv, d, page = KV_SHAPE
    q, k, v = normal_qkv((b, 1, hq, d), (b, length, hkv, d), dtype=torch.bfloat16, device=device)
    knew, vnew = (t[:, :1].clone() for t in (k, v))
    (kc, vc), table = paged_from_dense([k, v], page)
    k8, v8, ks, vs, table8 = build_fp8_paged_cache(k, v, page)
    lens = torch.full((b,), length - 8, dtype=torch.int32, device=device)
    rows = []
    variants = (("flash_attn_with_kvcache paged decode", kc, vc, table, None, None, False),
                ("flash_attn_with_kvcache paged + append", kc, vc, table, None, None, True),
                ("flash_attn_with_kvcache fp8 cache", k8, v8, table8, ks, vs, False))
    for label, kcache, vcache, tab, kd, vd, append in variants:
        new = dict(k=knew, v=vnew) if append else {}
        call = kvcache_call(q, kcache, vcache, None, None, lens + int(append), None, tab, None, kd, vd, None, True,
                            (-1, -1))
        inp = make_inputs(call.query, call.key, call.value, call.bias, k_descale=call.k_descale,
                          v_descale=call.v_descale)
        op = _selected(inp)
        launch = op.decode_launcher(inp, False, own_workspace=False)

        def direct(kcache=kcache, vcache=vcache, tab=tab, kd=kd, vd=vd, append=append, launch=launch):
            if append:
                kv_append(knew, vnew, kcache, vcache, lens, block_table=tab, k_scale=kd, v_scale=vd)
            out = torch.empty_like(q)
            launch(q, kcache, vcache, kd, vd, lens, tab, out, None, int(append))
            return out

        def ours(kcache=kcache, vcache=vcache, tab=tab, kd=kd, vd=vd, new=new):
            return flash_attn_with_kvcache(q, kcache, vcache, cache_seqlens=lens, page_table=tab, k_descale=kd,
                                           v_descale=vd, causal=True, **new)
        rows.append((label, op.NAME, ours, direct, None))
    return rows


def _training_row(q, k, v, causal) -> tuple:
    """memory_efficient_attention forward + backward against the selected op's own: an SDPA op's launch plan (its
    aten function on the BHMK views any caller with BMHK tensors makes, as the forward rows' direct) under torch's
    autograd, our ops' apply and apply_bw."""
    grads = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    do = torch.randn_like(q)
    inp = make_inputs(*grads, causal)
    fw = _selected(inp)
    ours = lambda: torch.autograd.grad(fmha_ops.memory_efficient_attention(*grads, causal), grads, do)  # noqa: E731
    if issubclass(fw, _SdpaOp):
        run = fw.launcher(inp, False)
        return ("memory_efficient_attention forward + backward", fw.NAME, ours,
                lambda: torch.autograd.grad(run(*grads, causal, None, None, None, None)[0], grads, do), None)
    bw = _selected(inp, "bw", needs_lse=True)
    return ("memory_efficient_attention forward + backward", f"{fw.NAME} + {bw.NAME}", ours,
            lambda: bw.apply_bw(inp, *fw.apply(inp, True), do), None)


class _DirectQuantized(torch.autograd.Function):
    """The direct launches of a differentiable fp8_attention / i8fp8_attention call under the smallest autograd node
    (what training on the bare kernels needs; the SDPA ops' direct likewise runs torch's autograd): forward
    ``quantize_smooth`` and the forward op's ``apply``, backward the backward op's ``apply_bw`` at the dequantized
    inputs. Arguments: the two ops, the q/k dtype, the bottom-right causal mask, the softmax scale, q, k, v (BMHK)."""

    @staticmethod
    def forward(ctx, fw, bw, qk_dtype, mask, scale, q, k, v):
        from fmha_ops.quantized import quantize_smooth

        qkv8, descales, deq = quantize_smooth(q, k, v, scale, qk_dtype)
        out, lse = fw.apply(make_inputs(*qkv8, mask, scale=1.0, output_dtype=q.dtype, is_partial=True, **descales),
                            True)
        ctx.save_for_backward(*deq, out, lse)
        ctx.bw, ctx.mask, ctx.scale = bw, mask, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qh, kh, vh, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.bw.apply_bw(Inputs(qh, kh, vh, ctx.mask, 0.0, ctx.scale, None, True), out, lse, grad_out)
        return None, None, None, None, None, dq, dk, dv


def _quantized_rows(q, k, v) -> list:
    """fp8_attention / i8fp8_attention forward and forward + backward against quantize_smooth plus the selected
    forward op called directly, and for forward + backward those launches and the backward op's under
    ``_DirectQuantized``."""
    from fmha_ops.quantized import quantize_smooth

    rows = []
    grads = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    do = torch.randn_like(q)
    br = ab.LowerTriangularFromBottomRightMask()
    scale = q.shape[-1] ** -0.5
    for fn, qk_dtype in ((fmha_ops.fp8_attention, torch.float8_e4m3fn), (fmha_ops.i8fp8_attention, torch.int8)):
        qkv8, descales, deq = quantize_smooth(q, k, v, scale, qk_dtype)
        inp = make_inputs(*qkv8, br, scale=1.0, output_dtype=q.dtype, is_partial=True, **descales)
        fw = _selected(inp, needs_lse=True)
        bw = _selected(make_inputs(*deq, br, scale=scale, is_partial=True), "bw", needs_lse=True)

        def direct_fw(fw=fw, qk_dtype=qk_dtype):
            qkv8, descales, _ = quantize_smooth(q, k, v, scale, qk_dtype)
            return fw.apply(make_inputs(*qkv8, br, scale=1.0, output_dtype=q.dtype, is_partial=True, **descales), True)

        def direct_fwbw(fw=fw, bw=bw, qk_dtype=qk_dtype):
            return torch.autograd.grad(_DirectQuantized.apply(fw, bw, qk_dtype, br, scale, *grads), grads, do)

        rows.append((f"{fn.__name__} forward", fw.NAME, lambda fn=fn: fn(q, k, v, causal=True), direct_fw, None))
        rows.append((f"{fn.__name__} forward + backward", f"{fw.NAME} + {bw.NAME}",
                     lambda fn=fn: torch.autograd.grad(fn(*grads, causal=True), grads, do), direct_fwbw, None))
    return rows


def measure(rows, iters: int, rounds: int, device: str) -> list[dict]:
    """Per row the median over ``rounds`` interleaved rounds (a noisy host slows all three alike) of the host time
    per call of ``iters`` back-to-back calls; printed as measured."""
    results = []
    for label, op, ours, direct, sdpa in rows:
        calls = {"ours_us": ours, "direct_us": direct, "sdpa_us": sdpa}
        times = {name: [] for name, fn in calls.items() if fn is not None}
        for _ in range(rounds):
            for name in times:
                times[name].append(common.host_us(calls[name], iters, warmup=20))
        r = {"device": device, "call": label, "op": op, "sdpa_us": None,
             **{name: statistics.median(t) for name, t in times.items()}}
        r["overhead_us"] = r["ours_us"] - r["direct_us"]
        r["within_target"] = r["overhead_us"] <= max(TARGET_FRACTION * r["direct_us"], TARGET_US)
        r["ours_over_sdpa"] = r["ours_us"] / r["sdpa_us"] if r["sdpa_us"] else None
        r["sdpa_target"] = r["ours_over_sdpa"] <= CPU_SDPA_RATIO if device == "cpu" and r["sdpa_us"] else None
        results.append(r)
        print("  ".join(f"{c}={r[c]:.4g}" if isinstance(r[c], float) else f"{c}={r[c]}" for c in COLUMNS), flush=True)
    return results


def short_sequence_rows() -> list[dict]:
    """fp8 through flash_attn_func against cuDNN bf16 SDPA at short sequences, TFLOP/s (CUDA events)."""
    rows = []
    cudnn = common.sdpa("CUDNN_ATTENTION")
    for b, m, hq, hkv, d, causal in SHORT_SEQUENCES:
        q, k, v = normal_qkv((b, m, hq, d), (b, m, hkv, d), dtype=torch.bfloat16, device="cuda")
        f8 = torch.float8_e4m3fn
        q8, k8, v8 = (t.to(f8) for t in (q, k, v))
        one = torch.ones(1, device="cuda")
        fp8_ms = common.time_ms(lambda: fmha_ops.flash_attn_func(q8, k8, v8, causal=causal, q_descale=one,
                                                                  k_descale=one, v_descale=one))
        bf16_ms = common.time_ms(lambda: fmha_ops.flash_attn_func(q, k, v, causal=causal))
        qt, kt, vt = _bhmk(q, k, v)
        cudnn_ms = common.time_ms(lambda: cudnn(qt, kt, vt, causal, hq != hkv))
        tf = lambda ms: common.attention_tflops(b, hq, m, d, causal, ms)  # noqa: E731
        rows.append({"shape": f"{b}x{m}x{hq}/{hkv}x{d}{' causal' if causal else ''}",
                     "fp8_flash_attn_func_tflops": tf(fp8_ms), "bf16_flash_attn_func_tflops": tf(bf16_ms),
                     "cudnn_bf16_tflops": tf(cudnn_ms), "fp8_over_cudnn": cudnn_ms / fp8_ms})
    return rows


def short_sequence_text(short: list[dict]) -> str:
    """The record's line on ``short_sequence_rows``: per shape the three TFLOP/s and fp8 / cuDNN.

    >>> text = short_sequence_text([{"shape": "8x1000x16/16x128", "fp8_flash_attn_func_tflops": 543.1,
    ...                              "bf16_flash_attn_func_tflops": 505.8, "cudnn_bf16_tflops": 496.7,
    ...                              "fp8_over_cudnn": 1.093}])
    >>> text.endswith("SDPA 543.1 / 505.8 / 496.7 (fp8 / cuDNN 1.093x) at 8x1000x16/16x128.")
    True
    """
    parts = [f"{common.fmt_cell(r['fp8_flash_attn_func_tflops'])} / {common.fmt_cell(r['bf16_flash_attn_func_tflops'])}"
             f" / {common.fmt_cell(r['cudnn_bf16_tflops'])} (fp8 / cuDNN {common.fmt_cell(r['fp8_over_cudnn'])}x) at "
             f"{r['shape']}" for r in short]
    return ("fp8 at short sequences through flash_attn_func, TFLOP/s (same run): fp8 / bf16 flash_attn_func / cuDNN "
            "bf16 SDPA " + "; ".join(parts) + ".")


PROFILE_TOP = 12  # functions printed per profiled call


def profile(rows, results: list[dict], calls: int) -> None:
    """For each row outside its target: the ``PROFILE_TOP`` functions with the most own time in ``calls`` calls of
    ours and of direct (cProfile, after the measurement), in microseconds per call of the row (own and
    cumulative) with their calls per row call. cProfile adds its overhead per Python call: compare the two
    listings' entries, not their totals with the table."""
    for (label, _, ours, direct, _), r in zip(rows, results):
        if r["within_target"] and r["sdpa_target"] is not False:
            continue
        for name, fn in (("ours", ours), ("direct", direct)):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                fn()
            if r["device"] == "cuda":
                torch.cuda.synchronize()
            prof.disable()
            stats = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, own, cumulative, _)
            top = sorted((item for item in stats.items() if "_lsprof" not in item[0][2]),  # not the profiler's own
                         key=lambda item: -item[1][2])[:PROFILE_TOP]
            print(f"--- profile {r['device']} {label}: {name} (us per call: own, cumulative; calls per call)")
            for (file, line, function), (_, n, own, cumulative, _) in top:
                where = function if file == "~" else f"{os.path.basename(file)}:{line}({function})"
                print(f"  {own / calls * 1e6:8.2f} {cumulative / calls * 1e6:8.2f} {n / calls:6.2f}  {where}")
        print(flush=True)


COLUMNS = ["device", "call", "op", "ours_us", "direct_us", "overhead_us", "within_target", "sdpa_us", "ours_over_sdpa",
           "sdpa_target"]
#: the record's columns (``by_call``: one row per entry point, each cell its CPU / CUDA values)
LABELS = ["entry point (cells: CPU / CUDA)", "op", "ours (us)", "direct (us)", "ours - direct (us)",
          "<= max(25%, 5 us)", "SDPA (us)", "ours / SDPA", "CPU: <= 2x SDPA"]


def by_call(rows: list[dict]) -> list[dict]:
    """The record's table from the measured ``rows``: one row per entry point (in the order the rows first give it),
    each cell the values of ``COLUMNS`` on each measured device joined by " / " (``-``: the device has no such row
    or value; one ``-`` where no device has a value), the devices in the order the rows give them.

    >>> by_call([{"device": "cpu", "call": "f", "ours_us": 24.76}, {"device": "cuda", "call": "f", "ours_us": 21.5},
    ...          {"device": "cuda", "call": "g", "ours_us": 9.0}])[1]["ours_us"]
    '- / 9'
    """
    devices = list(dict.fromkeys(r["device"] for r in rows))
    calls: dict[str, dict] = {}
    for r in rows:
        calls.setdefault(r["call"], {})[r["device"]] = r

    def cell(per: dict, column: str) -> str:
        values = [common.fmt_cell(per[d].get(column)) if d in per else "-" for d in devices]
        return "-" if set(values) == {"-"} else " / ".join(values)

    return [{"call": call, **{c: cell(per, c) for c in COLUMNS[2:]}} for call, per in calls.items()]


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", choices=("all", "cpu", "cuda"), default="all",
                   help="all: the CPU rows, then the GPU rows where CUDA is present")
    p.add_argument("--no-short-sequences", action="store_true", help="leave out the fp8 short-sequence table")
    p.add_argument("--profile", type=int, nargs="?", const=200, default=0, metavar="N",
                   help="after the table, cProfile N calls (default 200) of ours and direct for each row outside "
                        "its target")
    args = p.parse_args()
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    iters, rounds = (50, 3) if args.quick else (args.iters, args.rounds)
    threads = torch.get_num_threads()
    rows = []
    for device in devices:
        torch.set_num_threads(1 if device == "cpu" else threads)  # the tiny CPU call runs on one thread
        calls = cases(device)
        results = measure(calls, iters, rounds, device)
        if args.profile:
            profile(calls, results, args.profile)
        rows += results
    torch.set_num_threads(threads)
    common.print_table(rows, COLUMNS)
    short = short_sequence_rows() if "cuda" in devices and not args.no_short_sequences else []
    if short:
        common.print_table(short, list(short[0]))
    out = common.out_dir(args.out)
    tag = "gpu" if "cuda" in devices else "cpu"
    common.write_json(out, f"host_time_{tag}", rows, {"short_sequences": short, "environment": common.environment()})
    png = common.bar_plot(out, f"host_time_{tag}", [dict(r, call=f"{r['device']}: {r['call']}") for r in rows],
                          "call", ["ours_us", "direct_us", "sdpa_us"], "host us per call", f"host time per call ({tag})")
    met = [r for r in rows if r["within_target"] and r["sdpa_target"] is not False]
    print(f"targets met: {len(met)} of {len(rows)} rows")
    if not (args.no_record or args.quick):
        print("record:", record(rows, short, common.environment(), png, tag))


def record(rows: list[dict], short: list[dict], env: dict, png: str | None, tag: str) -> str:
    """Write bench/results/host_time.md (with GPU rows) or host_time_cpu.md (CPU rows only) from the rows."""
    body = common.markdown_table(by_call(rows), COLUMNS[1:], LABELS)
    body += ("\n\nHost wall time per call of back-to-back calls, microseconds, median of interleaved rounds; float32 "
             "calls on the CPU, bfloat16 on CUDA. direct: "
             "the selected op without the call path: its launch plan (launcher) made once and run on the call's "
             "tensors (SDPA ops: their aten function on the BHMK views any caller with BMHK tensors makes; forward + "
             "backward under torch's autograd); decode: the op's decode launch, after the append kernel where the "
             "call appends; fp8_attention / i8fp8_attention: the quantization "
             "launches, then the forward op's launcher, and for forward + backward those and the backward op's "
             "launcher under a minimal autograd.Function). SDPA: torch's eager "
             "scaled_dot_product_attention on BHMK tensors. cpu rows: one thread of the host's CPU.")
    if short:
        body += "\n\n" + short_sequence_text(short)
    name = "host_time" if tag == "gpu" else "host_time_cpu"
    title = "Host time per call" + ("" if tag == "gpu" else " (CPU)")
    return common.write_record(name, title, COMMAND + ("" if tag == "gpu" else " --device cpu"), body, env, png)


if __name__ == "__main__":
    main()
