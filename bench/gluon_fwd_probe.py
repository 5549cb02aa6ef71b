"""Gluon fp8 attention forward on the H200: tile/stage variants vs our Triton fp8 kernel and SDPA cuDNN bf16.

    python bench/gluon_fwd_probe.py [--out DIR] [--quick]
    python bench/gluon_fwd_probe.py --ws [--schedules pingpong,pingpong_overlap,...] [--child-timeout S] [--out DIR]

``--ws`` checks and times the warp-specialized ping-pong kernel (``kernels/gluon/attention_fwd_ws.py``, not
registered as an op): one subprocess per schedule (a deadlocked barrier protocol costs that schedule, not the run),
each first checked against a float32 reference on the dequantized inputs (odd sizes, causal, GQA, D 64/128/256,
NaN-poisoned output, LSE), then timed on the shapes of bench/attention_fwd_bench.py; a baseline subprocess times
the Triton fp8 kernel and the one-warpgroup Gluon kernel on the same inputs. Writes gluon_ws_probe.json.

TFLOP/s = 4*B*H*N^2*D / t, halved when causal; both fp8 kernels are timed as whole calls on pre-quantized
inputs (the V transpose included). Also checks each Gluon variant against the Triton fp8 output (same P
quantization: rel err ~1e-3) before timing it. Writes gluon_fwd_probe.json into --out.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.attention_fwd_bench import SHAPES, _safe, _sdpa, prepare, tflops
from bench.common import base_parser, environment, out_dir, print_table, time_ms
from fmha_ops.kernels.gluon import attention_fwd as G
from fmha_ops.kernels.triton.attention_fwd import attention_forward as triton_fwd
from fmha_ops.quant import quantize_qkv_fp8
from tests.numerics import error_report

VARIANTS = {  # head dim -> (block_m, block_n, stages) variants; block_m 128 = two warpgroups per CTA
    64: [(64, 128, 2), (64, 128, 3), (64, 64, 3), (128, 128, 2)],
    128: [(64, 128, 2), (64, 128, 3), (64, 64, 3), (128, 128, 2)],
    256: [(64, 64, 2), (64, 64, 3), (128, 64, 2)],
}


def probe_shape(B, Hq, Hkv, N, D, causal, cudnn):
    """One row: Triton fp8, cuDNN bf16 and every Gluon variant (checked against Triton first) in TFLOP/s."""
    q, k, v = prepare(B, Hq, Hkv, N, D, causal)
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
    kw = {"scale": D ** -0.5, "causal": causal, "q_descale": qd, "k_descale": kd, "v_descale": vd}

    def f(ms):
        return tflops(B, Hq, N, D, causal, ms) if ms else None

    row = {"shape": f"{B}x{Hq}/{Hkv}x{N}x{D}{' causal' if causal else ''}"}
    row["triton_fp8"] = f(_safe(lambda: time_ms(lambda: triton_fwd(q8, k8, v8, **kw))))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    row["cudnn"] = f(_safe(lambda: time_ms(lambda: cudnn(qt, kt, vt, causal, Hq != Hkv))))
    ref = triton_fwd(q8, k8, v8, **kw)[0]
    best = None
    for bm, bn, st in VARIANTS[D]:
        name = f"g{bm}_{bn}s{st}"

        def run(bm=bm, bn=bn, st=st):
            return G.attention_forward(q8, k8, v8, block_m=bm, block_n=bn, stages=st, **kw)[0]

        o = _safe(run)
        if o is None:
            row[name] = None
            continue
        e = error_report(o, ref)
        row[name + "_rel"] = e["rel"]
        if not e["rel"] < 2e-2:
            print(f"  {name} WRONG vs triton: {e}", flush=True)
            row[name] = None
            continue
        row[name] = f(_safe(lambda run=run: time_ms(run)))
        if row[name] and (best is None or row[name] > row[best]):
            best = name
    row["best"] = best
    if best:
        row["best/triton"] = row[best] / row["triton_fp8"] if row["triton_fp8"] else None
        row["best/cudnn"] = row[best] / row["cudnn"] if row["cudnn"] else None
    return row


# ------------------------------------------------------------------------------------ --ws: warp-specialized kernel

WS_SCHEDULES = ("pingpong", "pingpong_overlap", "pingpong_lookahead", "overlap")


def _ws_check(schedule):
    """Worst errors of one schedule over the Gluon GPU test shapes against the float32 reference (raises on a failure)."""
    from fmha_ops.kernels.gluon import attention_fwd_ws as W
    from tests.test_kernel_attention_fwd import _dq, _inputs, reference
    from tests.test_kernel_gluon_fwd import GPU_SHAPES

    worst = {"rel": 0.0, "cos": 1.0, "lse": 0.0}
    for B, Mq, Mk, Hq, Hkv, D, causal in GPU_SHAPES:
        q, k, v = _inputs("normal", B, Mq, Mk, Hq, Hkv, D, D, torch.bfloat16, seed=Mq + Mk)
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        ref, ref_lse = reference(_dq(q8, qd, Hq // Hkv), _dq(k8, kd), _dq(v8, vd), D ** -0.5, causal)
        out = torch.full((B, Mq, Hq, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        o, lse = W.attention_forward(q8, k8, v8, scale=D ** -0.5, causal=causal, q_descale=qd, k_descale=kd,
                                     v_descale=vd, return_lse=True, out=out, schedule=schedule)
        torch.cuda.synchronize()
        e = error_report(o, ref)
        fin = ~torch.isinf(ref_lse)
        lerr = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
        ok = (not torch.isnan(o).any() and e["rel"] < 4e-2 and e["cos"] > 0.999 and lerr < 2e-2
              and torch.equal(torch.isinf(lse), torch.isinf(ref_lse)))
        print(f"  {schedule} {(B, Mq, Mk, Hq, Hkv, D, causal)}: rel {e['rel']:.4f} cos {e['cos']:.6f} "
              f"lse {lerr:.2e} {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            raise AssertionError(f"{schedule} wrong on {(B, Mq, Mk, Hq, Hkv, D, causal)}: {e}, lse err {lerr}")
        worst = {"rel": max(worst["rel"], e["rel"]), "cos": min(worst["cos"], e["cos"]), "lse": max(worst["lse"], lerr)}
    return worst


def ws_child(name, out, quick):
    """One subprocess: 'baseline' (Triton fp8, one-warpgroup Gluon) or a schedule of the WS kernel."""
    shapes = SHAPES[:2] if quick else SHAPES
    res = {"name": name, "rows": []}
    if name != "baseline":
        from fmha_ops.kernels.gluon import attention_fwd_ws as W

        t0 = time.time()
        res["check"] = _ws_check(name)
        print(f"{name}: correct on the Gluon GPU test shapes ({time.time() - t0:.0f} s with compiles)", flush=True)
    for B, Hq, Hkv, N, D, causal in shapes:
        q, k, v = prepare(B, Hq, Hkv, N, D, causal)
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        kw = {"scale": D ** -0.5, "causal": causal, "q_descale": qd, "k_descale": kd, "v_descale": vd}
        row = {"shape": f"{B}x{Hq}/{Hkv}x{N}x{D}{' causal' if causal else ''}"}
        args = (q8, k8, v8)

        def f(fn, args=args, kw=kw):
            return fn(*args, **kw)

        if name == "baseline":
            row["triton_fp8"] = tflops(B, Hq, N, D, causal, time_ms(lambda f=f: f(triton_fwd)))
            row["gluon_fp8"] = tflops(B, Hq, N, D, causal, time_ms(lambda f=f: f(G.attention_forward)))
        else:
            ws = functools.partial(W.attention_forward, schedule=name)
            ref = f(triton_fwd)[0]
            row["rel_vs_triton"] = error_report(f(ws)[0], ref)["rel"]
            row[name] = tflops(B, Hq, N, D, causal, time_ms(lambda f=f, ws=ws: f(ws)))
        print(row, flush=True)
        res["rows"].append(row)
        torch.cuda.empty_cache()
    with open(os.path.join(out, f"ws_{name}.json"), "w") as fh:
        json.dump(res, fh, indent=1)


def ws_main(args, out):
    names = ["baseline", *(args.schedules.split(",") if args.schedules else WS_SCHEDULES)]
    results = {}
    for name in names:
        cmd = [sys.executable, os.path.abspath(__file__), "--ws-child", name, "--out", out]
        if args.quick:
            cmd.append("--quick")
        t0 = time.time()
        try:
            rc = subprocess.run(cmd, check=False, timeout=args.child_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout (deadlock?)"
        print(f"== {name}: rc {rc}, {time.time() - t0:.0f} s", flush=True)
        path = os.path.join(out, f"ws_{name}.json")
        if rc == 0 and os.path.exists(path):
            with open(path) as fh:
                results[name] = json.load(fh)
        else:
            results[name] = {"name": name, "error": str(rc), "rows": []}
    rows = {}
    for name, res in results.items():
        for r in res["rows"]:
            row = rows.setdefault(r["shape"], {"shape": r["shape"]})
            row.update({kk: vv for kk, vv in r.items() if kk != "rel_vs_triton"})
    table = list(rows.values())
    for row in table:
        cols = [n for n in names[1:] if row.get(n)]
        best = max(cols, key=lambda n: row[n]) if cols else None
        row["best_ws"] = best
        if best and row.get("triton_fp8"):
            row["ws/triton"] = row[best] / row["triton_fp8"]
        if best and row.get("gluon_fp8"):
            row["ws/gluon"] = row[best] / row["gluon_fp8"]
    with open(os.path.join(out, "gluon_ws_probe.json"), "w") as fh:
        json.dump({"env": environment(), "results": results, "table": table}, fh, indent=1)
    for name, res in results.items():
        if "check" in res or "error" in res:
            print(name, "check:", res.get("check"), "error:", res.get("error"))
    print_table(table, ["shape", "triton_fp8", "gluon_fp8", *names[1:], "best_ws", "ws/triton", "ws/gluon"])


def main():
    p = base_parser(__doc__)
    p.add_argument("--ws", action="store_true", help="check and time the warp-specialized kernel instead")
    p.add_argument("--schedules", default=None, help=f"--ws schedules, comma-separated (default {WS_SCHEDULES})")
    p.add_argument("--child-timeout", type=float, default=150.0, help="--ws: seconds per schedule subprocess")
    p.add_argument("--ws-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    out = out_dir(args.out)
    if args.ws_child:
        return ws_child(args.ws_child, out, args.quick)
    print(environment(), flush=True)
    if args.ws:
        return ws_main(args, out)
    cudnn = _sdpa("CUDNN_ATTENTION")
    rows = []
    for shape in (SHAPES[:2] if args.quick else SHAPES):
        row = probe_shape(*shape, cudnn)
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    with open(os.path.join(out, "gluon_fwd_probe.json"), "w") as fh:
        json.dump({"env": environment(), "rows": rows}, fh, indent=1)
    gcols = sorted({c for r in rows for c in r if c.startswith("g") and not c.endswith("_rel")})
    print_table(rows, ["shape", "triton_fp8", "cudnn", *gcols, "best", "best/triton", "best/cudnn"])


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
