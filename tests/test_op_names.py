"""xformers / MSLK op names, classes and tuples as ``op=`` (``fmha_ops.ops.aliases``), without xformers:
stand-in classes carry only what the real ones do (``NAME``, module and qualified name)."""
from __future__ import annotations

import warnings

import pytest
import torch

import fmha_ops
from fmha_ops.dispatch import REGISTRY, SELECTOR
from fmha_ops.ops import aliases
from fmha_ops.ops.aliases import RULES, TUPLES, foreign_op, mapping
from fmha_ops.inputs import Inputs
from fmha_ops.ops.reference import ReferenceFwOp, reference_attention
from fmha_ops.testing import error_report


def foreign_class(module: str, qualname: str, name: str | None):
    """A class shaped like xformers' op classes: defined in ``module``, optionally with a NAME."""
    ns = {"__module__": module, "__qualname__": qualname}
    if name is not None:
        ns["NAME"] = name
    return type(qualname, (), ns)


XF = "xformers.ops.fmha"
MSLK = "mslk.attention.fmha"

FW_CASES = [  # (foreign value, our op NAME or None for the selector's choice)
    ("cutlassF-pt", "sdpa_efficientF"),
    ("cutlassF", "sdpa_efficientF"),
    (foreign_class(f"{XF}.cutlass", "FwOp", "cutlassF-pt"), "sdpa_efficientF"),
    (foreign_class(f"{MSLK}.cutlass", "FwOp", None), "sdpa_efficientF"),  # no NAME: by qualified name
    ("xformers.ops.fmha.cutlass.FwOp", "sdpa_efficientF"),
    ("fa2F@2.5.6", "sdpa_flashF"),
    ("fa2F@2.5.6-pt", "sdpa_flashF"),
    (foreign_class(f"{XF}.flash", "FwOp", "fa2F@0.0.0"), "sdpa_flashF"),
    ("fa3F@2.7.4", None),
    ("fa3F_splitKV@2.7.4", None),
    (foreign_class(f"{MSLK}.flash3", "FwOp", "fa3F@3.0.0b1"), None),
    ("cutlassF-blackwell", None),
    ("cuteDSLF-hopper", None),
    ("ckF", None),
    ("flydslF", None),
    ("triton_splitKF", "triton_splitKF"),
    (foreign_class(f"{XF}.triton_splitk", "FwOp", "triton_splitKF"), "triton_splitKF"),
    (foreign_class(f"{XF}.triton_splitk", "FwOp", None), "triton_splitKF"),
    ("triton_splitK4", "triton_splitKF"),
    ("triton_splitK128", "triton_splitKF"),
    ("ck_decoderF", "flydsl_decoderF"),
    ("ck_splitKF", "flydsl_splitKF"),
    ("ck_splitK4", "flydsl_splitK4F"),
    (foreign_class(f"{MSLK}.ck_splitk", "FwOp_S8", None), "flydsl_splitK8F"),
    ("ck_splitK128", "flydsl_splitKF"),  # no fixed 128-split decoder: the heuristic one
    ("flydsl_splitK4", "flydsl_splitK4F"),
    ("flydsl_splitK128", "flydsl_splitKF"),
    ("MemoryEfficientAttentionFlashAttentionOp", "sdpa_flashF"),
    ("MemoryEfficientAttentionCutlassFwdFlashBwOp", "sdpa_efficientF"),
    ("MemoryEfficientAttentionCkDecoderOp", "flydsl_decoderF"),
    ((foreign_class(f"{XF}.flash", "FwOp", "fa2F@0.0.0"), foreign_class(f"{XF}.flash", "BwOp", "fa2B@0.0.0")),
     "sdpa_flashF"),
    (("cutlassF-pt", "cutlassB-pt"), "sdpa_efficientF"),
]


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("value,target", FW_CASES, ids=lambda x: getattr(x, "__qualname__", str(x)))
def test_forward_values_map_to_ours(quiet, value, target):
    got = foreign_op(value, "fw")
    assert (got.NAME if got is not None else None) == target
    resolved = SELECTOR.resolve(value, "fw")
    assert (resolved.NAME if resolved is not None else None) == target


@pytest.mark.parametrize("value", ["cutlassB-pt", "fa2B@2.5.6", "fa3B@2.7.4", "ckB", "flydslB", "cutlassB-blackwell",
                                   foreign_class(f"{XF}.flash", "BwOp", "fa2B@0.0.0"),
                                   foreign_class(f"{XF}.cutlass", "BwOp", None),
                                   ("fa2F@1", "fa2B@1"), "MemoryEfficientAttentionCutlassOp"])
