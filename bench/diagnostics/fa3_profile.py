"""Our 8-bit forwards against FlashAttention-3's fp8 kernel on the H200: speed, accuracy and an ``ncu`` profile.

    python bench/diagnostics/fa3_profile.py [--out DIR] [--shapes a,b] [--kernels a,b] [--variants JSON]
                                            [--ncu] [--ncu-shapes a,b] [--ncu-kernels a,b] [--no-time]

Per shape (``BxNxHq[/Hkv][dD][c]``, see ``parse_shape``), inputs already quantized (fp8 with (B, Hkv) descales,
the FA3 convention; i8fp8 int8 q/k with (B, Hkv) descales and fp8 v), every kernel is

* checked against a float64 reference of its own dequantized inputs (batch 0, first and last query head):
  rel err / cosine / max error, on fresh normal inputs; a NaN or unwritten row fails;
* timed with CUDA events (``time_ms``: do_bench median), FA3 bf16 and fp8 in the same process;

``--variants`` adds warp-specialized schedules: a JSON object name -> ``WsFwdConfig`` fields (``ws:NAME``
columns). ``--ncu`` then profiles one launch of each ``--ncu-kernels`` kernel at each ``--ncu-shapes`` shape in
its own ``ncu --clock-control none`` process (the card's clocks are left alone) and keeps the metrics of
``NCU_METRICS`` that this ncu knows plus its WarpStateStats / SpeedOfLight sections, as CSV and JSON.
A transformer-like accuracy row (1x8192x16 D128 by default) compares the kernels' cosine to the unquantized
float64 attention. Writes fa3_profile.json (and ncu_*.csv) into --out; prints a table last.
"""
from __future__ import annotations

import csv
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fmha_ops  # noqa: E402
from bench.backends import fa3_calls  # noqa: E402
from bench.common import attention_tflops, base_parser, environment, out_dir, print_table, time_graph_ms, time_ms  # noqa: E402
from fmha_ops.kernels.gluon import attention_fwd_ws as W  # noqa: E402
from fmha_ops.kernels.triton.attention_fwd import attention_forward as triton_fwd  # noqa: E402
from fmha_ops.quant import quantize_i8fp8, quantize_qkv_fp8  # noqa: E402
from fmha_ops.testing import error_report, normal_qkv, transformer_like  # noqa: E402

SHAPE_KEY = re.compile(r"^(\d+)x(\d+)x(\d+)(?:/(\d+))?(?:d(\d+))?(c?)$")


def parse_shape(key: str) -> tuple[int, int, int, int, int, bool]:
    """``BxNxHq[/Hkv][dD][c]`` (D 128 unless given, ``c``: causal) -> (B, Hq, Hkv, N, D, causal).

    Example: ``parse_shape("3x3000x24/8c") == (3, 24, 8, 3000, 128, True)``."""
    m = SHAPE_KEY.match(key)
    if m is None:
        raise SystemExit(f"shape {key!r}: expected BxNxHq[/Hkv][dD][c], e.g. 3x3000x24/8c or 16x512x32/8d64c")
    B, N, Hq, Hkv, D, causal = m.groups()
    return int(B), int(Hq), int(Hkv or Hq), int(N), int(D or 128), causal == "c"


DEFAULT_SHAPES = "4x4096x32,4x4096x32c,8x1000x16,3x3000x24/8c,4x4096x16d256"
DEFAULT_KERNELS = "fa3_bf16,fa3_fp8,triton_fp8,triton_i8fp8,ws,api_fp8"

NCU_METRICS = [
    "gpu__time_duration.sum",
    "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
    "launch__shared_mem_per_block_dynamic",
    "smsp__inst_executed.sum",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_gmma.sum",
    "sm__inst_executed_pipe_xu.sum",
    "sm__inst_executed_pipe_fma.sum",
    "sm__inst_executed_pipe_alu.sum",
    "sm__inst_executed_pipe_fmaheavy.sum",
    "sm__inst_executed_pipe_lsu.sum",
    "sm__inst_executed_pipe_uniform.sum",
    "sm__inst_executed_pipe_adu.sum",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed_op_shared_ld.sum",
    "smsp__inst_executed_op_shared_st.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
]
#: what the log line of each profiled kernel shows
NCU_SUMMARY = ("gpu__time_duration.sum", "smsp__inst_executed.sum",
               "smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__inst_executed_pipe_tensor_op_gmma.sum",
               "sm__inst_executed_pipe_fma.sum", "sm__inst_executed_pipe_alu.sum")
