"""The dtypes the attention API takes, and their short names in messages.

float16 / bfloat16 / float32 inputs run as they are; fp8 e4m3 (``float8_e4m3fn``, and AMD's
``float8_e4m3fnuz``) and int8 inputs are quantized and carry float32 descales (``fmha_ops.inputs``).
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def dtype_name(dt: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dt).replace("torch.", "")
