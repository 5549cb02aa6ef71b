"""AOT-compile the attention backward kernels for sm90 without a GPU: registers, spills, shared memory,
CTAs/SM, and the memory instructions of the PTX (TMA loads, the dQ reduce: ``cp.reduce.async.bulk.tensor``
for dq_mode "tma", ``red.global.add`` for "atomic"). Launch-like specialisation of a non-varlen
B x N x H x D problem (pointers and multiples of 16 marked divisible, GROUP 1 a constexpr).

    python bench/attention_bwd_aot.py [--D 128] [--kernel fused|dkdv|dq] [--mode tma|atomic] [--bm 64]
        [--bn 128] [--warps 8] [--stages 2] [--maxnreg N] [--causal] [--group 1] [--dump DIR]
    python bench/attention_bwd_aot.py --table        (the fused configurations of attention_bwd.md)
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

N, H = 4096, 32
SMEM_PER_SM = 233472  # sm_90: 228 KiB per SM, up to 227 KiB per CTA; each CTA also reserves 1 KiB


def _args(kernel, D, group, dtype="*bf16"):
    """(name, type, value) in kernel order; value None: no specialisation."""
    Hq, Hkv = H, H // group
    L = N  # padded lse2/delta row length (N is a multiple of 128)
    strides = lambda p, h: [(f"s_{p}b", "i32", N * h * D), (f"s_{p}m", "i32", h * D), (f"s_{p}h", "i32", D)]
    if kernel == "fused":
        a = [("q_ptr", dtype), ("k_ptr", dtype), ("v_ptr", dtype), ("do_ptr", dtype), ("lse2_ptr", "*fp32"),
             ("delta_ptr", "*fp32"), ("dk_ptr", dtype), ("dv_ptr", dtype), ("dqa_ptr", "*fp32"), ("cu_q_ptr", dtype),
             ("cu_k_ptr", dtype)]
        a = [(n, t, 0) for n, t in a]
        a += strides("q", Hq) + strides("k", Hkv) + strides("v", Hkv) + strides("do", Hq)
        a += [("s_eb", "i32", Hq * L), ("s_eh", "i32", L)] + strides("a", Hq) + strides("dk", Hkv) + strides("dv", Hkv)
    else:
        a = [(n, dtype, 0) for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr")]
        a += [("lse_ptr", "*fp32", 0), ("delta_ptr", "*fp32", 0)]
        a += [(n, dtype, 0) for n in (("dk_ptr", "dv_ptr") if kernel == "dkdv" else ("dq_ptr",))]
        a += [("cu_q_ptr", dtype, 0), ("cu_k_ptr", dtype, 0)]
        a += strides("q", Hq) + strides("k", Hkv) + strides("v", Hkv) + strides("do", Hq)
        a += [("s_lb", "i32", Hq * N), ("s_lh", "i32", N), ("s_lm", "i32", 1), ("s_eb", "i32", Hq * N), ("s_eh", "i32", N)]
        a += strides("dk", Hkv) + strides("dv", Hkv) if kernel == "dkdv" else strides("dq", Hq)
    a += [("Mq", "i32", N), ("Mk", "i32", N), ("qk_scale", "fp32", None), ("sm_scale", "fp32", None),
          ("GROUP", "i32", group)]
    return a


def compile_one(kernel="fused", D=128, mode="tma", bm=64, bn=128, warps=8, stages=2, maxnreg=None, causal=False,
                group=1, dump=None, swap=False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fmha_ops.kernels.triton import attention_bwd as A

    fn = {"fused": A._bwd_fused, "dkdv": A._bwd_dkdv, "dq": A._bwd_dq}[kernel]
    const = {"CAUSAL": causal, "BOTTOM_RIGHT": True, "IS_VARLEN": False, "BLOCK_M": bm, "BLOCK_N": bn,
             "HEAD_DIM": D, "HEAD_DIM_V": D, "NUM_STAGES": stages}
    if kernel == "fused":
        const.update(TMA_REDUCE=mode == "tma", DQ_SWAP=swap, PAD=A.PAD)
    names = fn.arg_names
    sig, consts, attrs = {}, {}, {}
    for n, t, v in _args(kernel, D, group):
        if v == 1 and not t.startswith("*"):
            sig[n], consts[n] = "constexpr", 1
        else:
            sig[n] = t
            if t.startswith("*") or (v is not None and v % 16 == 0):
                attrs[(names.index(n),)] = [["tt.divisibility", 16]]
    for n, v in const.items():
        sig[n], consts[n] = "constexpr", v
    assert sorted(sig) == sorted(names), set(names) ^ set(sig)
    sig = {n: sig[n] for n in names}
    opts = {"num_warps": warps, "num_stages": stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    d = dump or tempfile.mkdtemp()
    os.makedirs(d, exist_ok=True)
    ptx = k.asm["ptx"]
    for ext, body in (("ptx", ptx), ("ttgir", k.asm["ttgir"])):
        with open(os.path.join(d, f"k.{ext}"), "w") as f:
            f.write(body)
    with open(os.path.join(d, "k.cubin"), "wb") as f:
        f.write(k.asm["cubin"])
    r = subprocess.run([os.path.join(bindir, "ptxas"), "-v", "--gpu-name", "sm_90a", os.path.join(d, "k.ptx"),
                        "-o", os.path.join(d, "v.cubin")], capture_output=True, text=True, check=True)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", os.path.join(d, "k.cubin")],
                         capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    smem = k.metadata.shared
    ctas = min(65536 // (((regs + 7) // 8 * 8) * 32 * warps), SMEM_PER_SM // (smem + 1024), 32)
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                          capture_output=True, text=True, check=True).stdout
    count = lambda pat, text=ptx: len(re.findall(pat, text))
    return {
        "kernel": kernel, "mode": mode if kernel == "fused" else "-", "D": D, "tile": f"{bm}x{bn}", "warps": warps,
        "stages": stages, "maxnreg": maxnreg, "swap": swap, "causal": causal, "regs": regs,
        "spill_st": int(spill.group(1)) if spill else -1, "spill_ld": int(spill.group(2)) if spill else -1,
        "smem": smem, "ctas_per_sm": ctas,
        "ptx_tma_load": count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global"),
        "ptx_tma_reduce": count(r"cp\.reduce\.async\.bulk\.tensor[^;]*add"),
        "ptx_red_global": count(r"(?:red|atom)\.global[.\w]*\.add"),
        "ptx_bulk_wait": count(r"cp\.async\.bulk\.wait_group"),
        "sass_wgmma": count(r"HGMMA", sass), "sass_UTMAREDG": count(r"UTMAREDG", sass),
        "dump": d,
    }


TABLE = [  # (kernel, D, mode, bm, bn, warps, stages, maxnreg, causal, swap)
    ("dkdv", 128, "-", 64, 128, 8, 3, None, False, False),  # current default dK/dV kernel, for comparison
    ("dq", 128, "-", 128, 64, 8, 3, None, False, False),  # current default dQ kernel
    ("fused", 16, "tma", 64, 128, 8, 2, None, False, False),
    ("fused", 32, "tma", 64, 128, 8, 2, None, False, False),
    ("fused", 64, "tma", 64, 128, 8, 2, None, False, False),
    ("fused", 64, "tma", 64, 128, 8, 2, None, True, False),
    ("fused", 64, "tma", 64, 128, 8, 3, None, True, False),
    ("fused", 128, "tma", 64, 128, 8, 2, None, False, False),
    ("fused", 128, "tma", 64, 128, 8, 2, None, True, False),
    ("fused", 128, "tma", 64, 128, 8, 3, None, False, False),
    ("fused", 128, "tma", 64, 128, 8, 1, None, False, False),
    ("fused", 128, "tma", 64, 128, 8, 2, None, False, True),
    ("fused", 128, "atomic", 64, 128, 8, 2, None, False, False),
    ("fused", 128, "tma", 64, 64, 8, 2, None, False, False),
    ("fused", 128, "tma", 32, 128, 8, 2, None, False, False),
    ("fused", 128, "tma", 32, 128, 8, 2, None, False, True),
    ("fused", 256, "tma", 64, 64, 8, 1, None, False, False),
    ("fused", 256, "tma", 64, 64, 8, 2, None, False, False),
    ("fused", 256, "tma", 32, 64, 8, 1, None, False, True),
    ("fused", 256, "tma", 64, 32, 8, 1, None, False, False),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", default="fused", choices=["fused", "dkdv", "dq"])
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--mode", default="tma", choices=["tma", "atomic"])
    p.add_argument("--bm", type=int, default=64)
    p.add_argument("--bn", type=int, default=128)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--maxnreg", type=int, default=None)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--swap", action="store_true", help="dQ^T = K^T dS^T (FusedBwdConfig.dq_swap)")
    p.add_argument("--group", type=int, default=1)
    p.add_argument("--dump", default=None)
    p.add_argument("--table", action="store_true")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = p.parse_args()
    if a.table:
        keys = ("kernel", "D", "mode", "bm", "bn", "warps", "stages", "maxnreg", "causal", "swap")
        with cf.ProcessPoolExecutor(a.jobs) as ex:
            futs = [ex.submit(compile_one, **dict(zip(keys, row))) for row in TABLE]
            rows = [f.result() for f in futs]
    else:
        rows = [compile_one(a.kernel, a.D, a.mode, a.bm, a.bn, a.warps, a.stages, a.maxnreg, a.causal, a.group,
                            a.dump, a.swap)]
    cols = [c for c in rows[0] if c != "dump"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join("-" if r[c] is None else str(r[c]) for c in cols) + " |")
    if not a.table:
        print("dump:", rows[0]["dump"], file=sys.stderr)


if __name__ == "__main__":
    main()
