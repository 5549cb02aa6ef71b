"""Compile every FlyDSL decode configuration for gfx942 and gfx950 (no AMD GPU needed) and
check the emitted ISA. Needs flydsl and a toolchain folder (``.ci/install_flydsl_toolchain.sh``);
without them every test skips with the reason."""
import importlib.util
import re
from pathlib import Path

import pytest

from fmha_ops.kernels.flydsl import aot, host

pytestmark = pytest.mark.rocm


def _missing():
    if importlib.util.find_spec("flydsl") is None:
        return "flydsl is not installed (run .ci/install_flydsl_toolchain.sh)"
    if aot.toolchain_root() is None:
        return ("no ROCM_PATH-style toolchain with llvm/bin/ld.lld and amdgcn/bitcode "
                "(set FMHA_FLYDSL_ROCM_PATH or run .ci/install_flydsl_toolchain.sh)")
    return None


CONFIGS = host.kernel_configs()


@pytest.fixture(scope="module", params=host.ARCHS)
def isa(request, tmp_path_factory):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    arch = request.param
    out = tmp_path_factory.mktemp(f"isa_{arch}")
    recs = {r["name"]: r for r in aot.compile_all(arch, None, out, jobs=2)}
    return arch, recs


def _count(text, pattern):
    return len(re.findall(pattern, text))


@pytest.mark.parametrize("cfg", CONFIGS, ids=host.config_name)
def test_isa(isa, cfg):
    arch, recs = isa
    rec = recs[host.config_name(cfg)]
    assert rec["ok"], rec["log"]
    s = Path(rec["isa"]).read_text()
    assert re.search(rf'\.amdgcn_target "amdgcn-amd-amdhsa-[a-z-]*{arch}"', s), "wrong target"
    assert _count(s, r"\bscratch_") == 0 and re.search(r"\.vgpr_spill_count:\s+0", s), "register spills"
    D = cfg["D"]
    if cfg["kind"] == "reduce":
        wide = "global_load_dwordx4" if D == 256 else "global_load_dwordx2"  # D/64 floats per lane
        assert _count(s, wide) >= 1
        assert _count(s, r"\bv_exp_f32") >= 1 and _count(s, r"\bv_log_f32") == 1
        return
    mfma = "v_mfma_f32_16x16x16_bf16" if cfg["BF16"] else "v_mfma_f32_16x16x16_f16"
    # one QK^T and one PV MFMA per 16 head-dim columns, per 16-key block (loop not unrolled)
    assert _count(s, mfma) == 2 * D // 16
    assert _count(s, r"\bv_mfma") == 2 * D // 16
    # 16-byte loads: Q (D/4 per lane) and K (D/4 per lane, fp8: D/4 bytes) and V
    q_loads = D // 32
    k_loads = D // 64 if cfg["FP8"] else D // 32
    v_loads = (4 if D == 256 else 0) if cfg["FP8"] else 4 * D // 128  # fp8 D=128: 8-byte V rows
    assert _count(s, r"global_load_dwordx4\b") == q_loads + k_loads + v_loads
    if cfg["FP8"]:
        assert _count(s, r"v_cvt_pk_f32_fp8") == (D // 4 + 4 * D // 16) // 2  # K + 4 V rows per lane
        if D == 128:
            assert _count(s, r"global_load_dwordx2\b") == 4  # 8-byte V rows
    else:
        assert _count(s, r"v_cvt_pk_f32_fp8") == 0
    assert _count(s, r"global_store_dwordx4\b") >= 4  # out rows


def test_aot_cache_written(tmp_path):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    names = ["decode_d128_qbf16_kvbf16_single", "reduce_d128_bf16"]
    recs = aot.compile_all("gfx942", tmp_path, None, jobs=2, names=names)
    assert all(r["ok"] for r in recs), [r["log"] for r in recs]
    assert len(list((tmp_path / "paged_decode").glob("*.pkl"))) == 1
    assert len(list((tmp_path / "split_reduce").glob("*.pkl"))) == 1
