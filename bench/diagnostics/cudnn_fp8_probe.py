"""cuDNN fp8 attention beyond the ``cudnn_fp8F`` op: what its fp8 output saves over bf16 out, and whether its fp8
backward (``sdpa_fp8_backward``) beats the bf16 backward ops on the dequantized values.

    python bench/diagnostics/cudnn_fp8_probe.py [--out DIR] [--quick]

Per shape (the backends benchmark's):
* forward, per-tensor descales: ``fp8_out`` (the cached graph alone, o in fp8 with v's descale),
  ``bf16_out`` (``cudnn_fp8F``: the same plus the fused dequantization), ``triton_fp8F`` (bf16 out), TFLOP/s;
* backward: ``cudnn_fp8_bwd`` (q/k/v/o/dO in fp8 with per-tensor scales, gradients in the dtype cuDNN accepts:
  bf16 tried first, fp8 after; its scales for dP/dQ/dK/dV from a first run's amax), with and without the
  quantization of o and dO it needs, against ``fa4B`` and ``triton_attnB`` on the dequantized bf16 values
  (TFLOP/s, 2.5x the forward count), and its gradients' cosine to the float32 reference's.
Needs nvidia-cudnn-frontend (and flash-attn-4 for the fa4B column); prints one line per shape and a summary.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import attention_tflops, base_parser, or_none, out_dir, time_ms, write_json  # noqa: E402
import fmha_ops  # noqa: E402
from fmha_ops import attn_bias as ab  # noqa: E402
from fmha_ops.inputs import make_inputs  # noqa: E402
from fmha_ops.ops.cudnn_fp8 import FP8_MAX, GRAPHS  # noqa: E402
from fmha_ops.ops.cudnn_graphs import bhsd  # noqa: E402
from fmha_ops.quant import quantize_fp8_tensor  # noqa: E402
from fmha_ops.testing import error_report, transformer_like  # noqa: E402

SHAPES = [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True), (2, 16, 16, 16384, 128, False),
          (4, 16, 16, 4096, 64, False), (4, 16, 16, 4096, 256, False), (8, 16, 16, 1000, 128, False)]
BWD = 2.5
_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP", "scale_s",
            "scale_dQ", "scale_dK", "scale_dV", "scale_dP")


class Fp8Backward:
    """One ``sdpa_fp8_backward`` graph for (q, k, v) BMHK fp8 tensors; gradients in ``grad_dtype``."""

    def __init__(self, q8, k8, v8, causal: bool, scale: float, grad_dtype: torch.dtype) -> None:
        import cudnn

        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        out_type = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float8_e4m3fn: e4m3}[grad_dtype]
        self.handle = cudnn.create_handle()
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)
        b, mq, hq, d = q8.shape
        self.t = {n: g.tensor(name=n, dim=dim, stride=st, data_type=e4m3)
                  for n, (dim, st) in (("q", bhsd(q8)), ("k", bhsd(k8)), ("v", bhsd(v8)), ("o", bhsd(q8)),
                                       ("dO", bhsd(q8)))}
        self.t["stats"] = g.tensor(name="stats", dim=[b, hq, mq, 1], stride=[hq * mq, mq, 1, 1], data_type=f32)
        for n in _SCALARS:
            self.t[n] = g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
        outs = g.sdpa_fp8_backward(**{n: self.t[n] for n in ("q", "k", "v", "o", "dO", "stats", *_SCALARS)},
                                   attn_scale=scale, use_causal_mask=causal)
        self.dq, self.dk, self.dv, *self.amax = outs
        for t, like in ((self.dq, q8), (self.dk, k8), (self.dv, v8)):
            dim, st = bhsd(like)
            t.set_output(True).set_dim(dim).set_stride(st).set_data_type(out_type)
        for a in self.amax:
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph, self.grad_dtype, self.cudnn = g, grad_dtype, cudnn
        self.workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=q8.device)
        self.amax_out = [torch.zeros(1, 1, 1, 1, device=q8.device) for _ in self.amax]

    def run(self, tensors: dict, scalars: dict):
        dq, dk, dv = (torch.empty(tensors[n].shape, dtype=self.grad_dtype, device=tensors[n].device) for n in "qkv")
        pack = {self.t[n]: x for n, x in tensors.items()} | {self.t[n]: x for n, x in scalars.items()}
        pack |= {self.dq: dq, self.dk: dk, self.dv: dv} | dict(zip(self.amax, self.amax_out))
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.graph.execute(pack, self.workspace, handle=self.handle)
        return dq, dk, dv


def _scalar(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32, device="cuda").reshape(1, 1, 1, 1)


def forward_row(q8, k8, v8, kw, causal) -> dict:
    b, n, hq, d = q8.shape
    bias = ab.LowerTriangularFromBottomRightMask() if causal else None
    inp = make_inputs(q8, k8, v8, bias, **kw)
    graph, cudnn = GRAPHS.get(inp, False)
    tf = lambda ms: attention_tflops(b, hq, n, d, causal, ms)  # noqa: E731
    row = {"fp8_out": tf(or_none(lambda: time_ms(lambda: graph.run(inp, cudnn), warmup=3, rep=20))),
           "bf16_out": tf(or_none(lambda: time_ms(lambda: fmha_ops.memory_efficient_attention(
               q8, k8, v8, bias, op="cudnn_fp8F", **kw), warmup=3, rep=20))),
           "triton_fp8F": tf(or_none(lambda: time_ms(lambda: fmha_ops.memory_efficient_attention(
               q8, k8, v8, bias, op="triton_fp8F", **kw), warmup=3, rep=20)))}
    row["fp8_out/bf16_out"] = row["fp8_out"] / row["bf16_out"] if row["fp8_out"] and row["bf16_out"] else None
    return row


def backward_row(q, k, v, causal) -> dict:
    """cuDNN fp8 backward against fa4B / triton_attnB at the dequantized values, and its gradients' accuracy."""
    b, n, hq, d = q.shape
    bias = ab.LowerTriangularFromBottomRightMask() if causal else None
    scale = d ** -0.5
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8_tensor(t) for t in (q, k, v))
    qh, kh, vh = ((x.float() * s).to(torch.bfloat16) for x, s in ((q8, qd), (k8, kd), (v8, vd)))
    qh, kh, vh = (t.requires_grad_() for t in (qh, kh, vh))
    inp = make_inputs(qh, kh, vh, bias, is_partial=True)
    out, lse = fmha_ops.get_op("triton_attnF").apply(inp, True)
    grad = torch.randn_like(out)
    row = {}
    flops = lambda ms: (attention_tflops(b, hq, n, d, causal, ms) or 0) * BWD or None  # noqa: E731
    for name in ("fa4B", "triton_attnB"):
        op = fmha_ops.get_op(name)
        if op.available() is None:
            row[name] = flops(or_none(lambda: time_ms(lambda: op.apply_bw(inp, out, lse, grad), warmup=3, rep=20)))
    (o8, od), (g8, gd) = quantize_fp8_tensor(out), quantize_fp8_tensor(grad)
    tensors = {"q": q8, "k": k8, "v": v8, "o": o8, "dO": g8, "stats": lse[..., None]}
    one = _scalar(1.0)
    scalars = {"descale_q": _scalar(qd), "descale_k": _scalar(kd), "descale_v": _scalar(vd), "descale_o": _scalar(od),
               "descale_dO": _scalar(gd), "descale_s": _scalar(1 / FP8_MAX), "scale_s": _scalar(FP8_MAX),
               "descale_dP": one, "scale_dP": one, "scale_dQ": one, "scale_dK": one, "scale_dV": one}
    for grad_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        try:
            bw = Fp8Backward(q8, k8, v8, causal, scale, grad_dtype)
        except Exception as e:  # noqa: BLE001 - a graph cuDNN does not support is a finding
            row[f"cudnn_fp8_bwd[{str(grad_dtype)[6:]}]"] = f"unsupported: {str(e).splitlines()[0][:100]}"
            continue
        bw.run(tensors, scalars)
        amax_dq, amax_dk, amax_dv, amax_dp = (float(a) for a in bw.amax_out)
        tuned = dict(scalars, scale_dP=_scalar(FP8_MAX / max(amax_dp, 1e-30)),
                     descale_dP=_scalar(max(amax_dp, 1e-30) / FP8_MAX))
        if grad_dtype != torch.bfloat16:
            tuned |= {f"scale_d{r}": _scalar(FP8_MAX / max(a, 1e-30)) for r, a in zip("QKV", (amax_dq, amax_dk, amax_dv))}
        key = f"cudnn_fp8_bwd[{str(grad_dtype)[6:]}]"
        row[key] = flops(or_none(lambda: time_ms(lambda: bw.run(tensors, tuned), warmup=3, rep=20)))
        row[key + "+quant"] = flops(or_none(lambda: time_ms(lambda: (quantize_fp8_tensor(out), quantize_fp8_tensor(grad),
                                                                    bw.run(tensors, tuned)), warmup=3, rep=20)))
        dq, dk, dv = bw.run(tensors, tuned)
        if grad_dtype != torch.bfloat16:
            dq, dk, dv = (t.float() / s for t, s in zip((dq, dk, dv), (tuned["scale_dQ"], tuned["scale_dK"],
                                                                        tuned["scale_dV"])))
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (qh, kh, vh))
        r = fmha_ops.memory_efficient_attention(qf, kf, vf, bias, op="torch_referenceF")
        ref = torch.autograd.grad(r, (qf, kf, vf), grad.float())
        row[key + " cos"] = [round(error_report(x, y)["cos"], 5) for x, y in zip((dq, dk, dv), ref)]
        break
    return row


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    rows = []
    for B, H, Hkv, N, D, causal in SHAPES[:2] if args.quick else SHAPES:
        q, k, v = transformer_like((B, N, H, D), (B, N, Hkv, D), device="cuda", seed=D)
        (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8_tensor(t) for t in (q, k, v))
        row = {"shape": f"{B}x{H}/{Hkv}x{N}x{D}{' causal' if causal else ''}"}
        row.update(or_none(lambda: forward_row(q8, k8, v8, dict(q_descale=qd, k_descale=kd, v_descale=vd), causal))
                   or {})
        if N <= 4096:  # the reference backward of the 16k shape does not fit the time this probe takes
            row.update(or_none(lambda: backward_row(q, k, v, causal)) or {})
        print("PROBE", {k: (round(x, 3) if isinstance(x, float) else x) for k, x in row.items()}, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    write_json(out_dir(args.out), "cudnn_fp8_probe", rows)


if __name__ == "__main__":
    main()
