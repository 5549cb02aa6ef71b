"""Gluon fp8 attention forwards (fmha_ops/kernels/gluon/attention_fwd.py, attention_fwd_ws.py) and their ops
``gluon_fp8F``, ``gluon_ws_fp8F``.

Gluon kernels do not run in the Triton interpreter, so the CPU suite checks only the op's declarations,
rejections and registry behaviour; the ``gpu`` tests (H200, sm90) check the kernel against a float32
reference on odd sizes, head dims 64/128/256, causal, GQA and both descale kinds.
"""
import dataclasses

import pytest
import torch

from registry.arch import CPU, Arch
from tests.compiled_child import run_compiled
from tests.conftest import HAS_CUDA
from fmha_ops.testing import error_report
from tests.test_kernel_attention_fwd import (
    _check_lse,
    _dq,
    _inputs,
    _poisoned,
    reference,
)

FP8 = torch.float8_e4m3fn
SM90 = Arch("cuda", (9, 0), name="NVIDIA H200")


def _problem(**kw):
    from fmha_ops.inputs import Inputs

    B, Mq, Mk, Hq, Hkv, D = kw.pop("shape", (2, 300, 300, 8, 2, 128))
    dt = kw.pop("dtype", FP8)
    q = torch.zeros(B, Mq, Hq, D).to(dt)
    k = torch.zeros(B, Mk, Hkv, D).to(dt)
    v = torch.zeros(B, Mk, Hkv, D).to(dt)
    return Inputs(query=q, key=k, value=v, **kw)


# ----------------------------------------------------------------------------------------- CPU suite


def test_op_registered_and_declared():
    from fmha_ops.dispatch import REGISTRY
    from fmha_ops.ops.gluon_attention import GluonFp8FwOp

    op = REGISTRY.get("gluon_fp8F")
    assert op is GluonFp8FwOp
    assert op.ARCHS == ("cuda>=9.0,<10.0",)
    assert set(op.HEAD_DIMS) == {64, 128, 256}
    assert op.DTYPES == frozenset({(FP8, FP8, FP8)})
    assert op.OUT_DTYPES == frozenset({torch.bfloat16, FP8})
    ws = REGISTRY.get("gluon_ws_fp8F")
    for name in ("ARCHS", "HEAD_DIMS", "DTYPES", "OUT_DTYPES", "BIAS_KINDS", "DESCALES", "GQA"):
        assert getattr(ws, name) == getattr(op, name), name  # the same contract, another schedule


def test_op_not_available_on_cpu():
    from fmha_ops.ops.gluon_attention import GluonFp8FwOp

    if not HAS_CUDA:
        assert GluonFp8FwOp.available() is not None


def test_op_supports_and_rejects():
    from fmha_ops import attn_bias as ab
    from fmha_ops.ops.gluon_attention import GluonFp8FwOp

    def reasons(**kw):
        return GluonFp8FwOp.not_supported_reasons(dataclasses.replace(_problem(**kw).problem(), arch=SM90))

    qd = torch.ones(2, 2)
    assert reasons(q_descale=qd, k_descale=qd, v_descale=qd) == []
    assert reasons(attn_bias=ab.LowerTriangularFromBottomRightMask()) == []
    one = torch.ones(1)
    assert reasons(output_dtype=FP8, q_descale=one, k_descale=one, v_descale=one) == []
    assert any("per-tensor v_descale" in r for r in reasons(output_dtype=FP8, q_descale=qd, k_descale=qd, v_descale=qd))
    assert any("head dim" in r for r in reasons(shape=(1, 64, 64, 2, 2, 96)))
    assert any("dtypes" in r for r in reasons(dtype=torch.bfloat16))
    assert any("attn_bias" in r for r in reasons(attn_bias=ab.LowerTriangularMask()))  # top-left causal
    varlen = ab.BlockDiagonalMask.from_seqlens([100, 200], [100, 200])
    assert any("attn_bias" in r for r in reasons(shape=(1, 300, 300, 2, 2, 128), attn_bias=varlen))


def test_op_rejects_other_archs():
    from fmha_ops.ops.gluon_attention import GluonFp8FwOp

    assert GluonFp8FwOp.supports_arch(SM90)
    for arch in (Arch("cuda", (8, 9)), Arch("cuda", (10, 0)), CPU):
        assert not GluonFp8FwOp.supports_arch(arch), arch


