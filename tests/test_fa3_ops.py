"""FlashAttention-3 ops on a CPU machine: availability, the build found and its flags, declarations and reasons on
an sm90 arch. Nothing here needs a FlashAttention-3 build; problems are built from real inputs and re-targeted
to the H200, so the same ``not_supported_reasons`` the selector reads are checked."""
import importlib
import sys
from importlib.util import find_spec

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.ops import fa3
from fmha_ops.ops.fa3 import FA3BwOp, FA3Build, FA3FwOp, fa3_package_reason, find_build
from tests.test_ext_ops import B200, F8, H200, problem, reasons

#: the build flags the fa3-fwd 0.0.3 wheel ships (its fa3_fwd_config.CONFIG)
FA3_FWD_FLAGS = {"FLASHATTENTION_DISABLE_BACKWARD": True, "FLASHATTENTION_DISABLE_PAGEDKV": True,
                 "FLASHATTENTION_DISABLE_LOCAL": True, "FLASHATTENTION_DISABLE_FP16": True,
                 "FLASHATTENTION_DISABLE_SPLIT": False, "FLASHATTENTION_DISABLE_FP8": False}


@pytest.fixture
def fa3_fwd_build(monkeypatch):
    """The ops' build as the fa3-fwd wheel declares it."""
    monkeypatch.setattr(fa3, "BUILD", FA3Build("fa3_fwd_interface", "fa3-fwd", FA3_FWD_FLAGS))


@pytest.mark.skipif(fa3_package_reason() is None, reason="a FlashAttention-3 build is installed here")
def test_fa3_unavailable_names_both_builds_and_the_extra():
    for op in (FA3FwOp, FA3BwOp):
        why = op.available()
        assert "FlashAttention-3 is not installed" in why and "fmha-ops[fa3]" in why and "hopper/" in why, why
    q = torch.randn(1, 8, 2, 16)
    verdict = next(v for v in fmha_ops.explain(q, q, q).verdicts if v.op is FA3FwOp)
    assert not verdict.ok and "FlashAttention-3" in verdict.why_not()


def test_find_build_reads_the_config_of_the_first_build_installed(tmp_path, monkeypatch):
    (tmp_path / "fa3_fwd_interface.py").write_text("raise ImportError('the CUDA extension is not imported here')\n")
    (tmp_path / "fa3_fwd_config.py").write_text(
        "CONFIG = {'build_flags': {'FLASHATTENTION_DISABLE_BACKWARD': True, 'FLASHATTENTION_DISABLE_HDIM256': True}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    build = find_build()
    if build.module == "flash_attn_interface":
        pytest.skip("upstream FlashAttention-3 is installed here and wins")
    assert build.module == "fa3_fwd_interface" and build.package == "fa3-fwd"
    assert not build.has("BACKWARD") and build.has("VARLEN") and build.max_head_dim == 192
    assert "FLASHATTENTION_DISABLE_BACKWARD" in " ".join(build.missing("BACKWARD", "a backward"))


def test_the_fa3_fwd_wheel_without_a_config_is_taken_as_forward_only(tmp_path, monkeypatch):
    """A fa3-fwd build that ships no config (another version of the wheel) still has no backward: fa3B declines."""
    (tmp_path / "fa3_fwd_interface.py").write_text("raise ImportError('the CUDA extension is not imported here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fa3_fwd_config", raising=False)  # another test's config, imported
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "fa3_fwd_config" else find_spec(name))
    build = find_build()
    if build.module == "flash_attn_interface":
        pytest.skip("upstream FlashAttention-3 is installed here and wins")
    assert build.module == "fa3_fwd_interface" and not build.has("BACKWARD") and build.has("VARLEN")
    monkeypatch.setattr(fa3, "BUILD", build)
    assert "has no backward (FLASHATTENTION_DISABLE_BACKWARD)" in FA3BwOp.available()


