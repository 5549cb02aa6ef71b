"""flash_attn_varlen_func reuses the mask read from device cu_seqlens while the tensors are unchanged, and reads
them again after a write (here on CPU tensors, with the device-read predicate switched on)."""
import torch

from fmha_ops import attn_bias as ab
from fmha_ops import flash_attn_interface as fai
from fmha_ops.flash_attn_interface import flash_attn_varlen_func
from fmha_ops.plans import PLANS


def _qkv(total, heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, heads, dim, generator=g) for _ in range(3)]


def test_reused_while_unchanged_and_reread_after_a_write(monkeypatch):
    monkeypatch.setattr(fai, "_read_is_a_sync", lambda cu: True)
    PLANS.clear()
    reads = []
    original = ab.BlockDiagonalCausalFromBottomRightMask.from_cu_seqlens.__func__

    def counting(cls, *args, **kwargs):
        reads.append(args[0].tolist())
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(ab.BlockDiagonalCausalFromBottomRightMask, "from_cu_seqlens", classmethod(counting))
    q, k, v = _qkv(17)
    cu = torch.tensor([0, 5, 17], dtype=torch.int32)
    first = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True)
    second = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True)
    assert len(reads) == 1
    torch.testing.assert_close(second, first)

    cu.copy_(torch.tensor([0, 11, 17], dtype=torch.int32))  # a write bumps the version: read again
    after = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True)
    assert reads == [[0, 5, 17], [0, 11, 17]]
    fresh = flash_attn_varlen_func(q, k, v, cu.clone(), cu.clone(), 12, 12, causal=True)
    torch.testing.assert_close(after, fresh)
    assert not torch.allclose(after[5:11], first[5:11])  # the new first sequence attends across old boundary


def test_host_starts_are_read_every_call(monkeypatch):
    reads = []
    original = ab.BlockDiagonalMask.from_cu_seqlens.__func__
    monkeypatch.setattr(ab.BlockDiagonalMask, "from_cu_seqlens",
                        classmethod(lambda cls, *a, **kw: reads.append(1) or original(cls, *a, **kw)))
    q, k, v = _qkv(9, seed=1)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    for _ in range(2):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)
    assert len(reads) == 2  # CPU starts cost no sync: read on every call, nothing kept


def test_plans_keep_no_mask_of_their_first_call():
    """The packed call's plan runs each call's own mask: it holds none (a mask holds its sequence starts)."""
    PLANS.clear()
    q, k, v = _qkv(9, seed=2)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    first = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    again = flash_attn_varlen_func(q, k, v, cu.clone(), cu.clone(), 5, 5, causal=True)
    torch.testing.assert_close(again, first)
    packed = PLANS.plans(fai._attention)
    assert packed and all(plan.bound is None for plan in packed)
