"""Warp-specialized Gluon fp8 forward on the H200: schedule variants vs our other fp8 kernels and cuDNN fp8.

    python bench/diagnostics/gluon_ws_probe.py [--out DIR] [--quick] [--shape I] [--warm] [--accuracy] [--api]

Per shape (per-tensor descales, so cuDNN fp8 takes the same inputs): the Triton fp8 kernel, the software-
pipelined Gluon kernel, cuDNN fp8 (``cudnn_fp8F``, where nvidia-cudnn-frontend is installed) and every
warp-specialized variant, each first checked against the Triton output (same P quantization, rel err ~1e-3),
then timed. TFLOP/s = 4*B*H*N^2*D / t, halved when causal. Writes gluon_ws_probe.json into --out.
``--accuracy`` instead compares fp8 quantization with and without a random Hadamard rotation of q and k
(``quantize_qkv_fp8(rotation=...)``) on transformer-like inputs: cos / MAE / max error vs float32 of our fp8
kernels and cuDNN fp8, and what the rotation adds to the quantization time.
``--api`` times fp8 ``flash_attn_func`` with each fp8 op forced against cuDNN bf16 SDPA (short sequences).
``--warm`` only compiles (one launch of every kernel at batch 1, the same specializations), so several
processes, one ``--shape`` each, can fill Triton's cache in parallel before the timed run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fmha_ops  # noqa: E402
from bench.common import (  # noqa: E402
    attention_tflops,
    base_parser,
    environment,
    or_none,
    out_dir,
    print_table,
    time_ms,
)
from fmha_ops import attn_bias as ab  # noqa: E402
from fmha_ops.kernels.gluon import attention_fwd as G  # noqa: E402
from fmha_ops.kernels.gluon import attention_fwd_ws as W  # noqa: E402
from fmha_ops.kernels.triton.attention_fwd import attention_forward as triton_fwd  # noqa: E402
from fmha_ops.quant import quantize_fp8_tensor, quantize_qkv_fp8, random_hadamard  # noqa: E402
from fmha_ops.testing import error_report, normal_qkv, transformer_like  # noqa: E402

SHAPES = [  # B, Hq, Hkv, N, D, causal
    (4, 32, 32, 4096, 128, False),
    (4, 32, 32, 4096, 128, True),
    (2, 16, 16, 16384, 128, False),
    (4, 32, 8, 4096, 128, False),
    (8, 16, 16, 1000, 128, False),
    (16, 32, 8, 512, 64, True),
    (3, 24, 8, 3000, 128, True),
    (4, 16, 16, 4096, 64, False),
    (4, 16, 16, 4096, 256, False),
]

_ONE = W.SINGLE_CONSUMER_MAXNREG


def _variants(d: int) -> dict:
    """name -> config: two consumers with V^T from transpose_v (``c2``), one consumer per CTA and two CTAs per SM
    (``c1``); ``vtko``: V transposed in shared memory by the producer warpgroup, keys in the S accumulator's
    order."""
    base = W.WsFwdConfig(block_n=128 if d <= 128 else 64)
    out = {"c2": base, "c2vtko": dataclasses.replace(base, v_transpose=True, key_order=True)}
    if d <= 128:
        one = dataclasses.replace(base, consumers=1, maxnreg=_ONE[d])
        out.update({"c1": one, "c1vtko": dataclasses.replace(one, v_transpose=True, key_order=True)})
    return out


VARIANTS = {d: _variants(d) for d in (64, 128, 256)}


def warm_shape(B, Hq, Hkv, N, D, causal):
    """One untimed launch of every kernel the timed row runs, at batch 1 (the kernels' specializations do not
    depend on the batch): fills Triton's cache."""
    q, k, v = normal_qkv((1, N, Hq, D), (1, N, Hkv, D), dtype=torch.bfloat16, device="cuda")
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8_tensor(t) for t in (q, k, v))
    kw = {"scale": D ** -0.5, "causal": causal, "q_descale": qd, "k_descale": kd, "v_descale": vd}
    runs = {"triton": lambda: triton_fwd(q8, k8, v8, **kw), "gluon_sp": lambda: G.attention_forward(q8, k8, v8, **kw)}
    for name, cfg in VARIANTS[D].items():
        runs[name] = lambda cfg=cfg: W.attention_forward(q8, k8, v8, config=cfg, **kw)
    for name, run in runs.items():
        try:
            run()
        except Exception:  # noqa: BLE001 - the timed run reports it in full
            print(f"  warm {B}x{Hq}/{Hkv}x{N}x{D} {name} failed: {traceback.format_exc(limit=1)[-300:]}", flush=True)
    torch.cuda.synchronize()


#: sequences up to this long also get CUDA-graph timings (``g:`` columns: GPU time without the host's launches)
GRAPH_MAX_N = 1024