def test_fa3_declares_sm90_bf16_fp8_gqa_varlen_decode_and_lse():
    assert reasons(FA3FwOp, problem(H200, d=128, hkv=1)) == ""
    assert reasons(FA3FwOp, problem(H200, d=256, mq=17, mk=1000, bias=ab.LowerTriangularFromBottomRightMask())) == ""
    assert reasons(FA3FwOp, problem(H200, d=128, dtype=F8, descale="head", partial=True)) == ""
    assert reasons(FA3FwOp, problem(H200, d=64, dtype=F8, descale="tensor")) == ""
    assert reasons(FA3FwOp, problem(H200, d=192, dv=128)) == "", "DeepSeek-V3's 192/128"
    assert reasons(FA3FwOp, problem(H200, d=192, dv=128, dtype=F8, descale="head")) == ""
    mask = ab.BlockDiagonalMask.from_seqlens([3, 50, 1], [7, 50, 9])
    assert reasons(FA3FwOp, problem(H200, b=1, mq=54, mk=66, bias=mask.make_causal_from_bottomright())) == ""
    decode = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([2, 2, 2], 64, [9, 64, 33])
    assert reasons(FA3FwOp, problem(H200, b=1, mq=6, mk=3 * 64, bias=decode)) == ""
    assert FA3FwOp.PARTIAL and FA3FwOp.GQA and not FA3FwOp.AUTOGRAD


@pytest.mark.parametrize("kwargs,expect", [
    (dict(d=264), "head dim K=264 not supported"),
    (dict(d=60), "head dim K=60 not supported"),
    (dict(dtype=F8, d=72, descale="head"), "fp8 head dims K=72, Kv=72 must be multiples of 16"),
    (dict(d=128, dv=64), "value head dim Kv=64 with K=128 not supported; supported: K in 129..192 with Kv in 97..128"),
    (dict(dtype=F8, d=64, dv=256, descale="head"), "value head dim Kv=256 with K=64 not supported"),
    (dict(mq=17, mk=64, bias=ab.LowerTriangularMask()), "top-left causal with Mq=17 != Mk=64"),
    (dict(p=0.1), "dropout"),
    (dict(dtype=torch.float32), "dtypes (q, k, v) float32/float32/float32 not supported"),
])
def test_fa3_reasons(kwargs, expect):
    assert expect in reasons(FA3FwOp, problem(H200, **kwargs))


def test_fa3_declines_ragged_queries_over_a_cache_and_other_archs():
    decode = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 3], 64, [9, 64])
    assert "query sequences of different lengths over a KV cache" in reasons(FA3FwOp, problem(H200, b=1, mq=4,
                                                                                               mk=128, bias=decode))
    assert not FA3FwOp.supports_arch(B200)
    assert FA3FwOp.supports_arch(H200)


def test_the_fa3_fwd_wheel_refuses_what_it_was_built_without(fa3_fwd_build):
    window = ab.LowerTriangularFromBottomRightLocalAttentionMask(128)
    assert "local attention windows not supported by this FlashAttention-3 build (fa3-fwd: " \
           "FLASHATTENTION_DISABLE_LOCAL)" in reasons(FA3FwOp, problem(H200, mq=256, mk=256, bias=window))
    assert "float16 not supported by this FlashAttention-3 build" in reasons(FA3FwOp, problem(H200,
                                                                                                dtype=torch.float16))
    paged = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 64, [9, 64]).make_paged(
        torch.arange(4, dtype=torch.int32).view(2, 2), 32)
    assert "FLASHATTENTION_DISABLE_PAGEDKV" in reasons(FA3FwOp, problem(H200, b=1, mq=2, mk=128, bias=paged))
    whole = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 64, [9, 64]).make_paged(
        torch.arange(2, dtype=torch.int32).view(2, 1), 64)
    assert reasons(FA3FwOp, problem(H200, b=1, mq=2, mk=128, bias=whole)) == "", "a contiguous cache as one page"
    assert reasons(FA3FwOp, problem(H200, d=128)) == ""
    why = FA3BwOp.available()
    assert "has no backward (FLASHATTENTION_DISABLE_BACKWARD)" in why and "fa3-fwd" in why


