"""Times measured at callers' exact problems (autotune), kept in memory and in one JSON file per device.

The selector's autotune mode (``Selector.autotune``) times every op that supports a call the first time the call's
problem is seen and stores the seconds per op here, under the problem's description (``"fw " + str(problem)``).
Later calls of that problem, in this process or the next, rank ops by these times ("measured here").

Files: ``<folder>/autotune-<device>.json``, ``{"format": FORMAT, "device": name, "problems": {problem: {op: s}}}``.
A file that is not such JSON, or that names another device, is ignored with a warning (and replaced at the next
save); writes go to a temporary file renamed over the old one, so a process killed mid-write leaves the previous
file, and add what the file holds by then (processes on GPUs of one name share the file: none drops another's).
Nothing is ever evaluated or unpickled.

Example
-------
>>> store = MeasuredTimes("/tmp/fmha_ops_cache")
>>> store.record("NVIDIA H200", "fw bf16 B=2 ...", {"fa3F": 1.2e-4, "sdpa_cudnnF": 1.4e-4})
>>> store.times("NVIDIA H200", "fw bf16 B=2 ...")
{'fa3F': 0.00012, 'sdpa_cudnnF': 0.00014}
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
import warnings

#: the file layout's version; files of another format are ignored
FORMAT = 1


class MeasuredTimes:
    """Seconds per op per problem per device, loaded lazily from ``folder`` (None: memory only)."""

    def __init__(self, folder: str | None) -> None:
        self.folder = folder
        self._devices: dict[str, dict[str, dict[str, float]]] = {}

    def path(self, device: str) -> str | None:
        """The file of ``device`` (its name with anything but letters, digits, '.', '-' and '_' as '_')."""
        if not self.folder:
            return None
        return os.path.join(self.folder, f"autotune-{re.sub(r'[^A-Za-z0-9._-]', '_', device)}.json")

    def times(self, device: str, problem: str) -> dict[str, float]:
        """{op name: seconds} measured for ``problem`` on ``device`` (empty when none)."""
        return self._problems(device).get(problem, {})

    def record(self, device: str, problem: str, times: dict[str, float]) -> None:
        """Add ``times`` to ``problem``'s and write the device's file (when there is a folder), with what other
        processes wrote to it since it was read (the ranks of a multi-GPU job share one device name, so one file):
        their problems are added to this process's, and measured ops this process has not measured."""
        problems = self._problems(device)
        problems[problem] = {**problems.get(problem, {}), **times}
        path = self.path(device)
        if path is None:
            return
        try:
            on_disk = _read_file(path, device)
        except (OSError, ValueError):  # none yet, or one the first load warned of: the write replaces it
            on_disk = {}
        for name, theirs in on_disk.items():
            problems[name] = {**theirs, **problems.get(name, {})}
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".autotune-", dir=self.folder)
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "device": device, "problems": problems}, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:
            warnings.warn(f"fmha_ops autotune: could not write {path} ({e}); measurements stay in memory",
                          stacklevel=2)

    def clear(self) -> None:
        """Forget what was loaded or measured (files stay; they are read again when next needed)."""
        self._devices.clear()

    def _problems(self, device: str) -> dict[str, dict[str, float]]:
        if device not in self._devices:
            self._devices[device] = self._load(device)
        return self._devices[device]

    def _load(self, device: str) -> dict[str, dict[str, float]]:
        path = self.path(device)
        if path is None or not os.path.exists(path):
            return {}
        try:
            return _read_file(path, device)
        except (OSError, ValueError) as e:
            warnings.warn(f"fmha_ops autotune: ignoring {path}: {e}", stacklevel=3)
            return {}


def _read_file(path: str, device: str) -> dict[str, dict[str, float]]:
    """The checked problems of the file at ``path`` (``_checked``); OSError / ValueError as reading raises them."""
    with open(path) as f:
        return _checked(json.load(f), device)


def _checked(data, device: str) -> dict[str, dict[str, float]]:
    """The ``problems`` of a loaded file after checking every field; ValueError naming what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not an autotune file of format {FORMAT}")
    if data.get("device") != device:
        raise ValueError(f"measured on {data.get('device')!r}, not on this device ({device!r})")
    problems = data.get("problems")
    if not isinstance(problems, dict):
        raise ValueError("'problems' is not an object")
    for problem, times in problems.items():
        if not isinstance(times, dict) or not all(
                isinstance(op, str) and isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
                and s > 0 for op, s in times.items()):
            raise ValueError(f"the times of {problem!r} are not {{op name: positive seconds}}")
    return {problem: {op: float(s) for op, s in times.items()} for problem, times in problems.items()}