def graph_ms(fn):
    """Median ms of one replay of a CUDA graph of ``fn()`` (captured after a warm-up call), or None."""
    try:
        fn()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return time_ms(graph.replay)
    except Exception:  # noqa: BLE001 - a launch that cannot be captured gets an empty cell
        print(f"  graph capture failed: {traceback.format_exc(limit=1)[-300:]}", flush=True)
        return None


def probe_shape(B, Hq, Hkv, N, D, causal, quick):
    q, k, v = normal_qkv((B, N, Hq, D), (B, N, Hkv, D), dtype=torch.bfloat16, device="cuda")
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8_tensor(t) for t in (q, k, v))
    kw = {"scale": D ** -0.5, "causal": causal, "q_descale": qd, "k_descale": kd, "v_descale": vd}

    def f(ms):
        return attention_tflops(B, Hq, N, D, causal, ms) if ms else None

    row = {"shape": f"{B}x{Hq}/{Hkv}x{N}x{D}{' causal' if causal else ''}"}
    row["triton"] = f(or_none(lambda: time_ms(lambda: triton_fwd(q8, k8, v8, **kw))))
    row["gluon_sp"] = f(or_none(lambda: time_ms(lambda: G.attention_forward(q8, k8, v8, **kw))))
    bias = ab.LowerTriangularFromBottomRightMask() if causal else None
    dkw = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    row["cudnn_fp8"] = f(or_none(lambda: time_ms(
        lambda: fmha_ops.memory_efficient_attention(q8, k8, v8, bias, op="cudnn_fp8F", **dkw))))
    ref = triton_fwd(q8, k8, v8, **kw)[0]
    if N <= GRAPH_MAX_N:
        row["g:triton"] = f(graph_ms(lambda: triton_fwd(q8, k8, v8, **kw)))
    best = None
    for name, cfg in list(VARIANTS[D].items())[:2 if quick else None]:
        def run(cfg=cfg):
            return W.attention_forward(q8, k8, v8, config=cfg, **kw)[0]
        try:
            o = run()
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - report the full compile / launch error and go on
            print(f"  {row['shape']} {name} FAILED:\n{traceback.format_exc()}", flush=True)
            row[name] = None
            continue
        e = error_report(o, ref)
        if not e["rel"] < 2e-2:
            print(f"  {row['shape']} {name} WRONG vs triton: {e}", flush=True)
            row[name] = None
            continue
        row[name] = f(or_none(lambda run=run: time_ms(run)))
        if N <= GRAPH_MAX_N:
            row[f"g:{name}"] = f(graph_ms(run))
        if row[name] and (best is None or row[name] > row[best]):
            best = name
    row["best"] = best
    for den in ("cudnn_fp8", "triton", "gluon_sp"):
        row[f"best/{den}"] = row[best] / row[den] if best and row.get(den) else None
    return row


def accuracy_rows(B=1, H=16, N=4096, D=128):
    """Rows (inputs, kernel, rotation, cos, mae, max) on transformer-like inputs, and the quantization times."""
    q, k, v = transformer_like((B, N, H, D), (B, N, H, D), dtype=torch.bfloat16, device="cuda", seed=7)
    ref = torch.empty(B, N, H, D, device="cuda")
    kf, vf = k.float().permute(0, 2, 3, 1), v.float().permute(0, 2, 1, 3)
    for s0 in range(0, N, 1024):
        sc = (q[:, s0:s0 + 1024].float().permute(0, 2, 1, 3) @ kf) * D ** -0.5
        ref[:, s0:s0 + 1024] = (torch.softmax(sc, -1) @ vf).permute(0, 2, 1, 3)
    del kf, vf
    rot = random_hadamard(D, seed=1, device="cuda")
    rows = []
    for rotated in (False, True):
        r = rot if rotated else None
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v, rotation=r)
        kw = {"scale": D ** -0.5, "q_descale": qd, "k_descale": kd, "v_descale": vd}
        qr, kr = (q @ rot.to(q.dtype), k @ rot.to(k.dtype)) if rotated else (q, k)
        (tq, tqd), (tk, tkd), (tv, tvd) = (quantize_fp8_tensor(t) for t in (qr, kr, v))
        runs = {"triton fp8": lambda: triton_fwd(q8, k8, v8, **kw)[0],
                "gluon ws fp8": lambda: W.attention_forward(q8, k8, v8, **kw)[0],
                "cuDNN fp8 (tensor descales)": lambda: fmha_ops.memory_efficient_attention(
                    tq, tk, tv, None, op="cudnn_fp8F", q_descale=tqd, k_descale=tkd, v_descale=tvd)}
        for name, fn in runs.items():
            o = or_none(fn)
            if o is not None:
                e = error_report(o, ref)
                rows.append({"kernel": name, "rotation": rotated, "cos": e["cos"], "mae": e["mae"],
                             "max": e["max"]})
                print("ACC", rows[-1], flush=True)
    t_plain = time_ms(lambda: quantize_qkv_fp8(q, k, v))
    t_rot = time_ms(lambda: quantize_qkv_fp8(q, k, v, rotation=rot))
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
    t_attn = time_ms(lambda: W.attention_forward(q8, k8, v8, scale=D ** -0.5, q_descale=qd, k_descale=kd,
                                                 v_descale=vd))
    total = t_plain + t_attn
    print(f"ACC quantize_qkv_fp8 {t_plain:.3f} ms, with rotation {t_rot:.3f} ms (+{t_rot - t_plain:.3f} ms = "
          f"{(t_rot - t_plain) / total:.1%} of quantize + attention {total:.3f} ms)", flush=True)
    return rows