def test_the_backward_declares_equal_head_dims_and_no_cache_masks():
    assert reasons(FA3BwOp, problem(H200, d=128)) == ""
    assert "value head dim Kv=128 must equal K=192" in reasons(FA3BwOp, problem(H200, d=192, dv=128))
    decode = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 64, [9, 64])
    assert "attn_bias padded_keys_causal not supported" in reasons(FA3BwOp, problem(H200, b=1, mq=2, mk=128,
                                                                                     bias=decode))


def _leftpad_mask(page_size: int, pages: int = 1):
    """A causal decode mask over two sequences of ``pages`` pages with key starts 3 and 0 (``cache_leftpad``)."""
    lens, starts = torch.tensor([9, 40], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32)
    table = torch.arange(2 * pages, dtype=torch.int32).view(2, pages)
    return ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_device_seqlens(1, lens, table, page_size,
                                                                                  key_start=starts)


def test_fa3_declares_key_starts_the_wheel_too(fa3_fwd_build):
    """FA3's forward takes ``leftpad_k`` (fa3-fwd 0.0.3 and upstream 3.0): the decode op declares key starts, on
    whole cache rows with the wheel (it has no paged KV), on any page size with a paged build."""
    assert FA3FwOp.KEY_START and "leftpad_k" in fa3.FWD_ARGUMENTS
    p = problem(H200, b=1, mq=2, mk=128, bias=_leftpad_mask(64))
    assert p.key_start and reasons(FA3FwOp, p) == "", "whole rows (kv_batch_idx) with starts"
    paged = reasons(FA3FwOp, problem(H200, b=1, mq=2, mk=128, bias=_leftpad_mask(32, pages=2)))
    assert "FLASHATTENTION_DISABLE_PAGEDKV" in paged and "cache_leftpad" not in paged


def test_fa3_import_reason_names_a_forward_without_leftpad_k(monkeypatch):
    """A FlashAttention-3 forward older than the one this adapter calls (no ``leftpad_k``) is refused by name."""
    arguments = [type("Arg", (), {"name": n}) for n in sorted(fa3.FWD_ARGUMENTS - {"leftpad_k"})]
    fwd = type("Fwd", (), {"default": type("Overload", (), {"_schema": type("Schema", (), {"arguments": arguments})})})
    monkeypatch.setattr(fa3, "import_failure", lambda module: None)
    monkeypatch.setattr(fa3, "forward_kernel", lambda: fwd)
    assert "takes no ['leftpad_k']" in fa3.fa3_import_reason()


def test_fa3_passes_the_key_starts_as_leftpad_k(monkeypatch, fa3_fwd_build):
    """The adapter hands FA3 the mask's starts (the tensor itself, no copy) as ``leftpad_k``, through ``apply`` and
    the decode launcher; a call without starts passes None. FA3's forward is replaced by a recorder (CPU)."""
    from fmha_ops.inputs import make_inputs

    calls = []

    def fwd(q, **kw):
        calls.append(kw)
        return torch.zeros(q.shape[:3] + (kw["v"].shape[3],), dtype=q.dtype), torch.zeros(q.shape[0], q.shape[2],
                                                                                          q.shape[1])

    monkeypatch.setattr(fa3, "forward_kernel", lambda: fwd)
    mask = _leftpad_mask(64)
    q, kv = torch.randn(1, 2, 4, 64).to(torch.bfloat16), torch.randn(1, 128, 2, 64).to(torch.bfloat16)
    inp = make_inputs(q, kv, kv, mask)
    FA3FwOp.apply(inp, False)
    assert calls[-1]["leftpad_k"] is mask.key_start and calls[-1]["kv_batch_idx"].tolist() == [0, 1]
    launch = FA3FwOp.decode_launcher(inp, False)
    out = torch.empty(2, 1, 4, 64, dtype=torch.bfloat16)
    cache = kv.view(2, 64, 2, 64)
    lens, table = mask.k_seqinfo.seqlen, mask.block_tables
    launch(q.view(2, 1, 4, 64), cache, cache, None, None, lens, table, out, None, key_start=mask.key_start)
    assert calls[-1]["leftpad_k"] is mask.key_start
    launch(q.view(2, 1, 4, 64), cache, cache, None, None, lens, table, out, None)
    assert calls[-1]["leftpad_k"] is None


