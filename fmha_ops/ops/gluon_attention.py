"""Gluon 8-bit attention forwards for Hopper: the ops ``gluon_fp8F`` (``kernels/gluon/attention_fwd.py``, software
pipelined), ``gluon_ws_fp8F`` and ``gluon_ws_i8fp8F`` (``kernels/gluon/attention_fwd_ws.py``, warp-specialized;
int8 q/k in the latter).

sm90 only (async wgmma, TMA and mbarriers as Gluon exposes them for Hopper); needs a Triton with
``triton.experimental.gluon`` (3.6.0 has it). Dense batches, head dims 64/128/256 (K == Kv), no mask or
bottom-right causal, GQA, q/k/v descales per tensor or per (batch, kv head); bf16 out, or fp8 e4m3fn out in
v's units (per-tensor v descale); returns the LSE.
Gluon kernels do not run in the Triton interpreter: the ops never run on a CPU.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .. import attn_bias as ab
from ..dispatch import register
from ..problem import Problem
from .base import AttentionFwOp
from .cost import attention_time

_FP8 = torch.float8_e4m3fn


@register
class GluonFp8FwOp(AttentionFwOp):
    """fp8 e4m3fn q/k/v, FA3-style pipeline in Gluon (softmax of S_j overlapped with P_{j-1} V_{j-1})."""

    NAME = "gluon_fp8F"
    ARCHS = ("cuda>=9.0,<10.0",)
    REQUIRES = ("triton.experimental.gluon",)
    DTYPES = frozenset({(_FP8, _FP8, _FP8)})
    #: fp8: in v's units (attention = out * v_descale), for fp8 pipelines feeding an fp8 GEMM
    OUT_DTYPES = frozenset({torch.bfloat16, _FP8})
    HEAD_DIMS = (64, 128, 256)
    HEAD_DIMS_V = None  # Kv == K
    BIAS_KINDS = frozenset({ab.NONE, ab.CAUSAL_BR})
    GQA = True
    ALIGNMENT = "TMA descriptors"
    PARTIAL = True
    DESCALES: ClassVar[dict[str, frozenset[str]]] = {r: frozenset({"none", "tensor", "head"}) for r in "qkv"}
    #: achieved TFLOP/s on the H200 (fp8, d128, non-causal: 739 at 4x32x4096, 784 at 2x16x16384), for the cost
    #: model. At parity with triton_fp8F on the H200 (0.97-1.06x, bench/attention_fwd_bench.py), which declares a
    #: higher rate and so stays the default; pick this op with op="gluon_fp8F".
    TFLOPS = 760.0
    HOST_US = 72.0  # the kernel's launch and the launch that transposes V

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        r = []
        if p.arch.kind == "cuda" and p.arch.capability[0] != 9:
            r.append(f"needs sm90 (Hopper); this is sm{p.arch.capability[0]}{p.arch.capability[1]}")
        if p.out_dtype == _FP8 and p.descales[2] != "tensor":
            r.append(f"an fp8 output is in v's units: needs a per-tensor v_descale (got kind {p.descales[2]!r})")
        return r

    @staticmethod
    def kernel():
        """The kernel family's ``attention_forward`` (imported on first use: Gluon loads with the op)."""
        from ..kernels.gluon.attention_fwd import attention_forward

        return attention_forward

    @classmethod
    def apply(cls, inp, needs_lse):
        return cls.kernel()(inp.query, inp.key, inp.value, scale=inp.softmax_scale, causal=inp.bias_kind != ab.NONE,
                            q_descale=inp.q_descale, k_descale=inp.k_descale, v_descale=inp.v_descale,
                            return_lse=needs_lse, out_dtype=inp.out_dtype)

    @classmethod
    def estimate(cls, p: Problem) -> float:
        return attention_time(p, cls.TFLOPS, 3.0, 6.0)


@register
class GluonWsFp8FwOp(GluonFp8FwOp):
    """fp8 e4m3fn q/k/v, warp-specialized in Gluon: a TMA producer warp, two consumer warpgroups ping-ponging
    softmax against each other's wgmmas (FA3's schedule); the same contract as ``gluon_fp8F``."""

    NAME = "gluon_ws_fp8F"
    #: cost-model rates by (head dim, causal, keys >= LONG_KEYS): the default schedule's kernel time over
    #: triton_fp8F's, measured on the H200 from CUDA-graph replays (D128: 1.18 at 8x16x1000, 1.12 at 3x24/8x3000
    #: causal, 1.05 / 1.01 dense at 4096 / 16384 keys, 1.08 causal at 4096; D64: 0.91 dense at 4096, 0.83 at
    #: 16x32/8x512 causal; D256 1.07 dense, causal unmeasured: 0.95 taken, then x1.20 dense and x1.06 causal for
    #: the 128-key D256 tiles, their H100 gain over 64-key tiles in one run; causal tiles in sections of heads, H100:
    #: x1.06 at D128 from 4096 keys on the tile counter, x1.05 at D256), times triton_fp8F's calibrated rate and
    #: the tuning table's median calibration this op's estimate is scaled by (rows without a measurement: the
    #: nearest measured kind). The selector takes this op over triton_fp8F at D128 and D256, triton_fp8F at D64
    RATES: ClassVar[dict[tuple[int, bool, bool], float]] = {
        (64, False, False): 430.0, (64, True, False): 579.0, (64, False, True): 635.0, (64, True, True): 600.0,
        (128, False, False): 1212.0, (128, True, False): 1151.0, (128, False, True): 1058.0, (128, True, True): 1176.0,
        (256, False, False): 1596.0, (256, True, False): 1314.0, (256, False, True): 1596.0, (256, True, True): 1314.0,
    }
    #: this op's rate over ``RATES`` (the fp8 schedule's)
    RATE_FACTOR: ClassVar[float] = 1.0
    TFLOPS = 1058.0
    HOST_US = 90.0  # the kernel's launch and transpose_v's (91 us measured through the public call at B16 N512)

    @staticmethod
    def kernel():
        from ..kernels.gluon.attention_fwd_ws import attention_forward

        return attention_forward

    @classmethod
    def estimate(cls, p: Problem) -> float:
        from ..kernels.gluon.attention_fwd_ws import LONG_KEYS

        rate = cls.RATES.get((p.head_dim, p.causal, p.seqlen_k >= LONG_KEYS), cls.TFLOPS)
        return attention_time(p, rate * cls.RATE_FACTOR, 3.0, 6.0)


@register
class GluonWsI8Fp8FwOp(GluonWsFp8FwOp):
    """i8fp8 in the warp-specialized kernel: int8 q/k (s8 wgmma, int32 scores), fp8 e4m3fn v, bf16 out; descales
    per tensor or per (batch, kv head) (``i8fp8_attention``'s per-block q/k and per-channel v descales take
    ``triton_i8fp8F``). The kernel body is ``gluon_ws_fp8F``'s with its int8 switch on."""

    NAME = "gluon_ws_i8fp8F"
    DTYPES = frozenset({(torch.int8, torch.int8, _FP8)})
    OUT_DTYPES = frozenset({torch.bfloat16})
    #: 0.94-0.95x the fp8 schedule's kernel time at 1000-4096 keys (D128, H200), 1.05x at 16384 dense
    RATE_FACTOR: ClassVar[float] = 0.95
