"""flash_attn_varlen_func keeps the mask it read from cu_seqlens (and the packed call's plan) per starts pair: device
starts while the tensors are unchanged (here CPU tensors with the device-read predicate switched on), read again after
a write; host starts by their values, so any write, torch's or not, reads them again and never runs a stale mask."""
import pytest
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


def _counting_reads(monkeypatch, kind):
    """The starts ``kind.from_cu_seqlens`` reads, as lists, one per call."""
    reads = []
    original = kind.from_cu_seqlens.__func__

    def counting(cls, *args, **kwargs):
        reads.append(args[0].tolist())
        return original(cls, *args, **kwargs)
    monkeypatch.setattr(kind, "from_cu_seqlens", classmethod(counting))
    return reads


def test_host_starts_keep_their_mask_while_their_values_stay_and_a_write_reads_them_again(monkeypatch):
    PLANS.clear()
    reads = _counting_reads(monkeypatch, ab.BlockDiagonalMask)
    q, k, v = _qkv(9, seed=1)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    first = flash_attn_varlen_func(q, k, v, cu, cu, 9, 9)
    torch.testing.assert_close(flash_attn_varlen_func(q, k, v, cu, cu, 9, 9), first)
    assert reads == [[0, 4, 9]]

    cu.numpy()[1] = 2  # a write torch does not count (no version bump): the values still find no stale mask
    after = flash_attn_varlen_func(q, k, v, cu, cu, 9, 9)
    assert reads == [[0, 4, 9], [0, 2, 9]]
    torch.testing.assert_close(after, flash_attn_varlen_func(q, k, v, cu.clone(), cu.clone(), 9, 9))
    assert not torch.allclose(after[2:4], first[2:4])

    cu.numpy()[1] = 4  # the first starts again: the written tensor's entry was replaced, so they are read again
    torch.testing.assert_close(flash_attn_varlen_func(q, k, v, cu, cu, 9, 9), first)
    assert reads[-1] == [0, 4, 9]


def test_in_place_write_between_calls_with_distinct_q_and_k_starts(monkeypatch):
    """cu_seqlens_q and cu_seqlens_k as two tensors, each written in place between calls, on both key kinds."""
    for device_read in (False, True):
        monkeypatch.setattr(fai, "_read_is_a_sync", lambda cu, device_read=device_read: device_read)
        PLANS.clear()
        q, k, v = _qkv(8, seed=3)
        cu_q, cu_k = (torch.tensor([0, 3, 8], dtype=torch.int32) for _ in range(2))
        before = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True)
        for written, starts in ((cu_k, [0, 6, 8]), (cu_q, [0, 1, 8])):  # one tensor at a time
            written.copy_(torch.tensor(starts, dtype=torch.int32))
            after = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True)
            expected = flash_attn_varlen_func(q, k, v, cu_q.clone(), cu_k.clone(), 8, 8, causal=True)
            torch.testing.assert_close(after, expected)
            assert not torch.allclose(after, before)
            before = after


def test_bad_starts_still_raise_after_a_kept_layout():
    PLANS.clear()
    q, k, v = _qkv(9, seed=4)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)
    for bad, match in (([0, 6, 9], "max_seqlen_q=5 is smaller"), ([0, 5, 4], "never decrease")):
        with pytest.raises(ValueError, match=match):
            flash_attn_varlen_func(q, k, v, torch.tensor(bad, dtype=torch.int32), cu, 5, 5)
    cu[1] = 7  # the kept tensor itself, written to bad starts
    with pytest.raises(ValueError, match="max_seqlen_q=5 is smaller"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)


def test_a_plan_keeps_at_most_its_bound_of_starts_pairs(monkeypatch):
    PLANS.clear()
    reads = _counting_reads(monkeypatch, ab.BlockDiagonalMask)
    q, k, v = _qkv(9, seed=5)
    pairs = [torch.tensor([0, i, 9], dtype=torch.int32) for i in range(fai.VARLEN_MASKS_PER_PLAN + 1)]
    for cu in pairs:
        flash_attn_varlen_func(q, k, v, cu, cu, 9, 9)
    flash_attn_varlen_func(q, k, v, pairs[-1], pairs[-1], 9, 9)  # kept
    assert len(reads) == len(pairs)
    flash_attn_varlen_func(q, k, v, pairs[0], pairs[0], 9, 9)  # the oldest was dropped: read again
    assert len(reads) == len(pairs) + 1


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


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_a_kept_layout_runs_the_packed_launch_as_the_full_path_runs(monkeypatch, return_lse, grad):
    """A repeated call of a kept starts pair runs its op's packed launch (``varlen_launcher``, or the autograd pair's
    plan on batch-1 views) on the tensors as given: bit-identical output, lse and gradients to the full path's
    first call on new tensors of the same layout."""
    monkeypatch.setattr(fai, "_read_is_a_sync", lambda cu: True)
    cu = torch.tensor([0, 5, 17], dtype=torch.int32)
    results = []
    for seed in (0, 1, 1):  # the full path (a new plan cache), the kept layout's first, then its repeated call
        if seed == 0:
            PLANS.clear()
        q, k, v = (t.requires_grad_(grad) for t in _qkv(17, seed=seed))
        res = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True, return_attn_probs=return_lse)
        out = res[0] if return_lse else res
        grads = torch.autograd.grad(out.sum(), (q, k, v)) if grad else ()
        results.append([t.detach() for t in ((res if return_lse else (res,)) + tuple(grads))])
    PLANS.clear()
    q, k, v = (t.requires_grad_(grad) for t in _qkv(17, seed=1))
    res = flash_attn_varlen_func(q, k, v, cu.clone(), cu.clone(), 12, 12, causal=True, return_attn_probs=return_lse)
    out = res[0] if return_lse else res
    want = [t.detach() for t in ((res if return_lse else (res,))
                                  + (torch.autograd.grad(out.sum(), (q, k, v)) if grad else ()))]
    for got in results[1:]:
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    if return_lse:
        assert not results[2][1].requires_grad
