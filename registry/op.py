"""The op base class: identity, where it runs, availability, support and cost.

An op is a class. Its class attributes *declare*; the registry and selector read only
the declarations plus three class methods:

- ``available()`` -> ``None`` or one reason (package missing, no such hardware);
  checked once per process and cached.
- ``not_supported_reasons(problem)`` -> list of short sentences; empty means supported.
  The problem type belongs to the domain package (the registry never looks inside it).
- ``estimate(problem)`` -> seconds or ``None`` (the op's cost model).
- ``host_time(problem)`` -> seconds of host work per eager call (default ``HOST_US``). The selector ranks a
  GPU op by the larger of its device time and its host time: back-to-back calls of a small problem run at the
  pace of the host, and a device time alone would pick a kernel that waits on a slow launch path.
- ``backward_estimate(problem)`` -> seconds of the backward a forward op brings itself (one that autograd
  differentiates), or ``None`` when a ``bw`` op runs after it. For a problem whose ``needs_grad`` is true the
  selector ranks forward ops by forward + backward: their own backward's time, or the best ``bw`` op's.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Any, ClassVar

from .arch import Arch, ArchSpec, current_arch


class Op:
    NAME: ClassVar[str] = ""
    #: other names that resolve to this op (no warning)
    ALIASES: ClassVar[tuple[str, ...]] = ()
    #: deprecated names: resolving one warns once per process and names NAME
    LEGACY_ALIASES: ClassVar[tuple[str, ...]] = ()
    #: "fw" (forward) or "bw" (backward); selection happens within one kind
    KIND: ClassVar[str] = "fw"
    #: where it runs, e.g. ("cpu",), ("cuda>=9.0",), ("rocm:gfx942,gfx950",)
    ARCHS: ClassVar[tuple[str, ...]] = ()
    #: importable modules the op needs (checked by available())
    REQUIRES: ClassVar[tuple[str, ...]] = ()
    #: tie-breaker and last-resort rank when no estimate exists (higher wins)
    PRIORITY: ClassVar[int] = 0
    #: host time of one eager call of the op (launch path, allocations, argument handling), microseconds,
    #: measured on the reference GPU machine's host; 0 when negligible or unknown
    HOST_US: ClassVar[float] = 0.0
    #: another op whose tuning-table calibration (measured / cost-model time) stands in for this op's where a table
    #: has none of its own: the same kernels reached by another route (``cudnnF`` runs ``sdpa_cudnnF``'s), so the
    #: device-wide median would misjudge it
    CALIBRATED_AS: ClassVar[str | None] = None

    @classmethod
    def arch_specs(cls) -> tuple[ArchSpec, ...]:
        return _parse_archs(cls.ARCHS)

    @classmethod
    def supports_arch(cls, arch: Arch) -> bool:
        return any(spec.matches(arch) for spec in cls.arch_specs())

    @classmethod
    def available(cls) -> str | None:
        """None when the op can run in this process, else why not (cached per class)."""
        return _available(cls)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Override for extra availability checks (driver, runtime); called once."""
        return None

    @classmethod
    def not_supported_reasons(cls, problem: Any) -> list[str]:
        return []

    @classmethod
    def estimate(cls, problem: Any) -> float | None:
        return None

    @classmethod
    def backward_estimate(cls, problem: Any) -> float | None:
        """Seconds of this forward's own backward on ``problem``; None when a ``bw`` op differentiates it."""
        return None

    @classmethod
    def host_time(cls, problem: Any) -> float:
        """Seconds of host work per eager call on ``problem`` (``HOST_US``); the selector ranks a GPU op by
        max(estimate, host_time)."""
        return cls.HOST_US * 1e-6


@functools.lru_cache(maxsize=None)
def _parse_archs(archs: tuple[str, ...]) -> tuple[ArchSpec, ...]:
    return tuple(ArchSpec.parse(a) for a in archs)


@functools.lru_cache(maxsize=None)
def _available(op: type[Op]) -> str | None:
    # The hardware first: installing a package does not help an op this machine cannot run.
    archs = op.arch_specs()
    if not any(spec.kind == "cpu" for spec in archs):
        here = current_arch()
        if here.kind == "cpu":
            return f"needs a GPU ({', '.join(map(str, archs))}); none here"
        if not op.supports_arch(here):
            return f"needs {', '.join(map(str, archs))}; this is {here}"
    for mod in op.REQUIRES:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"package {mod!r} is not installed"
    return op.unavailable_reason()
