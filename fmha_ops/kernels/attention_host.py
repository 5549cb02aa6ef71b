"""Host-side helpers shared by the attention forward launchers (Triton and Gluon): descale arguments and the
scratch allocator that device-made TMA descriptors need."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.runtime import _allocation


def descale_args(t: torch.Tensor, B: int, H: int, name: str) -> tuple[torch.Tensor, int, int]:
    """(tensor, stride_b, stride_h) for a per-tensor (numel 1) or per-(batch, head) (B, H) float32 descale ``t``.

    Absent descales are the launcher's business: the Triton forward skips their loads (a constexpr), the Gluon
    forwards get ``unit_descale``. No device tensor is cached here: under CUDA graphs (torch.compile's
    mode="reduce-overhead") a tensor kept from the first call would live in the graph's memory pool.

    Example: ``descale_args(torch.ones(2, 4), 2, 4, "k_descale")`` -> (t, 4, 1).
    """
    assert t.dtype == torch.float32, f"{name} must be float32"
    if t.numel() == 1:
        return t.reshape(1), 0, 0
    assert t.shape == (B, H), f"{name} must have numel 1 or shape {(B, H)}, got {tuple(t.shape)}"
    return t, t.stride(0), t.stride(1)


def unit_descale(device: torch.device) -> torch.Tensor:
    """A float32 one (shape (1,)) on ``device``, made per call: the descale of an absent descale argument where a
    kernel always loads one."""
    return torch.ones(1, dtype=torch.float32, device=device)


def scratch(size: int, align: int, stream) -> torch.Tensor:
    """Triton's global scratch allocator signature: ``size`` bytes on the current CUDA device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Device-side TMA descriptors need a global scratch allocator (128 B per descriptor). Triton keeps it in a
    ContextVar, so each thread (the autograd engine's, a data loader's) starts without one: set ours where none
    is set; an allocator the caller set is kept."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(scratch)


@dataclass(frozen=True)
class Fp8ForwardArgs:
    """What an fp8 forward launcher passes on: output and LSE buffers, the three descale tensors and their
    (batch, head) strides, and ``done`` when the problem is empty and the buffers are already final."""

    out: torch.Tensor
    lse: torch.Tensor | None
    qd: torch.Tensor
    kd: torch.Tensor
    vd: torch.Tensor
    descale_strides: tuple[int, int, int, int, int, int]
    done: bool


#: output dtypes of the fp8 Hopper forwards: bf16, or fp8 e4m3fn in v's units (attention = out * v_descale)
FP8_FORWARD_OUT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def fp8_forward_args(q, k, v, q_descale, k_descale, v_descale, return_lse: bool, out, head_dims,
                     out_dtype: torch.dtype = torch.bfloat16, int8_qk: bool = False) -> Fp8ForwardArgs:
    """Check the fp8 forward inputs of the Hopper launchers and allocate their outputs.

    q (B, Mq, Hq, D), k / v (B, Mk, Hkv, D): ``float8_e4m3fn`` (``int8_qk``: q and k both ``int8`` or both fp8,
    v fp8), last dim contiguous, q / k strides multiples of
    16 elements (TMA), D in ``head_dims``, Hq % Hkv == 0; descales as ``descale_args`` takes them; ``out`` None
    or an ``out_dtype`` (B, Mq, Hq, D) tensor with a contiguous last dim and 16-element-aligned strides;
    ``out_dtype`` one of ``FP8_FORWARD_OUT_DTYPES``. Empty problems (no query, no key) are finished here:
    out 0, lse -inf.

    Example: ``fp8_forward_args(q, k, v, None, None, None, True, None, (64, 128, 256)).lse.shape`` -> (B, Hq, Mq).
    """
    qk_int8 = int8_qk and q.dtype == torch.int8
    for name, t in (("q", q), ("k", k), ("v", v)):
        want = torch.int8 if qk_int8 and name != "v" else torch.float8_e4m3fn
        if t.dtype != want:
            allowed = "torch.float8_e4m3fn" + (" (q and k: both that or both torch.int8)" if int8_qk else "")
            raise TypeError(f"{name} has dtype {t.dtype}; supported: {allowed}")
        if t.dim() != 4 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be 4-D (B, M, H, D) with a contiguous last dim, got shape "
                             f"{tuple(t.shape)} strides {t.stride()}")
    B, Mq, Hq, D = q.shape
    Mk, Hkv = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must be "
                         f"(B, Mk, Hkv, D) with q's B and D")
    if D not in head_dims:
        raise ValueError(f"head dim {D} not supported; supported: {tuple(head_dims)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq = {Hq} must be a multiple of Hkv = {Hkv}")
    if any(s % 16 for t in (q, k) for s in t.stride()[:3]):
        raise ValueError(f"q strides {q.stride()} and k strides {k.stride()} must be multiples of 16 (TMA)")
    device = q.device
    absent = q_descale is None or k_descale is None or v_descale is None
    unit = unit_descale(device) if absent else None
    qd, qd_sb, qd_sh = (unit, 0, 0) if q_descale is None else descale_args(q_descale, B, Hkv, "q_descale")
    kd, kd_sb, kd_sh = (unit, 0, 0) if k_descale is None else descale_args(k_descale, B, Hkv, "k_descale")
    vd, vd_sb, vd_sh = (unit, 0, 0) if v_descale is None else descale_args(v_descale, B, Hkv, "v_descale")
    if out_dtype not in FP8_FORWARD_OUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} not supported; supported: {FP8_FORWARD_OUT_DTYPES}")
    if out is None:
        out = torch.empty((B, Mq, Hq, D), dtype=out_dtype, device=device)
    elif (out.shape != (B, Mq, Hq, D) or out.dtype != out_dtype or out.stride(-1) != 1
          or any(s * out.element_size() % 16 for s in out.stride()[:3])):
        raise ValueError(f"out must be {out_dtype} {(B, Mq, Hq, D)} with a contiguous last dim and 16-byte "
                         f"strides (TMA), got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    lse = torch.empty((B, Hq, Mq), dtype=torch.float32, device=device) if return_lse else None
    done = out.numel() == 0 or Mk == 0
    if done:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
    return Fp8ForwardArgs(out, lse, qd, kd, vd, (qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh), done)
