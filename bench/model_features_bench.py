"""What attention sinks and a value head dim of their own cost on the H200, through the public calls.

* Sinks (GPT-OSS heads: 64 query / 8 KV heads of dim 64, causal, full or a 128-token window): the same call with
  and without ``sinks=`` (``sinks / none`` is the time ratio; the target is <= 1.03): the bf16 and fp8 Triton
  forwards, the bf16 forward + backward (the sinks' gradient included), and paged decode (bf16 and fp8 KV,
  single pass and split-K).
* Value head dim (DeepSeek-V3 heads: K=192, Kv=128, 128 heads): ``memory_efficient_attention`` with Kv=128 against
  the call transformers makes today for FlashAttention, V zero-padded to 192 and the output sliced back
  (``padded / ours`` is the speedup; target >= 1.25), forward and forward + backward; FA3's 192 -> 128 kernel
  (its own ``flash_attn_func``: the fa3-fwd wheel or a hopper/ build, where installed) and FA4 with Kv=128 beside it.

CUDA-event medians of whole public calls (``bench.common.time_ms``). Writes ``bench/results/model_features.md`` (one
row per measure against its target: the worst, median and best call over the shapes; + ``.png``: every call's ratio)
and ``<out>/model_features.json`` (every call's times) / ``model_features.png``. ``--budget``: calls that
would start after that many seconds are left out (empty cells, counted at the end and in the record). ``--device
cpu``: a smoke run, the same code at a few heads and 40 tokens (the Triton kernels through the interpreter,
wall-clock timings, no record).

    python bench/model_features_bench.py [--quick] [--budget SECONDS] [--parts sinks decode value_dim] [--out DIR]
                                         [--no-record] [--device cpu]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not torch.cuda.is_available():  # the Triton kernels run through the interpreter (set before any @triton.jit)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.common import (Record, bar_plot, base_parser, device_ms, environment, or_none, out_dir,  # noqa: E402
                          print_table, write_json)
import fmha_ops  # noqa: E402
from fmha_ops import LowerTriangularFromBottomRightMask, memory_efficient_attention  # noqa: E402
from fmha_ops.quant import quantize_qkv_fp8  # noqa: E402

CAUSAL = LowerTriangularFromBottomRightMask()
GPT_OSS = dict(hq=64, hkv=8, d=64)
DEEPSEEK = dict(hq=128, d=192, dv=128)
WINDOW = 128
#: the issue's targets: sinks cost at most 3% (sinks / none <= SINKS_MAX); Kv=128 at least 1.25x the V zero-padded
#: call (padded / ours >= PADDED_MIN) and 0.9x FA3's 192 -> 128 kernel (FA3 / ours >= FA3_MIN)
SINKS_MAX, PADDED_MIN, FA3_MIN = 1.03, 1.25, 0.9
#: (B, N) per part and size: the full grid, --quick, tiny (--device cpu smoke runs: 4 / 2 GPT-OSS heads, 2
#: DeepSeek heads)
SHAPES = {
    "sinks": {"full": [(1, 8192), (8, 4096), (1, 32768)], "quick": [(1, 8192)], "tiny": [(1, 40)]},
    "decode": {"full": [(1, 32768), (32, 8192), (64, 2048)], "quick": [(32, 8192)], "tiny": [(2, 40)]},
    "value_dim": {"full": [(1, 4096), (1, 16384), (4, 4096)], "quick": [(1, 4096)], "tiny": [(1, 40)]},
}
TINY_HEADS = dict(gpt_oss=(4, 2), deepseek=2)


class Run:
    """Where and how big this run is: device, dtype (bf16; float16 on the CPU, whose interpreter's bf16 dot is
    wrong), size ("full" / "quick" / "tiny") and the deadline after which calls are left out."""

    def __init__(self, device: str, size: str, budget_s: float):
        self.device, self.size = device, size
        self.dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float16
        self.deadline = time.perf_counter() + budget_s if budget_s else None
        self.left_out = 0

    def randn(self, *shape, grad=False):
        return torch.randn(*shape, device=self.device, dtype=self.dtype).requires_grad_(grad)

    def time(self, fn) -> float | None:
        """Median ms of ``fn()``, None if it fails (one logged line) or the budget is spent."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.left_out += 1
            return None
        return or_none(lambda: device_ms(fn, self.device))

    def shapes(self, part: str) -> list[tuple[int, int]]:
        return SHAPES[part][self.size]

    def gpt_oss_heads(self) -> tuple[int, int, int]:
        hq, hkv = TINY_HEADS["gpt_oss"] if self.size == "tiny" else (GPT_OSS["hq"], GPT_OSS["hkv"])
        return hq, hkv, GPT_OSS["d"]