def test_launcher_finishes_empty_problems_and_rejects_bad_inputs():
    """prepare_launch: empty problems never reach a kernel (so this runs on a CPU)."""
    from fmha_ops.kernels.gluon.attention_fwd import attention_forward as fwd

    q, k = torch.randn(2, 0, 4, 64).to(FP8), torch.randn(2, 5, 2, 64).to(FP8)
    out, lse = fwd(q, k, k, scale=0.125, return_lse=True)
    assert out.shape == (2, 0, 4, 64) and out.dtype == torch.bfloat16 and lse.shape == (2, 4, 0)
    q = torch.randn(1, 3, 4, 64).to(FP8)
    out, lse = fwd(q, k[:1, :0], k[:1, :0], scale=0.125, return_lse=True)
    assert out.float().eq(0).all() and lse.eq(float("-inf")).all()
    out, _ = fwd(q, k[:1, :0], k[:1, :0], scale=0.125, out_dtype=FP8)
    assert out.dtype == FP8 and out.float().eq(0).all()
    with pytest.raises(TypeError, match="out_dtype"):
        fwd(q, k[:1], k[:1], scale=0.125, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="16-byte"):
        fwd(q, k[:1], k[:1], scale=0.125, out=torch.empty(1, 3, 4, 68, dtype=torch.bfloat16)[..., :64])
    with pytest.raises(ValueError, match="head dim"):
        fwd(torch.randn(1, 3, 4, 32).to(FP8), torch.randn(1, 5, 2, 32).to(FP8), torch.randn(1, 5, 2, 32).to(FP8),
            scale=1.0)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fwd(q.float(), k[:1], k[:1], scale=1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        fwd(torch.randn(1, 3, 3, 64).to(FP8), k[:1], k[:1], scale=1.0)


def test_ws_launcher_finishes_empty_problems_and_rejects_bad_configs():
    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    q, k = torch.randn(1, 3, 4, 64).to(FP8), torch.randn(1, 0, 2, 64).to(FP8)
    out, lse = ws.attention_forward(q, k, k, scale=0.125, return_lse=True)
    assert out.float().eq(0).all() and lse.eq(float("-inf")).all()
    for bad in (ws.WsFwdConfig(consumers=4), ws.WsFwdConfig(stages=1), ws.WsFwdConfig(block_n=224),
                ws.WsFwdConfig(block_n=192, v_transpose=True), ws.WsFwdConfig(dynamic=True, persistent=False)):
        with pytest.raises(ValueError, match="config"):
            ws.attention_forward(q, k, k, scale=0.125, config=bad)
    with pytest.raises(ValueError, match="head dim"):
        ws.attention_forward(torch.randn(1, 3, 4, 96).to(FP8), torch.randn(1, 5, 2, 96).to(FP8),
                             torch.randn(1, 5, 2, 96).to(FP8), scale=1.0)


def test_ws_default_config_by_keys():
    """192-key tiles on two consumers from ``LONG_KEYS`` keys when not causal (int8 q/k: issued without turns; at
    D64 three consumers on 128-key tiles), one
    consumer per CTA with 128-key tiles otherwise, causal tiles from the counter at every length;
    at D256 two consumers on 128-key tiles, persistent when dense, causal tiles in sections of heads."""
    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    long_dense = ws.default_config(128, False, ws.LONG_KEYS)
    assert (long_dense.block_n, long_dense.consumers, long_dense.persistent) == (192, 2, True)
    assert ws.default_config(64, False, None).block_n == 192
    for causal, keys in ((True, ws.LONG_KEYS), (False, ws.LONG_KEYS - 1), (False, 1000)):
        cfg = ws.default_config(128, causal, keys)
        assert (cfg.block_n, cfg.consumers, cfg.persistent, cfg.key_order) == (128, 1, True, True), (causal, keys)
    for causal, keys in ((False, ws.LONG_KEYS), (True, 1000)):
        cfg = ws.default_config(256, causal, keys)
        assert (cfg.block_n, cfg.consumers, cfg.persistent, cfg.key_order) == (128, 2, not causal, True), causal
        assert cfg.head_section == (ws.CAUSAL_HEAD_SECTION if causal else 0) and not cfg.dynamic
    for head_dim, causal, keys, dynamic in ((128, True, 4096, True), (64, True, None, True), (64, True, 256, True),
                                            (128, False, 1000, False)):
        cfg = ws.default_config(head_dim, causal, keys)
        assert (cfg.dynamic, cfg.head_section) == (dynamic, ws.CAUSAL_HEAD_SECTION if dynamic else 0), (causal, keys)
    i8_d64 = ws.default_config(64, False, ws.LONG_KEYS, qk_int8=True)
    assert (i8_d64.consumers, i8_d64.block_n, i8_d64.maxnreg) == (3, 128, ws.THREE_CONSUMER_MAXNREG)
    i8_d128 = ws.default_config(128, False, ws.LONG_KEYS, qk_int8=True)
    assert (i8_d128.consumers, i8_d128.block_n, i8_d128.free_issue) == (2, 192, True)
    assert not long_dense.free_issue


_SPILL_CHECK = """
import os, re, subprocess, sys, tempfile
import triton
from fmha_ops.kernels.gluon import attention_fwd_ws as ws
B, H, N = 4, 32, 4096  # a launch's ints at 4x4096x32 D128, fp8 with (B, Hkv) descales
ints = dict(stride_ob=H * 128, stride_om=H * 128, stride_oh=128, stride_lb=0, stride_lh=0, qd_sb=H, qd_sh=1, kd_sb=H,
            kd_sh=1, vd_sb=H, vd_sh=1, n_m=N // 128, n_total=N // 128 * B * H, Mq=N, Mk=N, Hq=H, GROUP=1)
cfg = ws.WsFwdConfig(block_n=192, persistent=True, key_order=True)
ptx = ws.compile_sm90(128, config=cfg, launch_ints=ints).asm["ptx"]
path = os.path.join(tempfile.mkdtemp(), "k.ptx")
open(path, "w").write(ptx)
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", path + ".o"], capture_output=True, text=True,
                     check=True).stderr
print(re.search(r"(\\d+) bytes spill stores", err).group(1))
"""


#: spill stores the dense 192-key fp8 consumer may keep: one register, saved and restored once per masked tile (a
#: sequence's partial last tile), with the per-lane row sums
SPILL_ALLOWANCE_BYTES = 16


def test_ws_kernel_compiled_as_launched_spills_at_most_one_register():
    """The dense 192-key fp8 consumer compiled with a launch's specialization (ints, aligned pointers) spills at
    most ``SPILL_ALLOWANCE_BYTES``. With Mk specialized on divisibility by 16 ptxas spilled 1008 B there (488-530
    TFLOP/s on the H100 where the int8 tiles ran 730-791), so the kernel leaves Mk unspecialized. In a child
    process without ``TRITON_INTERPRET``."""
    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    assert [p.name for p in ws._attn_fwd_ws_kernel.params if p.do_not_specialize] == ["Mk"]
    run = run_compiled(_SPILL_CHECK, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) <= SPILL_ALLOWANCE_BYTES, run.stdout


_COMPILE_CHECK = """
import dataclasses, sys
from fmha_ops.kernels.gluon import attention_fwd_ws as ws
head_dim, causal, consumers, v_transpose = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4] == "1"
persistent, qk_int8, block_n = sys.argv[5] == "1", sys.argv[6] == "1", int(sys.argv[7])
direct, dynamic = sys.argv[8] == "1", sys.argv[9] == "1"
cfg = ws.WsFwdConfig(block_n=block_n or (128 if head_dim <= 128 else 64), v_transpose=v_transpose,
                     key_order=v_transpose, persistent=persistent, direct_store=direct, dynamic=dynamic)
if consumers == 1:
    cfg = dataclasses.replace(cfg, consumers=1, maxnreg=ws.SINGLE_CONSUMER_MAXNREG[head_dim])
elif consumers == 3:
    cfg = dataclasses.replace(cfg, consumers=3, block_n=64, maxnreg=ws.THREE_CONSUMER_MAXNREG,
                              consumer_regs=ws.THREE_CONSUMER_REGS)
kernel = ws.compile_sm90(head_dim, causal=causal, write_lse=True, config=cfg, qk_int8=qk_int8)
assert "wgmma" in kernel.asm["ptx"] and kernel.asm["cubin"]
assert ("wgmma.mma_async.sync.aligned.m64n" in kernel.asm["ptx"]) and (".s32.s8.s8" in kernel.asm["ptx"]) == qk_int8
assert kernel.metadata.num_warps == 4 * (consumers + 1), kernel.metadata.num_warps  # + the producer's warpgroup
# the direct store writes the output with st.global from registers, no TMA store from shared memory
assert ("cp.async.bulk.tensor.4d.global.shared" in kernel.asm["ptx"]) != direct
# the persistent grid's CTAs per SM come from this estimate: it must not undercount
assert cfg.shared_bytes(head_dim) >= kernel.metadata.shared, (cfg.shared_bytes(head_dim), kernel.metadata.shared)
print("compiled")
"""


_SECTIONS_CHECK = """
import dataclasses
from fmha_ops.kernels.gluon import attention_fwd_ws as ws
cfg = dataclasses.replace(ws.default_config(128, True, 4096), head_section=8, persistent=False)
kernel = ws.compile_sm90(128, causal=True, config=cfg)
assert "wgmma" in kernel.asm["ptx"] and kernel.asm["cubin"]
print("compiled")
"""


def test_ws_kernel_with_head_sections_compiles_for_sm90():
    """Causal tiles ordered across sections of (batch, head) pairs (``WsFwdConfig.head_section``): the producer's
    and the consumer's tile walks compile for sm90 (their GPU test: ``test_gpu_gluon_ws_i8fp8[head_sections]``)."""
    run = run_compiled(_SECTIONS_CHECK, timeout=300)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


_FREE_ISSUE_CHECK = """
import json
from bench.diagnostics import sass_compare as sc
from bench.diagnostics.aot import sass_instructions
rows = []
for free in (False, True):
    k = sc.ours_sass(64, {"free_issue": free})
    rows.append(sc.loop_report(sc.steady_iteration(sass_instructions(k["sass"])), k["tile"][1]))
print(json.dumps(rows))
"""


def test_ws_free_issue_drops_the_turn_from_the_key_loop():
    """``WsFwdConfig.free_issue`` on the D64 long-key schedule (two consumers, 192-key tiles), compiled for sm90:
    the unmasked key-loop iteration (``bench/diagnostics/sass_compare.py``) loses the turn's mbarrier wait, its
    arrive and the warpgroup barrier before that arrive, and keeps its wgmmas and exponentials (its GPU test:
    ``test_gpu_gluon_ws_free_issue``)."""
    import json

    run = run_compiled(_FREE_ISSUE_CHECK, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ordered, free = json.loads(run.stdout.splitlines()[-1])
    for key in ("S_wgmma", "PV_wgmma", "MUFU.EX2", "F2FP"):
        assert free[key] == ordered[key], key
    for key in ("mbar_wait", "mbar_arrive", "BAR.SYNC"):
        assert free[key] == ordered[key] - 1, (key, ordered[key], free[key])
    assert free["instr"] < ordered["instr"]


_EARLY_P8_SPAN_CHECK = """
import json
from bench.diagnostics import sass_compare as sc
from bench.diagnostics.aot import sass_instructions
rows = []
for d in (64, 128):
    for early in (False, True):
        k = sc.ours_sass(d, {"early_p8": early})
        row = sc.loop_report(sc.steady_iteration(sass_instructions(k["sass"])), k["tile"][1])
        row["regs"] = k["regs"]
        rows.append(row)
print(json.dumps(rows))
"""


def test_ws_early_p8_shortens_the_turn():
    """``WsFwdConfig.early_p8`` on the D64 and D128 long-key schedules (two consumers, 192-key tiles), compiled
    for sm90: in the unmasked key-loop iteration (``bench/diagnostics/sass_compare.py``) a consumer holds the turn
    (its mbarrier wait to its last wgmma) for at most 70 instructions, from over 100 with the conversion before the
    wgmmas; the wgmmas stay pipelined (the same waits), the registers and the instruction
    count do not grow (its GPU test: ``test_gpu_gluon_ws_early_p8``)."""
    import json

    run = run_compiled(_EARLY_P8_SPAN_CHECK, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.splitlines()[-1])
    for late, early in (rows[0:2], rows[2:4]):
        assert late["issue_span"] > 100 and early["issue_span"] <= 70, (late["issue_span"], early["issue_span"])
        for key in ("waits", "S_wgmma", "PV_wgmma", "MUFU.EX2", "F2FP", "regs"):
            assert early[key] == late[key], (key, late[key], early[key])
        assert early["instr"] <= late["instr"], (late["instr"], early["instr"])


_EARLY_P8_COMPILE_CHECK = """
import dataclasses
from fmha_ops.kernels.gluon import attention_fwd_ws as ws
for d, causal, i8 in ((128, True, False), (64, False, True), (256, False, False)):
    cfg = dataclasses.replace(ws.default_config(d, causal, 4096, qk_int8=i8), early_p8=True)
    kernel = ws.compile_sm90(d, causal=causal, config=cfg, qk_int8=i8)
    assert "wgmma" in kernel.asm["ptx"] and kernel.asm["cubin"]
print("compiled")
"""


def test_ws_early_p8_compiles_for_sm90():
    """``WsFwdConfig.early_p8`` with the one-consumer causal schedule (D128), int8 Q / K (D64, 128-key tiles) and
    D256: the packed loop-carried P compiles for sm90."""
    run = run_compiled(_EARLY_P8_COMPILE_CHECK, timeout=300)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


_ROW_SUM_LOOP_CHECK = """
import json
from bench.diagnostics import sass_compare as sc
from bench.diagnostics.aot import sass_instructions
rows = []
for on in (False, True):
    k = sc.ours_sass(128, {"row_sum_mma": on})
    row = sc.loop_report(sc.steady_iteration(sass_instructions(k["sass"])), k["tile"][1])
    row["regs"] = k["regs"]
    rows.append(row)
print(json.dumps(rows))
"""


def test_ws_row_sum_mma_drops_the_fadds():
    """``WsFwdConfig.row_sum_mma`` on the D128 long-key schedule (two consumers, 192-key tiles), compiled for sm90:
    the unmasked key-loop iteration (``bench/diagnostics/sass_compare.py``) adds the two parts' row-sum wgmmas
    (m64n8k32: 4 + 2, A from registers), waits for the S pair with those and the two P V parts outstanding, and
    loses the FADD per score of the softmax's row sums (98 -> at most 8); no more registers, 647 -> 563
    instructions (its GPU test: ``test_gpu_gluon_ws_row_sum_mma``)."""
    import json

    run = run_compiled(_ROW_SUM_LOOP_CHECK, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    off, on = json.loads(run.stdout.splitlines()[-1])
    assert on["PV_wgmma"] == 2 * off["PV_wgmma"], (off["PV_wgmma"], on["PV_wgmma"])  # the row sums read P too
    assert on["S_wgmma"] == off["S_wgmma"] and on["MUFU.EX2"] == off["MUFU.EX2"]
    assert off["waits"] == "0x2 0x0" and on["waits"] == "0x4 0x0", (off["waits"], on["waits"])
    assert off["FADD"] >= on["scores"] and on["FADD"] <= 8, (off["FADD"], on["FADD"])
    # one FADD per score gone; four FMULs (acc_l * alpha), six wgmmas and their arrive added
    assert on["regs"] <= off["regs"], (off["regs"], on["regs"])
    assert on["instr"] <= off["instr"] - 3 * on["scores"] // 4, (off["instr"], on["instr"])


_ROW_SUM_COMPILE_CHECK = """
import dataclasses
from fmha_ops.kernels.gluon import attention_fwd_ws as ws
ONES = str(int.from_bytes(bytes([ws.E4M3_ONE.value] * 4), "little"))  # the tile of ones as stored words
for d, causal, i8, early in ((128, True, False, True), (64, False, True, False), (256, False, False, False),
                             (64, False, False, True), (256, True, True, True)):
    cfg = dataclasses.replace(ws.default_config(d, causal, 4096, qk_int8=i8), early_p8=early, row_sum_mma=True)
    kernel = ws.compile_sm90(d, causal=causal, config=cfg, qk_int8=i8, write_lse=True)
    ptx = kernel.asm["ptx"]
    assert cfg.shared_bytes(d) >= kernel.metadata.shared, (d, cfg.shared_bytes(d), kernel.metadata.shared)
    assert "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3" in ptx, (d, causal, i8)
    assert ptx.count("{" + ONES + ", " + ONES + "}") == (2 if cfg.block_b else 1), (d, causal, i8)
print("compiled")
"""


def test_ws_row_sum_mma_compiles_for_sm90():
    """``WsFwdConfig.row_sum_mma`` with the one-consumer causal schedule (D128, early P8), int8 Q / K (D64,
    128-key tiles), D256 (fp8 not causal; int8 causal with early P8) and the 192-key two-part tiles (D64, early
    P8) compiles for sm90: m64n8k32 row-sum wgmmas, each tile of ones stored as e4m3 1.0 bytes (one tile per key
    part), within ``shared_bytes``."""
    run = run_compiled(_ROW_SUM_COMPILE_CHECK, timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


_DYNAMIC_CHECK = """
import dataclasses, os, re, subprocess, sys, tempfile
import triton
from fmha_ops.kernels.gluon import attention_fwd_ws as ws
head_dim, qk_int8 = int(sys.argv[1]), sys.argv[2] == "1"
B, H, N = 4, 32, 4096  # a launch's ints at 4x4096x32 causal, (B, Hkv) descales
base = dataclasses.replace(ws.default_config(head_dim, True, N, qk_int8=qk_int8), persistent=True, dynamic=False,
                           head_section=0)
n_m = N // (64 * base.consumers)
ints = dict(stride_ob=H * head_dim, stride_om=H * head_dim, stride_oh=head_dim, stride_lb=0, stride_lh=0, qd_sb=H,
            qd_sh=1, kd_sb=H, kd_sh=1, vd_sb=H, vd_sh=1, n_m=n_m, n_total=n_m * B * H, Mq=N, Mk=N, Hq=H, GROUP=1)
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
for cfg in (base, dataclasses.replace(base, dynamic=True, head_section=8)):
    kernel = ws.compile_sm90(head_dim, causal=True, config=cfg, qk_int8=qk_int8, launch_ints=ints)
    ptx = kernel.asm["ptx"]
    assert ("atom.global.gpu.relaxed.add" in ptx) == cfg.dynamic
    assert cfg.shared_bytes(head_dim) >= kernel.metadata.shared, (cfg.shared_bytes(head_dim), kernel.metadata.shared)
    path = os.path.join(tempfile.mkdtemp(), "k.ptx")
    open(path, "w").write(ptx)
    err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", path + ".o"], capture_output=True,
                         text=True, check=True).stderr
    print(re.search(r"(\\d+) bytes spill stores", err).group(1))
"""


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("qk_int8", [False, True], ids=["fp8", "int8"])
def test_ws_dynamic_tiles_compile_for_sm90_without_more_spills(head_dim, qk_int8):
    """``WsFwdConfig.dynamic`` (tiles taken from a launch-wide counter, heaviest first across sections of 8 heads)
    on the causal schedule ``default_config`` picks, made persistent: compiled as launched at 4x4096x32, it spills
    at most ``SPILL_ALLOWANCE_BYTES`` more than the same schedule on fixed strides (ptxas, spill stores; at the
    time of writing 0 / 0 at D64 and D128, 140 / 152 fp8 and 0 / 4 int8 at D256)."""
    run = run_compiled(_DYNAMIC_CHECK, str(head_dim), str(int(qk_int8)), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    strided, dynamic = map(int, run.stdout.split()[-2:])
    print(f"D{head_dim} {'int8' if qk_int8 else 'fp8'}: spill stores {dynamic} B dynamic, {strided} B strided")
    assert dynamic <= strided + SPILL_ALLOWANCE_BYTES, (dynamic, strided)


@pytest.mark.parametrize("head_dim,causal,consumers,v_transpose,persistent,qk_int8,block_n,direct,dynamic",
                         [(128, True, 2, False, False, False, 0, False, False),
                          (64, False, 1, False, False, False, 0, False, False),
                          (64, True, 3, False, False, False, 0, False, False),
                          (256, True, 2, True, False, False, 0, False, False),
                          (128, True, 2, False, True, True, 192, False, False),
                          (128, False, 1, False, True, True, 192, True, False),
                          (128, True, 2, True, True, False, 0, False, True)])
def test_ws_kernel_compiles_for_sm90(head_dim, causal, consumers, v_transpose, persistent, qk_int8, block_n, direct,
                                     dynamic):
    """Ahead-of-time sm90 compile (no GPU): Gluon front end, Triton passes and ptxas accept the kernel (the
    persistent grid's tile loop, int8 q / k on the s8 wgmma, 192-key tiles in two parts, the output stored from
    registers, tiles taken from a counter by a V-transposing producer warpgroup). In a child process without
    ``TRITON_INTERPRET`` (interpreted helpers cannot be called from a compiled kernel)."""
    run = run_compiled(_COMPILE_CHECK, str(head_dim), str(int(causal)), str(consumers), str(int(v_transpose)),
                       str(int(persistent)), str(int(qk_int8)), str(block_n), str(int(direct)), str(int(dynamic)),
                       timeout=300)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


# ----------------------------------------------------------------------------------------- GPU suite

GPU_SHAPES = [  # B, Mq, Mk, Hq, Hkv, D, causal
    (1, 1, 1, 1, 1, 128, False),
    (2, 17, 1000, 4, 2, 128, False),
    (2, 1000, 17, 4, 2, 128, True),
    (1, 4097, 4097, 8, 1, 128, True),
    (2, 1000, 4097, 6, 3, 64, False),
    (1, 4097, 1000, 8, 2, 64, True),
    (2, 1000, 1000, 4, 4, 256, False),
    (1, 17, 4097, 8, 8, 256, True),
    (1, 4097, 4097, 8, 4, 256, False),
    (3, 257, 383, 16, 2, 128, False),
]


def _check_fp8_forward(attention_forward, shape, descale):
    """``attention_forward`` (a Gluon fp8 launcher) against the float32 reference of the dequantized inputs."""
    from fmha_ops.quant import quantize_qkv_fp8

    B, Mq, Mk, Hq, Hkv, D, causal = shape
    q, k, v = _inputs("normal" if descale == "head" else "transformer_like", B, Mq, Mk, Hq, Hkv, D, D,
                      torch.bfloat16, seed=Mq + Mk)
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
    if descale == "tensor":
        qf, kf, vf = (x.float() for x in (q, k, v))
        qd, kd, vd = (x.abs().amax().reshape(1) / 448.0 for x in (qf, kf, vf))
        q8, k8, v8 = ((x / d).to(FP8) for x, d in ((qf, qd), (kf, kd), (vf, vd)))
    scale = D ** -0.5
    ref, ref_lse = reference(_dq(q8, qd, Hq // Hkv), _dq(k8, kd), _dq(v8, vd), scale, causal)
    o, lse = attention_forward(q8, k8, v8, scale=scale, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                               return_lse=True, out=_poisoned(B, Mq, Hq, D, torch.bfloat16))
    e = error_report(o, ref)
    print(f"\n{shape} {descale}: {e}")
    assert not torch.isnan(o).any(), "unwritten or NaN output"
    assert e["rel"] < 4e-2 and e["cos"] > 0.999, e  # P in fp8 (3 mantissa bits), imprecise fp8 accumulation
    # transformer-like inputs have logits in the hundreds: the fp8 MMA's imprecise accumulation moves them by
    # ~1e-3 relative (the Triton fp8 kernel's LSE agrees with ours to 1e-3: test_gpu_gluon_matches_triton_fp8)
    _check_lse(lse, ref_lse, 2e-2 if descale == "head" else 2e-3 * ref_lse.abs().max().item() + 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("descale", ["head", "tensor"])
def test_gpu_gluon_fwd(shape, descale):
    from fmha_ops.kernels.gluon.attention_fwd import attention_forward

    _check_fp8_forward(attention_forward, shape, descale)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("descale", ["head", "tensor"])
@pytest.mark.parametrize("consumers,v_transpose,key_order,persistent,block_n,direct",
                         [(2, False, False, False, 0, False), (2, True, False, False, 0, False),
                          (2, True, True, False, 0, False), (2, False, True, False, 0, False),
                          (1, True, True, False, 0, False), (1, False, False, False, 0, False),
                          (3, False, False, False, 0, False), (2, False, False, True, 0, False),
                          (2, False, True, True, 0, False), (1, True, True, True, 0, False),
                          (1, False, True, True, 0, False), (3, False, False, True, 0, False),
                          (2, False, True, True, 192, False), (2, False, False, False, 192, False),
                          (1, False, True, True, 192, True), (1, True, True, False, 0, True)],
                         ids=lambda v: str(v))
def test_gpu_gluon_ws_fwd(shape, descale, consumers, v_transpose, key_order, persistent, block_n, direct):
    """The warp-specialized kernel: ping-pong (2 or 3 consumer warpgroups) and single-consumer schedules, V^T
    from ``transpose_v`` or transposed in shared memory by the producer warpgroup, keys in order or in the S
    accumulator's order, one CTA per tile or a persistent grid (each CTA several tiles, rings and turns running
    on across them), 192-key tiles in two parts (``block_n`` 192; D <= 128: D256's accumulators leave no room),
    the output stored from the consumers' registers (``direct``)."""
    import functools

    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    if block_n and shape[5] == 256:
        pytest.skip("192-key tiles: S (96) + O (128) + P (24) registers exceed a D256 consumer's 240")
    cfg = ws.WsFwdConfig(block_n=block_n or (128 if shape[5] <= 128 else 64), v_transpose=v_transpose,
                         key_order=key_order, persistent=persistent, direct_store=direct)
    if consumers == 1:
        cfg = dataclasses.replace(cfg, consumers=1, maxnreg=ws.SINGLE_CONSUMER_MAXNREG[shape[5]])
    elif consumers == 3:
        if shape[5] == 256:
            pytest.skip("three 64-row consumers do not fit D256's accumulators in 160 registers")
        cfg = dataclasses.replace(cfg, consumers=3, block_n=64, maxnreg=ws.THREE_CONSUMER_MAXNREG,
                                  consumer_regs=ws.THREE_CONSUMER_REGS)
    _check_fp8_forward(functools.partial(ws.attention_forward, config=cfg), shape, descale)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES + [(2, 3000, 3000, 8, 1, 128, True)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("schedule", ["default", "persistent", "persistent_key_order", "persistent_192",
                                      "single_192_direct", "head_sections", "free_192", "three_128"])
def test_gpu_gluon_ws_i8fp8(shape, schedule):
    """i8fp8 (int8 q / k with (B, Hkv) descales, s8 wgmma into int32; fp8 v) through the same kernel body,
    against the float64 reference of the dequantized inputs, on fresh normal inputs. ``head_sections``: causal
    tiles ordered heaviest first across sections of 3 (batch, head) pairs (a partial last section where the pairs
    do not divide), on a grid of one CTA per tile. ``free_192`` / ``three_128``: the long-key schedules of int8 at
    D128 (two consumers without turns, 192-key tiles) and D64 (three consumers, 128-key tiles) at every shape."""
    from fmha_ops.kernels.gluon import attention_fwd_ws as ws
    from fmha_ops.quant import quantize_i8fp8

    B, Mq, Mk, Hq, Hkv, D, causal = shape
    q, k, v = _inputs("normal", B, Mq, Mk, Hq, Hkv, D, D, torch.bfloat16, seed=Mq * 7 + Mk)
    i8 = quantize_i8fp8(q, k, v, qk_granularity="head", v_granularity="tensor")
    cfg = None
    if ("192" in schedule or schedule == "three_128") and D == 256:
        pytest.skip("192-key tiles and three consumers: D <= 128")
    if schedule == "head_sections":
        cfg = dataclasses.replace(ws.default_config(D, causal, Mk, qk_int8=True), head_section=3, persistent=False,
                                  dynamic=False)
    elif schedule == "single_192_direct":
        cfg = ws.WsFwdConfig(consumers=1, maxnreg=ws.SINGLE_CONSUMER_MAXNREG[D], block_n=192, key_order=True,
                             persistent=True, direct_store=True)
    elif schedule == "free_192":
        cfg = ws.default_config(128, False, ws.LONG_KEYS, qk_int8=True)
    elif schedule == "three_128":
        cfg = ws.default_config(64, False, ws.LONG_KEYS, qk_int8=True)
    elif schedule != "default":
        cfg = ws.WsFwdConfig(block_n=192 if schedule == "persistent_192" else 128 if D <= 128 else 64,
                             persistent=True, key_order=schedule == "persistent_key_order")
    ref, ref_lse = reference(_dq(i8.q, i8.q_descale, Hq // Hkv).double(), _dq(i8.k, i8.k_descale).double(),
                             _dq(i8.v, i8.v_descale).double(), 1.0, causal, dtype=torch.float64)
    o, lse = ws.attention_forward(i8.q, i8.k, i8.v, scale=1.0, causal=causal, q_descale=i8.q_descale,
                                  k_descale=i8.k_descale, v_descale=i8.v_descale, return_lse=True, config=cfg,
                                  out=_poisoned(B, Mq, Hq, D, torch.bfloat16))
    e = error_report(o, ref)
    print(f"\n{shape} i8fp8 {schedule}: {e}")
    assert not torch.isnan(o).any(), "unwritten or NaN output"
    assert e["rel"] < 4e-2 and e["cos"] > 0.999, e
    _check_lse(lse, ref_lse, 2e-2)


DYNAMIC_SHAPES = [  # B, Mq, Mk, Hq, Hkv, D, all causal: 1 / 17 / 1000 / 3000 rows, GQA 1 / 4 / 8, D 64 / 128 / 256
    (1, 1, 1, 1, 1, 128),
    (2, 17, 1000, 4, 1, 128),
    (1, 17, 17, 8, 2, 64),
    (2, 1000, 1000, 6, 3, 64),  # 12 (batch, head) pairs: a partial last section of 8
    (2, 1000, 17, 4, 4, 256),
    (3, 3000, 3000, 8, 8, 128),  # 1128 tiles: most taken from the counter
    (1, 3000, 3000, 8, 1, 256),
]


def _quantized(qk, q, k, v):
    """(q8, k8, v8, q_descale, k_descale, v_descale, scale): fp8 with (B, Hkv) descales, or i8fp8 (int8 q / k with
    (B, Hkv) descales, fp8 v per tensor)."""
    from fmha_ops.quant import quantize_i8fp8, quantize_qkv_fp8

    if qk == "int8":
        i8 = quantize_i8fp8(q, k, v, qk_granularity="head", v_granularity="tensor")
        return i8.q, i8.k, i8.v, i8.q_descale, i8.k_descale, i8.v_descale, i8.softmax_scale
    return (*quantize_qkv_fp8(q, k, v), q.shape[-1] ** -0.5)


def _dynamic_config(D, Mk, qk):
    """The causal schedule ``default_config`` picks, on a persistent grid taking tiles from the counter, heaviest
    first across sections of 8 (batch, head) pairs."""
    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    return dataclasses.replace(ws.default_config(D, True, Mk, qk_int8=qk == "int8"), persistent=True, dynamic=True,
                               head_section=8)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", DYNAMIC_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("qk", ["fp8", "int8"])
def test_gpu_gluon_ws_dynamic_tiles(shape, qk):
    """``WsFwdConfig.dynamic``: against the float64 reference of the dequantized inputs, twice in a row: the
    counters are back to zero after each launch (the last CTA resets them) and the second output equals the first
    bit for bit (a tile's result does not depend on the CTA that takes it)."""
    from fmha_ops.kernels.gluon import attention_fwd_ws as ws
    from fmha_ops.kernels.tile_counter import tile_counters

    B, Mq, Mk, Hq, Hkv, D = shape
    q8, k8, v8, qd, kd, vd, scale = _quantized(qk, *_inputs("normal", B, Mq, Mk, Hq, Hkv, D, D, torch.bfloat16,
                                                            seed=Mq * 5 + Mk))
    ref, ref_lse = reference(_dq(q8, qd, Hq // Hkv).double(), _dq(k8, kd).double(), _dq(v8, vd).double(), scale,
                             True, dtype=torch.float64)
    outs = []
    for _ in range(2):
        o, lse = ws.attention_forward(q8, k8, v8, scale=scale, causal=True, q_descale=qd, k_descale=kd,
                                      v_descale=vd, return_lse=True, config=_dynamic_config(D, Mk, qk),
                                      out=_poisoned(B, Mq, Hq, D, torch.bfloat16))
        assert tile_counters(q8.device).eq(0).all(), "the counters must be reset by the launch's last CTA"
        e = error_report(o, ref)
        print(f"\n{shape} {qk} dynamic: {e}")
        assert not torch.isnan(o).any(), "unwritten or NaN output"
        assert e["rel"] < 4e-2 and e["cos"] > 0.999, e
        _check_lse(lse, ref_lse, 2e-2)
        outs.append(o)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [True, False], ids=["stream_warmed", "cold_stream"])
def test_gpu_gluon_ws_dynamic_tiles_in_cuda_graph(warm):
    """Captured in a CUDA graph and replayed three times, the dynamic schedule gives the eager output, on a stream
    that ran it before the capture and on a fresh one (a zeroed pair of the graph's own either way), with eager
    launches on the capture stream between replays."""
    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    B, Mq, Mk, Hq, Hkv, D = DYNAMIC_SHAPES[5]
    q8, k8, v8, qd, kd, vd, scale = _quantized("int8", *_inputs("normal", B, Mq, Mk, Hq, Hkv, D, D, torch.bfloat16,
                                                                seed=11))
    kw = {"scale": scale, "causal": True, "q_descale": qd, "k_descale": kd, "v_descale": vd,
          "config": _dynamic_config(D, Mk, "int8")}
    eager, _ = ws.attention_forward(q8, k8, v8, **kw)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    if warm:
        with torch.cuda.stream(stream):
            ws.attention_forward(q8, k8, v8, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured, _ = ws.attention_forward(q8, k8, v8, **kw)
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        with torch.cuda.stream(stream):
            ws.attention_forward(q8, k8, v8, **kw)
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES + [(2, 5000, 5000, 4, 2, 128, True), (1, 4500, 4500, 4, 2, 128, False)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_gluon_ws_fwd_default_schedule(shape):
    """The schedule ``default_config`` picks from the head dim and the keys (one consumer per CTA on a persistent
    grid at D <= 128, two consumers with 192-key tiles from ``LONG_KEYS`` keys when not causal, two at D256)."""
    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    _check_fp8_forward(ws.attention_forward, shape, "tensor")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [s for s in GPU_SHAPES if s[5] <= 128], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("consumers", [2, 3])
def test_gpu_gluon_ws_free_issue(shape, consumers):
    """Consumers that issue their wgmmas without taking turns (``WsFwdConfig.free_issue``): two with 192-key tiles
    (the long-key schedule at D <= 128) and three with 128-key tiles, on the persistent grid in key order."""
    import functools

    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    cfg = ws.WsFwdConfig(block_n=192, persistent=True, key_order=True, free_issue=True)
    if consumers == 3:
        cfg = dataclasses.replace(cfg, consumers=3, block_n=128, maxnreg=ws.THREE_CONSUMER_MAXNREG,
                                  consumer_regs=ws.THREE_CONSUMER_REGS)
    _check_fp8_forward(functools.partial(ws.attention_forward, config=cfg), shape, "tensor")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [s for s in GPU_SHAPES if s[5] <= 128], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("consumers", [1, 2])
def test_gpu_gluon_ws_early_p8(shape, consumers):
    """P converted to fp8 at the end of each key-loop iteration and carried packed (``WsFwdConfig.early_p8``): two
    consumers with 192-key tiles (the long-key schedule at D <= 128, taking turns) and one with 128-key tiles."""
    import functools

    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    cfg = ws.WsFwdConfig(block_n=192, persistent=True, key_order=True, early_p8=True)
    if consumers == 1:
        cfg = dataclasses.replace(cfg, consumers=1, block_n=128, maxnreg=ws.SINGLE_CONSUMER_MAXNREG[shape[5]])
    _check_fp8_forward(functools.partial(ws.attention_forward, config=cfg), shape, "tensor")


ROW_SUM_SHAPES = [  # B, Mq, Mk, Hq, Hkv, D, causal: 1 / 17 / 1000 / 3000 rows and keys, GQA 1 / 2 / 4 / 8
    (1, 1, 1, 1, 1, 128, False),
    (2, 17, 1000, 4, 1, 128, False),
    (2, 1000, 17, 4, 2, 64, True),
    (2, 1000, 1000, 6, 3, 64, False),
    (1, 3000, 3000, 8, 2, 128, True),
    (1, 17, 3000, 8, 8, 64, False),
    (2, 1000, 1000, 4, 1, 256, True),
    (1, 3000, 3000, 4, 4, 256, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ROW_SUM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("qk", ["fp8", "int8"])
@pytest.mark.parametrize("schedule", ["default", "default_early_p8", "two_part", "two_part_early_p8"])
def test_gpu_gluon_ws_row_sum_mma(shape, qk, schedule):
    """P's row sums on the tensor cores (``WsFwdConfig.row_sum_mma``) against the float64 reference of the
    dequantized inputs, output and LSE: the schedule ``default_config`` picks for the shape (one consumer at D <= 128
    and fewer than ``LONG_KEYS`` keys, two at D256), or two consumers with 192-key two-part tiles (D <= 128), each
    with P converted early (``early_p8``) or not."""
    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    B, Mq, Mk, Hq, Hkv, D, causal = shape
    if schedule.startswith("two_part") and D > 128:
        pytest.skip("192-key tiles: D <= 128")
    q8, k8, v8, qd, kd, vd, scale = _quantized(qk, *_inputs("normal", B, Mq, Mk, Hq, Hkv, D, D, torch.bfloat16,
                                                            seed=Mq * 3 + Mk))
    if schedule.startswith("two_part"):
        cfg = ws.WsFwdConfig(block_n=192, persistent=True, key_order=True)
    else:
        cfg = ws.default_config(D, causal, Mk, qk_int8=qk == "int8")
    cfg = dataclasses.replace(cfg, row_sum_mma=True, early_p8=schedule.endswith("early_p8"))
    ref, ref_lse = reference(_dq(q8, qd, Hq // Hkv).double(), _dq(k8, kd).double(), _dq(v8, vd).double(), scale,
                             causal, dtype=torch.float64)
    o, lse = ws.attention_forward(q8, k8, v8, scale=scale, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                  return_lse=True, config=cfg, out=_poisoned(B, Mq, Hq, D, torch.bfloat16))
    e = error_report(o, ref)
    print(f"\n{shape} {qk} {schedule} row_sum_mma: {e}")
    assert not torch.isnan(o).any(), "unwritten or NaN output"
    assert e["rel"] < 4e-2 and e["cos"] > 0.999, e
    # the sums are of the fp8 P (3 mantissa bits): the LSE of a row of 2-5 keys moves by up to ~0.03 (float64
    # simulation of N(0, 1) scores: 1% of such rows beyond 0.02), of a row of 1000 keys by 0.005
    _check_lse(lse, ref_lse, 4e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [GPU_SHAPES[1], GPU_SHAPES[5], GPU_SHAPES[6], GPU_SHAPES[9]],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kernel", ["gluon", "ws", "ws_vtko"])
def test_gpu_fp8_output_in_v_units(shape, kernel):
    """out_dtype=float8_e4m3fn: the output in v's units, attention = out.float() * v_descale (per tensor)."""
    import functools

    from fmha_ops.kernels.gluon import attention_fwd as sp
    from fmha_ops.kernels.gluon import attention_fwd_ws as ws

    B, Mq, Mk, Hq, Hkv, D, causal = shape
    q, k, v = _inputs("normal", B, Mq, Mk, Hq, Hkv, D, D, torch.bfloat16, seed=Mq + 2 * Mk)
    qd, kd, vd = (x.float().abs().amax().reshape(1) / 448.0 for x in (q, k, v))
    q8, k8, v8 = ((x.float() / d).to(FP8) for x, d in ((q, qd), (k, kd), (v, vd)))
    vtko = ws.WsFwdConfig(block_n=128 if D <= 128 else 64, v_transpose=True, key_order=True)
    fwd = {"gluon": sp.attention_forward, "ws": ws.attention_forward,
           "ws_vtko": functools.partial(ws.attention_forward, config=vtko)}[kernel]
    kw = {"scale": D ** -0.5, "causal": causal, "q_descale": qd, "k_descale": kd, "v_descale": vd}
    o8, _ = fwd(q8, k8, v8, out_dtype=FP8, **kw)
    o16, _ = fwd(q8, k8, v8, **kw)
    assert o8.dtype == FP8 and o8.shape == (B, Mq, Hq, D)
    ref, _ = reference(_dq(q8, qd, Hq // Hkv), _dq(k8, kd), _dq(v8, vd), D ** -0.5, causal)
    e = error_report(o8.float() * vd, ref)
    assert e["rel"] < 8e-2 and e["cos"] > 0.998, e  # and the output's own e4m3 rounding
    # the bf16 output rounded to e4m3 in v's units is the fp8 output, up to one rounding step
    assert ((o16.float() / vd).to(FP8).float() - o8.float()).abs().max().item() <= 32.0


@pytest.mark.gpu
def test_gpu_gluon_matches_triton_fp8():
    """Same function as the Triton fp8 kernel (same P quantization) up to accumulation order."""
    from fmha_ops.kernels.gluon.attention_fwd import attention_forward
    from fmha_ops.kernels.triton.attention_fwd import attention_forward as triton_fwd
    from fmha_ops.quant import quantize_qkv_fp8

    q, k, v = _inputs("transformer_like", 2, 2048, 3000, 8, 2, 128, 128, torch.bfloat16, seed=3)
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
    for causal in (False, True):
        kw = {"scale": 128 ** -0.5, "causal": causal, "q_descale": qd, "k_descale": kd, "v_descale": vd,
              "return_lse": True}
        o, lse = attention_forward(q8, k8, v8, **kw)
        o_t, lse_t = triton_fwd(q8, k8, v8, **kw)
        e = error_report(o, o_t)
        assert e["rel"] < 1e-2, e
        assert (lse - lse_t).abs().max().item() < 1e-3


@pytest.mark.gpu
def test_gpu_gluon_op_through_api():
    from fmha_ops import attn_bias as ab
    from fmha_ops import memory_efficient_attention_forward
    from fmha_ops.quant import quantize_qkv_fp8

    q, k, v = _inputs("normal", 2, 1000, 1000, 8, 2, 128, 128, torch.bfloat16, seed=5)
    q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
    for op in ("gluon_fp8F", "gluon_ws_fp8F"):
        for bias in (None, ab.LowerTriangularFromBottomRightMask()):
            o = memory_efficient_attention_forward(q8, k8, v8, attn_bias=bias, op=op, q_descale=qd,
                                                   k_descale=kd, v_descale=vd)
            ref, _ = reference(_dq(q8, qd, 4), _dq(k8, kd), _dq(v8, vd), 128 ** -0.5, bias is not None)
            assert error_report(o, ref)["rel"] < 4e-2, op

