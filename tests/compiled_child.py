"""Run a script in a child Python without ``TRITON_INTERPRET`` (so Triton and Gluon compile for real, as on a GPU
machine: ahead-of-time sm90 compiles, or GPU runs kept apart from the interpreted test process), with this
checkout first on the import path."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_compiled(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -c script *args`` in a child process without ``TRITON_INTERPRET``; its stdout / stderr captured
    as text.

    Example: ``assert run_compiled("print('compiled')").stdout.strip() == "compiled"``.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
