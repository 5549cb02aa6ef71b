"""What a new user meets first: the command line's help, info and tune on a machine without a GPU, and the
messages of the commonest mistakes (each names the argument, the value and what to pass)."""
from __future__ import annotations

import re

import pytest
import torch

import fmha_ops
from fmha_ops.__main__ import main

Q = torch.randn(1, 4, 2, 8)


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "python -m fmha_ops [info|explain|tune|merge]" in out and "tune" in out


def test_an_unknown_command_says_what_there_is(capsys):
    assert main(["tuen"]) == 2
    assert "use: python -m fmha_ops [info | explain | tune | merge]" in capsys.readouterr().err


def test_info_lists_unavailable_ops_once_grouped_by_reason(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    unavailable = [op for op in fmha_ops.REGISTRY.ops() if op.available() is not None]
    body = out.split("not available here")[1] if unavailable else ""
    for op in unavailable:
        listed = re.findall(rf"(?<![\w]){re.escape(op.NAME)}(?=,|\n)", body)  # whole names (cudnnF, sdpa_cudnnF)
        assert len(listed) == 1, op.NAME
        assert out.count(op.available()) == 1  # each reason once, above its ops


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_tune_without_a_gpu_says_so_and_stops(capsys, tmp_path):
    assert main(["tune", "--out", str(tmp_path / "t.json")]) == 2
    assert "torch sees none here" in capsys.readouterr().err and not (tmp_path / "t.json").exists()


def test_a_string_mask_names_what_to_pass():
    with pytest.raises(TypeError, match=r"attn_bias='causal' is a str; pass a mask object .*LowerTriangularMask\(\)"):
        fmha_ops.memory_efficient_attention(Q, Q, Q, "causal")
    with pytest.raises(TypeError, match=r"attn_bias=LowerTriangularMask is a mask class; .*LowerTriangularMask\(\)"):
        fmha_ops.memory_efficient_attention(Q, Q, Q, fmha_ops.LowerTriangularMask)


def test_an_unknown_op_lists_names_not_patterns():
    with pytest.raises(ValueError) as e:
        fmha_ops.memory_efficient_attention(Q, Q, Q, op="nope")
    assert "torch_referenceF" in str(e.value) and "cutlassF" in str(e.value) and "(?P" not in str(e.value)


def test_merge_of_an_empty_list_completes_its_sentence():
    with pytest.raises(TypeError, match=r"lse_split must be a tensor or a non-empty list of tensors, got an empty "
                                        r"list$"):
        fmha_ops.merge_attentions([Q], [])


def test_one_dim_shapes_print_as_tuples():
    k_cache = torch.randn(2, 8, 2, 8, dtype=torch.float16)
    q = torch.randn(2, 1, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"cache_seqlens has shape \(3,\); expected \(2,\)"):
        fmha_ops.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=torch.zeros(3, dtype=torch.int32))


def test_fp8_attention_of_float32_raises_value_error():
    with pytest.raises(ValueError, match="q has dtype float32; supported: float16, bfloat16"):
        fmha_ops.fp8_attention(Q, Q, Q)


def test_use_ops_of_a_number_raises_type_error():
    with pytest.raises(TypeError, match="use_ops takes op classes or op names"):
        with fmha_ops.use_ops(3):
            pass


def test_use_ops_checks_its_ops_when_called_not_when_entered():
    """``use_ops(3)`` alone raises (not only in a ``with``), and so does an unknown name or one among the excluded."""
    with pytest.raises(TypeError, match="use_ops takes op classes or op names"):
        fmha_ops.use_ops(3)
    with pytest.raises(TypeError, match="got float 2.5"):
        fmha_ops.use_ops(exclude=[2.5])
    with pytest.raises(ValueError, match="not a registered op"):
        fmha_ops.use_ops("sdpa_flashF", "no_such_op")
