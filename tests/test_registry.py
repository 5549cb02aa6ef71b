"""registry/: Op declarations, Registry (names, aliases, legacy warnings, listing), ArchSpec, availability."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from registry import Arch, ArchSpec, Op, Registry, current_arch, fp8_dtype
from registry.op import _available

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_op(name, kind="fw", archs=("cpu",), aliases=(), legacy=(), requires=(), priority=0, base=Op, **attrs):
    """A fresh dummy Op subclass (a new class each call, so availability caches never leak)."""
    ns = dict(NAME=name, KIND=kind, ARCHS=tuple(archs), ALIASES=tuple(aliases), LEGACY_ALIASES=tuple(legacy),
              REQUIRES=tuple(requires), PRIORITY=priority, **attrs)
    return type(f"Dummy_{name}", (base,), ns)


# ---- Registry ------------------------------------------------------------------------------------------

def test_register_and_lookup_by_name_and_alias():
    reg = Registry()
    a = reg.register(make_op("alphaF", aliases=("alpha", "a")))
    b = reg.register(make_op("betaB", kind="bw"))
    assert reg.get("alphaF") is a and reg.get("alpha") is a and reg.get("a") is a
    assert reg.get("betaB") is b
    assert set(reg.names()) == {"alphaF", "alpha", "a", "betaB"}
    assert not reg.is_legacy("alpha")


def test_register_as_decorator_returns_class():
    reg = Registry()

    @reg.register
    class Gamma(Op):
        NAME = "gammaF"
        ARCHS = ("cpu",)

    assert reg.get("gammaF") is Gamma


def test_unknown_name_lists_registered():
    reg = Registry()
    reg.register(make_op("alphaF"))
    reg.register(make_op("zetaF"))
    with pytest.raises(ValueError, match=r"op='nope' is not a registered op; registered: alphaF, zetaF"):
        reg.get("nope")


def test_duplicate_names_rejected():
    reg = Registry()
    a = reg.register(make_op("alphaF", aliases=("alpha",)))
    with pytest.raises(ValueError, match=r"'alphaF' already registered by Dummy_alphaF"):
        reg.register(make_op("alphaF"))
    with pytest.raises(ValueError, match=r"'alpha' already registered"):
        reg.register(make_op("otherF", aliases=("alpha",)))  # alias clash
    with pytest.raises(ValueError, match=r"'alpha' already registered"):
        reg.register(make_op("alpha"))  # NAME clashing with another op's alias
    reg.register(a)  # re-registering the same class is idempotent
    assert reg.ops() == [a]


def test_op_without_name_rejected():
    with pytest.raises(ValueError, match="has no NAME"):
        Registry().register(make_op(""))


def test_legacy_alias_warns_once_and_names_replacement():
    reg = Registry()
    a = reg.register(make_op("newF", legacy=("oldF", "olderF")))
    assert reg.is_legacy("oldF") and not reg.is_legacy("newF")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert reg.get("oldF") is a
        assert reg.get("oldF") is a
        assert reg.get("newF") is a
        assert reg.get("olderF") is a
        assert reg.get("olderF") is a
    msgs = [str(x.message) for x in w]
    assert msgs == ["op name 'oldF' is a legacy alias; use 'newF'", "op name 'olderF' is a legacy alias; use 'newF'"]
    # a fresh registry has its own once-per-process memory
    reg2 = Registry()
    reg2.register(make_op("newF", legacy=("oldF",)))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        reg2.get("oldF")
    assert len(w) == 1


def test_legacy_alias_warning_visible_under_default_filters():
    """A user passing a legacy name through op= (no -W flags, default warning filters) must see the warning
    exactly once. DeprecationWarning attributed to library code is hidden by Python's default filters."""
    script = textwrap.dedent("""
        import torch, fmha_ops
        from fmha_ops.dispatch import REGISTRY
        from fmha_ops.ops.reference import ReferenceFwOp
        REGISTRY._names["old_referenceF"] = ReferenceFwOp
        REGISTRY._legacy.add("old_referenceF")
        q = torch.randn(1, 3, 1, 8)
        for _ in range(3):
            fmha_ops.memory_efficient_attention(q, q, q, op="old_referenceF")
        fmha_ops.get_op("old_referenceF")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("'old_referenceF' is a legacy alias; use 'torch_referenceF'") == 1, res.stderr


def test_listing_by_kind_in_registration_order():
    reg = Registry()
    f1 = reg.register(make_op("f1"))
    b1 = reg.register(make_op("b1", kind="bw"))
    f2 = reg.register(make_op("f2"))
    assert reg.ops() == [f1, b1, f2]
    assert reg.ops("fw") == [f1, f2]
    assert reg.ops("bw") == [b1]
    assert reg.ops("nope") == []


# ---- ArchSpec ------------------------------------------------------------------------------------------

H200 = Arch("cuda", capability=(9, 0), name="NVIDIA H200")
A100 = Arch("cuda", capability=(8, 0), name="A100")
B200 = Arch("cuda", capability=(10, 0), name="B200")
MI300 = Arch("rocm", gfx="gfx942", name="MI300X")
MI355 = Arch("rocm", gfx="gfx950", name="MI355X")
CPU = Arch("cpu")


@pytest.mark.parametrize("text,arch,ok", [
    ("cpu", CPU, True), ("cpu", H200, False),
    ("cuda>=9.0", H200, True), ("cuda>=9.0", A100, False), ("cuda>=9.0", B200, True), ("cuda>=9.0", CPU, False),
    ("cuda>=8.0,<10.0", A100, True), ("cuda>=8.0,<10.0", H200, True), ("cuda>=8.0,<10.0", B200, False),
    ("cuda>=9", H200, True), ("cuda", A100, True), ("cuda>=9.0", MI300, False),
    ("rocm:gfx942,gfx950", MI300, True), ("rocm:gfx942,gfx950", MI355, True),
    ("rocm:gfx950", MI300, False), ("rocm", MI300, True), ("rocm:gfx942", H200, False),
    ("  cuda>=9.0 ", H200, True),
])
def test_archspec_matches(text, arch, ok):
    assert ArchSpec.parse(text).matches(arch) is ok


def test_archspec_parse_fields_and_str():
    s = ArchSpec.parse("cuda>=8.6,<10.0")
    assert (s.kind, s.min_cc, s.max_cc) == ("cuda", (8, 6), (10, 0))
    assert str(s) == "cuda>=8.6,<10.0"
    assert str(ArchSpec.parse("cuda>=9.0")) == "cuda>=9.0"
    r = ArchSpec.parse("rocm:gfx950, gfx942")
    assert r.gfx == frozenset({"gfx942", "gfx950"}) and str(r) == "rocm:gfx942,gfx950"
    assert str(ArchSpec.parse("cpu")) == "cpu"


@pytest.mark.parametrize("text", ["gpu:h200", "cuda=9.0", "cuda>=9.0,9.1", "tpu:v5", ""])
def test_archspec_bad(text):
    with pytest.raises(ValueError, match="bad arch spec"):
        ArchSpec.parse(text)


def test_arch_str_and_fp8_dtype():
    assert str(CPU) == "cpu"
    assert str(H200) == "cuda sm90 (NVIDIA H200)"
    assert str(MI300) == "rocm gfx942 (MI300X)"
    assert fp8_dtype(MI300) == torch.float8_e4m3fnuz
    assert fp8_dtype(MI355) == torch.float8_e4m3fn
    assert fp8_dtype(H200) == torch.float8_e4m3fn
    assert current_arch("cpu") == CPU
    if not torch.cuda.is_available():
        assert current_arch() == CPU


def test_supports_arch_uses_every_spec():
    op = make_op("multiF", archs=("cuda>=9.0", "rocm:gfx950"))
    assert op.supports_arch(H200) and op.supports_arch(MI355)
    assert not op.supports_arch(MI300) and not op.supports_arch(A100) and not op.supports_arch(CPU)


# ---- availability --------------------------------------------------------------------------------------

def test_available_when_requirements_met():
    assert make_op("okF", requires=("json", "torch")).available() is None


def test_missing_required_module():
    op = make_op("needsF", requires=("json", "fmha_ops_no_such_module_xyz"))
    assert op.available() == "package 'fmha_ops_no_such_module_xyz' is not installed"
    op2 = make_op("needs2F", requires=("no_such_parent_pkg_xyz.child",))  # parent missing: no exception
    assert op2.available() == "package 'no_such_parent_pkg_xyz.child' is not installed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU reason")
def test_gpu_only_op_unavailable_on_cpu():
    op = make_op("gpuF", archs=("cuda>=9.0", "rocm:gfx942"))
    reason = op.available()
    assert reason == "needs a GPU (cuda>=9.0, rocm:gfx942); none here"


def test_availability_cached_and_extra_reason():
    calls = []

    class Flaky(Op):
        NAME = "flakyF"
        ARCHS = ("cpu",)

        @classmethod
        def unavailable_reason(cls):
            calls.append(1)
            return "driver too old"

    assert Flaky.available() == "driver too old"
    assert Flaky.available() == "driver too old"
    assert calls == [1]
    assert _available.cache_info().currsize >= 1


def test_requires_checked_before_unavailable_reason():
    calls = []

    class Both(Op):
        NAME = "bothF"
        ARCHS = ("cpu",)
        REQUIRES = ("fmha_ops_no_such_module_xyz",)

        @classmethod
        def unavailable_reason(cls):
            calls.append(1)
            return "x"

    assert "fmha_ops_no_such_module_xyz" in Both.available()
    assert calls == []


def test_gpu_arch_lookup_is_a_constant_under_torch_compile(monkeypatch):
    """current_arch on a GPU device inside torch.compile(fullgraph=True): the device-properties query (which
    Dynamo cannot trace; stood in for by a function it may not enter) runs at trace time as plain Python, and
    later eager calls are one dict lookup."""
    import types

    import registry.arch as arch_mod

    props = types.SimpleNamespace(major=9, minor=0, name="NVIDIA H200")
    queries = []

    def properties(index):
        queries.append(index)
        return props

    monkeypatch.setattr(torch.cuda, "get_device_properties", torch._dynamo.disable(properties))
    monkeypatch.setattr(arch_mod, "_GPU_ARCHS", {})

    def scaled(x):
        arch = current_arch("cuda:0")
        return x * (2.0 if arch.kind == "cuda" and arch.capability >= (9, 0) else 3.0)

    torch._dynamo.reset()
    try:
        got = torch.compile(scaled, fullgraph=True, backend="aot_eager")(torch.ones(3))
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, torch.full((3,), 2.0)) and queries == [0]
    assert current_arch("cuda:0") == Arch("cuda", (9, 0), name="NVIDIA H200")
    assert current_arch("cuda:0") is current_arch(torch.device("cuda", 0)) and queries == [0, 0]
