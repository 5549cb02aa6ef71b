"""Launchers for the FlyDSL paged-decode kernels (ROCm gfx942/gfx950 only).

FlyDSL is imported on the first launch. Compiled kernels are looked up in the AOT cache
directory (``FMHA_FLYDSL_CACHE``, default ``~/.cache/fmha_ops/flydsl``; fill it with
``python -m fmha_ops.kernels.flydsl.aot``) and compiled just in time on a miss. Each
specialization is traced once per process; later launches reuse the compiled function
(no retracing) on the given stream, so launches are graph-capturable.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .host import choose_num_splits, decode_args, device_arch, reduce_args

_COMPILED: dict = {}


def cache_dir() -> Path:
    return Path(os.environ.get("FMHA_FLYDSL_CACHE", Path.home() / ".cache" / "fmha_ops" / "flydsl"))


def _launch(name: str, args: tuple, consts: tuple, stream) -> None:
    key = (name, consts)
    fn = _COMPILED.get(key)
    full = (*args, *consts, stream)
    if fn is not None:
        fn(*full)
        return
    import flydsl.compiler as flyc

    from . import decode

    prev = os.environ.get("FLYDSL_RUNTIME_CACHE_DIR")
    os.environ["FLYDSL_RUNTIME_CACHE_DIR"] = str(cache_dir())
    try:
        _COMPILED[key] = flyc.compile(getattr(decode, name), *full)  # compiles (or loads) and launches once
    finally:
        if prev is None:
            os.environ.pop("FLYDSL_RUNTIME_CACHE_DIR")
        else:
            os.environ["FLYDSL_RUNTIME_CACHE_DIR"] = prev


def paged_decode(q, k_cache, v_cache, block_table, seqlens, *, k_scale=None, v_scale=None, scale=None,
                 num_splits: int | None = 1, out=None, lse=None, stream=None):
    """Paged decode attention; returns ``(out (B, Mq, Hq, D) q.dtype, lse (B, Hq, Mq) float32)``.

    Layouts and dtypes as in :mod:`.host`. ``num_splits=None`` picks a split count with
    :func:`.host.choose_num_splits`; ``num_splits > 1`` runs the split-K kernel into float32
    partials and the reduce kernel. Every query row attends to all ``seqlens[b]`` keys.
    """
    B, Mq, Hq, D = q.shape
    stream = torch.cuda.current_stream(q.device) if stream is None else stream
    if num_splits is None:
        num_splits = choose_num_splits(B, k_cache.shape[2], Mq * Hq // k_cache.shape[2],
                                       int(block_table.shape[1]) * k_cache.shape[1], device_arch(q.device))
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(B, Hq, Mq, dtype=torch.float32, device=q.device) if lse is None else lse
    if num_splits == 1:
        args, consts = decode_args(q, k_cache, v_cache, block_table, seqlens, out, lse,
                                   k_scale=k_scale, v_scale=v_scale, scale=scale)
        _launch("paged_decode", args, consts, stream)
        return out, lse
    part_out = torch.empty(B, num_splits, Mq, Hq, D, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, num_splits, Hq, Mq, dtype=torch.float32, device=q.device)
    args, consts = decode_args(q, k_cache, v_cache, block_table, seqlens, part_out, part_lse,
                               k_scale=k_scale, v_scale=v_scale, scale=scale, num_splits=num_splits)
    _launch("paged_decode", args, consts, stream)
    args, consts = reduce_args(part_out, part_lse, out, lse)
    _launch("split_reduce", args, consts, stream)
    return out, lse
