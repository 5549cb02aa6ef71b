"""Ahead-of-time sm90 compiles of Triton kernels on a machine without a GPU (used by the ``*_aot.py`` scripts).

``compile_sm90`` specialises a kernel the way a launch would (pointers and ints that are multiples of 16 marked
divisible, ints equal to 1 made constexpr), compiles it for ``GPUTarget("cuda", 90, 32)`` and reads back what
decides occupancy and issue cost: registers (cubin), spills (``ptxas -v``), shared memory, CTAs per SM, and
the SASS (``cuobjdump``). ``sass_loops`` finds the loops of that SASS (backward branches before the first
unpredicated EXIT; mbarrier retry blocks after it are skipped) and ``opcodes`` counts base opcodes.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

SMEM_PER_SM = 233472  # sm_90: 228 KiB per SM, up to 227 KiB per CTA; each CTA also reserves 1 KiB


def plain_signature(fn, consts: dict, types: dict, default: str = "i32") -> dict:
    """A Triton signature for every parameter of ``fn``: "constexpr" for the names in ``consts``, ``types[name]``
    where given ("*bf16", "fp32", "tensordesc<...>"), ``default`` for the rest (no divisibility hints).

    Example: ``triton.compile(ASTSource(fn, plain_signature(fn, consts, {"x_ptr": "*fp32"}), consts), target=...)``.
    """
    return {n: "constexpr" if n in consts else types.get(n, default) for n in fn.arg_names}


def compile_sm90(fn, args, consts: dict, *, warps: int, stages: int, maxnreg: int | None = None,
                 dump: str | None = None) -> dict:
    """``args``: (name, type, value) for every runtime parameter (type as in a Triton signature: "*bf16", "i32",
    "fp32", "tensordesc<fp8e4nv[1, 1, 64, 128]>"; value None: no specialisation); ``consts``: the constexprs.
    Returns regs, spill_st/spill_ld (bytes), smem, ctas_per_sm, sass, dump (folder with k.ptx/ttgir/cubin/sass)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig, constexprs, attrs = {}, dict(consts), {}
    for n, t, v in args:
        if v == 1 and t in ("i32", "i64"):
            sig[n], constexprs[n] = "constexpr", 1
        else:
            sig[n] = t
            if t.startswith("*") or (t in ("i32", "i64") and v is not None and v % 16 == 0):
                attrs[(names.index(n),)] = [["tt.divisibility", 16]]
    for n in consts:
        sig[n] = "constexpr"
    assert sorted(sig) == sorted(names), set(names) ^ set(sig)
    opts = {"num_warps": warps, "num_stages": stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(ASTSource(fn, {n: sig[n] for n in names}, constexprs, attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    d = dump or tempfile.mkdtemp()
    os.makedirs(d, exist_ok=True)
    for ext in ("ptx", "ttgir"):
        with open(os.path.join(d, f"k.{ext}"), "w") as f:
            f.write(k.asm[ext])
    cubin = os.path.join(d, "k.cubin")
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    r = subprocess.run([os.path.join(bindir, "ptxas"), "-v", "--gpu-name", "sm_90a", os.path.join(d, "k.ptx"),
                        "-o", os.path.join(d, "v.cubin")] + (["--maxrregcount", str(maxnreg)] if maxnreg else []),
                       capture_output=True, text=True, check=True)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                         check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                          check=True).stdout
    with open(os.path.join(d, "k.sass"), "w") as f:
        f.write(sass)
    smem = k.metadata.shared
    ctas = min(65536 // (((regs + 7) // 8 * 8) * 32 * warps), SMEM_PER_SM // (smem + 1024), 32)
    return {"regs": regs, "spill_st": int(spill.group(1)) if spill else -1,
            "spill_ld": int(spill.group(2)) if spill else -1, "smem": smem, "ctas_per_sm": ctas, "sass": sass,
            "dump": d}


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text without the trailing ';') of each SASS instruction."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def sass_loops(ins: list[tuple[int, str]]) -> list[list[str]]:
    """The instruction texts of each loop body (a backward branch before the first unpredicated EXIT: the
    mbarrier retry blocks after it branch back too), in address order."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    end = next((i for i, (_, t) in enumerate(ins) if re.match(r"EXIT\b", t)), len(ins))
    loops = []
    for i, (a, t) in enumerate(ins[:end]):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            loops.append([txt for _, txt in ins[index[int(m.group(1), 16)]:i + 1]])
    return loops


def opcodes(texts: list[str]) -> collections.Counter:
    """Base opcodes (``FFMA`` for ``@P0 FFMA.FTZ ...``) counted over ``texts``."""
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in texts)
