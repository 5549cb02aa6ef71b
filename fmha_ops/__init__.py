"""fmha-ops: fast attention kernels behind an xformers-style API with a measured op selector.

    import fmha_ops
    out = fmha_ops.memory_efficient_attention(q, k, v, fmha_ops.LowerTriangularMask())
    print(fmha_ops.explain(q, k, v))          # why each op was or was not chosen
    with fmha_ops.use_ops("sdpa_cudnnF"): ... # restrict / force ops for a block
"""
from . import attn_bias, ops  # noqa: F401  (importing ops registers every backend)
from .api import (explain, get_op, memory_efficient_attention, memory_efficient_attention_backward,
                  memory_efficient_attention_forward, memory_efficient_attention_forward_requires_grad,
                  memory_efficient_attention_partial, merge_attentions)
from .checks import check_inputs
from .attn_bias import (BlockDiagonalCausalFromBottomRightMask, BlockDiagonalCausalMask,
                        BlockDiagonalCausalWithOffsetPaddedKeysMask, BlockDiagonalMask, BlockDiagonalPaddedKeysMask,
                        LowerTriangularFromBottomRightMask, LowerTriangularMask,
                        PagedBlockDiagonalCausalWithOffsetPaddedKeysMask, PagedBlockDiagonalPaddedKeysMask)
from .decode_plan import PagedDecodePlan, plan_kvcache
from .dispatch import REGISTRY, SELECTOR, use_ops
from .flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .fp8_backward import set_fp8_dequantized_backward
from .inputs import Inputs, make_inputs
from .problem import Problem
from .quantized import fp8_attention, i8fp8_attention
from registry import NoSupportedOpError

#: ``with fmha_ops.autotune():`` (or ``FMHA_OPS_AUTOTUNE=1``): the first call of each new problem times the ops that
#: could run it on the call's own tensors and runs the fastest; measurements persist in ``FMHA_OPS_CACHE_DIR``
autotune = SELECTOR.autotune
ALL_FW_OPS = REGISTRY.ops("fw")
ALL_BW_OPS = REGISTRY.ops("bw")

__all__ = [
    "memory_efficient_attention", "memory_efficient_attention_forward", "memory_efficient_attention_partial",
    "memory_efficient_attention_forward_requires_grad", "memory_efficient_attention_backward",
    "merge_attentions", "explain", "get_op", "use_ops", "REGISTRY", "SELECTOR", "ALL_FW_OPS", "ALL_BW_OPS", "Inputs", "make_inputs", "Problem",
    "NoSupportedOpError", "attn_bias", "LowerTriangularMask", "LowerTriangularFromBottomRightMask",
    "BlockDiagonalMask", "BlockDiagonalCausalMask", "BlockDiagonalCausalFromBottomRightMask",
    "BlockDiagonalPaddedKeysMask", "BlockDiagonalCausalWithOffsetPaddedKeysMask", "PagedBlockDiagonalPaddedKeysMask",
    "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask", "flash_attn_func", "flash_attn_varlen_func",
    "flash_attn_with_kvcache", "set_fp8_dequantized_backward", "check_inputs", "fp8_attention", "i8fp8_attention",
    "plan_kvcache", "PagedDecodePlan", "autotune",
]


def __getattr__(name: str):
    """xformers' op tuples (``MemoryEfficientAttentionFlashAttentionOp``, ...): our (FwOp, BwOp), warn once."""
    from .ops.aliases import xformers_tuple

    return xformers_tuple(name)
