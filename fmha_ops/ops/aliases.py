"""Other libraries' attention op names, classes and tuples, mapped onto ours.

xformers and MSLK (``mslk.attention.fmha``) name their ops by kernel family and version
(``cutlassF-pt``, ``fa3F@2.7.4``, ``triton_splitK4``, ``ck_decoderF``, ``flydsl_splitK128``), and
callers pass them to ``op=`` as classes (``xformers.ops.fmha.cutlass.FwOp``), as ``(FwOp, BwOp)``
tuples (``MemoryEfficientAttentionFlashAttentionOp``), or as names. ``op=`` accepts all of these
without importing either library: a class is read by its ``NAME`` attribute (or, lacking one, its
qualified name such as ``cutlass.FwOp``), then matched against ``RULES``.

Each rule says which of our ops runs the same computation, and why:

- the same kernel built elsewhere: ``cutlassF`` -> ``sdpa_efficientF`` (torch's build of the CUTLASS
  kernels), ``fa2F`` -> ``sdpa_flashF`` (torch's build of FlashAttention-2);
- the op that replaces it: ``ck_decoderF`` -> ``flydsl_decoderF``, ``ck_splitK{n}`` /
  ``flydsl_splitK{n}`` -> ``flydsl_splitK{n}F`` for the split counts we build (``FIXED_SPLITS``),
  else ``flydsl_splitKF``; ``triton_splitK{n}`` -> ``triton_splitKF``;
- ``None``, the selector's choice, for families without one kernel of ours that matches (FA3, the
  Blackwell CUTLASS / CuTe kernels, CK's prefill op, FlyDSL's prefill op) and for backward ops
  (ours pair with the forward: SDPA forwards differentiate through torch, the others through the
  selected backward op);
- an error naming the rule for devices we do not run on (MTIA).

The old CK names (``ck_decoderF``, ``ck_splitKF``, ``ck_splitK{n}``) are also registered as legacy
aliases, so ``use_ops`` and ``FMHA_OPS_FORCE`` accept them (warning once).

Example
-------
>>> from fmha_ops.ops.aliases import foreign_op, mapping
>>> mapping("fa2F@2.5.6").target
'sdpa_flashF'
>>> foreign_op("triton_splitK4", "fw").NAME
'triton_splitKF'
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

from registry import Op

from ..dispatch import REGISTRY
from .flydsl_decode import FIXED_SPLITS

#: The heuristic-split op of each split-K family, and its fixed-split op names.
_FLYDSL_SPLIT, _TRITON_SPLIT = "flydsl_splitKF", "triton_splitKF"


@dataclass(frozen=True)
class Mapping:
    """Where one foreign op name goes: ``target`` is our op's NAME (None: the selector chooses)."""

    name: str
    kind: str  # "fw" | "bw"
    target: str | None
    why: str


@dataclass(frozen=True)
class _Rule:
    pattern: str  # regular expression matched against the whole foreign NAME
    kind: str
    target: str | None
    why: str
    runs: bool = True  # False: a call with this op raises, naming ``why``

    def match(self, name: str) -> re.Match | None:
        return re.fullmatch(self.pattern, name)


_SELECTOR = "no one kernel of ours matches it; the selector chooses among ours (see fmha_ops.explain)"
_BACKWARD = ("our backward pairs with the forward: SDPA forwards differentiate through torch, the "
             "others through the selected backward op")
_VERSION = r"(@[\w.+-]*)?"