def sinks_rows(run: Run) -> list[dict]:
    rows = []
    hq, hkv, d = run.gpt_oss_heads()
    sinks = torch.randn(hq, device=run.device)
    for b, n in run.shapes("sinks"):
        q, k, v = run.randn(b, n, hq, d), run.randn(b, n, hkv, d), run.randn(b, n, hkv, d)
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        for window in (None, WINDOW):
            mask = CAUSAL if window is None else CAUSAL.make_local_attention(window)
            label = f"{b}x{n} {'full' if window is None else f'window {window}'}"
            for kind, call in (
                ("bf16 fwd", lambda s: memory_efficient_attention(q, k, v, mask, sinks=s)),
                ("fp8 fwd", lambda s: memory_efficient_attention(q8, k8, v8, mask, q_descale=qd, k_descale=kd,
                                                                 v_descale=vd, sinks=s)),
            ):
                rows.append(_row(label, kind, run.time(lambda: call(None)), run.time(lambda: call(sinks))))
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
            sg = sinks.clone().requires_grad_(True)
            grad = torch.randn_like(q)

            def train(s):
                out = memory_efficient_attention(qg, kg, vg, mask, sinks=s)
                torch.autograd.backward(out, grad)
            rows.append(_row(label, "bf16 fwd+bwd", run.time(lambda: train(None)), run.time(lambda: train(sg))))
    return rows


def decode_rows(run: Run) -> list[dict]:
    from fmha_ops.kv_cache import build_fp8_paged_cache, paged_from_dense

    rows = []
    hq, hkv, d = run.gpt_oss_heads()
    sinks = torch.randn(hq, device=run.device)
    for b, length in run.shapes("decode"):
        k, v = run.randn(b, length, hkv, d), run.randn(b, length, hkv, d)
        q = run.randn(b, 1, hq, d)
        lengths = torch.full((b,), length, dtype=torch.int32, device=run.device)
        (kc, vc), table = paged_from_dense([k, v], 64)
        k8, v8, ks, vs, table8 = build_fp8_paged_cache(k, v, 64)
        for kv, args in (("bf16", (kc, vc, table, None, None)), ("fp8", (k8, v8, table8, ks, vs))):
            for op in ("triton_decoderF", "triton_splitKF"):
                def call(s, args=args, op=op):
                    with fmha_ops.use_ops(op):
                        return fmha_ops.flash_attn_with_kvcache(q, args[0], args[1], cache_seqlens=lengths,
                                                                page_table=args[2], k_descale=args[3],
                                                                v_descale=args[4], causal=True, sinks=s)
                rows.append(_row(f"decode B{b} L{length}", f"{kv} KV {op}", run.time(lambda: call(None)),
                                 run.time(lambda: call(sinks))))
    return rows


def _row(shape: str, kind: str, none: float | None, with_sinks: float | None) -> dict:
    return {"shape": shape, "call": kind, "none_ms": none, "sinks_ms": with_sinks,
            "ratio": with_sinks / none if none and with_sinks else None}


