"""Where the host time of a call goes on the GPU machine: Triton kernel launches (Triton's own path, ``CachedKernel``,
a plan's ``BoundLaunch``, the compiled kernel's runner alone), the layers of the fp8 training path, and autograd's share of a backward.
Whole public calls against SDPA are the record of ``bench/host_time.py``.

Host wall time of back-to-back calls (``time.perf_counter`` over ``--iters`` calls after a warm-up, then one sync;
per-call microseconds); the GPU work of every case is far shorter than its host time.
Prints tables, writes launch_overhead.json and .png.

    PYTHONPATH=$PWD python bench/diagnostics/launch_overhead.py [--out DIR]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fmha_ops  # noqa: E402
from bench import common  # noqa: E402
from fmha_ops.kernels.triton import attention_fwd as af  # noqa: E402
from fmha_ops.kernels.triton import transpose_v as tv  # noqa: E402
from fmha_ops.kernels.triton.launch import launch  # noqa: E402


def captured_launch(fn, call):
    """(CachedKernel, grid, args, kwargs) of ``fn``'s launch inside ``call()``."""
    ck = launch(fn)
    seen = {}
    real = ck._launch

    def spy(grid, args, kwargs):
        seen.update(grid=grid, args=args, kwargs=kwargs)
        return real(grid, args, kwargs)

    ck._launch = spy
    try:
        call()
    finally:
        del ck._launch
    return ck, seen["grid"], seen["args"], seen["kwargs"]


