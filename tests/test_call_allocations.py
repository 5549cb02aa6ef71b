"""The prefill and training calls keep no tensor they allocate: a tensor a call caches for later calls, made on a first
call inside a CUDA graph capture or a ``torch.compile(mode="reduce-overhead")`` recording, would live in the graph's
memory pool (cudagraph trees then refuse the recording). Checked on the first call of a layout (validation,
selection, plans) and the repeated one (the plan), forward and forward + backward, our kernels (the Triton
interpreter on a CPU) and the SDPA ops; the GPU counterpart is tests/test_gpu_reduce_overhead.py."""
from __future__ import annotations

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.testing import normal_qkv
from tests.allocations import kept_tensors
from tests.conftest import DEVICE

DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
HALF = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # the Triton interpreter computes bf16 wrong


def _calls() -> dict:
    """name -> a call on shapes no other test uses (17 queries: a partial tile; GQA 3)."""
    B, M, HQ, HKV, D = 2, 17, 6, 2, 16
    q, k, v = normal_qkv((B, M, HQ, D), (B, M, HKV, D), dtype=DTYPE, device=DEVICE, seed=21)
    q16, k16, v16 = (t.to(HALF) for t in (q, k, v))
    leaves = [t.detach().clone().requires_grad_() for t in (q16, k16, v16)]
    grad = torch.randn_like(q16)
    causal = ab.LowerTriangularMask()
    cu = torch.tensor([0, 5, M], dtype=torch.int32, device=DEVICE)
    mea = fmha_ops.memory_efficient_attention

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, grad)

    return {
        "memory_efficient_attention": lambda: mea(q, k, v, causal),
        "triton_attnF": lambda: mea(q16, k16, v16, causal, op="triton_attnF"),
        "triton_attnF forward + backward": fwd_bwd(lambda a, b, c: mea(a, b, c, causal, op=("triton_attnF", "triton_attnB"))),
        "memory_efficient_attention_partial": lambda: fmha_ops.memory_efficient_attention_partial(q, k, v),
        "merge_attentions": lambda: fmha_ops.merge_attentions(
            *zip(*[fmha_ops.memory_efficient_attention_partial(q, k[:, s], v[:, s])
                   for s in (slice(0, 7), slice(7, None))])),
        "flash_attn_func": lambda: fmha_ops.flash_attn_func(q, k, v, causal=True),
        "flash_attn_varlen_func": lambda: fmha_ops.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, M, M, causal=True),
        "fp8_attention": lambda: fmha_ops.fp8_attention(q16, k16, v16, causal=True),
        "fp8_attention forward + backward": fwd_bwd(lambda a, b, c: fmha_ops.fp8_attention(a, b, c, causal=True)),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_calls_keep_no_tensor_they_allocate(name):
    call = _calls()[name]
    for attempt in ("first", "repeated"):
        assert kept_tensors(call) == [], f"{name}, {attempt} call"
