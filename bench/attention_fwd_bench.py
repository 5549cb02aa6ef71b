"""Forward attention benchmark: our Triton fp8 / i8fp8 / bf16 kernel and the Gluon fp8 kernels (sm90: pipelined
``gluon``, warp-specialized ``gluon_ws``) vs SDPA cuDNN and flash (bf16) and cuDNN fp8 (``cudnn_fp8``, ratios
``*/cudnn_fp8``).

    python bench/attention_fwd_bench.py [--sweep] [--quick] [--out DIR]

TFLOP/s = 4*B*H*N^2*D / t, halved when causal. Our fp8/i8fp8 times include the V transpose the
launcher makes (``transpose_v``, reported separately as ``vT_ms``) and exclude quantization (inputs arrive quantized,
as with FA3); SageAttention 1.0.6 (if importable) quantizes inside its call.
``--sweep`` first times tile/launch variants of the fp8 path per head dim and uses the best ones.
Writes attention_fwd.json/.png, attention_fwd_sweep.json and i8fp8_accuracy.json into --out, and the records
bench/results/attention_fwd.md and bench/results/accuracy.md (not with --quick or --no-record).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fmha_ops  # noqa: E402
from bench.backends import forward_columns, fp8_columns  # noqa: E402
from bench.common import (  # noqa: E402
    PREFILL_SHAPES,
    attention_tflops,
    Record,
    bar_plot,
    base_parser,
    capture_graph,
    environment,
    or_none,
    out_dir,
    print_table,
    sdpa,
    time_ms,
    write_json,
)
from fmha_ops.kernels.triton.attention_fwd import FwdConfig, attention_forward, default_config  # noqa: E402
from fmha_ops.kernels.triton.transpose_v import transpose_v  # noqa: E402
from fmha_ops.quant import quantize_fp8_tensor, quantize_i8fp8, quantize_qkv_fp8, random_hadamard  # noqa: E402
from fmha_ops.testing import error_report, normal_qkv, transformer_like  # noqa: E402

SHAPES = PREFILL_SHAPES + [  # B, Hq, Hkv, N, D, causal
    (2, 16, 16, 16384, 128, True),
    (2, 8, 8, 16384, 256, False),
    (4, 32, 8, 4096, 128, False),
]

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


def _gluon(module: str = "attention_fwd"):
    """A Gluon fp8 forward (``fmha_ops/kernels/gluon/<module>.py``: the pipelined ``attention_fwd`` or the
    warp-specialized ``attention_fwd_ws``), or None where it cannot run (not sm90, no gluon)."""
    try:
        if torch.cuda.get_device_capability()[0] != 9:
            return None
        import importlib

        return importlib.import_module(f"fmha_ops.kernels.gluon.{module}").attention_forward
    except Exception:  # noqa: BLE001 - optional backend
        return None


def _sage():
    try:
        from sageattention import sageattn

        return sageattn
    except Exception:  # noqa: BLE001 - optional package
        return None


def prepare(B, Hq, Hkv, N, D, causal, dist="normal", seed=0):
    """bf16 q, k, v on the GPU in BMHK layout from one of fmha_ops.testing's distributions."""
    make = normal_qkv if dist == "normal" else transformer_like
    return tuple(make((B, N, Hq, D), (B, N, Hkv, D), dtype=torch.bfloat16, device="cuda", seed=seed))


def _graph_ms(fn):
    """Median ms of a CUDA-graph replay of ``fn()``: the GPU time, also where one eager call would be shorter
    than its host launch path (small shapes)."""
    return time_ms(capture_graph(fn).replay)


def sweep(out, dims=(64, 128, 256), shape=None):
    """Tile variants per (head dim, causal), each timed as a CUDA-graph replay."""
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
                q8, k8, v8, scale=D ** -0.5, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, **_kw(cfg))))
            row["fp8"] = attention_tflops(B, H, N, D, causal, ms)
            if xi is not None and not extra:
                ms = or_none(lambda: _graph_ms(lambda: attention_forward(
                    xi.q, xi.k, xi.v, scale=1.0, causal=causal, q_descale=xi.q_descale, k_descale=xi.k_descale,
                    v_descale=xi.v_descale, **_kw(cfg))))
                row["i8fp8"] = attention_tflops(B, H, N, D, causal, ms)
            print(row, flush=True)
            rows.append(row)
            key = (D, causal)
            if row["fp8"] and (key not in best or row["fp8"] > best[key][0]):
                best[key] = (row["fp8"], cfg)
        del q, k, v, q8, k8, v8, xi
    with open(os.path.join(out, "attention_fwd_sweep.json"), "w") as f:
        json.dump({"env": environment(), "rows": rows, "best": {f"{k[0]}_{k[1]}": v for k, v in best.items()}}, f,
                  indent=1)
    print_table(rows, ["D", "causal", "cfg", "fp8", "i8fp8"])
    return {k: v[1] for k, v in best.items()}