def test_backward_values_leave_the_choice_to_the_selector(value):
    assert foreign_op(value, "bw") is None
    assert SELECTOR.resolve(value, "bw") is None


def test_every_rule_is_reached_and_every_tuple_resolves(quiet):
    names = ["fa2F-mtia", "cutlassF", "fa2F", "triton_splitKF", "ck_decoderF", "ck_splitK", "ck_splitK2",
             "triton_splitK2", "fa3F", "cutlassB"]
    hit = {next(i for i, r in enumerate(RULES) if r.match(n)) for n in names}
    assert hit == set(range(len(RULES)))
    for name in TUPLES:
        if "Mtia" in name:
            continue
        fw, bw = foreign_op(name, "fw"), foreign_op(name, "bw")
        assert fw is None or fw.KIND == "fw"
        assert bw is None or bw.KIND == "bw"


def test_mapping_says_why():
    m = mapping("ck_splitK128")
    assert m.target == "flydsl_splitKF" and "128" in m.why and "1, 2, 4" in m.why
    assert mapping("fa2F@2.5.6").why == "torch's build of FlashAttention-2"
    assert mapping("fa3F@2.7.4").target is None and "selector" in mapping("fa3F@2.7.4").why


@pytest.mark.parametrize("value,match", [
    ("fa2F@2.5.6-mtia", "cannot run here: MTIA"),
    ("MemoryEfficientAttentionFlashMtiaAttentionOp", "cannot run here: MTIA"),
    ("no_such_opF", r"is not a registered op \(.*torch_referenceF.*\) nor a known xformers / MSLK op name"),
    (foreign_class("somelib", "Thing", None), r"op='somelib.Thing' is not a registered op"),
    (object(), "is not an op class, op name or"),
    (("cutlassF",), r"a tuple must be \(FwOp, BwOp\)"),
])
def test_unknown_or_unrunnable_values_raise(value, match):
    with pytest.raises(ValueError, match=match):
        foreign_op(value, "fw")


def test_kind_mismatch_raises():
    with pytest.raises(ValueError, match="'fa2B@1' is a bw op; a fw op is needed"):
        foreign_op("fa2B@1", "fw")
    with pytest.raises(ValueError, match="'cutlassF-pt' is a fw op; a bw op is needed"):
        foreign_op("cutlassF-pt", "bw")


def test_our_own_values_pass_through():
    assert foreign_op(None, "fw") is None
    assert foreign_op(ReferenceFwOp, "fw") is ReferenceFwOp
    assert foreign_op("torch_referenceF", "fw") is ReferenceFwOp
    stand_in = type("FwOp", (), {"NAME": "fmha_ops:torch_referenceF", "FMHA_OPS_OP": ReferenceFwOp})
    assert foreign_op(stand_in, "fw") is ReferenceFwOp


def test_legacy_names_are_registry_aliases():
    for old, ours in aliases.LEGACY_NAMES.items():
        assert REGISTRY.is_legacy(old) and old in REGISTRY.aliases(REGISTRY.get(ours))


def test_xformers_tuple_attributes(monkeypatch):
    monkeypatch.setattr(aliases, "_WARNED", set())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pair = fmha_ops.MemoryEfficientAttentionFlashAttentionOp
        assert fmha_ops.MemoryEfficientAttentionFlashAttentionOp == pair
    assert pair == (REGISTRY.get("sdpa_flashF"), None)
    mine = [x for x in w if "MemoryEfficientAttentionFlashAttentionOp" in str(x.message)]
    assert len(mine) == 1 and "sdpa_flashF" in str(mine[0].message)


def test_a_call_with_xformers_flash_tuple_runs_sdpa_flash_on_cpu():
    flash = (foreign_class(f"{XF}.flash", "FwOp", "fa2F@0.0.0"), foreign_class(f"{XF}.flash", "BwOp", "fa2B@0.0.0"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 17, 4, 32, generator=g, requires_grad=True) for _ in range(3))
    out = fmha_ops.memory_efficient_attention(q, k, v, fmha_ops.LowerTriangularMask(), op=flash)
    ref, _ = reference_attention(Inputs(q, k, v, fmha_ops.LowerTriangularMask()), torch.float64)
    assert error_report(out, ref)["rel"] < 1e-5
    out.sum().backward()  # sdpa_flashF differentiates through torch: the BwOp maps to the selector's choice
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_a_forced_foreign_op_that_cannot_run_raises_naming_ours():
    q = k = v = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"op='sdpa_efficientF' cannot run this call: .*cuda"):
        fmha_ops.memory_efficient_attention(q, k, v, op=foreign_class(f"{XF}.cutlass", "FwOp", "cutlassF-pt"))
