"""Warp-specialized Gluon fp8 forward (fmha_ops/kernels/gluon/attention_fwd_ws.py): compile-only checks for sm90.

The kernel is not registered as an op and has not run on a GPU yet (bench/gluon_fwd_probe.py --ws checks it
there). These tests compile it ahead of time (no GPU needed), run ``ptxas -v`` on the PTX and look at the SASS:
no wgmma serialization (C7512/C7514), no spills, the QGMMAs of one GEMM issued back to back, setmaxnreg present.
They skip where Triton's bundled ptxas / cuobjdump are missing.
"""
import json
import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_PTXAS = os.path.join(_BIN, "ptxas")
_CUOBJDUMP = os.path.join(_BIN, "cuobjdump")

pytestmark = pytest.mark.skipif(not (os.path.exists(_PTXAS) and os.path.exists(_CUOBJDUMP)),
                                reason="Triton's ptxas/cuobjdump not found")

CASES = [  # (compile_sm90 kwargs, spills allowed)
    ({"head_dim": 128, "schedule": "pingpong"}, False),
    ({"head_dim": 128, "schedule": "pingpong_overlap", "causal": True, "write_lse": True}, False),
    ({"head_dim": 256, "schedule": "pingpong_overlap"}, False),
    ({"head_dim": 64, "schedule": "pingpong_lookahead", "causal": True, "write_lse": True}, False),
]


_COMPILE = """
import json, sys
from fmha_ops.kernels.gluon import attention_fwd_ws as W
k = W.compile_sm90(**json.loads(sys.argv[1]))
open(sys.argv[2] + "/k.ptx", "w").write(k.asm["ptx"])
open(sys.argv[2] + "/k.cubin", "wb").write(k.asm["cubin"])
print(k.metadata.num_warps)
"""


def _report(kw, tmp_path):
    """Compile in a subprocess: the CPU suite sets TRITON_INTERPRET=1, under which Gluon kernels do not compile."""
    env = {kk: vv for kk, vv in os.environ.items() if kk != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(kw), str(tmp_path)], capture_output=True,
                         text=True, env=env, cwd=root, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    ptx, cubin = tmp_path / "k.ptx", tmp_path / "k.cubin"
    log = subprocess.run([_PTXAS, "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "v.cubin")],
                         capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([_CUOBJDUMP, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return int(res.stdout.split()[-1]), ptx.read_text(), log, sass


@pytest.mark.parametrize("kw,spills", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values())
                         if isinstance(c, dict) else str(c))
def test_ws_compiles_without_wgmma_serialization(kw, spills, tmp_path):
    num_warps, ptx, log, sass = _report(kw, tmp_path)
    assert num_warps == 12  # 4 producer (default) + 2 x 4 consumer warps
    assert not re.search(r"C75\d\d", log), log
    if not spills:
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", log), log
    gmma = sass.count("QGMMA.")
    waits = sass.count("WARPGROUP.DEPBAR")
    assert gmma >= 24 and waits <= 12, (gmma, waits)  # serialized code has one DEPBAR per QGMMA
    assert "USETMAXREG" in sass
    if kw["schedule"] != "pingpong":  # the register patch: idle workers raised above the launch count
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+2\d\d;", ptx)


def test_patch_keeps_register_pool():
    """Prologue (4 default warps + 8 idle workers) and region (24 + 2 x 240) fit the 168 x 384 launch pool."""
    from fmha_ops.kernels.gluon.attention_fwd_ws import _patch_ptx_regs

    ptx = (".maxnreg 168\n\tmov.u32 \t%r1, %tid.x;\n\tsetp.lt.u32 \t%p1, %r2, 4;\n\t@%p1 bra \t$L__BB0_26;\n"
           "\tbra.uni \t$L__BB0_1;\n$L__BB0_26:\n\tsetmaxnreg.inc.sync.aligned.u32 \t256;\n"
           "\tsetmaxnreg.dec.sync.aligned.u32 \t24;\n$L__BB0_2:\n\tsetmaxnreg.dec.sync.aligned.u32 \t120;\n"
           "\tsetmaxnreg.inc.sync.aligned.u32 \t240;\n\tsetmaxnreg.dec.sync.aligned.u32 \t120;\n"
           "\tsetmaxnreg.inc.sync.aligned.u32 \t256;")
    out = _patch_ptx_regs(ptx, 200)
    regs = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", out)
    assert regs == [("inc", "200"), ("dec", "104"), ("dec", "24"), ("dec", "200"), ("inc", "240"), ("dec", "200"),
                    ("inc", "104")]
    assert 4 * 32 * 104 + 8 * 32 * 200 <= 168 * 384