def _kw(cfg: dict) -> dict:
    """attention_forward's keyword for a sweep config dict ({}: the kernel's default)."""
    return {"config": FwdConfig(**cfg)} if cfg else {}


def cfg_for(best, D, causal):
    """The sweep's best config for (D, causal), else {} (the kernel's own default for the shape)."""
    return best.get((D, causal)) or best.get((D, False)) or {}


def speed_table(out, best, quick):
    rows = []
    sdpa_cudnn, sdpa_flash, sage, gluon = sdpa("CUDNN_ATTENTION"), sdpa("FLASH_ATTENTION"), _sage(), _gluon()
    gluon_ws = _gluon("attention_fwd_ws")
    for B, Hq, Hkv, N, D, causal in (SHAPES[:2] if quick else SHAPES):
        q, k, v = prepare(B, Hq, Hkv, N, D, causal)
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        xi = quantize_i8fp8(q, k, v)
        cfg = cfg_for(best, D, causal)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        gqa = Hq != Hkv
        f = lambda ms: attention_tflops(B, Hq, N, D, causal, ms)  # noqa: E731
        row = dict(shape=f"{B}x{Hq}/{Hkv}x{N}x{D}{' causal' if causal else ''}",
                   cfg=json.dumps(cfg or dataclasses.asdict(default_config(D, causal, N, quantized=True))))
        row["fp8"] = f(or_none(lambda: time_ms(lambda: attention_forward(
            q8, k8, v8, scale=D ** -0.5, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, **_kw(cfg)))))
        if gluon is not None:
            row["gluon"] = f(or_none(lambda: time_ms(lambda: gluon(q8, k8, v8, scale=D ** -0.5, causal=causal,
                                                                 q_descale=qd, k_descale=kd, v_descale=vd))))
        if gluon_ws is not None:
            row["gluon_ws"] = f(or_none(lambda: time_ms(lambda: gluon_ws(
                q8, k8, v8, scale=D ** -0.5, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd))))
        row["i8fp8"] = f(or_none(lambda: time_ms(lambda: attention_forward(
            xi.q, xi.k, xi.v, scale=1.0, causal=causal, q_descale=xi.q_descale, k_descale=xi.k_descale,
            v_descale=xi.v_descale, **_kw(cfg)))))
        row["bf16"] = f(or_none(lambda: time_ms(lambda: attention_forward(q, k, v, scale=D ** -0.5, causal=causal))))
        row["cudnn"] = f(or_none(lambda: time_ms(lambda: sdpa_cudnn(qt, kt, vt, causal, gqa))))
        row["flash"] = f(or_none(lambda: time_ms(lambda: sdpa_flash(qt, kt, vt, causal, gqa))))
        row.update(forward_columns(q, k, v, causal))  # public API next to cuDNN / FA4 (bf16) and cuDNN fp8
        row.update(fp8_columns(q, k, v, causal))
        if sage is not None and D in (64, 128):
            ks = k.clone()
            row["sage1"] = f(or_none(lambda: time_ms(lambda: sage(q, ks, v, tensor_layout="NHD", is_causal=causal))))
        row["vT_ms"] = or_none(lambda: time_ms(lambda: transpose_v(v8)))
        for num, den in (("fp8", "cudnn"), ("i8fp8", "cudnn"), ("i8fp8", "fp8"), ("bf16", "cudnn"), ("gluon", "fp8"),
                         ("gluon", "cudnn"), ("gluon_ws", "fp8"), ("fp8", "cudnn_fp8"), ("gluon_ws", "cudnn_fp8")):
            row[f"{num}/{den}"] = row[num] / row[den] if row.get(num) and row.get(den) else None
        print(row, flush=True)
        rows.append(row)
        del q, k, v, q8, k8, v8, xi, qt, kt, vt
        torch.cuda.empty_cache()
    cols = ["shape", "fp8", "gluon", "gluon_ws", "i8fp8", "bf16", "cudnn", "flash", "sage1", "vT_ms", "fp8/cudnn",
            "gluon/fp8", "gluon/cudnn", "gluon_ws/fp8", "i8fp8/cudnn", "i8fp8/fp8", "bf16/cudnn", "api", "fa4",
            "api/best", "api_fp8", "cudnn_fp8", "fp8/cudnn_fp8", "gluon_ws/cudnn_fp8", "api_fp8/best"]
    print_table(rows, cols)
    write_json(out, "attention_fwd", rows)
    bar_plot(out, "attention_fwd", rows, "shape",
             ["fp8", "gluon", "gluon_ws", "i8fp8", "bf16", "cudnn", "flash", "sage1"], "TFLOP/s",
             "attention forward, H200")
    return rows, cols


