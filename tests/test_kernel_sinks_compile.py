"""Compile for sm90 ahead of time (no GPU, no interpreter) the kernels that sinks and value head dims of their own
changed: the backward at K=192 / Kv=128 (tiles padded to 256 and 128, masked columns), the decoder with sinks, key
starts (``cache_leftpad``) and Kv != K, its split reduce with sinks. The interpreter runs code the compiler may reject; this catches that on CPU."""
from tests.compiled_child import run_compiled

_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fmha_ops.kernels.triton.attention_bwd import _bwd_dkdv, _bwd_dq, _bwd_preprocess
from fmha_ops.kernels.triton.decode import _decode_kernel, _reduce_kernel
from fmha_ops.kernels.triton.kv_append import _kv_append_kernel
from bench.diagnostics.aot import plain_signature


def build(kernel, consts, pointers, floats=(), warps=4, stages=2):
    sig = plain_signature(kernel, consts, {**pointers, **dict.fromkeys(floats, "fp32")})
    triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps, "num_stages": stages})
    print("compiled", kernel.__name__)


bf16 = "*bf16"
bwd_ptrs = {n: bf16 for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dk_ptr", "dv_ptr", "dq_ptr", "o_ptr")}
bwd_ptrs.update({"lse_ptr": "*fp32", "delta_ptr": "*fp32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"})
meta = {"MASK_LEFT": True, "MASK_RIGHT": True, "BOTTOM_RIGHT": True, "SOFTCAP": False, "IS_VARLEN": False,
        "HEAD_DIM": 192, "HEAD_DIM_V": 128, "BLOCK_M": 64, "BLOCK_N": 64, "NUM_STAGES": 2}
floats = ("qk_scale", "sm_scale", "softcap_log2")
build(_bwd_preprocess, {"BLOCK_M": 64, "HEAD_DIM_V": 128}, bwd_ptrs)
build(_bwd_dkdv, meta, bwd_ptrs, floats, warps=8)
build(_bwd_dq, {**meta, "BLOCK_M": 128, "BLOCK_N": 32}, bwd_ptrs, floats, warps=8)
dec_ptrs = {"Q": bf16, "K": bf16, "V": bf16, "KS": "*fp32", "VS": "*fp32", "SEQ": "*i32", "BT": "*i32",
            "OUT": "*fp32", "LSE": "*fp32", "SINKS": "*fp32", "KEY_START": "*i32"}
build(_decode_kernel, {"G": 8, "MQ": 1, "D": 192, "DV": 128, "BLOCK_M": 16, "BLOCK_N": 32, "PAGE_SIZE": 64,
                       "PAGED": True, "FP8": False, "PARTIAL": False, "ASM_CVT": False, "PDL": False,
                       "WINDOW": True, "SOFTCAP": False, "STORE_LSE": True, "HAS_SINKS": True, "HAS_KEY_START": True},
      dec_ptrs, ("qk_scale", "softcap_log2"))
build(_reduce_kernel, {"S_PAD": 8, "D": 128, "BLOCK_D": 32, "PDL": False, "STORE_LSE": True, "HAS_SINKS": True},
      {"PO": "*fp32", "PL": "*fp32", "OUT": bf16, "LSE": "*fp32", "SINKS": "*fp32"})
build(_kv_append_kernel, {"D": 192, "DV": 128, "PAGE_SIZE": 64, "PAGED": True, "FP8": True, "FP8_MAX": 448.0},
      {"KN": bf16, "VN": bf16, "KC": "*fp8e4nv", "VC": "*fp8e4nv", "KS": "*fp32", "VS": "*fp32", "CSEQ": "*i32",
       "BT": "*i32"}, warps=1)
"""


def test_kernels_compile_for_sm90():
    r = run_compiled(_COMPILE)
    assert r.returncode == 0 and r.stdout.count("compiled") == 6, r.stderr[-3000:]