def value_dim_rows(run: Run) -> list[dict]:
    rows = []
    hq = TINY_HEADS["deepseek"] if run.size == "tiny" else DEEPSEEK["hq"]
    d, dv = DEEPSEEK["d"], DEEPSEEK["dv"]
    for b, n in run.shapes("value_dim"):
        q, k, v = run.randn(b, n, hq, d), run.randn(b, n, hq, d), run.randn(b, n, hq, dv)
        grad = run.randn(b, n, hq, dv)

        def ours():
            return memory_efficient_attention(q, k, v, CAUSAL)

        def padded():  # what transformers does for FlashAttention: V zero-padded to K, the output sliced back
            vp = torch.nn.functional.pad(v, (0, d - dv))
            return memory_efficient_attention(q, k, vp, CAUSAL)[..., :dv]

        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

        def ours_train():
            torch.autograd.backward(memory_efficient_attention(qg, kg, vg, CAUSAL), grad)

        def padded_train():
            vp = torch.nn.functional.pad(vg, (0, d - dv))
            torch.autograd.backward(memory_efficient_attention(qg, kg, vp, CAUSAL)[..., :dv], grad)

        fa3 = run.time(_fa3(q, k, v))
        fa4 = run.time(lambda: memory_efficient_attention(q, k, v, CAUSAL, op="fa4F"))
        for kind, mine, theirs in (("fwd", ours, padded), ("fwd+bwd", ours_train, padded_train)):
            t_ours = run.time(mine)
            t_pad = run.time(theirs)
            rows.append({"shape": f"{b}x{n}x{hq} K{d}/Kv{dv}", "call": kind, "ours_ms": t_ours, "padded_ms": t_pad,
                         "speedup": t_pad / t_ours if t_ours and t_pad else None,
                         "op": fmha_ops.explain(q, k, v, CAUSAL).selected.NAME,
                         "fa3_ms": fa3 if kind == "fwd" else None, "fa4_ms": fa4 if kind == "fwd" else None,
                         "ours/fa3": fa3 / t_ours if kind == "fwd" and fa3 and t_ours else None})
    return rows


def _fa3(q, k, v):
    """FlashAttention-3's own forward (``backends.fa3_calls``: the fa3-fwd wheel's, or a hopper/ build's) at
    K=192 / Kv=128, causal, as a call to time (it raises where FA3 is not installed)."""
    from bench.backends import fa3_calls

    calls = fa3_calls(q, k, v, True)
    if not calls:
        def missing():
            raise ImportError("FlashAttention-3 is not installed (fa3-fwd, or flash-attention's hopper/ build)")
        return missing
    return calls["fa3_bf16"]


#: the parts of the run, in order (``--parts``): GPT-OSS sinks in prefill, in paged decode; DeepSeek-V3's value dim
PARTS = {"sinks": sinks_rows, "decode": decode_rows, "value_dim": value_dim_rows}
COMMAND = "python bench/model_features_bench.py"
#: every call's columns, as printed and written to model_features.json
COLUMNS = ("shape", "call", "none_ms", "sinks_ms", "ratio", "ours_ms", "padded_ms", "speedup", "op", "fa3_ms",
           "fa4_ms", "ours/fa3")
RECORD = Record(
    "model_features", "Attention sinks and a value head dim of its own", COMMAND,
    {"measure": "measure", "target": "target", "worst": "worst", "median": "median", "best": "best",
     "worst_at": "worst call", "calls": "calls"},
    "Each row: one time ratio over its calls (shapes, windows, decoders), the worst against the target. Sinks: GPT-OSS "
    "attention heads (64 / 8 of dim 64, bf16), the same public call with and without sinks= (fp8: inputs quantized "
    "beforehand, per (batch, KV head) descales; decode: flash_attn_with_kvcache on 64-token pages, bf16 and fp8 KV, "
    "the decoder forced by use_ops). Value head dim: DeepSeek-V3 heads (128 of K=192, Kv=128, bf16, causal) through "
    "the selector, against V zero-padded to 192 with the output sliced (transformers' FlashAttention path); FA3: its "
    "own call where installed. CUDA-event medians of whole calls; every call's times in model_features.json.")