#: Foreign op NAME patterns -> ours, first match wins. ``{n}`` in a target is the split count.
RULES: tuple[_Rule, ...] = (
    _Rule(r"fa2[FB]" + _VERSION + r"-mtia", "any", None, "MTIA devices are not supported", runs=False),
    _Rule(r"cutlassF(-pt)?", "fw", "sdpa_efficientF", "torch's build of the same CUTLASS kernels"),
    _Rule(r"fa2F" + _VERSION + r"(-pt)?", "fw", "sdpa_flashF", "torch's build of FlashAttention-2"),
    _Rule(r"triton_splitKF", "fw", _TRITON_SPLIT, "the Triton split-K decoder of the same name"),
    _Rule(r"ck_decoderF", "fw", "flydsl_decoderF", "the FlyDSL decoder replaces CK's"),
    _Rule(r"(ck|flydsl)_splitKF?", "fw", _FLYDSL_SPLIT, "the FlyDSL split-K decoder replaces CK's"),
    _Rule(r"(ck|flydsl)_splitK(?P<n>\d+)F?", "fw", "flydsl_splitK{n}F",
          "the FlyDSL split-K decoder with the same fixed split count"),
    _Rule(r"triton_splitK(?P<n>\d+)", "fw", _TRITON_SPLIT,
          "the Triton split-K decoder; it chooses the split count itself"),
    _Rule(r"fa3F" + _VERSION + r"|fa3F_splitKV" + _VERSION + r"|cutlassF-blackwell(-decode)?|cuteDSLF-\w+"
          r"|ckF|flydslF", "fw", None, _SELECTOR),
    _Rule(r"cutlassB(-pt)?|fa[23]B" + _VERSION + r"(-pt)?|cutlassB-blackwell|cuteDSLB-\w+|ckB|flydslB",
          "bw", None, _BACKWARD),
)

#: Class qualified names (module basename + class) -> the NAME the class carries, for classes without one.
QUALNAMES = {
    "cutlass.FwOp": "cutlassF", "cutlass.BwOp": "cutlassB", "flash.FwOp": "fa2F", "flash.BwOp": "fa2B",
    "flash3.FwOp": "fa3F", "flash3.BwOp": "fa3B", "flash3.FwOp_KVSplit": "fa3F_splitKV",
    "triton_splitk.FwOp": "triton_splitKF", "ck.FwOp": "ckF", "ck.BwOp": "ckB", "ck_decoder.FwOp": "ck_decoderF",
    "ck_splitk.FwOp": "ck_splitKF", "cutlass_blackwell.FwOp": "cutlassF-blackwell",
    "cutlass_blackwell.BwOp": "cutlassB-blackwell", "cute_blackwell.FwOp": "cuteDSLF-blackwell",
    "cute_blackwell.BwOp": "cuteDSLB-blackwell", "cute_hopper.FwOp": "cuteDSLF-hopper",
    "cute_hopper.BwOp": "cuteDSLB-hopper", "flydsl.FwOp": "flydslF", "flydsl.BwOp": "flydslB",
    **{f"ck_splitk.FwOp_S{n}": f"ck_splitK{n}" for n in (1, 2, 4, 8, 16, 32, 64, 128)},
}

#: xformers' / MSLK's (FwOp, BwOp) tuple names -> the NAMEs of their two ops.
TUPLES = {
    "MemoryEfficientAttentionCutlassOp": ("cutlassF", "cutlassB"),
    "MemoryEfficientAttentionCutlassBlackwellOp": ("cutlassF-blackwell", "cutlassB-blackwell"),
    "MemoryEfficientAttentionCutlassFwdFlashBwOp": ("cutlassF", "fa2B"),
    "MemoryEfficientAttentionFlashAttentionOp": ("fa2F", "fa2B"),
    "MemoryEfficientAttentionFlashMtiaAttentionOp": ("fa2F-mtia", "fa2B-mtia"),
    "MemoryEfficientAttentionCkOp": ("ckF", "ckB"),
    "MemoryEfficientAttentionCkDecoderOp": ("ck_decoderF", "ckB"),
    "MemoryEfficientAttentionSplitKCkOp": ("ck_splitKF", "ckB"),
    "MemoryEfficientAttentionFlyDSLOp": ("flydslF", "flydslB"),
    "MemoryEfficientAttentionCuteFlashAttentionOp": ("cuteDSLF-blackwell", "cuteDSLB-blackwell"),
}

#: Old names of our own ops, registered as legacy aliases (``use_ops`` / ``FMHA_OPS_FORCE`` take them).
LEGACY_NAMES = {"ck_decoderF": "flydsl_decoderF", "ck_splitKF": _FLYDSL_SPLIT,
                **{f"ck_splitK{n}": f"flydsl_splitK{n}F" for n in FIXED_SPLITS}}