NCU_SECTIONS = ["SpeedOfLight", "WarpStateStats", "LaunchStats", "ComputeWorkloadAnalysis", "InstructionStats"]


def _reference(q, k, v, qd, kd, vd, scale, causal, heads):
    """float64 attention of batch 0's query heads ``heads`` from dequantized inputs: (len(heads), Mq, D)."""
    Hq, Hkv = q.shape[2], k.shape[2]
    out = []
    for h in heads:
        hk = h // (Hq // Hkv)
        qf = q[0, :, h].double() * (qd[0, hk].double() if qd is not None else 1.0)
        kf = k[0, :, hk].double() * (kd[0, hk].double() if kd is not None else 1.0)
        vf = v[0, :, hk].double() * (vd.reshape(-1)[0].double() if vd.numel() == 1 else vd[0, hk].double())
        s = (qf @ kf.T) * scale
        if causal:
            mq, mk = s.shape
            i = torch.arange(mq, device=s.device)[:, None]
            j = torch.arange(mk, device=s.device)[None, :]
            s = s.masked_fill(j > i + mk - mq, float("-inf"))
        out.append(torch.softmax(s, -1) @ vf)
    return torch.stack(out)


def _variant_configs(text: str | None) -> dict:
    """name -> WsFwdConfig from the --variants JSON (empty: none)."""
    if not text:
        return {}
    return {name: W.WsFwdConfig(**fields) for name, fields in json.loads(text).items()}


def kernels_for(B, Hq, Hkv, N, D, causal, names, variants, seed=0, inputs="normal"):
    """(kernels: name -> (call, its dequantized inputs for the reference), bf16 q/k/v)."""
    make = normal_qkv if inputs == "normal" else transformer_like
    q, k, v = make((B, N, Hq, D), (B, N, Hkv, D), dtype=torch.bfloat16, device="cuda", seed=seed)
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
    scale = D ** -0.5
    fp8_in = (q8, k8, v8, qd, kd, vd, scale)
    kw = {"scale": scale, "causal": causal, "q_descale": qd, "k_descale": kd, "v_descale": vd}
    out = {}
    if "fa3_bf16" in names or "fa3_fp8" in names:
        fa3 = fa3_calls(q, k, v, causal, (q8, k8, v8, qd, kd, vd))
        if not fa3:
            print("no FlashAttention-3 importable: no FA3 columns", flush=True)
        bf16_in = (q, k, v, None, None, torch.ones(1, device="cuda"), scale)
        out.update({name: (call, bf16_in if name == "fa3_bf16" else fp8_in) for name, call in fa3.items()})
    out["triton_fp8"] = (lambda: triton_fwd(q8, k8, v8, **kw), fp8_in)
    if "triton_i8fp8" in names:
        i8 = quantize_i8fp8(q, k, v, qk_granularity="head", v_granularity="tensor")
        out["triton_i8fp8"] = (lambda: triton_fwd(i8.q, i8.k, i8.v, scale=i8.softmax_scale, causal=causal,
                                                  q_descale=i8.q_descale, k_descale=i8.k_descale,
                                                  v_descale=i8.v_descale),
                               (i8.q, i8.k, i8.v, i8.q_descale, i8.k_descale, i8.v_descale, i8.softmax_scale))
    out["ws"] = (lambda: W.attention_forward(q8, k8, v8, **kw), fp8_in)
    for name, cfg in variants.items():
        out[f"ws:{name}"] = (lambda cfg=cfg: W.attention_forward(q8, k8, v8, config=cfg, **kw), fp8_in)
    if "ws_i8" in names:  # int8 q / k, (B, Hkv) descales; fp8 v per tensor
        j8 = quantize_i8fp8(q, k, v, qk_granularity="head", v_granularity="tensor")
        j8_in = (j8.q, j8.k, j8.v, j8.q_descale, j8.k_descale, j8.v_descale, j8.softmax_scale)
        jkw = {"scale": j8.softmax_scale, "causal": causal, "q_descale": j8.q_descale, "k_descale": j8.k_descale,
               "v_descale": j8.v_descale}
        out["ws_i8"] = (lambda: W.attention_forward(j8.q, j8.k, j8.v, **jkw), j8_in)
        for name, cfg in variants.items():
            out[f"ws_i8:{name}"] = (lambda cfg=cfg: W.attention_forward(j8.q, j8.k, j8.v, config=cfg, **jkw), j8_in)
    out["api_fp8"] = (lambda: fmha_ops.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                                       v_descale=vd), fp8_in)
    keep = {n: c for n, c in out.items() if n in names or n.startswith(("ws:", "ws_i8:"))}
    return keep, (q, k, v)


