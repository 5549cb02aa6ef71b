"""Measured timings per (device, op, shape bucket), read by the selector.

A table is a JSON file::

    {"device": "NVIDIA H200", "versions": {"torch": "...", "triton": "..."},
     "timings": {"<op NAME>": {"<bucket>": seconds, ...}, ...},
     "calibration": {"<op NAME>": measured / cost-model time (median over buckets), ...},
     "host": {"<op NAME>": host seconds per eager call (median over its host rows), ...},
     "host_timings": {"<op NAME>": {"<bucket>": host seconds per eager call, ...}, ...}}

Buckets are strings the domain package computes from a problem (``problem.bucket()``). Timings are device
times; ``host_timings`` holds what the host spends per call of the op in each bucket it was timed in (its work
depends on the call's kind: masks, paging, dtypes), ``host`` one value per op for calls of kinds it has no row of
(tables without either: the ops' declared host times; tables without ``host_timings``, written before it
existed, load with none). The selector asks ``lookup(device_name, op_name, bucket)`` and, where a bucket was not
measured, scales the op's cost model by ``calibration(device_name, op_name)``; other devices' tables are ignored.
Tables are keyed by ``table_device(driver name)``: one table serves the driver names of one card (``TABLE_DEVICES``).
A table built in pieces (tune runs split by ops, dtypes or shards) is joined by ``merge_tables``.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field

#: driver names of a card whose table is keyed by a shorter name: the H100 SXM (132 SMs, 80 GB HBM3 at 3.35 TB/s).
#: The H100 PCIe (114 SMs, 2.0 TB/s HBM2e) and H100 NVL (3.9 TB/s, lower clocks) run at other rates: not mapped.
TABLE_DEVICES = {"NVIDIA H100 80GB HBM3": "NVIDIA H100"}


def table_device(name: str) -> str:
    """The device name the tuning table of a card named ``name`` (as the driver reports it) is keyed by.

    Example: ``table_device("NVIDIA H100 80GB HBM3")`` -> "NVIDIA H100"; ``table_device("NVIDIA H200")`` -> itself.
    """
    return TABLE_DEVICES.get(name, name)


@dataclass
class TuningTable:
    device: str
    versions: dict = field(default_factory=dict)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    calibration: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    host_timings: dict[str, dict[str, float]] = field(default_factory=dict)

    def lookup(self, op_name: str, bucket: str) -> float | None:
        return self.timings.get(op_name, {}).get(bucket)

    def record(self, op_name: str, bucket: str, seconds: float) -> None:
        self.timings.setdefault(op_name, {})[bucket] = float(seconds)

    def record_host(self, op_name: str, bucket: str, seconds: float) -> None:
        self.host_timings.setdefault(op_name, {})[bucket] = float(seconds)

    def save(self, path: str) -> None:
        """Write the table to ``path`` whole or not at all (a temporary file renamed over it: a run killed while
        saving leaves the previous table)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"device": self.device, "versions": self.versions, "timings": self.timings,
                       "calibration": self.calibration, "host": self.host, "host_timings": self.host_timings},
                      f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, path: str) -> "TuningTable":
        with open(path) as f:
            data = json.load(f)
        return cls(device=data["device"], versions=data.get("versions", {}), timings=data.get("timings", {}),
                   calibration=data.get("calibration", {}), host=data.get("host", {}),
                   host_timings=data.get("host_timings", {}))


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
                    key = table_device(table.device)
                    merged = tables.setdefault(key, TuningTable(key, table.versions))
                    for op_name, rows in table.timings.items():
                        merged.timings.setdefault(op_name, {}).update(rows)
                    merged.calibration.update(table.calibration)
                    merged.host.update(table.host)
                    for op_name, rows in table.host_timings.items():
                        merged.host_timings.setdefault(op_name, {}).update(rows)
        return tables

    def lookup(self, device: str, op_name: str, bucket: str) -> float | None:
        table = self.table(device)
        return table.lookup(op_name, bucket) if table else None

    def rows(self, device: str, op_name: str) -> dict[str, float]:
        """Every measured ``{bucket: seconds}`` of the op on ``device`` (empty when none)."""
        table = self.table(device)
        return table.timings.get(op_name, {}) if table else {}

    def host_rows(self, device: str, op_name: str) -> dict[str, float]:
        """Every measured ``{bucket: host seconds per eager call}`` of the op on ``device`` (empty when none)."""
        table = self.table(device)
        return table.host_timings.get(op_name, {}) if table else {}

    def table(self, device: str) -> TuningTable | None:
        """The table of the card named ``device`` (a driver's name or ``table_device``'s), all folders' files of it
        joined; None where no folder holds one."""
        if self._by_device is None:
            self._by_device = self._load()
        return self._by_device.get(table_device(device))

    def calibration(self, device: str, op_name: str, median_fallback: bool = True) -> float | None:
        """The op's measured/model factor on ``device``; for an op the table has not measured, the median
        factor of the ops it has (cost models share a device-wide bias), so a new op's raw estimate is
        not compared with its neighbours' corrected ones; None there without ``median_fallback`` (ops of a
        kind the table does not time, whose models come from their own measurements)."""
        table = self.table(device)
        if not table or not table.calibration:
            return None
        if op_name in table.calibration or not median_fallback:
            return table.calibration.get(op_name)
        return statistics.median(table.calibration.values())

    def host_time(self, device: str, op_name: str) -> float | None:
        """The op's one measured host seconds per eager call on ``device`` (the fallback for calls of a kind it has
        no host row of); None where no table measured it."""
        table = self.table(device)
        return table.host.get(op_name) if table else None

    def reload(self) -> None:
        self._by_device = None


def merge_tables(pieces: list[TuningTable]) -> TuningTable:
    """One table from the ``pieces`` of one device (``python -m fmha_ops tune`` runs split by ops, dtypes or shards,
    in grid order): device rows bucket by bucket, a later piece's row over an earlier one's; an op's host rows whole
    from the last piece that has any (rows of one run: host times of one call moved up to 2x between runs) and its
    host median from those; its calibration from the piece with most of its device rows (``selector_offline.py
    --recalibrate`` recomputes it over all of them); versions from the last piece.

    Example: ``merge_tables([TuningTable.load(p) for p in ("bf16.json", "fp8.json", "host.json")])``.
    """
    if not pieces:
        raise ValueError("merge_tables: no pieces given")
    devices = {table_device(t.device) for t in pieces}
    if len(devices) > 1:
        raise ValueError(f"merge_tables: the pieces are of different devices {sorted(devices)}; merge one device's")
    out = TuningTable(devices.pop(), dict(pieces[-1].versions))
    rows_from: dict[str, int] = {}
    for piece in pieces:
        for name, rows in piece.timings.items():
            out.timings.setdefault(name, {}).update(rows)
            if name in piece.calibration and len(rows) >= rows_from.get(name, 0):
                out.calibration[name], rows_from[name] = piece.calibration[name], len(rows)
        for name, rows in piece.host_timings.items():
            if rows:
                out.host_timings[name] = dict(rows)
                out.host[name] = statistics.median(rows.values())
        for name, seconds in piece.host.items():
            if name not in out.host_timings:
                out.host[name] = seconds
    return out
