"""Row sums of an fp8 P on the tensor cores, alone: one warpgroup computes P (64 x KEYS, fp8 e4m3, A operand from
registers as the ws kernel holds it) times a tile of ones (K-major B operand in shared memory, N columns) and
writes the 64 x N accumulator, which must hold each row's sum in every column.

An earlier row-sum wgmma in the ws kernel came out 12-17x too large on the H100. Where B comes from (``--b``):

* ``global``: B loaded from global memory (ones, or one-hot columns that each pick one key of P, so a wrong row of
  B as read or a wrong key of P as held shows by the column it spoils), N = 8 .. 64, 128 keys;
* ``kernel``: the ws kernel's own tile of ones (``attention_fwd_ws.ones_tile``: e4m3 1.0 stored as bytes), N = 8,
  128 and 64 keys (both parts of a 192-key tile);
* ``splat``: the earlier attempt's tile, a float splat of 1.0 converted to fp8 in the kernel. Its SASS stores
  ``F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R18, R18, R18, R1``: half of each word from R1, not a second pair of
  ones, so this mode is expected WRONG.

Usage (GPU: runs and checks; without one, ``--compile-only`` compiles for sm90 and prints the wgmma lines and
the constant each B source stores):

    python bench/diagnostics/wgmma_rowsum_probe.py [--b global,kernel,splat] [--compile-only]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fmha_ops.kernels.gluon.attention_common import acc_layout, fp8_tile_layout, p_operand_layout  # noqa: E402
from fmha_ops.kernels.gluon.attention_fwd_ws import SUM_N, ones_tile  # noqa: E402

#: rows of one warpgroup's wgmma and its warps
ROWS = 64
WARPS = gl.constexpr(4)
#: widths of the B tile tried from global memory: the narrowest fp8 wgmma (8) and wider ones
WIDTHS = (8, 16, 32, 64)
KEYS = 128
#: B sources (module docstring), as the kernel's ``B_SOURCE`` constexpr
SOURCES = {"global": 0, "kernel": 1, "splat": 2}
#: (N, keys) compiled for each source; ``kernel`` and ``splat`` use the ws kernel's width and its tiles' keys
SHAPES = {"global": [(n, KEYS) for n in WIDTHS], "kernel": [(SUM_N.value, 128), (SUM_N.value, 64)],
          "splat": [(SUM_N.value, 128), (SUM_N.value, 64)]}


@gluon.jit
def _row_sums(p_ptr, b_ptr, out_ptr, N: gl.constexpr, KEYS: gl.constexpr, B_SOURCE: gl.constexpr):
    """out[64, N] = P[64, KEYS] (fp8, row-major at p_ptr) @ B[KEYS, N]: B stored N x KEYS (K-major, as the ws
    kernel's tile of ones) from b_ptr (``B_SOURCE`` 0), ``ones_tile`` (1) or a converted float splat (2)."""
    load_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, load_layout))
    cols = gl.arange(0, KEYS, layout=gl.SliceLayout(0, load_layout))
    p = gl.load(p_ptr + gl.expand_dims(rows, 1) * KEYS + gl.expand_dims(cols, 0))
    p = gl.convert_layout(p, p_operand_layout(WARPS, N))
    fill: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    if B_SOURCE == 1:
        b_smem = ones_tile(KEYS)
    else:
        b_smem = gl.allocate_shared_memory(gl.float8e4nv, [N, KEYS], fp8_tile_layout(N, KEYS))
        if B_SOURCE == 0:
            b_rows = gl.arange(0, N, layout=gl.SliceLayout(1, fill))
            b_cols = gl.arange(0, KEYS, layout=gl.SliceLayout(0, fill))
            b_smem.store(gl.load(b_ptr + gl.expand_dims(b_rows, 1) * KEYS + gl.expand_dims(b_cols, 0)))
        else:
            b_smem.store(gl.full([N, KEYS], 1.0, gl.float32, fill).to(gl.float8e4nv))
        fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(p, b_smem.permute((1, 0)), gl.zeros([64, N], gl.float32, acc_layout(WARPS, N)))
    out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // N if N < 32 else 1, N if N < 32 else 32],
                                                [WARPS, 1], [1, 0])
    acc = gl.convert_layout(acc, out_layout)
    orow = gl.arange(0, 64, layout=gl.SliceLayout(1, out_layout))
    ocol = gl.arange(0, N, layout=gl.SliceLayout(0, out_layout))
    gl.store(out_ptr + gl.expand_dims(orow, 1) * N + gl.expand_dims(ocol, 0), acc)


