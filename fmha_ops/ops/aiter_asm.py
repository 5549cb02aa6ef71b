"""Adapter for AMD aiter's prebuilt (hand-written asm) i8fp8 attention forward on gfx942 / gfx950.

Not run on AMD hardware: the argument mapping is tested on CPU against a fake of aiter's function
(``tests/test_amd_ops.py``); on an MI300/MI350, compare it with the reference op before relying on it.

The aiter entry point (ROCm/aiter ``aiter/ops/mha.py`` declares its fp8 sibling ``flash_attn_fp8_pertensor_func``
with the same parameters; aiter's ``op_tests/op_benchmarks/bench_sage.py`` on the i8fp8 branch calls this one)::

    aiter.ops.mha.flash_attn_i8fp8_pertensor_func(
        q, k, v, q_descale, k_descale, v_descale,
        causal=False, window_size=(-1, -1, 0), softmax_scale=None) -> out

    q (batch, seqlen_q, nheads, 128) int8        k (batch, seqlen_k, nheads_k, 128) int8
    v (batch, seqlen_k, nheads_k, 128) fp8 (aiter.dtypes.fp8: e4m3fnuz on gfx942, e4m3fn on gfx950)
    q/k/v_descale float32, each [1] (per tensor) or [batch, nheads_k]; the C++ launcher
    (csrc ``mha_fwd.cu``, data type "i8fp8bf16") reads them through batch/head strides
    out (batch, seqlen_q, nheads, 128) bfloat16, allocated by aiter; softmax_scale defaults to 1/sqrt(128)

It goes through ``_flash_attn_forward`` to the compiled ``fmha_v3_fwd`` op, which on the i8fp8 branch
accepts int8 q/k + fp8 v and forces a bf16 output (kernel ``fwd_hd128_i8fp8.co``, tile 256x128).

Mapping from our call: aiter's BSHD layout is our BMHK, so q/k/v pass unchanged (last dim
contiguous, as validated); a "tensor" descale is passed reshaped to [1], a "head" descale (B, Hkv)
as is (contiguous); all three must be of one kind (aiter's own gate requires equal shapes);
``softmax_scale`` is ours (default 1/sqrt(K)); ``causal=False``; no LSE is returned. GQA is
declared for power-of-two ratios only, mirroring aiter's gate for its fp8 asm kernels.
"""
from __future__ import annotations

import torch

from ..dispatch import register
from ..dtypes import FP8_DTYPES
from ..inputs import Inputs
from ..problem import Problem
from .base import AttentionFwOp
from .cost import attention_flops

ENTRY_POINT = "flash_attn_i8fp8_pertensor_func"
# Achieved int8/fp8 MFMA throughput assumed by the cost model (about 1/3 of MI300X's and MI355X's
# dense int8 peaks); not calibrated on hardware.
_OPS_PER_S = {"gfx942": 0.8e15, "gfx950": 1.5e15}


def _fp8_for(gfx: str) -> torch.dtype:
    return torch.float8_e4m3fnuz if gfx == "gfx942" else torch.float8_e4m3fn


def aiter_args(inp: Inputs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for aiter's ``flash_attn_i8fp8_pertensor_func`` from one call."""
    def descale(d: torch.Tensor) -> torch.Tensor:
        return d.reshape(1) if d.numel() == 1 else d.contiguous()

    args = (inp.query, inp.key, inp.value)
    kwargs = dict(q_descale=descale(inp.q_descale), k_descale=descale(inp.k_descale),
                  v_descale=descale(inp.v_descale), causal=False, softmax_scale=inp.softmax_scale)
    return args, kwargs


@register
class AiterAsmI8Fp8FwOp(AttentionFwOp):
    """aiter's asm i8fp8 forward: int8 q/k (QK in int32), fp8 v, bf16 out, K = Kv = 128, non-causal."""

    NAME = "aiter_asm_i8fp8F"
    ARCHS = ("rocm:gfx942,gfx950",)
    REQUIRES = ("aiter",)
    DTYPES = frozenset((torch.int8, torch.int8, f) for f in FP8_DTYPES)
    OUT_DTYPES = frozenset({torch.bfloat16})
    HEAD_DIMS = (128,)
    GQA = True
    DESCALES = {r: frozenset({"tensor", "head"}) for r in "qkv"}
    CUDA_GRAPH = False  # not verified
    PRIORITY = 1

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            from aiter.ops import mha
        except Exception as e:  # aiter JIT-builds on import; any failure means it cannot run here
            return f"aiter failed to import: {type(e).__name__}: {e}"
        if not hasattr(mha, ENTRY_POINT):
            return f"this aiter build has no aiter.ops.mha.{ENTRY_POINT} (needs an aiter with the i8fp8 forward)"
        return None

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        r = []
        if len(set(p.descales)) > 1:
            r.append(f"q/k/v descales must be of one kind (all per-tensor or all (batch, kv-head)), got "
                     f"{'/'.join(p.descales)}")
        g = p.gqa_ratio
        if g & (g - 1):
            r.append(f"GQA ratio {g} is not a power of two")
        if p.arch.kind == "rocm" and p.arch.gfx in _OPS_PER_S and p.v_dtype != _fp8_for(p.arch.gfx):
            r.append(f"fp8 value {p.v_dtype} is not the native format of {p.arch.gfx} (use {_fp8_for(p.arch.gfx)})")
        return r

    @classmethod
    def apply(cls, inp, needs_lse):
        from aiter.ops import mha

        args, kwargs = aiter_args(inp)
        return getattr(mha, ENTRY_POINT)(*args, **kwargs), None

    @classmethod
    def estimate(cls, p: Problem) -> float:
        if p.arch.kind != "rocm" or p.arch.gfx not in _OPS_PER_S:
            return 1e3
        return attention_flops(p) / _OPS_PER_S[p.arch.gfx] + 8e-6
