"""The process-wide op registry and selector for attention ops.

Tuning tables are read from the package's ``tuning/`` folder (shipped measurements) and from
``$FMHA_OPS_TUNING_DIR`` (a user's own ``python -m fmha_ops tune`` output), later overriding earlier.
"""
from __future__ import annotations

import os

from registry import Registry, Selector, TuningTables

REGISTRY = Registry()
register = REGISTRY.register
TUNING_DIRS = [os.path.join(os.path.dirname(__file__), "tuning"), os.environ.get("FMHA_OPS_TUNING_DIR", "")]
SELECTOR = Selector(REGISTRY, TuningTables(TUNING_DIRS))
use_ops = SELECTOR.use_ops
