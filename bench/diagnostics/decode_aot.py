"""AOT-compile ``_decode_kernel`` for sm90 without a GPU: registers, spills, shared memory, CTAs/SM and
the SASS of the key loop. Shape B64/Hkv8/L4096/page 64, Mq=1, launch-like
specialisation (stride 1 constexpr, multiples of 16 marked divisible).

    python bench/diagnostics/decode_aot.py REPO [CONSTEXPR=value ...] [--warps 4] [--stages 2] [--maxnreg N]
        [--bn 64] [--D 128] [--G 4] [--fp8 1] [--partial] [--dump DIR] [--hist]
    e.g. python bench/diagnostics/decode_aot.py . BLOCK_N=64 --stages 3   (constexprs of a patched kernel work the same way)
"""
import argparse
import collections
import importlib.util
import os
import re
import sys

p = argparse.ArgumentParser()
p.add_argument("repo")
p.add_argument("extra", nargs="*")
p.add_argument("--warps", type=int, default=4)
p.add_argument("--stages", type=int, default=2)
p.add_argument("--maxnreg", type=int, default=None)
p.add_argument("--bn", type=int, default=64)
p.add_argument("--dtype", default="bf16")
p.add_argument("--D", type=int, default=128)
p.add_argument("--G", type=int, default=4)
p.add_argument("--fp8", type=int, default=1)
p.add_argument("--dump", default=None)
p.add_argument("--hist", action="store_true")
p.add_argument("--partial", action="store_true")
a = p.parse_args()

sys.path.insert(0, a.repo)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import triton  # noqa: E402

from bench.diagnostics.aot import compile_sm90, opcodes, sass_instructions, sass_loops  # noqa: E402

spec = importlib.util.spec_from_file_location("dec", os.path.join(a.repo, "fmha_ops/kernels/triton/decode.py"))
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod  # its dataclasses look their module up
spec.loader.exec_module(mod)
fn = mod._decode_kernel

B, HKV, D, PAGE, L = 64, 8, a.D, 64, 4096
G = a.G
HQ = G * HKV
npages = B * L // PAGE
qt = "*" + a.dtype
kt = "*fp8e4nv" if a.fp8 else qt
# (name, type, value): value used for specialisation (1 -> constexpr, %16 -> divisibility)
args = [("Q", qt, 0), ("K", kt, 0), ("V", kt, 0), ("KS", "*fp32" if a.fp8 else kt, 0), ("VS", "*fp32" if a.fp8 else kt, 0),
        ("SEQ", "*i32", 0), ("BT", "*i32", 0), ("OUT", "*fp32" if a.partial else qt, 0), ("LSE", "*fp32", 0),
        ("stride_qb", "i32", HQ * D), ("stride_qm", "i32", HQ * D), ("stride_qh", "i32", D),
        ("stride_kp", "i32", PAGE * HKV * D), ("stride_ks", "i32", HKV * D), ("stride_kh", "i32", D),
        ("stride_vp", "i32", PAGE * HKV * D), ("stride_vs", "i32", HKV * D), ("stride_vh", "i32", D)]
sc = (PAGE * HKV, HKV, 1) if a.fp8 else (0, 0, 0)
args += [("stride_ksp", "i32", sc[0]), ("stride_kss", "i32", sc[1]), ("stride_ksh", "i32", sc[2]),
         ("stride_vsp", "i32", sc[0]), ("stride_vss", "i32", sc[1]), ("stride_vsh", "i32", sc[2]),
         ("stride_btb", "i32", L // PAGE),
         ("stride_os", "i32", 64 * B * G * HKV * D if a.partial else 0), ("stride_ob", "i32", HQ * D), ("stride_om", "i32", HQ * D), ("stride_oh", "i32", D),
         ("stride_ls", "i32", B * HQ if a.partial else 0), ("stride_lb", "i32", HQ), ("stride_lh", "i32", 1), ("stride_lm", "i32", 1),
         ("qk_scale", "fp32", None), ("softcap_log2", "fp32", None), ("NUM_KV_HEADS", "i32", HKV),
         ("NUM_SPLITS", "i32", 64 if a.partial else 1), ("NUM_PAGES", "i32", None), ("CAPACITY", "i32", None),
         ("WINDOW_LEFT", "i32", None), ("SEQ_OFFSET", "i32", None)]
rows = G
bm = min(64, max(16, triton.next_power_of_2(rows)))
const = {"G": G, "MQ": 1, "D": D, "BLOCK_M": bm, "BLOCK_N": a.bn, "PAGE_SIZE": PAGE, "PAGED": True,
         "FP8": bool(a.fp8), "PARTIAL": a.partial, "ASM_CVT": bool(a.fp8), "PDL": False, "WINDOW": False,
         "SOFTCAP": False, "STORE_LSE": True}
for e in a.extra:
    k, v = e.split("=")
    const[k] = eval(v)
r = compile_sm90(fn, args, const, warps=a.warps, stages=a.stages, maxnreg=a.maxnreg, dump=a.dump)
loops = sass_loops(sass_instructions(r["sass"]))
loop = max(loops, key=len) if loops else []
n_loop = len(loop) if loop else -1
print(f"regs/spill: cubin REG {r['regs']}; spill stores {r['spill_st']} B, loads {r['spill_ld']} B")
print(f"smem {r['smem']} B, CTAs/SM {r['ctas_per_sm']} (warps/scheduler {r['ctas_per_sm'] * a.warps / 4:.1f}), "
      f"loop {n_loop} SASS, warp-instr/key {n_loop * a.warps / a.bn:.1f}")
if loop:
    base = opcodes(loop)
    key = ["LDS", "LDSM", "STS", "LDGSTS", "LDG", "HGMMA", "QGMMA", "WARPGROUP", "BAR", "SHFL", "MUFU", "F2FP", "FFMA",
           "FMUL", "FADD", "FMNMX", "PRMT", "I2F", "F2I", "IMAD", "SYNCS", "WARPSYNC", "DEPBAR", "FSEL", "SEL", "FSETP",
           "ISETP"]
    print("  " + " ".join(f"{x}:{base[x]}" for x in key if base[x]))
    print("  LDS.U8:", sum(1 for t in loop if re.search(r"\bLDS\.(U8|S8)", t)))
    if a.hist:
        full = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in loop)
        print(sorted(full.items(), key=lambda x: -x[1]))
