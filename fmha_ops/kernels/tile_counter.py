"""Launch-wide tile counters for kernels that hand out tiles dynamically (a persistent grid whose CTAs take their
next tile with an atomic add): one int32 pair per (device, stream), zero between launches.

A kernel takes tiles from word 0 and counts its CTAs out on word 1; the last CTA out sets both back to 0 (the
ordering argument: ``kernels/gluon/attention_fwd_ws.py``, ``_retire``). So the pair is zeroed once, when it is
made, and a launch costs no memset: in eager calls and in CUDA-graph replays alike. Kernels of one stream run one
after another and share its pair; kernels on two streams may run at once, so each stream has its own.

Under CUDA-graph capture a stream without a pair gets a fresh zeroed one that is not kept: its fill is captured
with the kernel, one memset node per call in the graph (a pair made before the capture, by a call on the capturing
stream, avoids it). A graph's kernels use the pair of the stream they were captured on: replaying two graphs
captured on one stream concurrently, or replaying one while that stream runs the kernel eagerly, is not supported.
"""
from __future__ import annotations

import torch
from triton.runtime.driver import driver

#: int32 words of a pair: the tile counter and the count of CTAs done
COUNTER_WORDS = 2

_PAIRS: dict[tuple, torch.Tensor] = {}


def tile_counters(device: torch.device) -> torch.Tensor:
    """The zeroed int32 counters (``COUNTER_WORDS``,) of ``device``'s current stream (a CPU device: one pair),
    made on first use and kept; a fresh pair, not kept, while that stream captures a CUDA graph.

    Example::

        counters = tile_counters(torch.device("cuda", 0))  # tensor([0, 0], device='cuda:0', dtype=torch.int32)
    """
    device = torch.device(device)
    if device.type != "cuda":
        key = (device, 0)
    else:
        index = torch.cuda.current_device() if device.index is None else device.index
        device = torch.device("cuda", index)
        key = (device, driver.active.get_current_stream(index))
    pair = _PAIRS.get(key)
    if pair is None:
        pair = torch.zeros(COUNTER_WORDS, dtype=torch.int32, device=device)
        if device.type == "cuda":
            with torch.cuda.device(device):
                if torch.cuda.is_current_stream_capturing():
                    return pair
        _PAIRS[key] = pair
    return pair