def compile_only(sources):
    """sm90 compile of each source and shape without a GPU: the wgmma lines of the PTX and the immediates its SASS
    moves into registers before the first shared store of B (the ones: 0x38383838; the splat: an F2FP)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for src_name in sources:
        for n, keys in SHAPES[src_name]:
            src = GluonASTSource(_row_sums, {"p_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*fp32",
                                             "N": "constexpr", "KEYS": "constexpr", "B_SOURCE": "constexpr"},
                                 {"N": n, "KEYS": keys, "B_SOURCE": SOURCES[src_name]})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS.value})
            lines = sorted({line.split()[0] for line in k.asm["ptx"].splitlines() if "wgmma.mma_async" in line})
            path = os.path.join(tempfile.mkdtemp(), "k.cubin")
            with open(path, "wb") as f:
                f.write(k.asm["cubin"])
            sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
            fills = sorted(set(re.findall(r"IMAD\.MOV\.U32 R\d+, RZ, RZ, (0x[0-9a-f]+)", sass)
                               + re.findall(r"(F2FP\.\S+ [^;]*)", sass)))
            print(f"{src_name} N={n} keys={keys}: {lines} B fill {fills}")


def _check(p8, b8, source, label):
    """One launch: max relative error of out against the float64 P @ B of the same fp8 values (B: what the source
    must hold); on a mismatch, the first wrong column."""
    n, keys = b8.shape
    out = torch.empty(ROWS, n, device="cuda")
    _row_sums[(1,)](p8, b8, out, N=n, KEYS=keys, B_SOURCE=SOURCES[source], num_warps=WARPS.value)
    ref = p8.double() @ b8.double().t()
    err = (out.double() - ref).abs() / ref.abs().clamp_min(1.0)
    rel = err.max().item()
    where = "" if rel < 1e-2 else f" first wrong column {int(err.max(0).values.gt(1e-2).nonzero()[0])}"
    print(f"{source:6s} N={n:3d} keys={keys:3d} {label}: max rel error {rel:.3e}  {'ok' if rel < 1e-2 else 'WRONG'}"
          f"{where}", flush=True)


def run(sources):
    """Each source on fresh P (scaled by 2**8 as the kernels hold it): B = ones (row sums, the kernel's use) over
    the first 1 .. keys keys; from global memory also B = one-hot columns picking single keys (column c picks key
    base + c: out[:, c] must be P[:, base + c], which shows which of P's keys or B's rows the wgmma reads wrong)."""
    torch.manual_seed(0)
    for source in sources:
        for n, keys in SHAPES[source]:
            for keys_used in sorted({1, 16, 17, 64, keys} & set(range(1, keys + 1))):
                p = torch.zeros(ROWS, keys, device="cuda")
                p[:, :keys_used] = torch.rand(ROWS, keys_used, device="cuda") * 256
                _check(p.to(torch.float8_e4m3fn), torch.ones(n, keys, device="cuda").to(torch.float8_e4m3fn),
                       source, f"ones, keys used={keys_used:4d}")
            if source != "global":
                continue
            p8 = (torch.rand(ROWS, keys, device="cuda") * 256).to(torch.float8_e4m3fn)
            for base in range(0, keys, n):
                b = torch.zeros(n, keys, device="cuda")
                b[torch.arange(n), torch.arange(base, base + n) % keys] = 1.0
                _check(p8, b.to(torch.float8_e4m3fn), source, f"one-hot keys {base}..{base + n - 1}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", default="global,kernel,splat", help="B sources, comma-separated: global, kernel, splat")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    chosen = args.b.split(",")
    unknown = [s for s in chosen if s not in SOURCES]
    if unknown:
        ap.error(f"--b {args.b}: unknown source(s) {unknown}; choose from {sorted(SOURCES)}")
    if args.compile_only or not torch.cuda.is_available():
        compile_only(chosen)
    else:
        run(chosen)
