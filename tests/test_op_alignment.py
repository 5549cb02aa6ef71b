"""Operand alignment and empty problems in the ops' declarations, checked on the CPU with an sm90 ``Problem``.

The memory-efficient SDPA kernels load 16-byte vectors along the head dim and fault on the GPU (a sticky
"misaligned address") when a head dim, start address or stride breaks that; the op must refuse such calls with a
reason naming the argument. Every op's ``not_supported_reasons`` and ``estimate`` must answer for empty problems
(batch 0, no queries, no keys), which ``explain`` and the selector ask about.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fmha_ops import attn_bias as ab
from fmha_ops.api import REGISTRY
from fmha_ops.inputs import make_inputs
from fmha_ops.kernels.decode_splits import choose_num_splits
from registry.arch import Arch

SM90 = Arch("cuda", (9, 0), name="NVIDIA H200")
SM75 = Arch("cuda", (7, 5), name="Tesla T4")


def _problem(dtype, d, dv, mq=256, mk=128, bias=None, arch=SM90, key=None):
    q = torch.randn(3, mq, 1, d).to(dtype)
    k = torch.randn(3, mk, 1, d).to(dtype) if key is None else key
    v = torch.randn(3, mk, 1, dv).to(dtype)
    return dataclasses.replace(make_inputs(q, k, v, bias).problem(), arch=arch)


@pytest.mark.parametrize("dtype, d, dv, bad", [
    (torch.float16, 32, 36, "value head dim Kv=36 is not a multiple of 8"),
    (torch.bfloat16, 36, 36, "query/key head dim K=36 is not a multiple of 8"),
    (torch.float32, 30, 32, "query/key head dim K=30 is not a multiple of 4"),
])
def test_sdpa_efficient_refuses_head_dims_off_16_byte_vectors(dtype, d, dv, bad):
    op = REGISTRY.get("sdpa_efficientF")
    reasons = op.not_supported_reasons(_problem(dtype, d, dv, bias=ab.LowerTriangularFromBottomRightMask()))
    assert any(bad in r and "supported: multiples of" in r for r in reasons), reasons


@pytest.mark.parametrize("dtype, d, dv", [(torch.float16, 8, 8), (torch.bfloat16, 80, 80), (torch.float32, 36, 36),
                                          (torch.float16, 32, 264)])
def test_sdpa_efficient_takes_whole_vectors(dtype, d, dv):
    assert REGISTRY.get("sdpa_efficientF").not_supported_reasons(_problem(dtype, d, dv)) == []


def test_sdpa_efficient_alignment_follows_the_arch():
    """Before sm80 fp32 runs without tensor cores (any head dim: only its 120-byte rows are refused); fp16 needs
    8-element vectors on sm75 too."""
    op = REGISTRY.get("sdpa_efficientF")
    assert not any("head dim" in r for r in op.not_supported_reasons(_problem(torch.float32, 30, 30, arch=SM75)))
    assert any("head dim" in r for r in op.not_supported_reasons(_problem(torch.float32, 30, 30)))
    assert any("head dim K=36" in r for r in op.not_supported_reasons(_problem(torch.float16, 36, 36, arch=SM75)))


def test_sdpa_efficient_refuses_a_misaligned_key_stride():
    """Key rows 2 * 68 bytes apart (a slice of wider rows): the reason names the key; the contiguous key passes."""
    wide = torch.randn(3, 128, 1, 68, dtype=torch.float16)
    reasons = REGISTRY.get("sdpa_efficientF").not_supported_reasons(
        _problem(torch.float16, 64, 64, key=wide[..., :64]))
    assert any(r.startswith("key sequence stride 68 elements (136 bytes): not a multiple of 16 bytes")
               for r in reasons), reasons
    assert REGISTRY.get("sdpa_efficientF").not_supported_reasons(_problem(torch.float16, 64, 64)) == []


def test_sdpa_cudnn_refuses_rows_off_16_bytes():
    """q / k / v sliced from one (B, M, 3 * 64 + 4) bf16 tensor (392-byte rows): cuDNN's TMA loads read them wrong
    (cosine 0.02 on the H200), so the op refuses, naming the operands; dense ones pass."""
    packed = torch.randn(3, 128, 1, 3 * 64 + 4, dtype=torch.bfloat16)
    q, k, v = (packed[..., i * 64:(i + 1) * 64] for i in range(3))
    op = REGISTRY.get("sdpa_cudnnF")
    p = dataclasses.replace(make_inputs(q, k, v).problem(), arch=SM90)
    assert any(r.startswith("query sequence stride 196 elements (392 bytes); key sequence stride 196 elements "
                            "(392 bytes); value sequence stride 196 elements (392 bytes): not a multiple of 16 bytes")
               for r in op.not_supported_reasons(p)), op.not_supported_reasons(p)
    assert op.not_supported_reasons(_problem(torch.bfloat16, 64, 64)) == []


#: ops whose kernels read q / k / v in 16-byte vectors or through TMA on the GPU, by the dtype they run
_ALIGNED_OPS = {torch.float16: ("sdpa_flashF", "sdpa_cudnnF", "sdpa_efficientF", "triton_attnF", "fa4F", "fa4B", "cudnnF",
                                 "cudnnB"),
                torch.float8_e4m3fn: ("triton_fp8F", "gluon_fp8F", "gluon_ws_fp8F", "cudnn_fp8F")}


@pytest.mark.parametrize("dtype, name", [(d, n) for d, names in _ALIGNED_OPS.items() for n in names])
@pytest.mark.parametrize("start, pad, why", [
    (0, 8, "sequence stride {} elements (392 bytes)"),  # 8-byte aligned rows
    (2, 0, "start address 2 bytes past a 16-byte boundary"),
])
def test_ops_with_16_byte_loads_refuse_misaligned_rows(dtype, name, start, pad, why):
    """q / k / v of 128 bytes each sliced from one (B, M, start + 3 * 128 + pad bytes) tensor, as a fused QKV
    projection gives them: every op that loads 16-byte vectors or TMA tiles refuses on sm90, naming the input and
    the value."""
    es, width = dtype.itemsize, 128 // dtype.itemsize
    packed = torch.randn(3, 128, 1, (start + 3 * 128 + pad) // 2, dtype=torch.float16).view(dtype)
    q, k, v = (packed[..., start // es + i * width: start // es + (i + 1) * width] for i in range(3))
    p = dataclasses.replace(make_inputs(q, k, v).problem(), arch=SM90)
    if es == 1:  # the fp8 ops take descales
        p = dataclasses.replace(p, descales=("tensor",) * 3)
    reasons = REGISTRY.get(name).not_supported_reasons(p)
    assert any(r.startswith(f"query {why.format(392 // es)}") and "not a multiple of 16 bytes" in r
               for r in reasons), reasons


def test_pointer_kernels_take_misaligned_rows():
    """SDPA's math path, the reference and the CPU flash kernel read any stride: they serve the calls above."""
    packed = torch.randn(3, 128, 1, 3 * 64 + 4, dtype=torch.float16)
    q, k, v = (packed[..., i * 64:(i + 1) * 64] for i in range(3))
    p = make_inputs(q, k, v).problem()
    assert p.misaligned and p.arch.kind == "cpu"
    for name in ("sdpa_flashF", "sdpa_mathF", "torch_referenceF"):
        assert REGISTRY.get(name).not_supported_reasons(p) == [], name
    p90 = dataclasses.replace(p, arch=SM90)
    assert REGISTRY.get("sdpa_mathF").not_supported_reasons(p90) == []
    assert REGISTRY.get("sdpa_flashF").not_supported_reasons(p90)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("batch, mq, mk", [(0, 4, 64), (1, 0, 64), (1, 4, 0), (2, 0, 0), (1, 1, 0), (0, 1, 1)])
def test_every_op_answers_for_empty_problems(dtype, batch, mq, mk):
    """Reasons and estimates of every registered op (decoders' split counts included) for empty dims."""
    q = torch.randn(batch, mq, 8, 128).to(dtype)
    k, v = (torch.randn(batch, mk, 2, 128).to(dtype) for _ in range(2))
    p = dataclasses.replace(make_inputs(q, k, v).problem(), arch=SM90)
    for op in (op for op in REGISTRY.ops() if op.supports_arch(SM90)):
        op.not_supported_reasons(p)
        t = op.estimate(p)
        assert math.isfinite(t) and t >= 0.0, (op.NAME, t)


@pytest.mark.parametrize("resident", [None, 4])
def test_no_programs_or_no_keys_take_one_split(resident):
    assert choose_num_splits(0, 4096, 132, resident) == 1
    assert choose_num_splits(8, 0, 132, resident) == 1
    assert choose_num_splits(8, 131072, 132, resident) > 1