def mapping(name: str) -> Mapping:
    """Where the foreign op ``name`` (a NAME, a qualified class name) goes; ValueError if it cannot run.

    Example
    -------
    >>> mapping("cutlassF-pt")
    Mapping(name='cutlassF-pt', kind='fw', target='sdpa_efficientF', why="torch's build of the same CUTLASS kernels")
    """
    name = QUALNAMES.get(_qualname_tail(name), name)
    for rule in RULES:
        m = rule.match(name)
        if m is None:
            continue
        if not rule.runs:
            raise ValueError(f"op={name!r} cannot run here: {rule.why}")
        target, why = rule.target, rule.why
        n = m.groupdict().get("n")
        if n is not None and "{n}" in (target or ""):
            if int(n) in FIXED_SPLITS:
                target = target.format(n=n)
            else:
                target, why = _FLYDSL_SPLIT, (f"no fixed {n}-split FlyDSL decoder is built (fixed: "
                                              f"{', '.join(map(str, FIXED_SPLITS))}); {_FLYDSL_SPLIT} chooses the split count")
        return Mapping(name, rule.kind, target, why)
    raise ValueError(f"op={name!r} is not a registered op ({', '.join(sorted(o.NAME for o in REGISTRY.ops()))}) "
                     f"nor a known xformers / MSLK op name ({', '.join(sorted(set(QUALNAMES.values())))}; "
                     f"fa2/fa3 names may carry a version, e.g. fa2F@2.5.6, and split-K names a split count, e.g. "
                     f"triton_splitK8, ck_splitK8F)")


def foreign_op(op: Any, kind: str) -> type[Op] | None:
    """Our op class of ``kind`` for a foreign ``op=`` value (name, class or tuple), None for the
    selector's choice; ValueError when the value names nothing we know or cannot run here.

    Our own op classes, our names and None pass through unchanged.

    Example
    -------
    >>> foreign_op("MemoryEfficientAttentionFlashAttentionOp", "fw").NAME
    'sdpa_flashF'
    """
    if op is None or (isinstance(op, type) and issubclass(op, Op)):
        return op
    if isinstance(op, tuple):
        if len(op) != 2:
            raise ValueError(f"op={op!r}: a tuple must be (FwOp, BwOp)")
        return foreign_op(op[0] if kind == "fw" else op[1], kind)
    if hasattr(op, "FMHA_OPS_OP"):  # our ops exposed as xformers classes (fmha_ops.xformers_ops); None: the selector's
        return op.FMHA_OPS_OP
    name = _foreign_name(op)
    if name in REGISTRY.names():
        return REGISTRY.get(name)
    if name in TUPLES:
        return foreign_op(TUPLES[name], kind)
    m = mapping(name)
    if m.kind != kind:
        raise ValueError(f"op={name!r} is a {m.kind} op; a {kind} op is needed here")
    return None if m.target is None else REGISTRY.get(m.target)


def xformers_tuple(name: str) -> tuple[type[Op] | None, type[Op] | None]:
    """``fmha_ops.<xformers tuple name>``: our (FwOp, BwOp) pair (DeprecationWarning once per name)."""
    if name not in TUPLES:
        raise AttributeError(f"module 'fmha_ops' has no attribute {name!r}")
    pair = (foreign_op(name, "fw"), foreign_op(name, "bw"))
    if name not in _WARNED:
        _WARNED.add(name)
        shown = pair[0].NAME if pair[0] is not None else "None (the selector chooses)"
        warnings.warn(f"fmha_ops.{name} is xformers' name; use op={shown!r}", DeprecationWarning, stacklevel=3)
    return pair


_WARNED: set[str] = set()


def _foreign_name(op: Any) -> str:
    if isinstance(op, str):
        return op
    name = getattr(op, "NAME", None)
    if isinstance(name, str) and name:
        return name
    if isinstance(op, type):
        return f"{op.__module__.rsplit('.', 1)[-1]}.{op.__qualname__}"
    raise ValueError(f"op={op!r} is not an op class, op name or (FwOp, BwOp) tuple")


def _qualname_tail(name: str) -> str:
    """``xformers.ops.fmha.cutlass.FwOp`` -> ``cutlass.FwOp`` (other names unchanged)."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if len(parts) > 2 else name


def register_legacy_names() -> None:
    """Register ``LEGACY_NAMES`` as legacy aliases of our ops (once, after every backend registered)."""
    for old, ours in LEGACY_NAMES.items():
        REGISTRY.add_alias(old, REGISTRY.get(ours), legacy=True)
