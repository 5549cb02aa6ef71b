"""Measured timings per (device, op, shape bucket), read by the selector.

A table is a JSON file::

    {"device": "NVIDIA H200", "versions": {"torch": "...", "triton": "..."},
     "timings": {"<op NAME>": {"<bucket>": seconds, ...}, ...},
     "calibration": {"<op NAME>": measured / cost-model time (median over buckets), ...},
     "host": {"<op NAME>": host seconds per eager call (median over buckets), ...}}

Buckets are strings the domain package computes from a problem (``problem.bucket()``). Timings are device
times; ``host`` holds what the host spends per call of the op (tables without it: the ops' declared host times).
The selector asks ``lookup(device_name, op_name, bucket)`` and, where a bucket was not measured,
scales the op's cost model by ``calibration(device_name, op_name)``; other devices' tables are ignored.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field


@dataclass
class TuningTable:
    device: str
    versions: dict = field(default_factory=dict)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    calibration: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)

    def lookup(self, op_name: str, bucket: str) -> float | None:
        return self.timings.get(op_name, {}).get(bucket)

    def record(self, op_name: str, bucket: str, seconds: float) -> None:
        self.timings.setdefault(op_name, {})[bucket] = float(seconds)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"device": self.device, "versions": self.versions, "timings": self.timings,
                       "calibration": self.calibration, "host": self.host}, f, indent=1, sort_keys=True)

    @classmethod
    def load(cls, path: str) -> "TuningTable":
        with open(path) as f:
            data = json.load(f)
        return cls(device=data["device"], versions=data.get("versions", {}), timings=data.get("timings", {}),
                   calibration=data.get("calibration", {}), host=data.get("host", {}))


class TuningTables:
    """All tables found in a list of folders (later folders override earlier ones)."""

    def __init__(self, folders: list[str]) -> None:
        self._folders = folders
        self._by_device: dict[str, TuningTable] | None = None

    def _load(self) -> dict[str, TuningTable]:
        tables: dict[str, TuningTable] = {}
        for folder in self._folders:
            if not folder or not os.path.isdir(folder):
                continue
            for name in sorted(os.listdir(folder)):
                if name.endswith(".json"):
                    table = TuningTable.load(os.path.join(folder, name))
                    merged = tables.setdefault(table.device, TuningTable(table.device, table.versions))
                    for op_name, rows in table.timings.items():
                        merged.timings.setdefault(op_name, {}).update(rows)
                    merged.calibration.update(table.calibration)
                    merged.host.update(table.host)
        return tables

    def lookup(self, device: str, op_name: str, bucket: str) -> float | None:
        if self._by_device is None:
            self._by_device = self._load()
        table = self._by_device.get(device)
        return table.lookup(op_name, bucket) if table else None

    def rows(self, device: str, op_name: str) -> dict[str, float]:
        """Every measured ``{bucket: seconds}`` of the op on ``device`` (empty when none)."""
        if self._by_device is None:
            self._by_device = self._load()
        table = self._by_device.get(device)
        return table.timings.get(op_name, {}) if table else {}

    def calibration(self, device: str, op_name: str, median_fallback: bool = True) -> float | None:
        """The op's measured/model factor on ``device``; for an op the table has not measured, the median
        factor of the ops it has (cost models share a device-wide bias), so a new op's raw estimate is
        not compared with its neighbours' corrected ones; None there without ``median_fallback`` (ops of a
        kind the table does not time, whose models come from their own measurements)."""
        if self._by_device is None:
            self._by_device = self._load()
        table = self._by_device.get(device)
        if not table or not table.calibration:
            return None
        if op_name in table.calibration or not median_fallback:
            return table.calibration.get(op_name)
        return statistics.median(table.calibration.values())

    def host_time(self, device: str, op_name: str) -> float | None:
        """The op's measured host seconds per eager call on ``device``; None where no table measured it."""
        if self._by_device is None:
            self._by_device = self._load()
        table = self._by_device.get(device)
        return table.host.get(op_name) if table else None

    def reload(self) -> None:
        self._by_device = None
