"""AOT-compile ``_decode_kernel`` for sm90 without a GPU: registers, spills, shared memory, CTAs/SM and
the SASS of the key loop (decode.md steps 5-6). Shape B64/Hkv8/L4096/page 64, Mq=1, launch-like
specialisation (stride 1 constexpr, multiples of 16 marked divisible).

    python bench/decode_aot.py REPO [CONSTEXPR=value ...] [--warps 4] [--stages 2] [--maxnreg N]
        [--bn 64] [--D 128] [--G 4] [--fp8 1] [--partial] [--dump DIR] [--hist]
    e.g. python bench/decode_aot.py . BLOCK_N=64 --stages 3   (constexprs of a patched kernel work the same way)
"""
import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

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
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

spec = importlib.util.spec_from_file_location("dec", os.path.join(a.repo, "fmha_ops/kernels/triton/decode.py"))
mod = importlib.util.module_from_spec(spec)
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
         ("qk_scale", "fp32", None), ("NUM_KV_HEADS", "i32", HKV), ("NUM_SPLITS", "i32", 64 if a.partial else 1)]
rows = G
bm = min(64, max(16, triton.next_power_of_2(rows)))
const = {"G": G, "MQ": 1, "D": D, "BLOCK_M": bm, "BLOCK_N": a.bn, "PAGE_SIZE": PAGE, "PAGED": True,
         "FP8": bool(a.fp8), "PARTIAL": a.partial}
for e in a.extra:
    k, v = e.split("=")
    const[k] = eval(v)
names = fn.arg_names
sig, consts, attrs = {}, {}, {}
for n, t, v in args:
    if v == 1 and not t.startswith("*"):
        sig[n] = "constexpr"; consts[n] = 1
    else:
        sig[n] = t
        if t.startswith("*") or (v is not None and v % 16 == 0):
            attrs[(names.index(n),)] = [["tt.divisibility", 16]]
for k, v in const.items():
    sig[k] = "constexpr"; consts[k] = v
missing = [n for n in names if n not in sig]
assert not missing, missing
sig = {n: sig[n] for n in names}
opts = {"num_warps": a.warps, "num_stages": a.stages}
if a.maxnreg:
    opts["maxnreg"] = a.maxnreg
k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
d = a.dump or tempfile.mkdtemp()
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "k.ptx"), "w") as f:
    f.write(k.asm["ptx"])
with open(os.path.join(d, "k.ttgir"), "w") as f:
    f.write(k.asm["ttgir"])
with open(os.path.join(d, "k.cubin"), "wb") as f:
    f.write(k.asm["cubin"])
r = subprocess.run([os.path.join(bindir, "ptxas"), "-v", "--gpu-name", "sm_90a", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "v.cubin")], capture_output=True, text=True, check=True)
info = " ".join(l.strip() for l in r.stderr.splitlines() if "Used" in l or "spill" in l)
sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True).stdout
with open(os.path.join(d, "k.sass"), "w") as f:
    f.write(sass)
ins = []
for line in sass.splitlines():
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip()))
addr_idx = {ad: i for i, (ad, _) in enumerate(ins)}
best = None
for i, (ad, txt) in enumerate(ins):
    m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|)\s*`?\(?\.?L?_?x?_?\d*\)?\s*", txt)
    mm = re.search(r"BRA.*?0x([0-9a-f]+)", txt)
    if "BRA" in txt and mm:
        tgt = int(mm.group(1), 16)
        if tgt < ad and tgt in addr_idx:
            n = i - addr_idx[tgt] + 1
            if best is None or n > best[0]:
                best = (n, addr_idx[tgt], i)
n_loop = best[0] if best else -1
res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True).stdout
regs = int(re.search(r"REG:(\d+)", res).group(1))
info = f"cubin REG {regs}; ptxas: " + info
smem = k.metadata.shared
ctas = min(65536 // (regs * 32 * a.warps) if regs else 99, (233472 - 1024) // (smem + 1024) if smem else 32, 32)
ctas = min(65536 // (((regs + 7) // 8 * 8) * 32 * a.warps), (233472) // (smem + 1024), 32)
print(f"regs/spill: {info}")
print(f"smem {smem} B, CTAs/SM {ctas} (warps/scheduler {ctas * a.warps / 4:.1f}), loop {n_loop} SASS, "
      f"warp-instr/key {n_loop * a.warps / a.bn:.1f}")
if best:
    loop = [t for _, t in ins[best[1]:best[2] + 1]]
    ops = collections.Counter(t.split()[0] if not t.startswith("@") else t.split()[1] for t in loop)
    base = collections.Counter()
    for o, c in ops.items():
        base[o.split(".")[0]] += c
    key = ["LDS", "LDSM", "STS", "LDGSTS", "LDG", "HGMMA", "QGMMA", "WARPGROUP", "BAR", "SHFL", "MUFU", "F2FP", "FFMA", "FMUL", "FADD", "FMNMX", "PRMT", "I2F", "F2I", "IMAD", "SYNCS", "WARPSYNC", "DEPBAR", "FSEL", "SEL", "FSETP", "ISETP"]
    print("  " + " ".join(f"{x}:{base[x]}" for x in key if base[x]))
    print("  LDS.U8:", sum(c for o, c in ops.items() if o.startswith(("LDS.U8", "LDS.S8"))))
    if a.hist:
        print(sorted(ops.items(), key=lambda x: -x[1]))
