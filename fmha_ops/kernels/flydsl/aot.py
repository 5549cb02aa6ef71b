"""Ahead-of-time compilation of every FlyDSL decode kernel configuration for one arch.

    python -m fmha_ops.kernels.flydsl.aot --arch gfx942 --out DIR [--isa-dir DIR] [--jobs N]

Each configuration (:func:`.host.kernel_configs`) compiles in its own subprocess with
``COMPILE_ONLY=1`` (FlyDSL's LLVM never shares a process with Triton's, and no GPU is
needed) and lands in DIR as FlyDSL's on-disk JIT cache, which :mod:`.launcher` reads
through ``FMHA_FLYDSL_CACHE=DIR``. ``--isa-dir`` also writes each kernel's ISA to
``ISA_DIR/<config>.s`` (a second compile per configuration; FlyDSL skips its cache while
dumping). Cache entries are keyed by FlyDSL's version and the device bitcode library
under ``ROCM_PATH``, so build the cache with the same FlyDSL and ROCm as the runtime.

Compiling needs ``ROCM_PATH`` with ``llvm/bin/ld.lld`` (LLVM >= 19) and ``amdgcn/bitcode``;
when unset, ``FMHA_FLYDSL_ROCM_PATH`` or the folder written by
``.ci/install_flydsl_toolchain.sh`` (:func:`toolchain_root`) is used.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .host import ARCHS, config_name, kernel_configs

DEFAULT_TOOLCHAIN = Path.home() / ".cache" / "fmha_ops" / "flydsl_rocm"


def toolchain_root() -> Path | None:
    """A ROCM_PATH-style folder usable for compiling, or None."""
    for cand in (os.environ.get("ROCM_PATH"), os.environ.get("FMHA_FLYDSL_ROCM_PATH"), str(DEFAULT_TOOLCHAIN)):
        if cand and (Path(cand) / "llvm" / "bin" / "ld.lld").exists() and (Path(cand) / "amdgcn" / "bitcode").is_dir():
            return Path(cand)
    return None


def _compile_one(name: str) -> None:
    """Runs inside the subprocess: trace and compile one configuration (no launch).

    The placeholder arguments go through the launcher's own packing, so the traced
    specialization is the one the launcher requests.
    """
    import torch

    from . import decode
    from .host import decode_args, fp8_dtype, reduce_args

    cfg = next(c for c in kernel_configs() if config_name(c) == name)
    cdt = torch.bfloat16 if cfg["BF16"] else torch.float16
    D = cfg["D"]
    if cfg["kind"] == "reduce":
        args, consts = reduce_args(torch.zeros(1, 2, 1, 2, D), torch.zeros(1, 2, 2, 1),
                                   torch.zeros(1, 1, 2, D, dtype=cdt), torch.zeros(1, 2, 1))
        decode.split_reduce(*args, *consts)
        return
    q = torch.zeros(1, 1, 2, D, dtype=cdt)
    kv = torch.zeros(2, 16, 1, D, dtype=cdt)
    scales = {}
    if cfg["FP8"]:
        kv = kv.to(fp8_dtype(os.environ["ARCH"]))
        scales = {"k_scale": torch.ones(2, 16, 1), "v_scale": torch.ones(2, 16, 1)}
    bt = torch.zeros(1, 2, dtype=torch.int32)
    sl = torch.ones(1, dtype=torch.int32)
    S = 2 if cfg["OUT_F32"] else 1
    out, lse = ((torch.zeros(1, S, 1, 2, D), torch.zeros(1, S, 2, 1)) if cfg["OUT_F32"]
                else (torch.zeros_like(q), torch.zeros(1, 2, 1)))
    args, consts = decode_args(q, kv, kv, bt, sl, out, lse, num_splits=S, **scales)
    assert consts == (D, cfg["BF16"], cfg["FP8"], cfg["OUT_F32"])
    decode.paged_decode(*args, *consts)


def compile_config(name: str, arch: str, out: Path | None, isa_dir: Path | None = None,
                   rocm_path: Path | None = None, timeout: float = 300) -> dict:
    """Compile one configuration in a subprocess; returns a record (name, ok, seconds, log, isa)."""
    rocm_path = rocm_path or toolchain_root()
    env = dict(os.environ, COMPILE_ONLY="1", ARCH=arch, FLYDSL_GPU_ARCH=arch, PYTHONUNBUFFERED="1")
    if rocm_path is not None:
        env["ROCM_PATH"] = str(rocm_path)
    env.pop("FLYDSL_RUNTIME_RUN_ONLY", None)
    tmp = None
    if isa_dir is not None:
        tmp = tempfile.TemporaryDirectory()
        env.update(FLYDSL_DEBUG_DUMP_ASM="1", FLYDSL_DUMP_DIR=tmp.name, FLYDSL_RUNTIME_ENABLE_CACHE="0")
    else:
        env.update(FLYDSL_RUNTIME_CACHE_DIR=str(out), FLYDSL_RUNTIME_ENABLE_CACHE="1")
        env.pop("FLYDSL_DEBUG_DUMP_ASM", None)
        env.pop("FLYDSL_DUMP_IR", None)
    root = Path(__file__).resolve().parents[3]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fmha_ops.kernels.flydsl.aot", "--compile-one", name],
                          env=env, capture_output=True, text=True, timeout=timeout)
    rec = {"name": name, "arch": arch, "ok": proc.returncode == 0, "seconds": time.perf_counter() - t0,
           "log": (proc.stdout + proc.stderr)[-4000:], "isa": None}
    if tmp is not None:
        found = sorted(Path(tmp.name).rglob("*final_isa.s"))
        if rec["ok"] and len(found) == 1:
            isa_dir.mkdir(parents=True, exist_ok=True)
            dst = isa_dir / f"{name}.s"
            dst.write_text(found[0].read_text())
            rec["isa"] = str(dst)
        elif rec["ok"]:
            rec["ok"] = False
            rec["log"] += f"\nexpected one ISA dump, found {len(found)}"
        tmp.cleanup()
    return rec


def compile_all(arch: str, out: Path | None, isa_dir: Path | None = None, jobs: int = 2,
                names: list[str] | None = None) -> list[dict]:
    names = names or [config_name(c) for c in kernel_configs()]
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        recs = list(ex.map(lambda n: compile_config(n, arch, out, isa_dir), names))
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=ARCHS)
    ap.add_argument("--out", type=Path, help="cache directory (FMHA_FLYDSL_CACHE for the launcher)")
    ap.add_argument("--isa-dir", type=Path, help="also write each kernel's ISA here")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--compile-one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.compile_one:
        _compile_one(a.compile_one)
        return 0
    if not a.arch or not a.out:
        ap.error("--arch and --out are required")
    if toolchain_root() is None:
        print("no toolchain: set ROCM_PATH to a folder with llvm/bin/ld.lld and amdgcn/bitcode "
              "(.ci/install_flydsl_toolchain.sh makes one)", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    recs = compile_all(a.arch, a.out, None, a.jobs)
    if a.isa_dir:
        recs += compile_all(a.arch, None, a.isa_dir, a.jobs)
    for r in recs:
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['arch']} {r['name']:40s} {r['seconds']:.1f}s {r['isa'] or ''}")
        if not r["ok"]:
            print(r["log"], file=sys.stderr)
    (a.out / f"manifest_{a.arch}.json").write_text(json.dumps(
        [{k: r[k] for k in ("name", "arch", "ok", "seconds")} for r in recs], indent=1))
    return 0 if all(r["ok"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
