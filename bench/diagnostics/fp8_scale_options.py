"""fp8 forward accuracy and speed by q/k scale option: per (batch, kv head), per block of 128 tokens, Hadamard
rotation, per tensor; cuDNN fp8 (per tensor) beside where cudnn-frontend is installed. Needs a CUDA GPU.

    python bench/diagnostics/fp8_scale_options.py [--out DIR]

Accuracy: transformer-like inputs (``fmha_ops.testing.transformer_like``), B1 N16384 H16 D128, against float32
attention of the bf16 inputs: cos / MAE / max / relative L2 error. Speed: TFLOP/s (CUDA-event medians) of the
Triton kernel with per-head and per-block descales, the warp-specialized Gluon kernel (per head only) and cuDNN
fp8, on 4x4096x32 (causal and not), 8x1000x16 and 1x16384x16, D128. Rows print as measured; JSON goes to
``--out`` (default $OUT) as fp8_scale_options.json.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fmha_ops  # noqa: E402
from bench.common import attention_tflops, base_parser, or_none, out_dir, time_ms, write_json  # noqa: E402
from fmha_ops.quant import quantize_fp8_tensor, quantize_i8fp8, quantize_qkv_fp8, random_hadamard  # noqa: E402
from fmha_ops.testing import error_report, transformer_like  # noqa: E402

D = 128
ACCURACY_SHAPE = (1, 16384, 16)  # B, N, H
SPEED_SHAPES = [(4, 4096, 32, False), (4, 4096, 32, True), (8, 1000, 16, False), (1, 16384, 16, False)]
REF_CHUNK = 2048
#: timed options (a Hadamard rotation and a per-tensor descale run the per-head kernel: the same speed)
TIMED = ("triton fp8 per head", "triton fp8 block q/k", "gluon_ws fp8 per head", "cudnn fp8 per tensor")


def reference(q, k, v):
    """float32 softmax(q k^T / sqrt(D)) v of BMHK bf16 inputs, chunked over queries."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    kf, vf = k.float().permute(0, 2, 3, 1), v.float().permute(0, 2, 1, 3)
    for s0 in range(0, q.shape[1], REF_CHUNK):
        s = (q[:, s0:s0 + REF_CHUNK].float().permute(0, 2, 1, 3) @ kf) * D ** -0.5
        out[:, s0:s0 + REF_CHUNK] = (torch.softmax(s, -1) @ vf).permute(0, 2, 1, 3)
    return out


def options(q, k, v):
    """name -> (q8, k8, v8, descales dict, op) for each fp8 scale option."""
    head = quantize_qkv_fp8(q, k, v)
    block = quantize_qkv_fp8(q, k, v, qk_granularity="block")
    rot = quantize_qkv_fp8(q, k, v, rotation=random_hadamard(D, device=q.device))
    (qt, qtd), (kt, ktd), (vt, vtd) = (quantize_fp8_tensor(t) for t in (q, k, v))

    def opt(x, op):
        return x[:3], dict(q_descale=x[3], k_descale=x[4], v_descale=x[5]), op

    return {
        "triton fp8 per head": opt(head, "triton_fp8F"),
        "triton fp8 block q/k": opt(block, "triton_fp8F"),
        "triton fp8 Hadamard q/k": opt(rot, "triton_fp8F"),
        "triton fp8 per tensor": opt((qt, kt, vt, qtd, ktd, vtd), "triton_fp8F"),
        "gluon fp8 per head": opt(head, "gluon_fp8F"),
        "gluon_ws fp8 per head": opt(head, "gluon_ws_fp8F"),
        "cudnn fp8 per tensor": opt((qt, kt, vt, qtd, ktd, vtd), "cudnn_fp8F"),
    }


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    out = out_dir(args.out)
    rows = []
    b, n, h = ACCURACY_SHAPE
    q, k, v = transformer_like((b, n, h, D), (b, n, h, D), device="cuda", seed=7)
    ref = reference(q, k, v)
    xi = quantize_i8fp8(q, k, v)
    accuracy = {name: (lambda t=t, kw=kw, op=op: fmha_ops.memory_efficient_attention(*t, op=op, **kw))
                for name, (t, kw, op) in options(q, k, v).items()}
    accuracy["triton i8fp8 block q/k"] = lambda: fmha_ops.memory_efficient_attention(
        xi.q, xi.k, xi.v, scale=xi.softmax_scale, q_descale=xi.q_descale, k_descale=xi.k_descale,
        v_descale=xi.v_descale)
    for name, fn in accuracy.items():
        o = or_none(fn)
        if o is not None:
            rows.append(dict(table="accuracy", shape=f"{b}x{n}x{h} D{D} transformer_like", option=name,
                             **error_report(o, ref)))
            print(rows[-1], flush=True)
    del ref
    for b, n, h, causal in SPEED_SHAPES:
        q, k, v = transformer_like((b, n, h, D), (b, n, h, D), device="cuda", seed=1)
        bias = fmha_ops.LowerTriangularMask() if causal else None
        for name, (t, kw, op) in options(q, k, v).items():
            if name not in TIMED:
                continue
            ms = or_none(lambda: time_ms(lambda: fmha_ops.memory_efficient_attention(*t, bias, op=op, **kw),
                                         warmup=10, rep=40))
            if ms is not None:
                rows.append(dict(table="speed", shape=f"{b}x{n}x{h} D{D}{' causal' if causal else ''}",
                                 option=name, ms=ms, tflops=attention_tflops(b, h, n, D, causal, ms)))
                print(rows[-1], flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    print("json:", write_json(out, "fp8_scale_options", rows))


if __name__ == "__main__":
    main()