def accuracy_table(out, best):
    B, H, N, D = 1, 16, 16384, 128
    rows = []
    sdpa_cudnn, sage = sdpa("CUDNN_ATTENTION"), _sage()
    cfg = cfg_for(best, D, False)
    for dist in ("normal", "transformer_like"):
        q, k, v = prepare(B, H, H, N, D, False, dist, seed=7)
        ref = torch.empty(B, N, H, D, device="cuda")
        kf, vf = k.float().permute(0, 2, 3, 1), v.float().permute(0, 2, 1, 3)
        for s0 in range(0, N, 2048):
            s = (q[:, s0:s0 + 2048].float().permute(0, 2, 1, 3) @ kf) * D ** -0.5
            ref[:, s0:s0 + 2048] = (torch.softmax(s, -1) @ vf).permute(0, 2, 1, 3)
        del kf, vf
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        xb = quantize_qkv_fp8(q, k, v, qk_granularity="block")
        xr = quantize_qkv_fp8(q, k, v, rotation=random_hadamard(D, device=q.device))
        xt = [quantize_fp8_tensor(t) for t in (q, k, v)]
        xi = quantize_i8fp8(q, k, v)
        xh = quantize_i8fp8(q, k, v, qk_granularity="head")
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        runs = {
            "ours i8fp8 (block q/k, channel v)": lambda: attention_forward(
                xi.q, xi.k, xi.v, scale=1.0, q_descale=xi.q_descale, k_descale=xi.k_descale, v_descale=xi.v_descale,
                **_kw(cfg))[0],
            "ours i8fp8 (head q/k, channel v)": lambda: attention_forward(
                xh.q, xh.k, xh.v, scale=1.0, q_descale=xh.q_descale, k_descale=xh.k_descale, v_descale=xh.v_descale,
                **_kw(cfg))[0],
            "ours i8fp8 (block q/k, channel v), fp16 PV": lambda: attention_forward(
                xi.q, xi.k, xi.v, scale=1.0, q_descale=xi.q_descale, k_descale=xi.k_descale, v_descale=xi.v_descale,
                pv_fp8=False, **_kw(cfg))[0],
            "ours fp8 (B,Hkv descales)": lambda: attention_forward(
                q8, k8, v8, scale=D ** -0.5, q_descale=qd, k_descale=kd, v_descale=vd, **_kw(cfg))[0],
            "ours fp8 (block q/k, B,Hkv v)": lambda: attention_forward(
                *xb[:3], scale=D ** -0.5, q_descale=xb[3], k_descale=xb[4], v_descale=xb[5], **_kw(cfg))[0],
            "ours fp8 (Hadamard q/k, B,Hkv descales)": lambda: attention_forward(
                *xr[:3], scale=D ** -0.5, q_descale=xr[3], k_descale=xr[4], v_descale=xr[5], **_kw(cfg))[0],
            "cuDNN fp8 (per tensor, cudnn-frontend)": lambda: fmha_ops.memory_efficient_attention(
                *(t for t, _ in xt), op="cudnn_fp8F", q_descale=xt[0][1], k_descale=xt[1][1], v_descale=xt[2][1]),
            "ours fp8 (per tensor)": lambda: fmha_ops.memory_efficient_attention(
                *(t for t, _ in xt), op="triton_fp8F", q_descale=xt[0][1], k_descale=xt[1][1], v_descale=xt[2][1]),
            "ours bf16": lambda: attention_forward(q, k, v, scale=D ** -0.5)[0],
            "ours Gluon fp8 (B,Hkv descales)": lambda: _gluon()(
                q8, k8, v8, scale=D ** -0.5, q_descale=qd, k_descale=kd, v_descale=vd)[0],
            "SDPA cuDNN bf16": lambda: sdpa_cudnn(qt, kt, vt, False, False).transpose(1, 2),
        }
        if sage is not None:
            ks = k.clone()
            runs["SageAttention 1.0.6"] = lambda: sage(q, ks, v, tensor_layout="NHD")
        for name, fn in runs.items():
            o = or_none(fn)
            if o is None:
                continue
            e = error_report(o, ref)
            ms = or_none(lambda: time_ms(fn))
            rows.append(dict(inputs=dist, kernel=name, ms=ms, tflops=attention_tflops(B, H, N, D, False, ms),
                             mae=e["mae"], max=e["max"], cos=e["cos"], rel=e["rel"]))
            print(rows[-1], flush=True)
        del q, k, v, ref, q8, k8, v8, xb, xr, xt, xi, xh, qt, kt, vt
        torch.cuda.empty_cache()
    cols = ["inputs", "kernel", "ms", "tflops", "mae", "max", "cos", "rel"]
    print_table(rows, cols)
    write_json(out, "i8fp8_accuracy", rows)
    return rows, cols


