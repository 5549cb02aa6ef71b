"""The README's Python blocks run as written (on this machine's device: the CPU in CI): the tour's blocks in one
namespace, in order; a block that starts with ``# <name>.py`` is a script, written to a file and run on its own."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
SCRIPT = re.compile(r"# (\w+\.py)\n")


def _blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return BLOCK.findall(f.read())


def test_the_readme_has_python_blocks_and_a_script():
    blocks = _blocks()
    assert len(blocks) >= 3 and any(SCRIPT.match(b) for b in blocks)


def test_the_tour_runs_in_one_session(capsys):
    namespace: dict = {"__name__": "readme"}
    for block in _blocks():
        if not SCRIPT.match(block):
            exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    assert "selected:" in capsys.readouterr().out  # explain printed its verdicts


def test_the_scripts_run(tmp_path):
    for block in _blocks():
        match = SCRIPT.match(block)
        if match:
            path = tmp_path / match.group(1)
            path.write_text(block)
            env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            r = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            assert r.stdout.count("max |ring - one process|") == 2, r.stdout
