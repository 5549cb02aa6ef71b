"""Key splits of the decode kernels: how many splits of each sequence's keys keep the GPU busy.

Shared by the Triton decoder (``kernels/triton/decode.py``) and the Gluon fp8-KV decoder
(``kernels/gluon/decode.py``): each kernel family says how many programs one split launches and how many of its
programs an SM holds (``resident_programs`` there); the rule here turns that into a split count.
"""
from __future__ import annotations

MIN_KEYS_PER_SPLIT = 512  # shorter splits cost more in the reduce than they gain in parallelism
MAX_SPLITS = 64  # the bandwidth rule's cap (a latency-bound kernel may take one wave's worth beyond it)
FILL_TOLERANCE = 1.05  # the fewest splits whose modelled time is within 5% of the best


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_num_splits(programs: int, max_len: int, sm_count: int, resident: int | None = None) -> int:
    """Number of key splits (each at least ``MIN_KEYS_PER_SPLIT`` keys) for a launch of ``programs`` programs per
    split over sequences of up to ``max_len`` keys.

    ``resident=None`` (bandwidth-bound kernel): 1 when the programs fill every SM once, else about four
    programs per SM, at most 64 splits. ``resident`` programs per SM (latency-bound kernel): the time is
    modelled as waves of ``sm_count * resident`` programs, each as long as its split, and the fewest splits
    within 5% of the best are taken, or, when they run in one wave, as many as that wave holds (at most 64 or
    one wave). 512 programs (B64 x 8 KV heads, fp8 at D256) on 132 x 3 slots fill 1.3 waves, so 3 splits run 4
    full waves of thirds; 8 programs (B1 x 8 KV heads) on 528 slots take 66 splits, 1.8% faster than 64 on the
    H200. No programs (an empty batch, no query rows) or no keys: 1 split (nothing to spread).

    Example
    -------
    >>> choose_num_splits(8, 131072, 132, resident=4)
    66
    """
    if programs <= 0 or max_len <= 0:
        return 1
    if resident is None:
        if programs >= sm_count:
            return 1
        return min(_cdiv(4 * sm_count, programs), max(1, min(max_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS)))
    slots = sm_count * resident
    most = max(1, min(max_len // MIN_KEYS_PER_SPLIT, max(MAX_SPLITS, slots // programs)))
    cost = [_cdiv(programs * s, slots) / s for s in range(1, most + 1)]
    best = min(cost)
    splits = next(s for s, c in enumerate(cost, 1) if c <= FILL_TOLERANCE * best)
    if programs * splits <= slots:  # one wave: the shortest programs that still fit in it
        splits = max(splits, min(most, slots // programs))
    return splits
