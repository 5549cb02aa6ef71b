"""Backends: importing this package registers every op (one module per backend)."""
from . import reference, sdpa  # noqa: F401
