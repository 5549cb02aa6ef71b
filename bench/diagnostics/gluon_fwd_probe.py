"""Gluon fp8 attention forward on the H200: tile/stage variants vs our Triton fp8 kernel and SDPA cuDNN bf16.

    python bench/diagnostics/gluon_fwd_probe.py [--out DIR] [--quick]

TFLOP/s = 4*B*H*N^2*D / t, halved when causal; both fp8 kernels are timed as whole calls on pre-quantized
inputs (the V transpose included). Also checks each Gluon variant against the Triton fp8 output (same P
quantization: rel err ~1e-3) before timing it. Writes gluon_fwd_probe.json into --out.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.attention_fwd_bench import SHAPES, prepare
from bench.common import attention_tflops, base_parser, environment, or_none, out_dir, print_table, sdpa, time_ms
from fmha_ops.kernels.gluon import attention_fwd as G
from fmha_ops.kernels.triton.attention_fwd import attention_forward as triton_fwd
from fmha_ops.quant import quantize_qkv_fp8
from fmha_ops.testing import error_report

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
        return attention_tflops(B, Hq, N, D, causal, ms) if ms else None

    row = {"shape": f"{B}x{Hq}/{Hkv}x{N}x{D}{' causal' if causal else ''}"}
    row["triton_fp8"] = f(or_none(lambda: time_ms(lambda: triton_fwd(q8, k8, v8, **kw))))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    row["cudnn"] = f(or_none(lambda: time_ms(lambda: cudnn(qt, kt, vt, causal, Hq != Hkv))))
    ref = triton_fwd(q8, k8, v8, **kw)[0]
    best = None
    for bm, bn, st in VARIANTS[D]:
        name = f"g{bm}_{bn}s{st}"

        def run(bm=bm, bn=bn, st=st):
            return G.attention_forward(q8, k8, v8, config=G.GluonFwdConfig(bm, bn, st), **kw)[0]

        o = or_none(run)
        if o is None:
            row[name] = None
            continue
        e = error_report(o, ref)
        row[name + "_rel"] = e["rel"]
        if not e["rel"] < 2e-2:
            print(f"  {name} WRONG vs triton: {e}", flush=True)
            row[name] = None
            continue
        row[name] = f(or_none(lambda run=run: time_ms(run)))
        if row[name] and (best is None or row[name] > row[best]):
            best = name
    row["best"] = best
    if best:
        row["best/triton"] = row[best] / row["triton_fp8"] if row["triton_fp8"] else None
        row["best/cudnn"] = row[best] / row["cudnn"] if row["cudnn"] else None
    return row


def main():
    p = base_parser(__doc__)
    args = p.parse_args()
    out = out_dir(args.out)
    print(environment(), flush=True)
    cudnn = sdpa("CUDNN_ATTENTION")
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
    main()