API_SHAPES = [(8, 16, 16, 1000, 128, False), (16, 32, 8, 512, 64, True), (4, 32, 8, 4096, 128, False)]
API_OPS = ("triton_fp8F", "gluon_fp8F", "gluon_ws_fp8F", "cudnn_fp8F")


def api_rows():
    """TFLOP/s of fp8 ``flash_attn_func`` (per-tensor descales) with each fp8 op forced, against cuDNN bf16 SDPA
    on the same shape, printed as measured."""
    from bench.common import sdpa

    cudnn_bf16 = sdpa("CUDNN_ATTENTION")
    rows = []
    for B, Hq, Hkv, N, D, causal in API_SHAPES:
        q, k, v = normal_qkv((B, N, Hq, D), (B, N, Hkv, D), dtype=torch.bfloat16, device="cuda")
        (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8_tensor(t) for t in (q, k, v))
        row = {"shape": f"{B}x{N}x{Hq}/{Hkv}x{D}{' causal' if causal else ''}"}

        def call_ws():
            with fmha_ops.use_ops("gluon_ws_fp8F"):
                return fmha_ops.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)

        for op in API_OPS:
            def call(op=op):
                with fmha_ops.use_ops(op):
                    return fmha_ops.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                                    v_descale=vd)
            ms = or_none(lambda call=call: time_ms(call))
            row[op] = attention_tflops(B, Hq, N, D, causal, ms) if ms else None
        # the ws op with the other schedule of its default_config (long <-> short keys) swapped in
        default_config = W.default_config
        W.default_config = lambda d, c, n: default_config(d, c, 1 if n >= W.LONG_KEYS else None)
        try:
            ms = or_none(lambda: time_ms(call_ws))
        finally:
            W.default_config = default_config
        row["gluon_ws_fp8F_other"] = attention_tflops(B, Hq, N, D, causal, ms) if ms else None
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        ms = or_none(lambda: time_ms(lambda: cudnn_bf16(qt, kt, vt, causal, Hq != Hkv)))
        row["cudnn_bf16"] = attention_tflops(B, Hq, N, D, causal, ms) if ms else None
        fp8 = [row[c] for c in (*API_OPS[:3], "gluon_ws_fp8F_other") if row.get(c)]
        row["best_ours/cudnn_bf16"] = max(fp8) / row["cudnn_bf16"] if fp8 and row["cudnn_bf16"] else None
        print("API", " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        rows.append(row)
    return rows


def main():
    p = base_parser(__doc__)
    p.add_argument("--shape", type=int, default=None, help="only SHAPES[I]")
    p.add_argument("--warm", action="store_true", help="compile only (batch 1, untimed)")
    p.add_argument("--accuracy", action="store_true", help="the Hadamard rotation's accuracy and cost instead")
    p.add_argument("--api", action="store_true", help="fp8 flash_attn_func per forced op vs cuDNN bf16 instead")
    args = p.parse_args()
    if args.accuracy:
        accuracy_rows()
        return
    if args.api:
        print(environment(), flush=True)
        rows = api_rows()
        with open(os.path.join(out_dir(args.out), "fp8_api.json"), "w") as fh:
            json.dump({"env": environment(), "rows": rows}, fh, indent=1)
        return
    shapes = [SHAPES[args.shape]] if args.shape is not None else SHAPES[:2] if args.quick else SHAPES
    if args.warm:
        for shape in shapes:
            warm_shape(*shape)
        return
    out = out_dir(args.out)
    print(environment(), flush=True)
    rows = []
    for shape in shapes:
        row = probe_shape(*shape, args.quick)
        print("ROW", " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    with open(os.path.join(out, "gluon_ws_probe.json"), "w") as fh:
        json.dump({"env": environment(), "variants": {d: {n: dataclasses.asdict(c) for n, c in v.items()}
                                                      for d, v in VARIANTS.items()}, "rows": rows}, fh, indent=1)
    vcols = sorted({c for r in rows for c in r if c.startswith("c") and c[1].isdigit()})
    print_table(rows, ["shape", "triton", "gluon_sp", "cudnn_fp8", *vcols, "best", "best/cudnn_fp8", "best/triton"])


if __name__ == "__main__":
    main()