def launch_rows(iters: int) -> list[dict]:
    """Each Triton launch of the fp8 training path at a tiny size (1x64x1x64 bf16 q/k/v): Triton's launch,
    CachedKernel's, a plan's bound launch of it (``CachedKernel.bind``), and the compiled kernel's runner alone."""
    from fmha_ops.kernels.triton import attention_bwd as ab, quantize as qz

    qkv = [torch.randn(1, 64, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    fp8 = torch.float8_e4m3fn
    quantize = lambda: qz.quantize_qkv(*qkv, fp8, fp8, scale=0.125, q_block=128, k_block=128)  # noqa: E731
    (q8, k8, v8), (qd, kd, vd), _ = quantize()
    forward = lambda: af.attention_forward(q8, k8, v8, scale=1.0, causal=True, q_descale=qd,  # noqa: E731
                                           k_descale=kd, v_descale=vd, return_lse=True)
    out, lse = forward()
    backward = lambda: ab.attention_backward(torch.ones_like(qkv[0]), *qkv, out, lse, scale=0.125,  # noqa: E731
                                             causal=True)
    vt_input = torch.randn(1, 64, 1, 64, device="cuda").to(fp8)
    cases = {
        "kv stats": (qz._kv_stats_kernel, quantize),
        "fused quantize": (qz._quantize_qkv_kernel, quantize),
        "attention fwd (4 host TMA descriptors)": (af._attn_fwd_kernel, forward),
        "V transpose": (tv._transpose_v_kernel, lambda: tv.transpose_v(vt_input)),
        "bwd preprocess": (ab._bwd_preprocess, backward),
        "bwd dK/dV": (ab._bwd_dkdv, backward),
        "bwd dQ": (ab._bwd_dq, backward),
    }
    rows = []
    for name, (fn, call) in cases.items():
        ck, grid, args, kwargs = captured_launch(fn, call)
        kernel, rest, _ = next(v for v in ck._cache.values())
        bound = ck.bind(grid, **kwargs)
        full = list(args) + [kwargs[n] if n in kwargs else d for n, d in rest]
        grid3 = (*grid, 1, 1)[:3]
        rows.append({"case": f"launch: {name}", "args": len(args) + len(kwargs),
                     "tensors": sum(isinstance(a, torch.Tensor) for a in args),
                     "triton_us": common.host_us(lambda: fn[grid](*args, **kwargs), iters),
                     "cached_us": common.host_us(lambda: ck[grid](*args, **kwargs), iters),
                     "bound_us": common.host_us(lambda: bound(*args), iters),
                     "runner_us": common.host_us(lambda: kernel[grid3](*full), iters)})
    return rows


def layer_rows(iters: int) -> list[dict]:
    """Host time of each layer of the fp8 training path at a tiny size, outermost last."""
    from fmha_ops import attn_bias
    from fmha_ops.call import run_forward
    from fmha_ops.inputs import make_inputs
    from fmha_ops.kernels.triton import attention_bwd as ab, quantize as qz

    qkv = [torch.randn(1, 64, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    grads = [t.clone().requires_grad_() for t in qkv]
    fp8 = torch.float8_e4m3fn
    (q8, k8, v8), (qd, kd, vd), _ = qz.quantize_qkv(*qkv, fp8, fp8, scale=0.125, q_block=128, k_block=128)
    causal = attn_bias.LowerTriangularFromBottomRightMask()
    inputs = lambda: make_inputs(q8, k8, v8, causal, scale=1.0, output_dtype=torch.bfloat16,  # noqa: E731
                                 is_partial=True, q_descale=qd, k_descale=kd, v_descale=vd)
    inp = inputs()
    out, lse = af.attention_forward(q8, k8, v8, scale=1.0, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                                    return_lse=True)
    ones = torch.ones_like(qkv[0])

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, c):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g, None, None

    cases = {
        "torch.empty (CUDA)": lambda: torch.empty((1, 64, 1, 64), dtype=fp8, device="cuda"),
        "TensorDescriptor": lambda: af._desc4(q8, (1, 1, 64, 64), (q8.stride(0), q8.stride(2), q8.stride(1)),
                                              (64, 64)),
        "kv_stats": lambda: qz.kv_stats(*qkv[1:]),
        "quantize_qkv": lambda: qz.quantize_qkv(*qkv, fp8, fp8, scale=0.125, q_block=128, k_block=128),
        "attention_forward": lambda: af.attention_forward(q8, k8, v8, scale=1.0, causal=True, q_descale=qd,
                                                          k_descale=kd, v_descale=vd, return_lse=True),
        "make_inputs": inputs,
        "Inputs.signature": inp.signature,
        "run_forward (dispatch + attention_forward)": lambda: run_forward(inp, None, True),
        "attention_backward": lambda: ab.attention_backward(ones, *qkv, out, lse, scale=0.125, causal=True),
        "autograd.Function identity fwd+bwd": lambda: torch.autograd.grad(Identity.apply(*grads), grads[0], ones),
        "fp8_attention fwd, no grad": lambda: fmha_ops.fp8_attention(*qkv, causal=True),
        "fp8_attention fwd+bwd": lambda: torch.autograd.grad(fmha_ops.fp8_attention(*grads, causal=True), grads,
                                                             ones),
    }
    return [{"case": f"layer: {name}", "host_us": common.host_us(fn, iters)} for name, fn in cases.items()]


def autograd_rows(iters: int) -> list[dict]:
    """Where ``autograd.grad`` spends host time on the fp8 path's node: each case times the backward called
    directly on this thread (``node.apply``) and through ``autograd.grad`` on a graph built once (retained), for
    ``fp8_attention`` itself and for replicas of its Function that drop one ingredient at a time."""
    from fmha_ops import quantized as qz
    from fmha_ops.attn_bias import LowerTriangularFromBottomRightMask
    from fmha_ops.call import make_problem, run_forward
    from fmha_ops.dispatch import SELECTOR
    from fmha_ops.inputs import make_inputs
    from fmha_ops.kernels.triton.attention_bwd import attention_backward

    qkv = [torch.randn(1, 64, 1, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    ones = torch.ones_like(qkv[0])

    def replica(save_output: bool, dispatch: bool, extra_inputs: bool = False):
        class Replica(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                q, k, v = args[-3:]
                qkv8, descales, dequantized = qz.quantize_smooth(q, k, v, 0.125, torch.float8_e4m3fn)
                inp = make_inputs(*qkv8, LowerTriangularFromBottomRightMask(), scale=1.0, output_dtype=q.dtype, is_partial=True,
                                     **descales)
                out, lse = run_forward(inp, None, True)
                ctx.save_for_backward(*dequantized, out if save_output else out.detach().clone(), lse)
                ctx.bias = LowerTriangularFromBottomRightMask()
                return out

            @staticmethod
            def backward(ctx, grad_out):
                qh, kh, vh, out, lse = ctx.saved_tensors
                if not dispatch:
                    grads = attention_backward(grad_out, qh, kh, vh, out, lse, scale=0.125, causal=True)
                else:
                    inp = make_inputs(qh, kh, vh, ctx.bias, scale=0.125, is_partial=True)
                    bw = SELECTOR.select(("quantized backward", inp.signature(True)),
                                         lambda: make_problem(inp, True), "bw")
                    grads = bw.apply_bw(inp, out, lse, grad_out.contiguous())
                return (None, None, None, None, *grads) if extra_inputs else grads

        if extra_inputs:  # fp8_attention's own signature: four non-tensor inputs before q, k, v
            return lambda: Replica.apply(torch.float8_e4m3fn, LowerTriangularFromBottomRightMask(), None, None, *qkv)
        return lambda: Replica.apply(*qkv)

    cases = {
        "fp8_attention": lambda: qz.fp8_attention(*qkv, causal=True),
        "replica": replica(True, True),
        "replica, output saved as a copy": replica(False, True),
        "replica, backward without dispatch": replica(True, False),
        "replica, fp8_attention's signature": replica(True, True, True),
        "fp8_attention, timed again last": lambda: qz.fp8_attention(*qkv, causal=True),
    }
    rows = []
    for name, make in cases.items():
        y = make()
        rows.append({"case": f"autograd: {name}", "node_apply_us": common.host_us(lambda: y.grad_fn.apply(ones), iters),
                     "autograd_grad_us": common.host_us(lambda: torch.autograd.grad(y, qkv, ones, retain_graph=True),
                                                 iters)})
        rows[-1]["engine_us"] = rows[-1]["autograd_grad_us"] - rows[-1]["node_apply_us"]
    return rows


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    launches = launch_rows(args.iters)
    common.print_table(launches, ["case", "args", "tensors", "triton_us", "cached_us", "bound_us",
                                    "runner_us"])
    layers = layer_rows(max(args.iters // 2, 50))
    common.print_table(layers, ["case", "host_us"])
    engine = autograd_rows(max(args.iters // 2, 50))
    common.print_table(engine, ["case", "node_apply_us", "autograd_grad_us", "engine_us"])
    out = common.out_dir(args.out)
    common.write_json(out, "launch_overhead", launches + layers + engine)
    common.bar_plot(out, "launch_overhead", launches, "case", ["triton_us", "cached_us", "bound_us", "runner_us"], "host us",
                    "Triton launch host time (H200 host)")


if __name__ == "__main__":
    main()