def _fa3_recorder(calls: list):
    """FA3's forward replaced by a recorder of its keywords: out (total or B, Mq, Hq, Kv) in bf16, lse zeros."""
    def fwd(q, **kw):
        calls.append(dict(kw, q=q))
        out = torch.zeros(q.shape[:-1] + (kw["v"].shape[-1],), dtype=torch.bfloat16)
        return out, torch.zeros(q.shape[0], q.shape[-2], q.shape[1]) if q.ndim == 4 else torch.zeros(q.shape[1],
                                                                                                      q.shape[0])
    return fwd


def _same_keywords(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor):
            strides = [(a, b) for n, a, b in zip(g.shape, g.stride(), w.stride()) if n > 1]  # size-1 dims: any stride
            assert (g.shape, g.dtype, g.data_ptr()) == (w.shape, w.dtype, w.data_ptr()), name
            assert all(a == b for a, b in strides), name
        else:
            assert g == w and type(g) is type(w), name


LAUNCHER_CASES = {
    "bf16 causal": (torch.bfloat16, "causal", None),
    "bf16 window, lse": (torch.bfloat16, "window", None),
    "fp8, per-tensor descales (1,)": (F8, "causal", (1,)),
    "fp8, per-tensor descales ()": (F8, "none", ()),
    "fp8, per-tensor descales (1, 1, 1)": (F8, "causal", (1, 1, 1)),
    "fp8, (B, Hkv) descales": (F8, "causal", (2, 2)),
    "fp8, per-tensor descales (1, 1)": (F8, "causal", (1, 1)),
    "varlen fp8, per-tensor descales": (F8, "varlen", (1,)),
    "varlen bf16, lse": (torch.bfloat16, "varlen", None),
}


@pytest.mark.parametrize("case", list(LAUNCHER_CASES))
def test_fa3_launcher_passes_what_apply_passes(monkeypatch, case):
    """The launch plan of repeated calls hands FA3 the keywords ``apply`` does (values, shapes, strides), on the
    new call's tensors, descales and varlen starts; it returns what ``apply`` returns."""
    from fmha_ops.inputs import make_inputs

    calls = []
    monkeypatch.setattr(fa3, "forward_kernel", lambda: _fa3_recorder(calls))
    dtype, mask, descale_shape = LAUNCHER_CASES[case]
    needs_lse = "lse" in case
    q, k, v = (torch.randn(2, 10, h, 64).to(dtype) for h in (4, 2, 2))
    if mask == "varlen":
        q, k, v = (t.reshape(1, 20, t.shape[2], 64) for t in (q, k, v))
    descales = {} if descale_shape is None else {f"{r}_descale": torch.rand(descale_shape) + 0.5 for r in "qkv"}
    bias = {"causal": ab.LowerTriangularFromBottomRightMask(), "none": None,
            "window": ab.LowerTriangularFromBottomRightLocalAttentionMask(4),
            "varlen": ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens([3, 17])}[mask]
    inp = make_inputs(q, k, v, bias, **descales)
    run = FA3FwOp.launcher(inp, needs_lse)
    q2, k2, v2 = (t.clone() for t in (q, k, v))  # another call of the same layout
    descales2 = {name: d * 2 for name, d in descales.items()}
    bias2 = (ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens([11, 9]) if mask == "varlen" else bias)
    inp2 = make_inputs(q2, k2, v2, bias2, **descales2)
    want = FA3FwOp.apply(inp2, needs_lse)
    got = run(q2, k2, v2, bias2, descales2.get("q_descale"), descales2.get("k_descale"), descales2.get("v_descale"))
    assert len(calls) == 2
    _same_keywords(calls[1], calls[0])
    assert got[0].shape == want[0].shape and got[0].dtype == want[0].dtype
    assert (got[1] is None) == (want[1] is None) and (got[1] is None or got[1].shape == want[1].shape)
