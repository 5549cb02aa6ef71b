"""Compute ceiling of the fp8 attention forward's loop: the Triton kernel with its softmax taken apart.

Variants of ``fmha_ops/kernels/triton/attention_fwd.py`` built at run time by rewriting the unmasked softmax step
of ``_tile`` (the script stops if that source text changed), same tiles, launch and inputs:

* ``full``: the kernel as shipped;
* ``exp``: exp2 of the scaled scores and the row sum, without the running max and the rescale of O;
* ``mma``: no softmax at all: S converted to fp8 as P, i.e. QK^T, the conversion and PV.

The outputs of ``exp`` and ``mma`` are meaningless; their times bound what any softmax schedule in this loop can
reach (masked tiles keep the full step). Also the fp8 GEMM ceiling (``torch._scaled_mm`` 8192^3) and the issue #3
targets. TFLOP/s = 4*B*H*N^2*D / t, halved when causal; v is passed keys-contiguous (no transpose timed).

    python bench/attention_fwd_ceiling.py [--out DIR]
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

SHAPES = [  # B, H, N, D, causal, issue #3 target TFLOP/s
    (4, 32, 4096, 128, False, 1100),
    (2, 16, 16384, 128, False, 1100),
    (4, 32, 4096, 128, True, 950),
    (2, 16, 16384, 128, True, 950),
    (4, 16, 4096, 64, False, 700),
    (4, 16, 4096, 256, False, 1150),
    (2, 8, 16384, 256, False, 1150),
]
KERNEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fmha_ops", "kernels", "triton",
                      "attention_fwd.py")
SOFTMAX = """        m_ij = tl.maximum(m_i, (tl.max(s, 1) - OFF) * qk_scale)
        p = tl.math.exp2(s * qk_scale - (m_ij + (OFF * qk_scale - P_SHIFT))[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
"""
PV = "    acc = tl.dot(p, v, acc * alpha[:, None])\n"
VARIANTS = {
    "exp": """        m_ij = m_i
        p = tl.math.exp2(s * qk_scale - P_SHIFT)
        alpha = 1.0
    l_i = l_i + tl.sum(p, 1) if not MASKED else l_i * alpha + tl.sum(p, 1)
""",
    "mma": """        m_ij = m_i
        p = s
        alpha = 1.0
    l_i = l_i if not MASKED else l_i * alpha + tl.sum(p, 1)
""",
}
PV_PROBE = "    acc = tl.dot(p, v, acc * alpha[:, None] if MASKED else acc)\n"


def load_variant(name: str, folder: str):
    """The forward module with its unmasked softmax step replaced by VARIANTS[name]."""
    src = open(KERNEL).read()
    for old in (SOFTMAX, PV):
        if src.count(old) != 1:
            raise SystemExit(f"{KERNEL} changed: the softmax step this probe rewrites was not found once; update SOFTMAX/PV")
    src = src.replace(SOFTMAX, VARIANTS[name]).replace(PV, PV_PROBE)
    path = os.path.join(folder, f"attention_fwd_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"attention_fwd_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    args = common.base_parser(__doc__).parse_args()
    out = common.out_dir(args.out)
    from fmha_ops.kernels.triton import attention_fwd

    folder = tempfile.mkdtemp()
    forwards = {"full": attention_fwd.attention_forward,
                **{n: load_variant(n, folder).attention_forward for n in VARIANTS}}
    rows = []
    for B, H, N, D, causal, target in SHAPES:
        torch.manual_seed(0)
        q = (torch.randn(B, N, H, D, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        k = (torch.randn(B, N, H, D, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        v = (torch.randn(B, H, D, N, device="cuda") * 0.5).to(torch.float8_e4m3fn).permute(0, 3, 1, 2)
        flops = 4 * B * H * N * N * D / (2 if causal else 1)
        row = {"shape": f"{B}x{H}x{N}x{D}" + (" causal" if causal else ""), "target": target}
        for name, fwd in forwards.items():
            def call(fwd=fwd):
                return fwd(q, k, v, scale=D ** -0.5, causal=causal)
            call()
            row[name] = flops / common.time_ms(call) / 1e9
        row["full_of_mma"] = row["full"] / row["mma"]
        row["target_of_mma"] = target / row["mma"]
        rows.append(row)
        common.print_table(rows[-1:], list(row))
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).T
    one = torch.ones((), device="cuda")
    gemm = 2 * 8192 ** 3 / common.time_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)) / 1e9
    for r in rows:
        r["gemm_fp8"] = gemm
    columns = ["shape", "full", "exp", "mma", "gemm_fp8", "target", "full_of_mma", "target_of_mma"]
    common.print_table(rows, columns)
    common.write_json(out, "attention_fwd_ceiling", rows)
    common.bar_plot(out, "attention_fwd_ceiling", rows, "shape", ["full", "exp", "mma", "target"], "TFLOP/s",
                    "fp8 forward loop with its softmax taken apart, H200")
    env = common.environment()
    lines = [f"## fp8 forward loop ceiling - {env.get('date')}, {env.get('gpu')}, torch {env.get('torch')}, "
             f"triton {env.get('triton')}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(common._fmt(r.get(c)) for c in columns) + " |" for r in rows]
    with open(os.path.join(out, "attention_fwd_ceiling.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