def _output(res):
    return res[0] if isinstance(res, tuple) else res


def check(call, deq, causal, heads):
    """Error report of one kernel against the float64 reference of its dequantized inputs (output poisoned
    first through a NaN-filled cache line is not possible for library calls: NaN rows fail instead)."""
    q, k, v, qd, kd, vd, scale = deq
    o = _output(call())
    torch.cuda.synchronize()
    ref = _reference(q, k, v, qd, kd, vd, scale, causal, heads)
    got = torch.stack([o[0, :, h].double() for h in heads])
    e = error_report(got, ref)
    e["nan"] = bool(torch.isnan(got).any())
    return e


def time_shape(key, names, variants, graph=False):
    B, Hq, Hkv, N, D, causal = parse_shape(key)
    kernels, _ = kernels_for(B, Hq, Hkv, N, D, causal, names, variants, seed=hash(key) % 1000)
    row = {"shape": key}
    for name, (call, deq) in kernels.items():
        try:
            e = check(call, deq, causal, [0, Hq - 1])
            ok = e["rel"] < 3e-2 and not e["nan"]
            row[f"err:{name}"] = e
            if not ok:
                print(f"  {key} {name} WRONG: {e}", flush=True)
                row[name] = None
                continue
            row[name] = attention_tflops(B, Hq, N, D, causal, time_graph_ms(call)[0] if graph else time_ms(call))
        except Exception:  # noqa: BLE001 - report and go on with the other kernels
            print(f"  {key} {name} FAILED:\n{traceback.format_exc()[-1500:]}", flush=True)
            row[name] = None
    fa3 = row.get("fa3_fp8")
    ours = [n for n in row if (n in ("ws", "triton_fp8", "api_fp8") or n.startswith("ws:")) and row.get(n)]
    if ours:
        best = max(ours, key=lambda n: row[n])
        row["best"] = best
        row["best/fa3_fp8"] = row[best] / fa3 if fa3 else None
    i8 = [n for n in row if (n.startswith("ws_i8") or n == "triton_i8fp8") and row.get(n)]
    if i8 and fa3:
        row["best_i8"] = max(i8, key=lambda n: row[n])
        row["i8/fa3_fp8"] = row[row["best_i8"]] / fa3
    print("ROW", json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                             if not k.startswith("err:")}), flush=True)
    print("ERR", key, json.dumps({k[4:]: {m: round(x, 6) for m, x in v.items() if m != "nan"}
                                  for k, v in row.items() if k.startswith("err:")}), flush=True)
    return row


def accuracy_row(names, variants, B=1, Hq=16, N=8192, D=128):
    """Cosine / rel err to the unquantized float64 attention on transformer-like inputs (batch 0, heads 0 and
    Hq - 1)."""
    kernels, (q, k, v) = kernels_for(B, Hq, Hq, N, D, False, names, variants, seed=7, inputs="transformer")
    heads = [0, Hq - 1]
    ref = _reference(q, k, v, None, None, torch.ones(1, device="cuda"), D ** -0.5, False, heads)
    row = {"shape": f"transformer-like {B}x{N}x{Hq} D{D}"}
    for name, (call, _) in kernels.items():
        try:
            o = _output(call())
            e = error_report(torch.stack([o[0, :, h].double() for h in heads]), ref)
            row[name] = {m: round(x, 6) for m, x in e.items()}
        except Exception:  # noqa: BLE001
            print(f"  accuracy {name} FAILED: {traceback.format_exc()[-600:]}", flush=True)
    print("ACC", json.dumps(row), flush=True)
    return row


def ncu_one(key, name, variants):
    """Warm a kernel up, then run it once between cudaProfilerStart / Stop (what ``ncu --profile-from-start
    off`` profiles)."""
    B, Hq, Hkv, N, D, causal = parse_shape(key)
    kernels, _ = kernels_for(B, Hq, Hkv, N, D, causal, [name, name.split(":")[0]], variants)  # ws_i8:X needs ws_i8
    call = kernels[name][0]
    call()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def ncu_path() -> str:
    """The ncu executable: on the PATH, else the newest under /opt/nvidia/nsight-compute."""
    found = shutil.which("ncu") or sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))[-1:]
    return found if isinstance(found, str) else (found[0] if found else "ncu")


