"""fmha_ops.testing: the error metrics on known values and the distributions' shapes, seeds and outliers."""
import math

import pytest
import torch

from fmha_ops.testing import error_report, normal_qkv, transformer_like


def test_error_report_known_values():
    ref = torch.tensor([3.0, 4.0])
    e = error_report(torch.tensor([3.0, 5.0]), ref)
    assert e["rel"] == pytest.approx(1 / 5)
    assert e["mae"] == pytest.approx(0.5)
    assert e["max"] == pytest.approx(1.0)
    assert e["cos"] == pytest.approx((9 + 20) / (5 * math.sqrt(34)))


def test_error_report_empty_and_zero_reference():
    assert error_report(torch.empty(0), torch.empty(0)) == {"rel": 0.0, "cos": 1.0, "mae": 0.0, "max": 0.0}
    assert error_report(torch.ones(3), torch.zeros(3))["rel"] > 1e20  # any output against a zero reference fails


@pytest.mark.parametrize("make", [normal_qkv, transformer_like])
def test_distributions_shapes_seeds(make):
    q, k, v = make((2, 17, 4, 64), (2, 33, 2, 64), dtype=torch.float16, seed=3)
    assert (q.shape, k.shape, v.shape) == ((2, 17, 4, 64), (2, 33, 2, 64), (2, 33, 2, 64))
    assert q.dtype == k.dtype == v.dtype == torch.float16
    again = make((2, 17, 4, 64), (2, 33, 2, 64), dtype=torch.float16, seed=3)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    other = make((2, 17, 4, 64), (2, 33, 2, 64), dtype=torch.float16, seed=4)
    assert not torch.equal(q, next(iter(other)))


def test_transformer_like_outliers_and_empty_keys():
    q, k, v = transformer_like((1, 64, 2, 64), (1, 256, 2, 64), dtype=torch.float32)
    assert k[..., :2].mean() - k[..., 2:].mean() > 2.0  # outlier channels: +8 / D ** 0.25 on every key
    token_norm = v.norm(dim=(-1, -2)).flatten()
    assert token_norm.max() > 5 * token_norm.median()  # outlier tokens in V
    q, k, v = transformer_like((1, 4, 1, 16), (1, 0, 1, 16))
    assert k.shape == (1, 0, 1, 16) and v.numel() == 0
