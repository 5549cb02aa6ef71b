"""Launch-wide tile counters for kernels that hand out tiles dynamically (a persistent grid whose CTAs take their
next tile with an atomic add): one int32 pair per (device, stream), zero between launches.

A kernel takes tiles from word 0 and counts its CTAs out on word 1; the last CTA out sets both back to 0 (the
ordering argument: ``kernels/gluon/attention_fwd_ws.py``, ``_retire``). So the pair is zeroed once, when it is
made, and an eager launch costs no memset. Kernels of one stream run one
after another and share its pair; kernels on two streams may run at once, so each stream has its own.

Under CUDA-graph capture every call gets a fresh zeroed pair, not kept: its fill is captured with the kernel (one
memset node per call in the graph, no host work at replay), so a graph's kernels share no counters with eager calls
or with other graphs, whichever streams they are captured on and replayed on.
"""
from __future__ import annotations

import torch
from triton.runtime.driver import driver

#: int32 words of a pair: the tile counter and the count of CTAs done
COUNTER_WORDS = 2

_PAIRS: dict[tuple, torch.Tensor] = {}


def tile_counters(device: torch.device) -> torch.Tensor:
    """The zeroed int32 counters (``COUNTER_WORDS``,) of ``device``'s current stream (a CPU device: one pair),
    made on first use and kept; a fresh pair, not kept, for each call while that stream captures a CUDA graph.

    Example::

        counters = tile_counters(torch.device("cuda", 0))  # tensor([0, 0], device='cuda:0', dtype=torch.int32)
    """
    device = torch.device(device)
    if device.type != "cuda":
        key = (device, 0)
    else:
        index = torch.cuda.current_device() if device.index is None else device.index
        device = torch.device("cuda", index)
        if _capturing(index):
            return torch.zeros(COUNTER_WORDS, dtype=torch.int32, device=device)
        key = (device, driver.active.get_current_stream(index))
    pair = _PAIRS.get(key)
    if pair is None:
        pair = _PAIRS[key] = torch.zeros(COUNTER_WORDS, dtype=torch.int32, device=device)
    return pair


def _capturing(index: int) -> bool:
    """Whether device ``index``'s current stream is capturing a CUDA graph."""
    if index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()
