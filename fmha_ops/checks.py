"""Host validation of index tensors: always for host tensors, opt-in for device tensors.

The kernels guard every index they read (page ids, sequence lengths, append positions): an entry out of
range gives masked output (keys on a bad page are not attended, lengths are clamped to the cache, writes
past the cache are dropped), never an access outside a tensor. Device-resident index tensors are not read
back by default, so a call costs no host sync and stays CUDA-graph capturable. With checks on
(``FMHA_OPS_CHECK=1`` in the environment, or inside ``check_inputs()``), they are read back once per call
(one sync) and a bad entry raises ValueError naming the argument, the entry and the bound. Index tensors
on the host are always checked. Checks are skipped while a CUDA graph is being captured (no sync there) and
inside a torch.compile trace (the values are data of the graph; the kernels' index guards still apply).

Example
-------
>>> import torch
>>> from fmha_ops.checks import IndexCheck, check_inputs, validate_indices
>>> lengths = torch.tensor([3, 9], dtype=torch.int32)
>>> with check_inputs():
...     validate_indices(IndexCheck("cache_seqlens", lengths, 0, 8, "the cache holds 8 keys per sequence"))
Traceback (most recent call last):
    ...
ValueError: cache_seqlens[1] = 9 is outside [0, 8]: the cache holds 8 keys per sequence
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from typing import Iterator

import torch

ENV_VAR = "FMHA_OPS_CHECK"

_scope: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fmha_ops_check", default=None)
_env = [False]


def refresh_env() -> None:
    """Re-read ``FMHA_OPS_CHECK`` (read once at import)."""
    _env[0] = os.environ.get(ENV_VAR, "") not in ("", "0")


refresh_env()


def checks_enabled() -> bool:
    """Whether device-resident index tensors are validated: the innermost ``check_inputs`` block, else the
    environment."""
    scoped = _scope.get()
    return _env[0] if scoped is None else scoped


#: what ``checks_enabled`` reads, for a key that holds it without a Python call: the innermost ``check_inputs``
#: block's switch (None outside any, one C call) and the environment's (item 0 of ``ENV``, set by ``refresh_env``)
scoped_now = _scope.get
ENV = _env


@contextlib.contextmanager
def check_inputs(enabled: bool = True) -> Iterator[None]:
    """Validate device-resident index tensors on the host inside this block (``enabled=False``: do not, even
    with ``FMHA_OPS_CHECK=1``).

    Example
    -------
    >>> with check_inputs():  # doctest: +SKIP
    ...     out = fmha_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table)
    """
    token = _scope.set(bool(enabled))
    try:
        yield
    finally:
        _scope.reset(token)


@dataclass(frozen=True)
class IndexCheck:
    """Entries of ``values`` (an integer tensor named ``name`` for the user) must lie in [low, high].

    ``used``: a bool tensor shaped like ``values`` marking the entries a kernel reads (None: all of them);
    ``bound`` says where the bounds come from, for the message.
    """

    name: str
    values: torch.Tensor
    low: int
    high: int
    bound: str
    used: torch.Tensor | None = None

    def bad(self) -> torch.Tensor:
        out = (self.values < self.low) | (self.values > self.high)
        return out if self.used is None else out & self.used

    def error(self) -> ValueError:
        where = self.bad().nonzero()[0].tolist()
        value = self.values[tuple(where)].item()
        return ValueError(f"{self.name}[{', '.join(map(str, where))}] = {value} is outside "
                          f"[{self.low}, {self.high}]: {self.bound}")


@dataclass(frozen=True)
class StartCheck:
    """Entries of ``values`` (int (B,), named ``name`` for the user: each sequence's first key) must lie in
    [0, ends[b]] (``ends`` int (B,), each sequence's length, named ``ends_name``): a start equal to its length
    leaves the sequence no key. Checked like an ``IndexCheck`` by ``validate_indices``."""

    name: str
    values: torch.Tensor
    ends: torch.Tensor
    ends_name: str

    def bad(self) -> torch.Tensor:
        return (self.values < 0) | (self.values > self.ends)

    def error(self) -> ValueError:
        b = int(self.bad().nonzero()[0, 0])
        return ValueError(f"{self.name}[{b}] = {int(self.values[b])} is outside [0, {self.ends_name}[{b}] = "
                          f"{int(self.ends[b])}]: a sequence's keys start at most at its length")


def wanted(*tensors: torch.Tensor) -> bool:
    """Whether ``validate_indices`` would check any of these tensors (cheap: no tensor work)."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:  # a loop on ``is_cpu``: this runs on every decode step
        if t.is_cpu:
            return True
    return device_checks_wanted()


def device_checks_wanted() -> bool:
    """Whether device-resident tensors are checked now: check mode on and no CUDA graph being captured."""
    return checks_enabled() and not torch.cuda.is_current_stream_capturing()


def validate_indices(*checks: IndexCheck) -> None:
    """Raise the first check's ValueError whose tensor has an entry out of range. Host tensors are always
    checked; device tensors when ``checks_enabled()`` and no CUDA graph is being captured, with one host
    sync for all of them. Nothing is checked inside a torch.compile trace."""
    if torch.compiler.is_compiling():
        return
    host = [c for c in checks if c.values.device.type == "cpu"]
    device = [c for c in checks if c.values.device.type != "cpu"]
    if device and not (checks_enabled() and not torch.cuda.is_current_stream_capturing()):
        device = []
    flags = [bool(c.bad().any()) for c in host]
    if device:
        flags += torch.stack([c.bad().any() for c in device]).tolist()
    for c, failed in zip(host + device, flags):
        if failed:
            raise c.error()


def page_table_check(name: str, table: torch.Tensor, lengths: torch.Tensor, page_size: int, num_pages: int,
                     pool: str) -> IndexCheck:
    """The entries of ``table`` (B, max_pages) that hold the first ``lengths[b]`` keys of each sequence must
    be pages of the pool (``pool`` names it); entries past a sequence's keys are not read and may hold
    anything."""
    pages_used = (lengths.clamp(min=0).to(torch.int64) + page_size - 1) // page_size
    used = torch.arange(table.shape[1], device=table.device)[None, :] < pages_used[:, None]
    return IndexCheck(name, table, 0, num_pages - 1, f"{pool} has {num_pages} pages", used)
