"""Where code runs: CPU, a CUDA GPU (compute capability) or a ROCm GPU (gfx name).

``Arch`` is hashable and cheap; ``current_arch(device)`` is memoized per device index (a plain dict, so it is a
constant under torch.compile).
``ArchSpec`` parses the declarations ops use: ``"cpu"``, ``"cuda>=9.0"``, ``"cuda>=8.0,<10.0"``,
``"rocm:gfx942,gfx950"``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Arch:
    kind: str  # "cpu" | "cuda" | "rocm"
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability
    gfx: str = ""  # ROCm gfx target, e.g. "gfx942"
    name: str = "cpu"  # device name as the driver reports it

    def __str__(self) -> str:
        if self.kind == "cuda":
            return f"cuda sm{self.capability[0]}{self.capability[1]} ({self.name})"
        if self.kind == "rocm":
            return f"rocm {self.gfx} ({self.name})"
        return "cpu"


CPU = Arch("cpu")


#: the arch of each GPU index seen so far: a plain dict, which torch.compile reads as a constant of the trace
_GPU_ARCHS: dict[int, Arch] = {}


_FIELD_SEP = "\x1f"  # joins Arch's fields in the one string the trace-time query returns


@torch.compiler.assume_constant_result
def _gpu_arch_fields(index: int) -> str:
    """Arch(...)'s fields for GPU ``index``, from the driver, joined by ``_FIELD_SEP``: kind, major, minor, gfx,
    name. Under torch.compile this runs as plain Python at trace time (Dynamo cannot trace the device-properties
    object) and its result is one string constant: Dynamo cannot guard on the parts of a constant tuple."""
    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        fields = ("rocm", 0, 0, getattr(props, "gcnArchName", "").split(":")[0], props.name)
    else:
        fields = ("cuda", props.major, props.minor, "", props.name)
    return _FIELD_SEP.join(map(str, fields))


def _gpu_arch(index: int) -> Arch:
    arch = _GPU_ARCHS.get(index)
    if arch is None:
        kind, major, minor, gfx, name = _gpu_arch_fields(index).split(_FIELD_SEP)
        arch = Arch(kind, (int(major), int(minor)), gfx, name)
        if not torch.compiler.is_compiling():  # a traced store would be replayed on every call
            _GPU_ARCHS[index] = arch
    return arch


def current_arch(device: torch.device | str | None = None) -> Arch:
    """The arch of ``device`` (default: the current CUDA device if any, else CPU); memoized per device index and
    safe to call inside torch.compile (fullgraph).

    Example: ``current_arch("cuda:0").capability`` -> (9, 0) on an H200; ``current_arch("cpu")`` -> CPU.
    """
    if device is None:
        if not torch.cuda.is_available():
            return CPU
        return _gpu_arch(torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return CPU
    return _gpu_arch(device.index if device.index is not None else torch.cuda.current_device())


def fp8_dtype(arch: Arch) -> torch.dtype:
    """The e4m3 fp8 flavour the arch's matrix units take: e4m3fnuz on gfx942, e4m3fn elsewhere."""
    if arch.kind == "rocm" and arch.gfx == "gfx942":
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


@dataclass(frozen=True)
class ArchSpec:
    """One arch declaration, parsed from a string (see module docstring)."""

    kind: str
    min_cc: tuple[int, int] = (0, 0)
    max_cc: tuple[int, int] = (99, 99)  # exclusive
    gfx: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> "ArchSpec":
        text = text.strip()
        if text == "cpu":
            return cls("cpu")
        if text.startswith("rocm"):
            _, _, names = text.partition(":")
            return cls("rocm", gfx=frozenset(n.strip() for n in names.split(",") if n.strip()))
        if text.startswith("cuda"):
            lo, hi = (0, 0), (99, 99)
            for part in text[4:].split(","):
                part = part.strip()
                if part.startswith(">="):
                    lo = _cc(part[2:])
                elif part.startswith("<"):
                    hi = _cc(part[1:])
                elif part:
                    raise ValueError(f"bad arch spec {text!r}")
            return cls("cuda", min_cc=lo, max_cc=hi)
        raise ValueError(f"bad arch spec {text!r}: use 'cpu', 'cuda>=X.Y[,<X.Y]' or 'rocm:gfxA,gfxB'")

    def matches(self, arch: Arch) -> bool:
        if arch.kind != self.kind:
            return False
        if self.kind == "cuda":
            return self.min_cc <= arch.capability < self.max_cc
        if self.kind == "rocm":
            return not self.gfx or arch.gfx in self.gfx
        return True

    def __str__(self) -> str:
        if self.kind == "cuda":
            hi = "" if self.max_cc == (99, 99) else f",<{self.max_cc[0]}.{self.max_cc[1]}"
            return f"cuda>={self.min_cc[0]}.{self.min_cc[1]}{hi}"
        if self.kind == "rocm":
            return "rocm:" + ",".join(sorted(self.gfx))
        return "cpu"


def _cc(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


@functools.lru_cache(maxsize=None)
def sm_count(arch: Arch) -> int:
    """Multiprocessor count of the first device of this arch (132 when unknown)."""
    if arch.kind == "cpu" or not torch.cuda.is_available():
        return 132
    for i in range(torch.cuda.device_count()):
        if _gpu_arch(i) == arch:
            return torch.cuda.get_device_properties(i).multi_processor_count
    return 132
