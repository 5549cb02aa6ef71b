"""Which op faults on which operand layout: every forward op, forced, on layouts some kernels cannot address
(q / k / v sliced from fused-projection rows off 16 bytes, odd start addresses, a tensor bias with odd strides,
empty batches / sequences), each layout in its own process.

An op that declares the layout must match the float64 reference; one that does not must raise ValueError naming
the reason. The ops run one after another with a device synchronization after each; a CUDA fault (sticky: it
fails every later call in that process) ends the process, the op that was running is reported as the culprit, and
a fresh process carries on with the remaining ops. Lines print as measured; ``--out`` writes the JSON.

    python bench/diagnostics/alignment_probe.py [--layouts NAME,...] [--jobs 6] [--out DIR]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

#: max relative L2 error against the float64 reference, by dtype name
TOLERANCE = {"float16": 4e-3, "bfloat16": 2e-2}
#: layout name: (dtype, how the inputs are made; see ``_inputs``)
LAYOUTS = {
    "bmk_rows392_f16": ("float16", ("packed", 64, 4, 0)),  # rows 196 elements apart: 8-byte aligned
    "bmk_rows392_bf16": ("bfloat16", ("packed", 64, 4, 0)),
    "bmk_start2B_f16": ("float16", ("packed", 64, 0, 1)),  # q starts 2 bytes in
    "bmk_rows196_f16": ("float16", ("packed", 32, 2, 0)),  # 4-byte aligned rows
    "bmk_rows790_bf16": ("bfloat16", ("packed", 128, 8, 3)),  # odd start, 2-byte aligned rows
    "bmhk_heads136_f16": ("float16", ("heads", 64, 4)),  # heads 68 elements apart
    "bias_rows134_f16": ("float16", ("bias",)),  # a (B, H, Mq, Mk) bias sliced from rows of Mk + 3
    "empty_b0_bf16": ("bfloat16", ("empty", 0, 32, 32)),
    "empty_mq0_bf16": ("bfloat16", ("empty", 1, 0, 32)),
    "empty_mk0_bf16": ("bfloat16", ("empty", 1, 32, 0)),
}
_CAUSAL = "causal"


def _inputs(layout: str, device: str):
    """(q, k, v, bias kinds to try) for a layout: the tensors as a user would pass them."""
    import torch

    from fmha_ops import attn_bias as ab

    dtype_name, (kind, *args) = LAYOUTS[layout]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    if kind == "packed":
        k_dim, pad, start = args
        packed = randn(2, 200, start + 3 * k_dim + pad)
        q, k, v = (packed[..., start + i * k_dim: start + (i + 1) * k_dim] for i in range(3))
        return q, k, v, (None, ab.LowerTriangularMask())
    if kind == "heads":
        k_dim, pad = args
        q, k, v = (randn(2, 131, 4, k_dim + pad)[..., :k_dim] for _ in range(3))
        return q, k, v, (None, ab.LowerTriangularMask())
    if kind == "bias":
        q, k, v = (randn(2, 131, 4, 64) for _ in range(3))
        tensor = randn(2, 4, 131, 131 + 3)[..., :131]
        return q, k, v, (tensor, ab.LowerTriangularMask().add_bias(tensor))
    b, mq, mk = args
    q = randn(b, mq, 2, 64)
    k, v = (randn(b, mk, 2, 64) for _ in range(2))
    return q, k, v, (None, ab.LowerTriangularMask()) if mq == mk else (None,)


def worker(layout: str, skip: set[str]) -> None:
    """Run every forward op (but ``skip``) on ``layout``: prints ``RUN op bias`` before and one result line after
    each call (``OK`` with the error, ``REFUSED`` with the first reason, ``FAIL`` with what went wrong)."""
    import torch

    import fmha_ops
    from fmha_ops.dispatch import REGISTRY
    from fmha_ops.inputs import make_inputs
    from fmha_ops.ops.reference import reference_attention
    from fmha_ops.testing import error_report

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    q, k, v, biases = _inputs(layout, device)
    as4 = (lambda t: t.unsqueeze(2)) if q.dim() == 3 else (lambda t: t)
    tol = TOLERANCE[LAYOUTS[layout][0]]
    arch = make_inputs(as4(q), as4(k), as4(v)).problem().arch
    ops = [op for op in REGISTRY.ops("fw") if op.available() is None and op.supports_arch(arch)]
    for bias in biases:
        tag = "none" if bias is None else type(bias).__name__
        ref, _ = reference_attention(make_inputs(as4(q), as4(k), as4(v), bias), torch.float64)
        sync()
        for op in ops:
            key = f"{op.NAME}:{tag}"
            if key in skip:
                continue
            print(f"RUN {key}", flush=True)
            reasons = op.not_supported_reasons(make_inputs(as4(q), as4(k), as4(v), bias).problem())
            try:
                out = as4(fmha_ops.memory_efficient_attention(q, k, v, bias, op=op))
                sync()
            except ValueError as e:
                status = "REFUSED" if reasons else "FAIL"
                print(f"{status} {key} {'' if reasons else 'declared, then raised: '}{str(e).splitlines()[0][:200]}",
                      flush=True)
                continue
            except (RuntimeError, NotImplementedError, TypeError, AttributeError) as e:
                sync()  # a fault ends the process here; a plain exception is reported
                print(f"FAIL {key} {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            if reasons:
                print(f"FAIL {key} ran though it declares: {reasons[0][:200]}", flush=True)
            elif out.shape != ref.shape:
                print(f"FAIL {key} shape {tuple(out.shape)} != {tuple(ref.shape)}", flush=True)
            else:
                rel = error_report(out, ref)["rel"] if ref.numel() else 0.0
                print(f"{'OK' if rel < tol else 'FAIL'} {key} rel {rel:.2e}", flush=True)


def probe(layout: str) -> list[dict]:
    """Every op on ``layout``, a fresh process after each fault; rows of {layout, op, status, detail}."""
    rows, done = [], set()
    while True:
        proc = subprocess.run([sys.executable, "-u", __file__, "--worker", layout, "--skip", ",".join(sorted(done))],
                              capture_output=True, text=True)
        running = None
        for line in proc.stdout.splitlines():
            word, _, rest = line.partition(" ")
            key, _, detail = rest.partition(" ")
            if word == "RUN":
                running = key
            elif word in ("OK", "REFUSED", "FAIL"):
                rows.append(dict(layout=layout, op=key, status=word, detail=detail))
                done.add(key)
                running = None
        if proc.returncode == 0:
            return rows
        err = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln]
        if running is None:  # died outside an op (inputs, reference): nothing to blame, stop
            rows.append(dict(layout=layout, op="-", status="CRASH", detail=(err or ["?"])[-1][:200]))
            return rows
        rows.append(dict(layout=layout, op=running, status="FAULT", detail=(err or ["?"])[-1][:200]))
        done.add(running)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--jobs", type=int, default=6, help="layouts probed at once (one process each)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, set(filter(None, args.skip.split(","))))
        return
    names = args.layouts.split(",")
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; known: {', '.join(LAYOUTS)}")
    rows = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for layout_rows in pool.map(probe, names):
            for r in layout_rows:
                print(f"{r['layout']:20s} {r['op']:36s} {r['status']:8s} {r['detail']}", flush=True)
            rows.extend(layout_rows)
    bad = [r for r in rows if r["status"] not in ("OK", "REFUSED")]
    print(f"alignment probe: {len(rows)} calls, {sum(r['status'] == 'OK' for r in rows)} ok, "
          f"{sum(r['status'] == 'REFUSED' for r in rows)} refused, {len(bad)} bad: "
          + (", ".join(f"{r['layout']}/{r['op']} {r['status']}" for r in bad) or "none"))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "alignment_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