def _measures(row: dict) -> list[tuple[str, str, float, bool]]:
    """The record's measures a JSON row adds to: (measure, target, ratio, lower is better) for each of its ratios."""
    if row.get("ratio"):
        call = "decode" if row["shape"].startswith("decode") else row["call"]
        return [(f"sinks / none, {call}", f"<= {SINKS_MAX}", row["ratio"], True)]
    out = []
    if row.get("speedup"):
        out.append((f"V padded to 192 / Kv=128, {row['call']}", f">= {PADDED_MIN}", row["speedup"], False))
    if row.get("ours/fa3"):
        out.append((f"FA3 192->128 / ours, {row['call']}", f">= {FA3_MIN}", row["ours/fa3"], False))
    return out


def summary_rows(rows: list[dict]) -> list[dict]:
    """The record's table: one row per measure (in the order the rows first give it), its measured ratios' worst
    (max where lower is better), median and best, the call that gave the worst, and how many calls it summarizes.

    >>> summary_rows([{"shape": "1x8 full", "call": "bf16 fwd", "ratio": 1.01},
    ...               {"shape": "1x8 window 128", "call": "bf16 fwd", "ratio": 1.05}])[0]["worst_at"]
    '1x8 window 128 bf16 fwd'
    """
    groups: dict = {}
    for row in rows:
        for measure, target, value, lower in _measures(row):
            groups.setdefault((measure, target, lower), []).append((value, f"{row['shape']} {row['call']}"))
    out = []
    for (measure, target, lower), calls in groups.items():
        ranked = sorted(calls, reverse=lower)  # worst first
        out.append({"measure": measure, "target": target, "worst": ranked[0][0],
                    "median": statistics.median(v for v, _ in calls), "best": ranked[-1][0],
                    "worst_at": ranked[0][1], "calls": len(calls)})
    return out


def plot_rows(rows: list[dict]) -> list[dict]:
    """For the plot: each row's ratio (sinks / none, padded / ours, FA3 / ours) under its shape and call."""
    return [{"label": f"{r['shape']} {r['call']}", **{k: r.get(k) for k in ("ratio", "speedup", "ours/fa3")}}
            for r in rows if any(r.get(k) for k in ("ratio", "speedup", "ours/fa3"))]


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds; leave out calls that would start later (0: none)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"),
                   help="cpu: a smoke run at tiny shapes (no record)")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS),
                   help="which parts to measure (a record needs all of them: with fewer, pass --no-record)")
    args = p.parse_args(argv)
    if set(args.parts) != set(PARTS) and not (args.no_record or args.device == "cpu"):
        p.error("--parts with fewer than all parts writes no record: pass --no-record")
    began = time.perf_counter()
    tiny = args.device == "cpu"
    run = Run(args.device, "tiny" if tiny else "quick" if args.quick else "full", args.budget)
    rows = [row for part in args.parts for row in PARTS[part](run)]
    out = out_dir(args.out)
    print_table(rows, COLUMNS)
    write_json(out, "model_features", rows, {"left_out_calls": run.left_out})
    png = bar_plot(out, "model_features", plot_rows(rows), "label", ["ratio", "speedup", "ours/fa3"], "time ratio",
                   f"Sinks (sinks / none: target <= {SINKS_MAX}), Kv=128 (padded / ours: >= {PADDED_MIN}; "
                   f"FA3 / ours: >= {FA3_MIN})")
    if not (args.no_record or tiny):
        notes = RECORD.notes + (f" Not measured (time budget): {run.left_out} calls." if run.left_out else "")
        RECORD.write(summary_rows(rows), environment(), png, notes)
    if run.left_out:
        print(f"left out (budget): {run.left_out} calls")
    print(f"{time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
