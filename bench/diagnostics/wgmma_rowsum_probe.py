"""Row sums of an fp8 P on the tensor cores, alone: one warpgroup computes P (64 x KEYS, fp8 e4m3, A operand from
registers as the ws kernel holds it) times a tile of ones (K-major B operand in shared memory, N columns) and
writes the 64 x N accumulator, which must hold each row's sum in every column.

The ws kernel's row-sum wgmma (P times an 8-column tile of ones, beside P V) came out 12-17x too large on the
H100 from the first key tile on (bench/diagnostics/fa3_profile.md), with PTX and SASS that look right. This probe
takes the kernel away: B comes from global memory (ones, or one-hot columns that each pick one key of P), so a
wrong row of B as read or a wrong key of P as held shows by the column it spoils.

Usage (GPU: runs and checks; without one, ``--compile-only`` compiles for sm90 and prints the wgmma lines):

    python bench/diagnostics/wgmma_rowsum_probe.py [--compile-only]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fmha_ops.kernels.gluon.attention_common import acc_layout, fp8_tile_layout, p_operand_layout  # noqa: E402

#: rows of one warpgroup's wgmma and its warps
ROWS = 64
WARPS = gl.constexpr(4)
#: widths of the ones tile tried: the narrowest fp8 wgmma (8) and wider ones
WIDTHS = (8, 16, 32, 64)
KEYS = 128


@gluon.jit
def _row_sums(p_ptr, b_ptr, out_ptr, N: gl.constexpr, KEYS: gl.constexpr):
    """out[64, N] = P[64, KEYS] (fp8, row-major at p_ptr) @ B[KEYS, N] (fp8, stored N x KEYS row-major at b_ptr:
    K-major, as the kernel's tile of ones)."""
    load_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, load_layout))
    cols = gl.arange(0, KEYS, layout=gl.SliceLayout(0, load_layout))
    p = gl.load(p_ptr + gl.expand_dims(rows, 1) * KEYS + gl.expand_dims(cols, 0))
    p = gl.convert_layout(p, p_operand_layout(WARPS, N))
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [N, KEYS], fp8_tile_layout(N, KEYS))
    fill: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    b_rows = gl.arange(0, N, layout=gl.SliceLayout(1, fill))
    b_cols = gl.arange(0, KEYS, layout=gl.SliceLayout(0, fill))
    b_smem.store(gl.load(b_ptr + gl.expand_dims(b_rows, 1) * KEYS + gl.expand_dims(b_cols, 0)))
    fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(p, b_smem.permute((1, 0)), gl.zeros([64, N], gl.float32, acc_layout(WARPS, N)))
    out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // N if N < 32 else 1, N if N < 32 else 32],
                                                [WARPS, 1], [1, 0])
    acc = gl.convert_layout(acc, out_layout)
    orow = gl.arange(0, 64, layout=gl.SliceLayout(1, out_layout))
    ocol = gl.arange(0, N, layout=gl.SliceLayout(0, out_layout))
    gl.store(out_ptr + gl.expand_dims(orow, 1) * N + gl.expand_dims(ocol, 0), acc)


def compile_only():
    """sm90 compile of each width without a GPU: the wgmma lines of the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for n in WIDTHS:
        src = GluonASTSource(_row_sums, {"p_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*fp32", "N": "constexpr",
                                         "KEYS": "constexpr"}, {"N": n, "KEYS": KEYS})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS.value})
        lines = sorted({line.split()[0] for line in k.asm["ptx"].splitlines() if "wgmma.mma_async" in line})
        print(f"N={n}: {lines}")


def _check(p8, b8, label):
    """One launch: max relative error of out against the float64 P @ B of the same fp8 values; on a mismatch, the
    first wrong column."""
    n = b8.shape[0]
    out = torch.empty(ROWS, n, device="cuda")
    _row_sums[(1,)](p8, b8, out, N=n, KEYS=KEYS, num_warps=WARPS.value)
    ref = p8.double() @ b8.double().t()
    err = (out.double() - ref).abs() / ref.abs().clamp_min(1.0)
    rel = err.max().item()
    where = "" if rel < 1e-2 else f" first wrong column {int(err.max(0).values.gt(1e-2).nonzero()[0])}"
    print(f"N={n:3d} {label}: max rel error {rel:.3e}  {'ok' if rel < 1e-2 else 'WRONG'}{where}", flush=True)


def run():
    """Each width on fresh transformer-like P (scaled by 2**8 as the kernels hold it): B = ones (row sums, the
    kernel's use) over the first 1 .. KEYS keys, then B = one-hot columns picking single keys (column c picks key
    PICKS[c]: out[:, c] must be P[:, PICKS[c]], which shows which of P's keys or B's rows the wgmma reads wrong)."""
    torch.manual_seed(0)
    for n in WIDTHS:
        for keys_used in (1, 16, 17, 64, KEYS):
            p = torch.zeros(ROWS, KEYS, device="cuda")
            p[:, :keys_used] = torch.rand(ROWS, keys_used, device="cuda") * 256
            _check(p.to(torch.float8_e4m3fn), torch.ones(n, KEYS, device="cuda").to(torch.float8_e4m3fn),
                   f"ones, keys={keys_used:4d}")
        p8 = (torch.rand(ROWS, KEYS, device="cuda") * 256).to(torch.float8_e4m3fn)
        for base in range(0, KEYS, n):
            b = torch.zeros(n, KEYS, device="cuda")
            b[torch.arange(n), torch.arange(base, base + n) % KEYS] = 1.0
            _check(p8, b.to(torch.float8_e4m3fn), f"one-hot keys {base}..{base + n - 1}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only or not torch.cuda.is_available():
        compile_only()
    else:
        run()
