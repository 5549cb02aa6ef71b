"""Attention-agnostic op machinery: arch detection, the Op base class, a registry,
a memoized selector with overrides, and measured tuning tables."""
from .arch import Arch, ArchSpec, current_arch, fp8_dtype
from .op import Op
from .registry import Registry
from .select import NoSupportedOpError, Report, Selector, Verdict
from .tuning import TuningTable, TuningTables, merge_tables, table_device

__all__ = ["Arch", "ArchSpec", "current_arch", "fp8_dtype", "Op", "Registry", "Selector", "Report", "Verdict",
           "NoSupportedOpError", "TuningTable", "TuningTables", "merge_tables", "table_device"]
