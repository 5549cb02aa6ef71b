"""Shared test setup.

On a machine without CUDA, Triton kernels run through the interpreter
(``TRITON_INTERPRET=1``), which must be set before any ``@triton.jit`` runs.
``gpu``-marked tests are skipped there; run them on the H200 with ``pytest -m gpu``.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
