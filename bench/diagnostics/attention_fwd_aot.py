"""AOT-compile the Triton attention forward (``_attn_fwd_kernel``) for sm90 without a GPU: registers, spills,
shared memory, CTAs/SM and the SASS of each key loop (instructions per warp and tile, per score, the MMA, MUFU and
move counts). Launch-like specialisation of a non-varlen 4 x 4096 x 32 x D problem with host TMA descriptors,
keys-contiguous fp8 V, as ``attention_forward`` launches it.

    python bench/diagnostics/attention_fwd_aot.py [--dtype fp8|i8fp8|bf16] [--D 128] [--causal] [--descale head|block]
        [--bm 64] [--bn 128] [--warps 4] [--stages 3] [--dump DIR]
    python bench/diagnostics/attention_fwd_aot.py --table        (default tiles, fp8 and i8fp8, D 64/128/256, causal or not)
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.diagnostics.aot import compile_sm90, opcodes, sass_instructions, sass_loops  # noqa: E402

N, H = 4096, 32
_TYPES = {"fp8": ("fp8e4nv", "fp8e4nv"), "i8fp8": ("i8", "fp8e4nv"), "bf16": ("bf16", "bf16")}


def _args(dtype: str, D: int, bm: int, bn: int) -> list[tuple[str, str, int | None]]:
    """(name, type, value) of the runtime parameters, in kernel order."""
    qk, v = _TYPES[dtype]
    out = "bf16"
    v_block = f"[1, 1, {D}, {bn}]" if dtype != "bf16" else f"[1, 1, {bn}, {D}]"
    a = [("Q", f"tensordesc<{qk}[1, 1, {bm}, {D}]>", None), ("K", f"tensordesc<{qk}[1, 1, {bn}, {D}]>", None),
         ("V", f"tensordesc<{v}{v_block}>", None), ("Out", f"tensordesc<{out}[1, 1, {bm}, {D}]>", None)]
    a += [(n, "*fp32", 0) for n in ("Lse", "QD", "KD", "VD", "CuQ", "CuK", "CuVT", "Sinks")]
    a += [("sm_scale_log2", "fp32", None), ("softcap_log2", "fp32", None)]
    row = H * D
    v_strides = (N * row, 1, D * N) if dtype != "bf16" else (N * row, row, D)  # keys-contiguous fp8 v
    a += [(f"stride_q{x}", "i32", s) for x, s in zip("bmh", (N * row, row, D))]
    a += [(f"stride_k{x}", "i32", s) for x, s in zip("bmh", (N * row, row, D))]
    a += [(f"stride_v{x}", "i32", s) for x, s in zip("bmh", v_strides)]
    a += [(f"stride_o{x}", "i32", s) for x, s in zip("bmh", (N * row, row, D))]
    a += [("qd_sb", "i32", H * 32), ("qd_sh", "i32", 32), ("kd_sb", "i32", H * 32), ("kd_sh", "i32", 32),
          ("vd_sb", "i32", H * D), ("vd_sh", "i32", D)]
    return a + [("Mq", "i32", N), ("Mk", "i32", N), ("Hq", "i32", H), ("GROUP", "i32", 1),
                ("window_left", "i32", None), ("window_right", "i32", None)]


def compile_one(dtype="fp8", D=128, causal=False, descale="block", bm=None, bn=None, warps=None, stages=None,
                dump=None) -> dict:
    from fmha_ops.kernels.triton.attention_fwd import _attn_fwd_kernel, default_config

    cfg = default_config(D, causal, N, dtype != "bf16")
    bm, bn = bm or cfg.block_m, bn or cfg.block_n
    warps, stages = warps or cfg.num_warps, stages or cfg.num_stages
    maxnreg = cfg.maxnreg if (bm, bn) == (cfg.block_m, cfg.block_n) else None
    quantized = dtype != "bf16"
    block = quantized and descale == "block"
    consts = {"D": D, "DV": D, "BLOCK_M": bm, "BLOCK_N": bn, "MASK_LEFT": False, "MASK_RIGHT": causal,
              "BOTTOM_RIGHT": True, "SOFTCAP": False, "VARLEN": False, "V_T": quantized, "P_SHIFT": 8 if quantized else 0,
              "Q_BLOCKSCALE": block, "K_BLOCKSCALE": block, "V_PER_CHANNEL": block, "WRITE_LSE": False,
              "Q_DESCALED": quantized, "K_DESCALED": quantized, "V_DESCALED": quantized, "ONE_LOOP": False, "SINKS": False}
    r = compile_sm90(_attn_fwd_kernel, _args(dtype, D, bm, bn), consts, warps=warps, stages=stages, maxnreg=maxnreg,
                     dump=dump)
    row = {"dtype": dtype, "D": D, "causal": causal, "descale": descale if quantized else "-",
           "tile": f"{bm}x{bn}", "warps": warps, "stages": stages, "maxnreg": maxnreg or "-", "regs": r["regs"], "spill_st": r["spill_st"],
           "smem": r["smem"], "ctas_per_sm": r["ctas_per_sm"]}
    scores = bm * bn // (32 * warps)  # per thread and tile
    mma = [loop for loop in sass_loops(sass_instructions(r["sass"])) if any("GMMA" in t for t in loop)]
    for name, loop in zip(("loop", "masked_loop"), mma):  # the unmasked key loop, then the diagonal (masked) one
        ops = opcodes(loop)
        row[f"{name}_instr"] = len(loop)
        row[f"{name}_per_score"] = round(len(loop) / scores, 2)
        row[f"{name}_mufu"] = ops["MUFU"]
        row[f"{name}_mov"] = ops["MOV"] + sum(1 for t in loop if "IMAD.MOV" in t)
    row["dump"] = r["dump"]
    return row


def _table() -> list[dict]:
    return [{"dtype": dt, "D": D, "causal": c} for dt in ("fp8", "i8fp8") for D in (64, 128, 256)
            for c in (False, True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="fp8", choices=sorted(_TYPES))
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--descale", default="block", choices=("head", "block"))
    p.add_argument("--bm", type=int, default=None)
    p.add_argument("--bn", type=int, default=None)
    p.add_argument("--warps", type=int, default=None)
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--dump", default=None)
    p.add_argument("--table", action="store_true")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = p.parse_args()
    if a.table:
        with cf.ProcessPoolExecutor(a.jobs) as ex:
            rows = [f.result() for f in [ex.submit(compile_one, **kw) for kw in _table()]]
    else:
        rows = [compile_one(a.dtype, a.D, a.causal, a.descale, a.bm, a.bn, a.warps, a.stages, a.dump)]
    cols = [c for c in dict.fromkeys(k for r in rows for k in r) if c != "dump"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    if not a.table:
        print("dump:", rows[0]["dump"], file=sys.stderr)


if __name__ == "__main__":
    main()