def known_metrics() -> list[str]:
    """The ``NCU_METRICS`` this ncu knows for the GPU (``ncu --query-metrics``)."""
    r = subprocess.run([ncu_path(), "--query-metrics", "--chip", "gh100"], capture_output=True, text=True)
    have = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
    if not have:
        print(f"ncu --query-metrics gave nothing (rc {r.returncode}): {r.stderr[-500:]}", flush=True)
    return [m for m in NCU_METRICS if m.split(".")[0] in have]


def run_ncu(keys, names, variants, out):
    metrics = known_metrics()
    print(f"ncu metrics known: {len(metrics)} of {len(NCU_METRICS)}; missing "
          f"{sorted(set(NCU_METRICS) - set(metrics))}", flush=True)
    results = {}
    for key in keys:
        for name in names:
            cmd = [ncu_path(), "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "details",
                   "--metrics", ",".join(metrics)]
            for s in NCU_SECTIONS:
                cmd += ["--section", s]
            cmd += [sys.executable, os.path.abspath(__file__), "--ncu-child", key, name]
            if variants:
                cmd += ["--variants", json.dumps({n: vars(c) for n, c in variants.items()})]
            r = subprocess.run(cmd, capture_output=True, text=True)
            text = r.stdout[r.stdout.find('"ID"'):] if '"ID"' in r.stdout else ""
            rows = list(csv.DictReader(io.StringIO(text)))
            tag = f"{key}|{name}"
            results[tag] = {}
            for row in rows:
                kname = row.get("Kernel Name", "")[:60]
                results[tag].setdefault(kname, {})[f'{row.get("Section Name")}/{row.get("Metric Name")}'] = \
                    f'{row.get("Metric Value")} {row.get("Metric Unit")}'.strip()
            if not rows:
                print(f"ncu {tag}: no rows (rc {r.returncode}): {r.stderr[-1500:]} {r.stdout[-800:]}", flush=True)
            for kname, m in results[tag].items():
                short = {k.split("/")[-1]: v for k, v in m.items()}
                print(f"NCU {tag} {kname}: " + "; ".join(f"{k}={short.get(k)}" for k in NCU_SUMMARY), flush=True)
    with open(os.path.join(out, "fa3_ncu.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    return results


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--ncu-child":
        variants = _variant_configs(sys.argv[5]) if len(sys.argv) > 5 else {}
        ncu_one(sys.argv[2], sys.argv[3], variants)
        return
    p = base_parser(__doc__)
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    p.add_argument("--kernels", default=DEFAULT_KERNELS)
    p.add_argument("--variants", default=None, help="JSON: name -> WsFwdConfig fields")
    p.add_argument("--ncu", action="store_true")
    p.add_argument("--ncu-shapes", default="4x4096x32,8x1000x16")
    p.add_argument("--ncu-kernels", default="fa3_fp8,ws,triton_fp8")
    p.add_argument("--no-time", action="store_true")
    p.add_argument("--graph", action="store_true",
                   help="time each call replayed from a CUDA graph: kernel time without the host's launch cost "
                        "(at ~100 us kernels a host path of that cost otherwise decides the time)")
    p.add_argument("--no-accuracy", action="store_true")
    args = p.parse_args()
    out = out_dir(args.out)
    variants = _variant_configs(args.variants)
    names = args.kernels.split(",")
    print(environment(), flush=True)
    result = {"env": environment(), "variants": {n: vars(c) for n, c in variants.items()}, "rows": []}
    if not args.no_accuracy:
        result["accuracy"] = accuracy_row(names, variants)
    if not args.no_time:
        for key in args.shapes.split(","):
            result["rows"].append(time_shape(key, names, variants, args.graph))
            torch.cuda.empty_cache()
            with open(os.path.join(out, "fa3_profile.json"), "w") as fh:
                json.dump(result, fh, indent=1)
    if args.ncu:
        result["ncu"] = run_ncu(args.ncu_shapes.split(","), args.ncu_kernels.split(","), variants, out)
    with open(os.path.join(out, "fa3_profile.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    cols = ["shape", *[n for n in names if n not in ("ws", "ws_i8")], "ws", *[f"ws:{n}" for n in variants], "best",
            "best/fa3_fp8"]
    if "ws_i8" in names:
        cols += ["ws_i8", *[f"ws_i8:{n}" for n in variants]]
    cols += ["best_i8", "i8/fa3_fp8"]
    print_table(result["rows"], cols)


if __name__ == "__main__":
    main()
