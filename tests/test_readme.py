"""The README's Python blocks run as written (on this machine's device: the CPU in CI): the tour's blocks in one
namespace, in order; a block that starts with ``# <name>.py`` is a script, written to a file and run on its own.
The job table's calls name functions, modules and keywords that exist."""
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


#: the README's job table: its rows' call column
JOB_TABLE = re.compile(r"## Which function for which job\n(.*?)\n## ", re.S)
CODE = re.compile(r"`([^`]+)`")
CALL = re.compile(r"^(?:with |\w+ = )?([\w.]+)\((.*)\):?$")
KEYWORD = re.compile(r"(\w+)=")
#: the names the table calls on what a call returned
RETURNED = {"plan": "PagedDecodePlan"}
#: the entry points a bare keyword of the table (``sinks=`` "on every entry point") names
ENTRY_POINTS = ("memory_efficient_attention", "memory_efficient_attention_forward", "memory_efficient_attention_partial",
                "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "plan_kvcache",
                "fp8_attention", "i8fp8_attention")


def _job_rows() -> list[list[str]]:
    """The code spans of each row's call column."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        table = JOB_TABLE.search(f.read()).group(1)
    rows = [line.rstrip().rstrip("|").split("|")[-1] for line in table.splitlines() if line.startswith("| ")]
    return [CODE.findall(cell) for cell in rows[1:]]  # the header row aside


def _resolve(name: str, modules: list):
    """The object ``name`` (dotted, from fmha_ops or one of ``modules``, the modules the same cell names) is."""
    import importlib

    import fmha_ops

    first, *rest = name.split(".")
    if first == "fmha_ops":
        obj, path = fmha_ops, "fmha_ops"
        for part in rest:
            path = f"{path}.{part}"
            obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(path)
        return obj
    for module in [fmha_ops, *modules]:
        obj = getattr(module, RETURNED.get(first, first), None)
        if obj is not None:
            for part in rest:
                obj = getattr(obj, part)
            return obj
    raise AssertionError(f"README job table: {name} is not a name of fmha_ops or of {[m.__name__ for m in modules]}")


def _parameters(fn) -> set[str]:
    import inspect

    return set(inspect.signature(fn).parameters)


def test_the_job_table_names_what_exists_with_its_keywords():
    """Every function, module and keyword the job table names exists as written: names resolve (from ``fmha_ops`` or
    a module the same cell names) and each ``keyword=`` of a call is one of the called function's parameters; a bare
    keyword is one of its row's calls' (``sinks=``: every entry point's)."""
    import types

    import fmha_ops

    for spans in _job_rows():
        modules, called, keywords = [], [], []
        for span in spans:
            call = CALL.match(span)
            if span.startswith("import "):
                modules.append(_resolve(span.split()[1], []))
            elif "/" in span:
                assert os.path.exists(os.path.join(ROOT, span)), span
            elif call:
                fn = _resolve(call.group(1), modules)
                assert set(KEYWORD.findall(call.group(2))) <= _parameters(fn), span
                called.append(fn)
                module = call.group(1).rpartition(".")[0]
                if module.startswith("fmha_ops."):
                    modules.append(_resolve(module, []))
            elif re.fullmatch(r"\w+=", span):
                keywords.append(span[:-1])
            elif re.fullmatch(r"[a-z_][\w.]*", span) and not span.startswith("_") and len(span) > 1:
                obj = _resolve(span, modules)
                if isinstance(obj, types.ModuleType):
                    modules.append(obj)
                elif span.startswith("fmha_ops."):
                    modules.append(_resolve(span.rpartition(".")[0], []))
                if callable(obj):
                    called.append(obj)
        for keyword in keywords:
            fns = called or [getattr(fmha_ops, name) for name in ENTRY_POINTS]
            takers = [fn for fn in fns if keyword in _parameters(fn)]
            assert takers if called else len(takers) == len(fns), (keyword, spans)
