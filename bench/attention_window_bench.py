"""Local (sliding-window) attention forward on the H200: a causal 4096-key window at N = 32k against full causal
attention, ours (Triton, bf16 and fp8) next to FlashAttention-4 with the same window and SDPA cuDNN (the window as
a boolean mask: cuDNN has no window of its own through torch).

TFLOP/s = 4*B*H*D*P / t over the P visible (query, key) pairs (a window's own, or N(N+1)/2 for full causal), so a
kernel that skips the keys outside the window scores like full attention; ``win/full`` is that ratio for ours
(same dtype, same run), ``ours/fa4`` ours over FA4 with the window (bf16; FA4 takes fp8 only on sm100). fp8
inputs are quantized per tensor beforehand (the call excludes quantization, includes the V transpose); the
``kernel`` columns pass fp8 V already keys-contiguous (the layout the kernel reads), so the transpose is not timed.
CUDA-event medians of whole calls. Writes ``bench/results/attention_window.md`` (+ .png) and
``<out>/attention_window.json`` / ``.png``.

    python bench/attention_window_bench.py [--quick] [--window 4096] [--out DIR] [--no-record]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (Record, bar_plot, base_parser, environment, environment_line, or_none,  # noqa: E402
                          out_dir, print_table, time_ms, write_json)
from fmha_ops.kernels.triton.attention_fwd import attention_forward  # noqa: E402
from fmha_ops.kernels.triton.transpose_v import transpose_v  # noqa: E402
from fmha_ops.ops.fa4 import fa4_unavailable_reason  # noqa: E402
from fmha_ops.quant import quantize_fp8_tensor  # noqa: E402


def visible_pairs(N: int, window: int) -> int:
    """(query, key) pairs of causal attention over N tokens where each query sees at most ``window`` keys (its own
    included); window >= N: full causal."""
    w = min(window, N)
    return w * (w + 1) // 2 + (N - w) * w


def _tflops(B, H, D, pairs, ms):
    return 4 * B * H * D * pairs / (ms * 1e-3) / 1e12 if ms else None


COMMAND = "python bench/attention_window_bench.py"
RECORD = Record(
    "attention_window", "Local (sliding-window) attention forward", COMMAND,
    {"shape": "shape (B x H x N x D, window)", "dtype": "dtype", "ours": "ours window", "ours_full": "ours full",
     "win/full": "win / full", "ours_kernel": "ours window (kernel)", "ours_full_kernel": "ours full (kernel)",
     "win/full_kernel": "win / full (kernel)", "fa4": "FA4 window", "fa4_full": "FA4 full",
     "ours/fa4": "ours / FA4 (window)", "ours/fa4_full": "ours / FA4 (full)",
     "cudnn_mask": "cuDNN bool mask", "cudnn_full": "cuDNN full"},
    "TFLOP/s over the visible (query, key) pairs (4*B*H*D*pairs / t; the window's pairs, or N(N+1)/2 for full "
    "causal), causal bottom-right, the window ending at each query's own key. Ours: the Triton forward "
    "(kernels/triton/attention_fwd.py), fp8 per-tensor descales, inputs already quantized, the V transpose "
    "included; (kernel): fp8 V passed keys-contiguous, no transpose in the timed call. FA4: flash-attn-4 with "
    "window_size=(window - 1, 0) (bf16; empty where not installed). cuDNN: torch SDPA's cuDNN backend with the window "
    "as an (N, N) boolean mask. CUDA-event medians of whole calls. bf16: ours / FA4 with the window cannot pass ours / "
    "FA4 at full attention (the bf16 Triton kernel's rate against FA4's; the window only skips tiles), so the "
    "selector runs bf16 windows on fa4F where flash-attn-4 is installed and on triton_attnF elsewhere.")


def _fa4(q, k, v, window_left):
    from flash_attn.cute import flash_attn_func

    return flash_attn_func(q, k, v, causal=True, window_size=(window_left, None))[0]


def _cudnn_masked(qt, kt, vt, mask):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)


def _time_cudnn_masked(qt, kt, vt, left):
    """ms of cuDNN SDPA with the causal window as an [N, N] boolean mask (True = visible), freed on return."""
    i = torch.arange(qt.shape[2], device=qt.device)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - left)
    return time_ms(lambda: _cudnn_masked(qt, kt, vt, mask))


def _cudnn_causal(qt, kt, vt):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)


def run(B: int, H: int, N: int, D: int, window: int) -> list[dict]:
    left = window - 1  # a window of `window` keys ending at the query's own
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    scale = D ** -0.5
    p_win, p_full = visible_pairs(N, window), visible_pairs(N, N)
    rows = []
    for name in ("bf16", "fp8"):
        if name == "fp8":
            (qx, qd), (kx, kd), (vx, vd) = (quantize_fp8_tensor(t) for t in (q, k, v))
            desc = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        else:
            qx, kx, vx, desc = q, k, v, {}
        win = or_none(lambda: time_ms(lambda: attention_forward(qx, kx, vx, scale=scale, causal=True,
                                                                window_left=left, **desc)))
        full = or_none(lambda: time_ms(lambda: attention_forward(qx, kx, vx, scale=scale, causal=True, **desc)))
        row = dict(shape=f"{B}x{H}x{N}x{D} w{window}", dtype=name, ours_ms=win, ours_full_ms=full,
                   ours=_tflops(B, H, D, p_win, win), ours_full=_tflops(B, H, D, p_full, full))
        row["win/full"] = row["ours"] / row["ours_full"] if row["ours"] and row["ours_full"] else None
        if name == "fp8":  # the kernel alone: V already in the keys-contiguous layout it reads
            vk = transpose_v(vx)[0].permute(0, 3, 1, 2)[:, :N]
            win_k = or_none(lambda: time_ms(lambda: attention_forward(qx, kx, vk, scale=scale, causal=True,
                                                                      window_left=left, **desc)))
            full_k = or_none(lambda: time_ms(lambda: attention_forward(qx, kx, vk, scale=scale, causal=True, **desc)))
            row["ours_kernel"] = _tflops(B, H, D, p_win, win_k)
            row["ours_full_kernel"] = _tflops(B, H, D, p_full, full_k)
            if row["ours_kernel"] and row["ours_full_kernel"]:
                row["win/full_kernel"] = row["ours_kernel"] / row["ours_full_kernel"]
        rows.append(row)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    rows[0]["cudnn_mask"] = _tflops(B, H, D, p_win, or_none(lambda: _time_cudnn_masked(qt, kt, vt, left)))
    rows[0]["cudnn_full"] = _tflops(B, H, D, p_full, or_none(lambda: time_ms(lambda: _cudnn_causal(qt, kt, vt))))
    missing = fa4_unavailable_reason()
    if missing:
        print(f"  [skip] FA4: {missing}")
    else:
        rows[0]["fa4"] = _tflops(B, H, D, p_win, or_none(lambda: time_ms(lambda: _fa4(q, k, v, left))))
        rows[0]["fa4_full"] = _tflops(B, H, D, p_full, or_none(lambda: time_ms(lambda: _fa4(q, k, v, None))))
        if rows[0]["fa4"] and rows[0]["ours"]:
            rows[0]["ours/fa4"] = rows[0]["ours"] / rows[0]["fa4"]
        if rows[0]["fa4_full"] and rows[0]["ours_full"]:
            rows[0]["ours/fa4_full"] = rows[0]["ours_full"] / rows[0]["fa4_full"]
    return rows


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=4096)
    a = p.parse_args()
    out = out_dir(a.out)
    B, H, N, D = (1, 16, 8192, 128) if a.quick else (1, 16, 32768, 128)
    rows = run(B, H, N, D, a.window)
    env = environment()
    print(environment_line(env))
    print_table(rows, list(RECORD.columns))
    print("json:", write_json(out, "attention_window", rows))
    plot_rows = [dict(r, label=f"{r['shape']} {r['dtype']}") for r in rows]
    png = bar_plot(out, "attention_window", plot_rows, "label", ["ours", "ours_full", "ours_kernel", "fa4", "fa4_full",
                                                                  "cudnn_mask", "cudnn_full"],
                   "TFLOP/s (visible pairs)", "Causal 4096-key window vs full attention, H200")
    if not a.no_record and not a.quick:
        print("record:", RECORD.write(rows, env, png))


if __name__ == "__main__":
    main()
