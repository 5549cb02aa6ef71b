"""The merge kernel (fmha_ops/kernels/triton/merge.py) against a float64 merge of the same parts: part counts
1..MAX_PARTS and beyond (grouped merges), odd sizes, empty parts and rows, strided parts, dtypes. CPU: through
the Triton interpreter; GPU: the kernel, and merge_attentions' public call on CUDA (BMHK and BMGHK)."""
import math

import pytest
import torch

import fmha_ops
from fmha_ops.kernels.triton.merge import MAX_PARTS, merge_parts
from tests.conftest import DEVICE, HAS_CUDA


def _reference(outs, lses):
    """float64 merge: out (B, M, H, K), lse (B, H, M)."""
    lse = torch.stack([t.double() for t in lses])  # (S, B, H, M)
    top = lse.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - top)
    total = w.sum(0)
    attn = torch.stack([t.double() for t in outs])  # (S, B, M, H, K)
    out = (w.permute(0, 1, 3, 2)[..., None] * attn).sum(0) / torch.where(total > 0, total, 1.0).permute(0, 2, 1)[..., None]
    return out, torch.where(total > 0, top + torch.log(total), -math.inf)


def _parts(n, b, m, h, k, dtype, seed, empty_part=None, empty_rows=()):
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(b, m, h, k, generator=g).to(dtype).to(DEVICE) for _ in range(n)]
    lses = [(torch.randn(b, h, m, generator=g) * 3).to(DEVICE) for _ in range(n)]
    if empty_part is not None:  # a part that saw no key: out 0, lse -inf
        outs[empty_part].zero_()
        lses[empty_part].fill_(-math.inf)
    for row in empty_rows:  # a query row no part saw
        for t in lses:
            t[:, :, row] = -math.inf
    return outs, lses


_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


@pytest.mark.parametrize("n, b, m, h, k", [(1, 1, 1, 1, 16), (2, 2, 17, 3, 40), (3, 1, 33, 2, 64),
                                           (MAX_PARTS, 1, 5, 1, 16), (MAX_PARTS + 3, 2, 9, 2, 24)])
@pytest.mark.parametrize("dtype", _DTYPES)
def test_merge_kernel_matches_float64(n, b, m, h, k, dtype):
    outs, lses = _parts(n, b, m, h, k, dtype, seed=n * 100 + m, empty_part=n - 1 if n > 1 else None,
                        empty_rows=(m - 1,) if m > 1 else ())
    out, lse = merge_parts(outs, lses, torch.float32)
    want, want_lse = _reference(outs, lses)
    assert out.shape == (b, m, h, k) and out.dtype == torch.float32 and lse.shape == (b, h, m)
    torch.testing.assert_close(out.double().cpu(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double().cpu()[finite], want_lse[finite], atol=1e-5, rtol=1e-6)
    if m > 1:  # the row no part saw: out 0, lse -inf
        assert torch.equal(out[:, m - 1].cpu(), torch.zeros(b, h, k)) and torch.isneginf(lse[:, :, m - 1]).all()


def test_merge_kernel_reads_strided_parts_and_writes_the_output_dtype():
    """Parts that are views (a slice along M of a larger tensor; lse slices of a (B, H, 2M) tensor): read where
    they lie. Output in bfloat16/float16 as asked; no LSE when not written."""
    b, m, h, k = 2, 19, 3, 32
    g = torch.Generator().manual_seed(5)
    big = [torch.randn(b, 2 * m, h, k, generator=g).to(DEVICE) for _ in range(2)]
    big_lse = [torch.randn(b, h, 2 * m, generator=g).to(DEVICE) for _ in range(2)]
    outs, lses = [t[:, 3:3 + m] for t in big], [t[:, :, 3:3 + m] for t in big_lse]
    out, lse = merge_parts(outs, lses, torch.float16, write_lse=False)
    want, _ = _reference(outs, lses)
    assert lse is None and out.dtype == torch.float16
    torch.testing.assert_close(out.double().cpu(), want, atol=2e-3, rtol=2e-3)


def test_merge_attentions_public_call_matches_the_whole_attention():
    """Split keys, merge: equals attention over all keys (the kernel on CUDA, torch ops on the CPU)."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 13, 4, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(2, 29, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    splits = (slice(0, 7), slice(7, 7), slice(7, 20), slice(20, 29))  # one split sees no key
    parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, s], v[:, s], op="torch_referenceF") for s in splits]
    whole, whole_lse = fmha_ops.memory_efficient_attention_partial(q, k, v, op="torch_referenceF")
    out, lse = fmha_ops.merge_attentions([o for o, _ in parts], [l for _, l in parts])
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)
    stacked, none = fmha_ops.merge_attentions(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]),
                                              write_lse=False, output_dtype=torch.float16)
    assert none is None and stacked.dtype == torch.float16
    torch.testing.assert_close(stacked.float(), whole, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_merge_attentions_bmghk_and_many_parts():
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, 37, 2, 3, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 300, 2, 1, 64, device="cuda", generator=g, dtype=torch.bfloat16).expand(2, 300, 2, 3, 64)
            for _ in range(2))
    bounds = list(range(0, 301, 30))  # 10 parts: more than one launch's MAX_PARTS
    parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, a:b_], v[:, a:b_]) for a, b_ in zip(bounds, bounds[1:])]
    out, lse = fmha_ops.merge_attentions([o for o, _ in parts], [l for _, l in parts])
    whole, whole_lse = fmha_ops.memory_efficient_attention_partial(q, k, v)
    assert out.shape == whole.shape == (2, 37, 2, 3, 64) and lse.shape == whole_lse.shape == (2, 2, 3, 37)
    torch.testing.assert_close(out, whole, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, whole_lse, atol=1e-3, rtol=1e-4)
