"""make_inputs, the call signature, the masks' own validate / signature / dims, and the context-local
fp8-backward switch."""
from __future__ import annotations

import contextvars
import threading

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.fp8_backward import fp8_dequantized_backward_enabled, set_fp8_dequantized_backward
from fmha_ops.inputs import Signature, make_inputs


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def test_fp8_backward_switch_is_a_switch_and_a_context_manager():
    assert not fp8_dequantized_backward_enabled()

    def body():
        set_fp8_dequantized_backward(True)
        assert fp8_dequantized_backward_enabled()
        with set_fp8_dequantized_backward(False):
            assert not fp8_dequantized_backward_enabled()
            with set_fp8_dequantized_backward(True):
                assert fp8_dequantized_backward_enabled()
            assert not fp8_dequantized_backward_enabled()
        assert fp8_dequantized_backward_enabled()

    contextvars.copy_context().run(body)  # the plain call stays inside that context
    assert not fp8_dequantized_backward_enabled()


def test_fp8_backward_switch_is_context_local():
    seen = []
    with set_fp8_dequantized_backward(True):
        worker = threading.Thread(target=lambda: seen.append(fp8_dequantized_backward_enabled()))
        worker.start()
        worker.join()
        assert fp8_dequantized_backward_enabled()
        q, k, v = _t(1, 3, 2, 16), _t(1, 3, 2, 16), _t(1, 3, 2, 16)
        assert make_inputs(q, k, v).signature().fp8_backward and make_inputs(q, k, v).problem().fp8_backward
    assert seen == [False]
    assert not fp8_dequantized_backward_enabled()


def test_make_inputs_folds_bmghk_and_bmk_and_unfolds_outputs():
    q5, k5 = _t(2, 5, 3, 4, 16), _t(2, 7, 3, 1, 16).expand(2, 7, 3, 4, 16)
    inp = make_inputs(q5, k5, k5, scale=0.5)
    assert inp.query.shape == (2, 5, 12, 16) and inp.key.shape == (2, 7, 3, 16) and inp.scale == 0.5
    assert inp.layout(torch.zeros(2, 5, 12, 8)).shape == (2, 5, 3, 4, 8)
    assert inp.layout.lse(torch.zeros(2, 12, 5)).shape == (2, 3, 4, 5)
    q3 = _t(2, 5, 16)
    inp = make_inputs(q3, q3, q3)
    assert inp.query.shape == (2, 5, 1, 16) and inp.layout(torch.zeros(2, 5, 1, 8)).shape == (2, 5, 8)
    with pytest.raises(ValueError, match="key must be a torch.Tensor, got list"):
        make_inputs(q3, [1], q3)
    bmk_bias = make_inputs(q3, q3, q3, torch.zeros(2, 5, 5)).attn_bias  # BMK (B, Mq, Mk) gains its heads dim
    assert isinstance(bmk_bias, ab.TensorBias) and bmk_bias.tensor_bias.shape == (2, 1, 5, 5)


def test_signature_is_read_by_name():
    q, k, v = _t(1, 4, 2, 16), _t(1, 6, 2, 16), _t(1, 6, 2, 16)
    mask = ab.BlockDiagonalCausalMask.from_seqlens([1, 3], [2, 4])
    sig = make_inputs(q, k, v, mask, p=0.25).signature()
    assert isinstance(sig, Signature)
    assert not sig.needs_grad and sig.p == 0.25 and sig.bias == mask.signature()
    assert sig.shapes == (q.shape, k.shape, v.shape) and sig.dtypes == (torch.float32,) * 3
    assert make_inputs(q.requires_grad_(), k, v, mask).signature().needs_grad
    with torch.no_grad():
        assert not make_inputs(q, k, v, mask).signature().needs_grad
    assert hash(sig) == hash(make_inputs(q.detach(), k, v, mask, p=0.25).signature())


def _masks():
    bt = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    padded = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 2], 8, [5, 8])
    return {
        "causal": (ab.LowerTriangularMask(), (2, 5, 3), (2, 7, 2), ab.MaskDims(2, 5, 7, True, 0)),
        "varlen": (ab.BlockDiagonalMask.from_seqlens([2, 3], [4, 3]), (1, 5, 2), (1, 7, 2),
                   ab.MaskDims(2, 3, 4, False, 0)),
        "padded": (padded, (1, 3, 2), (1, 16, 2), ab.MaskDims(2, 2, 8, False, 0)),
        "paged": (padded.make_paged(bt, 4), (1, 3, 2), (1, 16, 2), ab.MaskDims(2, 2, 8, False, 4)),
    }


@pytest.mark.parametrize("name", list(_masks()))
def test_masks_state_their_dims_and_signature(name):
    mask, qs, ks, dims = _masks()[name]
    q, k = _t(*qs, 16), _t(*ks, 16)
    mask.validate(q, k)
    assert mask.dims(q, k) == dims
    sig = mask.signature()
    assert sig[0] is type(mask) and sig is mask.signature()  # cached
    assert hash(sig) is not None
    problem = make_inputs(q, k, k, mask).problem()
    assert (problem.batch, problem.seqlen_q, problem.seqlen_k, problem.q_uniform, problem.page_size) == dims


@pytest.mark.parametrize("name, qs, ks, msg", [
    ("varlen", (2, 5, 2), (2, 7, 2), "needs batch 1"),
    ("varlen", (1, 6, 2), (1, 7, 2), "query has 6 tokens but attn_bias q_seqinfo covers 5"),
    ("varlen", (1, 5, 2), (1, 8, 2), "key has 8 tokens but attn_bias k_seqinfo covers 7"),
    ("padded", (1, 3, 2), (1, 15, 2), "key has 15 rows but attn_bias needs at least 2 sequences x kv_padding 8"),
    ("paged", (1, 3, 2), (1, 18, 2), "not a multiple of page_size=4"),
])
def test_masks_validate_the_call(name, qs, ks, msg):
    mask = _masks()[name][0]
    with pytest.raises(ValueError, match=msg):
        mask.validate(_t(*qs, 16), _t(*ks, 16))
    with pytest.raises(ValueError, match=msg):  # and through the public API
        fmha_ops.memory_efficient_attention(_t(*qs, 16), _t(*ks, 16), _t(*ks, 16), mask)
