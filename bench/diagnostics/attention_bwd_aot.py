"""AOT-compile the split attention backward kernels (``_bwd_dkdv``, ``_bwd_dq``, ``_bwd_preprocess``) for sm90
without a GPU: registers, spills, shared memory, CTAs/SM, wgmma count. Launch-like specialisation of a
non-varlen B x N x H x D problem (pointers and multiples of 16 marked divisible, GROUP 1 a constexpr).
``--dump DIR`` keeps the PTX/TTGIR/cubin (e.g. to diff the PTX before and after a kernel edit).

    python bench/diagnostics/attention_bwd_aot.py [--kernel dkdv|dq|pre] [--D 128] [--bm 64] [--bn 128] [--warps 8]
        [--stages 3] [--maxnreg N] [--causal] [--group 1] [--dump DIR]
    python bench/diagnostics/attention_bwd_aot.py --table        (default tiles of both kernels, D 64/128/256)
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.diagnostics.aot import compile_sm90  # noqa: E402

N, H = 4096, 32


def _args(kernel, D, group, dtype="*bf16"):
    """(name, type, value) in kernel order; value None: no specialisation."""
    Hq, Hkv = H, H // group
    strides = lambda p, h: [(f"s_{p}b", "i32", N * h * D), (f"s_{p}m", "i32", h * D), (f"s_{p}h", "i32", D)]
    if kernel == "pre":
        a = [("o_ptr", dtype, 0), ("do_ptr", dtype, 0), ("delta_ptr", "*fp32", 0), ("M", "i32", N)]
        return a + strides("o", Hq) + strides("do", Hq) + [("s_eb", "i32", Hq * N), ("s_eh", "i32", N)]
    a = [(n, dtype, 0) for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr")]
    a += [("lse_ptr", "*fp32", 0), ("delta_ptr", "*fp32", 0)]
    a += [(n, dtype, 0) for n in (("dk_ptr", "dv_ptr") if kernel == "dkdv" else ("dq_ptr",))]
    a += [("cu_q_ptr", dtype, 0), ("cu_k_ptr", dtype, 0)]
    a += strides("q", Hq) + strides("k", Hkv) + strides("v", Hkv) + strides("do", Hq)
    a += [("s_lb", "i32", Hq * N), ("s_lh", "i32", N), ("s_lm", "i32", 1), ("s_eb", "i32", Hq * N), ("s_eh", "i32", N)]
    a += strides("dk", Hkv) + strides("dv", Hkv) if kernel == "dkdv" else strides("dq", Hq)
    a += [("Mq", "i32", N), ("Mk", "i32", N), ("qk_scale", "fp32", None), ("sm_scale", "fp32", None),
          ("softcap_log2", "fp32", None), ("window_left", "i32", None), ("window_right", "i32", None),
          ("GROUP", "i32", group)]
    return a


def compile_one(kernel="dkdv", D=128, bm=64, bn=128, warps=8, stages=3, maxnreg=None, causal=False, group=1,
                dump=None):
    from fmha_ops.kernels.triton import attention_bwd as A

    fn = {"dkdv": A._bwd_dkdv, "dq": A._bwd_dq, "pre": A._bwd_preprocess}[kernel]
    if kernel == "pre":  # as launched by attention_backward: 64 rows, 4 warps
        const = {"BLOCK_M": 64, "HEAD_DIM_V": D}
    else:
        const = {"MASK_LEFT": False, "MASK_RIGHT": causal, "BOTTOM_RIGHT": True, "SOFTCAP": False, "IS_VARLEN": False,
                 "BLOCK_M": bm, "BLOCK_N": bn, "HEAD_DIM": D, "HEAD_DIM_V": D, "NUM_STAGES": stages}
    r = compile_sm90(fn, _args(kernel, D, group), const, warps=warps, stages=stages, maxnreg=maxnreg, dump=dump)
    return {
        "kernel": kernel, "D": D, "tile": "-" if kernel == "pre" else f"{bm}x{bn}", "warps": warps,
        "stages": stages, "maxnreg": maxnreg, "causal": causal, "regs": r["regs"], "spill_st": r["spill_st"],
        "spill_ld": r["spill_ld"], "smem": r["smem"], "ctas_per_sm": r["ctas_per_sm"],
        "sass_wgmma": len(re.findall(r"HGMMA", r["sass"])), "dump": r["dump"],
    }


def _table():
    """(kernel, D, bm, bn, warps, stages, maxnreg, causal) of the defaults (``default_config``)."""
    from fmha_ops.kernels.triton.attention_bwd import default_config

    rows = []
    for D in (64, 128, 256):
        for causal in (False, True):
            c = default_config(D, causal)
            rows.append(("dkdv", D, c.block_m_kv, c.block_n_kv, c.warps_kv, c.stages_kv, None, causal))
            rows.append(("dq", D, c.block_m_q, c.block_n_q, c.warps_q, c.stages_q, None, causal))
        rows.append(("pre", D, 64, 0, 4, 3, None, False))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", default="dkdv", choices=["dkdv", "dq", "pre"])
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--bm", type=int, default=64)
    p.add_argument("--bn", type=int, default=128)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--maxnreg", type=int, default=None)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--group", type=int, default=1)
    p.add_argument("--dump", default=None)
    p.add_argument("--table", action="store_true")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = p.parse_args()
    if a.table:
        keys = ("kernel", "D", "bm", "bn", "warps", "stages", "maxnreg", "causal")
        with cf.ProcessPoolExecutor(a.jobs) as ex:
            futs = [ex.submit(compile_one, **dict(zip(keys, row))) for row in _table()]
            rows = [f.result() for f in futs]
    else:
        rows = [compile_one(a.kernel, a.D, a.bm, a.bn, a.warps, a.stages, a.maxnreg, a.causal, a.group, a.dump)]
    cols = [c for c in rows[0] if c != "dump"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join("-" if r[c] is None else str(r[c]) for c in cols) + " |")
    if not a.table:
        print("dump:", rows[0]["dump"], file=sys.stderr)


if __name__ == "__main__":
    main()
