"""Roofline cost model shared by the ops: time = max(compute, memory) + EXPOSED x min(compute, memory) + overhead,
compute = flops / rate, memory = bytes / bandwidth.

Each op passes its own achieved rates (calibrated from measurements on the H200, see BENCHMARKS.md);
rates are scaled for other GPUs by their SM count relative to the H200's 132.
"""
from __future__ import annotations

from ..problem import Problem


#: keys beyond a local window that a tile-skipping kernel computes per query: a block of 128 queries spans its window
#: plus the block's own 128 keys in whole key tiles
WINDOW_TILE = 128


def visible_keys(p: Problem, window: bool = True, causal: bool = True) -> float:
    """Keys per query an op computes scores for: Mk, halved for causal masks when Mq ~ Mk (``causal``: the op's
    kernels skip the tiles a causal mask hides), and with ``window`` (its kernels skip the tiles outside a local
    window) at most the window's span plus ``WINDOW_TILE``. Kernels that mask out-of-window scores instead of
    skipping their tiles pass ``window=False``: their work is the mask's without the window.

    Example: 8192 queries and keys, bottom-right causal with a 128-key window (window_left 127)

    >>> visible_keys(problem), visible_keys(problem, window=False)  # doctest: +SKIP
    (256.0, 4096.0)
    """
    keys = float(p.seqlen_k)
    if causal and p.causal and p.seqlen_q > 1 and p.seqlen_q * 2 > p.seqlen_k:
        keys *= 0.5
    if window and p.windowed:
        left = p.window_left if p.window_left >= 0 else p.seqlen_k
        right = 0 if p.causal else (p.window_right if p.window_right >= 0 else p.seqlen_k)
        keys = min(keys, left + right + 1 + WINDOW_TILE)
    return keys


def attention_flops(p: Problem, window: bool = True, causal: bool = True) -> float:
    """Forward FLOPs: 2 matmuls of 2*M*N*K each over the keys each query sees (``visible_keys``: ``window`` and
    ``causal`` say whether the op's kernels skip the tiles a window / causal mask hides)."""
    return 2.0 * p.batch * p.heads_q * p.seqlen_q * visible_keys(p, window, causal) * (p.head_dim + p.head_dim_v)


#: a backward's matrix work relative to its forward's (five GEMMs of the forward's size against two)
BACKWARD_WORK = 2.5


def head_dim_rate(rates: dict[int, float], head_dim: int) -> float:
    """The rate listed for the smallest head dim >= ``head_dim`` (the largest listed one beyond them)."""
    fitting = [d for d in rates if d >= head_dim]
    return rates[min(fitting) if fitting else max(rates)]


def backward_time(p: Problem, rates: dict[int, float], tbps: float, overhead_us: float, window: bool = True,
                  causal: bool = True) -> float:
    """Seconds for one backward at ``rates`` (head dim -> achieved TFLOP/s counted over the backward's
    BACKWARD_WORK x the forward's FLOPs), ``tbps`` TB/s and a fixed overhead. The greater of compute and memory
    time only (``exposed`` 0): the rates were fitted that way on long sequences and no tuning table times a
    backward to fit ``EXPOSED`` on. ``window`` / ``causal``: as ``attention_flops``."""
    return (BACKWARD_WORK * attention_time(p, head_dim_rate(rates, p.head_dim), tbps, 0.0, exposed=0.0,
                                           window=window, causal=causal)
            + overhead_us * 1e-6)


def attention_bytes(p: Problem) -> float:
    """Bytes of Q, K, V read and O written once (decode: K/V dominate)."""
    def size(dt) -> int:
        return dt.itemsize

    kv_elem = 1 if p.quantize_kv else size(p.k_dtype)
    q = p.batch * p.seqlen_q * p.heads_q * (p.head_dim * size(p.q_dtype) + p.head_dim_v * size(p.out_dtype))
    kv = p.batch * p.seqlen_k * p.heads_kv * (p.head_dim + p.head_dim_v) * kv_elem
    return float(q + kv)


#: the share of the lesser of compute and memory time a call does not overlap with the greater (its per-tile loads
#: of Q and stores of O, the pipeline's fill and drain: work that grows with the tokens, as the bytes do). With
#: max() alone, measured / model on the H200 table's prefill rows (151 op x kind pairs measured at 512, 2048 and
#: 8192 tokens) is 2.01 / 1.23 / 1.05 (medians per length): short calls ran ~2x their model, a slope the selector
#: carried past the grid's edges; with 1.5 x the lesser term added, 1.08 / 0.98 / 0.97 (0.5: 1.56 / 1.11 / 1.03;
#: 2.0: 0.95 / 0.90 / 0.96), one pair's spread across the three lengths 1.31x (median; 1.66x with max() alone).
#: Estimating each 512-token grid point from the other lengths only (bench/diagnostics/selector_offline.py --hide
#: size), the selector's worst regret there is 36% against 86% with max() alone. A memory-bound decode's compute
#: term is small: it barely moves.
EXPOSED = 1.5


def attention_time(p: Problem, tflops: float, tbps: float, overhead_us: float, passes: float = 1.0,
                   exposed: float = EXPOSED, window: bool = True, causal: bool = True) -> float:
    """Seconds for one call at ``tflops`` achieved TFLOP/s and ``tbps`` achieved TB/s: the greater of compute and
    memory time plus ``exposed`` x the lesser, plus ``overhead_us``. ``window`` / ``causal``: whether the op's
    kernels skip the tiles a local window / causal mask hides (``attention_flops``).

    Example
    -------
    >>> attention_time(problem, tflops=600.0, tbps=3.0, overhead_us=6.0)  # doctest: +SKIP
    6.9e-05
    """
    scale = 1.0
    if p.arch.kind != "cpu":
        from registry.arch import sm_count

        scale = sm_count(p.arch) / 132.0
    compute = attention_flops(p, window, causal) / (tflops * 1e12 * scale)
    memory = passes * attention_bytes(p) / (tbps * 1e12 * scale)
    return max(compute, memory) + exposed * min(compute, memory) + overhead_us * 1e-6