COMMAND = "PYTHONPATH=$PWD python bench/attention_fwd_bench.py"
SPEED_RECORD = Record(
    "attention_fwd", "Forward attention (prefill)", COMMAND,
    {"shape": "shape (B x Hq/Hkv x N x D)", "fp8": "ours fp8", "i8fp8": "ours i8fp8", "bf16": "ours bf16",
     "cudnn": "cuDNN bf16", "fa4": "FA4", "cudnn_fp8": "cuDNN fp8", "fp8/cudnn": "fp8 / cuDNN",
     "i8fp8/cudnn": "i8fp8 / cuDNN"},
    "TFLOP/s = 4*B*H*N^2*D / t, halved when causal; CUDA-event medians of whole calls. Ours take inputs already "
    "quantized (fp8: per (batch, kv head) descales; i8fp8: int8 q/k per 128-token block, fp8 v per channel) and "
    "include the V transpose. cuDNN is torch SDPA's cuDNN backend in the same run; the FA4 and cuDNN fp8 columns are "
    "empty where the package is not installed.")
ACCURACY_RECORD = Record(
    "accuracy", "Accuracy of the quantized forward", COMMAND,
    {"inputs": "inputs", "kernel": "kernel", "cos": "cosine", "mae": "mean abs err", "max": "max abs err",
     "rel": "rel L2 err"},
    "B=1, H=16, N=16384, D=128, non-causal, against float32 attention of the bf16 inputs; inputs from "
    "`fmha_ops.testing` (`normal_qkv`, `transformer_like`). fp8 block q/k: one descale per 128 queries / 128 keys "
    "(`quantize_qkv_fp8(..., qk_granularity=\"block\")`); Hadamard: `rotation=random_hadamard(128)`; cuDNN fp8 and "
    "ours per tensor through `memory_efficient_attention` (`op=\"cudnn_fp8F\"` / `\"triton_fp8F\"`).")


def main():
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="time tile/launch variants first and use the best")
    p.add_argument("--sweep-only", default=None, help="comma list of head dims: run only their sweep, then stop")
    p.add_argument("--sweep-shape", default=None, help="B,H,N for --sweep-only (default 4,32,4096 at D128, 4,16,4096)")
    p.add_argument("--no-accuracy", action="store_true")
    args = p.parse_args()
    out = out_dir(args.out)
    env = environment()
    print(env)
    if args.sweep_only:
        shape = tuple(int(x) for x in args.sweep_shape.split(",")) if args.sweep_shape else None
        sweep(out, tuple(int(d) for d in args.sweep_only.split(",")), shape)
        return
    best = {}
    if args.sweep:
        best = or_none(lambda: sweep(out)) or {}
    rows, _ = speed_table(out, best, args.quick)
    record = not (args.no_record or args.quick)
    if record:
        print("record:", SPEED_RECORD.write(rows, env, os.path.join(out, "attention_fwd.png")))
    if not args.no_accuracy:
        arows, _ = or_none(lambda: accuracy_table(out, best)) or ([], [])
        if record and arows:
            print("record:", ACCURACY_RECORD.write(arows, env))


if __name__ == "__main__":
    main()
