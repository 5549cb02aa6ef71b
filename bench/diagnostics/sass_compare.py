"""The consumer main loop of FA3's fp8 forward against the warp-specialized Gluon kernel's, from their sm90 SASS
(no GPU): per key tile and per score, the instruction mix, where the wgmma waits sit against the softmax, the
row-max shuffles, the P conversion, the barriers; and each loop's event timeline.

    python bench/diagnostics/sass_compare.py [--fa3-so PATH] [--head-dims 64,128] [--timeline] [--config JSON]

FA3's kernels come from the fa3-fwd wheel's ``_C.abi3.so`` (``.carry/anchors/install.sh`` unpacks it into
/tmp/anchors): the fp8 e4m3 forward for each head dim, not causal, no split / varlen / paging / pack-GQA, P V
from registers with the intra-warpgroup overlap. Ours: ``attention_fwd_ws.compile_sm90`` with
``default_config(D, False, 4096)``, or those fields replaced by ``--config`` (a JSON object of ``WsFwdConfig``
fields). The steady-state iteration is the innermost loop holding an S wgmma (A from shared memory), a P V wgmma
(A from registers) and the exponentials, walked along its shortest path through the branches that keeps every
wgmma and exponential: the unmasked softmax (ours branches to the masked one inside the loop). Findings:
``fa3_profile.md``, section "Main loop SASS".
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.diagnostics.aot import sass_instructions  # noqa: E402

FA3_SO = "/tmp/anchors/fa3_fwd/_C.abi3.so"
#: FA3's mainloop template flags after the element types: causal, local, softcap, varlen, paged (non-TMA), append
#: KV, Qv, P V from registers, intra-warpgroup overlap, pack GQA, split, V column-major
FA3_FLAGS = "false, false, false, false, false, false, false, true, true, false, false, false"
FA3_MAINLOOP = re.compile(r"CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
                          r"cute::tuple<cute::C<(\d+)>, cute::C<(\d+)>, cute::C<(\d+)> >, (\d+), "
                          r"cutlass::float_e4m3_t, float, cutlass::arch::Sm90, " + FA3_FLAGS + ">")
#: exponentials that mark a loop as a softmax loop (a tile's, per thread, are 64 x BLOCK_N / 128 >= 32)
MIN_EXP = 16
#: instructions back within which an identical mbarrier try-wait is a second try of the same wait
RETRY_WINDOW = 4
#: threads of one consumer warpgroup (each holds 64 x BLOCK_N / 128 scores of a tile)
WG_THREADS = 128
#: rows of one consumer warpgroup (an m64 wgmma)
WG_ROWS = 64
#: opcode columns of the mix table, in order; the rest is summed as "other"
MIX = ("FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "F2FP", "PRMT", "SHFL", "LOP3", "IMAD", "MOV", "IADD3", "VIADD",
       "FSEL", "ISETP", "BAR", "SYNCS", "GMMA", "WARPGROUP", "uniform")
_PRED = re.compile(r"^@!?U?P\w+\s+")
_BRA = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def opcode(text: str) -> str:
    """Base opcode of one instruction (``FFMA`` for ``@P0 FFMA.FTZ R1, ...``; any ``*GMMA`` as ``GMMA``)."""
    op = _PRED.sub("", text).split()[0].split(".")[0]
    return "GMMA" if op.endswith("GMMA") else op


def column(text: str) -> str:
    """Mix-table column of one instruction: its opcode (``IMAD.MOV`` counts as ``MOV``), ``uniform`` for the
    uniform-datapath ``U*`` opcodes (scalar work off the vector pipes), else the opcode itself."""
    op = opcode(text)
    if op == "IMAD" and ".MOV" in text:
        return "MOV"
    if op.startswith("U"):
        return "uniform"
    return op


def is_rs_gmma(text: str) -> bool:
    """A wgmma whose A operand comes from registers (``QGMMA ... Rd, Ra, gdesc[..]``: P V here) rather than from
    shared memory (``Rd, gdesc[..], ..``: S = Q K^T)."""
    return opcode(text) == "GMMA" and re.search(r"GMMA\S*\s+R\d+,\s+R\d+,", text) is not None


def steady_iteration(ins: list[tuple[int, str]]) -> list[str]:
    """Instruction texts of one steady-state iteration of the consumer key loop (module docstring): the innermost
    backward-branch loop with both wgmma kinds and at least ``MIN_EXP`` exponentials, the first by address,
    walked along the shortest path from its head to its back branch that keeps the most wgmmas, exponentials and
    mbarrier waits (``_best_path``). Branches out of the loop (mbarrier retry blocks) count as falling through.

    Example: ``loop_report(steady_iteration(sass_instructions(cuobjdump_sass)), block_n=192)["per_score"]``."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, t) in enumerate(ins):
        m = _BRA.search(t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            body = [x for _, x in ins[index[int(m.group(1), 16)]:i + 1]]
            if (any(is_rs_gmma(x) for x in body) and any(opcode(x) == "GMMA" and not is_rs_gmma(x) for x in body)
                    and sum("MUFU.EX2" in x for x in body) >= MIN_EXP):
                loops.append((index[int(m.group(1), 16)], i))
    if not loops:
        raise SystemExit("no consumer key loop (S and P V wgmmas with exponentials) in this SASS")
    inner = [(h, t) for h, t in loops if not any(h <= h2 and t2 <= t and (h2, t2) != (h, t) for h2, t2 in loops)]
    head, tail = min(inner)
    return _best_path(ins, head, tail)


def _best_path(ins: list[tuple[int, str]], head: int, tail: int) -> list[str]:
    """The path from ``head`` to ``tail`` (instruction indices) through forward branches inside that range that
    maximizes (wgmmas, exponentials, mbarrier waits) and then minimizes its length (dynamic programming from the
    tail back). A wait counts once: a repeated try of the same wait (FA3 tries twice before its retry loop) does
    not, so the path is the one where every wait is taken and its first try succeeds."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    best: dict[int, tuple[tuple[int, ...], int | None]] = {}  # start -> ((-gmma, -mufu, -waits, length), next)
    for i in range(tail, head - 1, -1):
        t = ins[i][1]
        first_try = "TRYWAIT" in t and all(ins[k][1] != t for k in range(max(head, i - RETRY_WINDOW), i))
        score = (-(opcode(t) == "GMMA"), -("MUFU.EX2" in t), -first_try, 1)
        if i == tail:
            best[i] = (score, None)
            continue
        succ = []
        m = _BRA.search(t)
        target = index.get(int(m.group(1), 16)) if m else None
        unconditional = m is not None and not _PRED.match(t)
        if target is not None and i < target <= tail:
            succ.append(target)
        if not (unconditional and target is not None and i < target <= tail):
            succ.append(i + 1)
        nxt = min(succ, key=lambda s: best[s][0])
        best[i] = (tuple(x + y for x, y in zip(score, best[nxt][0])), nxt)
    path, i = [], head
    while i is not None:
        path.append(ins[i][1])
        i = best[i][1]
    return path


def loop_report(texts: list[str], block_n: int) -> dict:
    """Counts of one iteration (``texts``) of a consumer warpgroup's loop over ``block_n``-key tiles: the mix,
    instructions per score, the waits and what runs between them, the named barriers and mbarrier operations."""
    scores = WG_ROWS * block_n // WG_THREADS
    cols = collections.Counter(column(t) for t in texts)
    row = {"instr": len(texts), "per_score": round(len(texts) / scores, 2), "scores": scores}
    row.update({c: cols.get(c, 0) for c in MIX})
    row["other"] = len(texts) - sum(row[c] for c in MIX)
    row["MUFU.EX2"] = sum("MUFU.EX2" in t for t in texts)
    row["S_wgmma"] = sum(opcode(t) == "GMMA" and not is_rs_gmma(t) for t in texts)
    row["PV_wgmma"] = sum(is_rs_gmma(t) for t in texts)
    row["BAR.SYNC"] = sum(opcode(t) == "BAR" and ".SYNC" in t for t in texts)
    row["mbar_wait"] = len({t.split("[")[1].split("]")[0] for t in texts if "TRYWAIT" in t})
    row["mbar_arrive"] = sum(opcode(t) == "SYNCS" and ".ARRIVE" in t for t in texts)
    waits = [i for i, t in enumerate(texts) if "WARPGROUP.DEPBAR" in t]
    last_pv = max(i for i, t in enumerate(texts) if is_rs_gmma(t))
    exp = [i for i, t in enumerate(texts) if "MUFU.EX2" in t]
    final = waits[-1] if waits else len(texts)
    row["waits"] = " ".join(texts[i].split()[-1].rstrip(";") for i in waits)
    # the exponentials issued while P V may still run: after its issue, before the wait for it (the last wait)
    row["exp_under_PV"] = sum(last_pv < i < final for i in exp)
    row["instr_under_PV"] = max(0, final - last_pv - 1 - sum(1 for i in waits if last_pv < i < final))
    row["after_PV_wait"] = len(texts) - final - 1
    # the issue span: from the last blocking wait (mbarrier or named barrier) before the first wgmma to the last
    # wgmma; a consumer holding the turn keeps the others from issuing for this long
    first = min(i for i, t in enumerate(texts) if opcode(t) == "GMMA")
    blocking = [i for i, t in enumerate(texts[:first]) if "TRYWAIT" in t or (opcode(t) == "BAR" and ".SYNC" in t)]
    last = max(i for i, t in enumerate(texts) if opcode(t) == "GMMA")
    row["issue_span"] = last - (blocking[-1] if blocking else 0)
    return row


def timeline(texts: list[str]) -> list[str]:
    """The iteration as events (wgmma issue, wgmma wait, barriers, mbarrier wait / arrive, shuffles) with the
    instructions between them summed by opcode (the five most frequent)."""
    out, run = [], collections.Counter()

    def flush():
        if run:
            out.append(f"  {sum(run.values()):4d}: " + " ".join(f"{k} {v}" for k, v in run.most_common(5)))
            run.clear()

    for t in texts:
        op = opcode(t)
        if op in ("GMMA", "WARPGROUP", "BAR", "SHFL") or (op == "SYNCS" and ("TRYWAIT" in t or "ARRIVE" in t)):
            flush()
            kind = ("P V " if is_rs_gmma(t) else "S ") if op == "GMMA" else ""
            out.append("  " + kind + re.sub(r"\s+", " ", t))
        else:
            run[column(t)] += 1
    flush()
    return out


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def fa3_sass(so: str, head_dims: list[int]) -> dict[int, dict]:
    """head dim -> {"name", "tile" (BLOCK_M x BLOCK_N), "regs", "sass"} of FA3's fp8 forward (module docstring)
    in ``so``."""
    if not os.path.exists(so):
        raise SystemExit(f"--fa3-so {so}: not found (source .carry/anchors/install.sh to unpack the fa3-fwd wheel)")
    d = tempfile.mkdtemp()
    subprocess.run([_tool("cuobjdump"), "-xelf", "all", so], cwd=d, capture_output=True, check=True)
    found = {}
    for cubin in sorted(f for f in os.listdir(d) if f.endswith("sm_90.cubin")):
        path = os.path.join(d, cubin)
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        for name, regs in re.findall(r"Function (\S+):\s*\n\s*REG:(\d+)", res):
            pretty = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout
            m = FA3_MAINLOOP.search(pretty)
            if m and m.group(3) == m.group(4) and int(m.group(3)) in head_dims:
                sass = subprocess.run([_tool("cuobjdump"), "-sass", "-fun", name, path], capture_output=True,
                                      text=True, check=True).stdout
                found[int(m.group(4))] = {"name": name, "tile": (int(m.group(1)), int(m.group(2))),
                                          "regs": int(regs), "sass": sass}
    return found


def ours_sass(head_dim: int, overrides: dict) -> dict:
    """{"tile" (BLOCK_M x BLOCK_N), "regs", "sass"} of the ws kernel at ``head_dim`` (not causal, 4096 keys, fp8)."""
    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    cfg = dataclasses.replace(ws.default_config(head_dim, False, 4096), **overrides)
    kernel = ws.compile_sm90(head_dim, causal=False, config=cfg)
    path = os.path.join(tempfile.mkdtemp(), "k.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    return {"tile": (cfg.consumers * WG_ROWS, cfg.block_n), "regs": regs, "sass": sass}


def reg_split(sass: str) -> str:
    """The distinct ``setmaxnreg`` values of a warp-specialized kernel (its partitions' registers), ascending."""
    found = re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP0, )?(0x[0-9a-f]+)", sass)
    return "/".join(str(v) for v in sorted({int(v, 16) for v in found}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fa3-so", default=FA3_SO)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--config", default="{}", help="JSON: WsFwdConfig fields replacing default_config's")
    p.add_argument("--timeline", action="store_true", help="print each loop's event timeline too")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args()
    dims = [int(x) for x in a.head_dims.split(",")]
    fa3 = fa3_sass(a.fa3_so, dims)
    rows, lines = [], []
    for D in dims:
        kernels = [("fa3", fa3[D])] if D in fa3 else []
        kernels.append(("ws", ours_sass(D, json.loads(a.config))))
        for who, k in kernels:
            texts = steady_iteration(sass_instructions(k["sass"]))
            row = {"kernel": who, "D": D, "tile": "x".join(map(str, k["tile"])),
                   "consumers": k["tile"][0] // WG_ROWS, "regs": k["regs"], "setmaxnreg": reg_split(k["sass"])}
            row.update(loop_report(texts, k["tile"][1]))
            rows.append(row)
            lines += [f"{who} D{D} ({row['tile']}):"] + timeline(texts)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if a.timeline:
        print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
