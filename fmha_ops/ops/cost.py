"""Roofline cost model shared by the ops: time = max(flops / rate, bytes / bandwidth) + overhead.

Each op passes its own achieved rates (calibrated from measurements on the H200, see BENCHMARKS.md);
rates are scaled for other GPUs by their SM count relative to the H200's 132.
"""
from __future__ import annotations

from ..problem import Problem


def attention_flops(p: Problem) -> float:
    """Forward FLOPs: 2 matmuls of 2*M*N*K each, halved for causal masks when Mq ~ Mk."""
    f = 2.0 * p.batch * p.heads_q * p.seqlen_q * p.seqlen_k * (p.head_dim + p.head_dim_v)
    if p.causal and p.seqlen_q > 1 and p.seqlen_q * 2 > p.seqlen_k:
        f *= 0.5
    return f


#: a backward's matrix work relative to its forward's (five GEMMs of the forward's size against two)
BACKWARD_WORK = 2.5


def head_dim_rate(rates: dict[int, float], head_dim: int) -> float:
    """The rate listed for the smallest head dim >= ``head_dim`` (the largest listed one beyond them)."""
    fitting = [d for d in rates if d >= head_dim]
    return rates[min(fitting) if fitting else max(rates)]


def backward_time(p: Problem, rates: dict[int, float], tbps: float, overhead_us: float) -> float:
    """Seconds for one backward at ``rates`` (head dim -> achieved TFLOP/s counted over the backward's
    BACKWARD_WORK x the forward's FLOPs), ``tbps`` TB/s and a fixed overhead."""
    return BACKWARD_WORK * attention_time(p, head_dim_rate(rates, p.head_dim), tbps, 0.0) + overhead_us * 1e-6


def attention_bytes(p: Problem) -> float:
    """Bytes of Q, K, V read and O written once (decode: K/V dominate)."""
    def size(dt) -> int:
        return dt.itemsize

    kv_elem = 1 if p.quantize_kv else size(p.k_dtype)
    q = p.batch * p.seqlen_q * p.heads_q * (p.head_dim * size(p.q_dtype) + p.head_dim_v * size(p.out_dtype))
    kv = p.batch * p.seqlen_k * p.heads_kv * (p.head_dim + p.head_dim_v) * kv_elem
    return float(q + kv)


def attention_time(p: Problem, tflops: float, tbps: float, overhead_us: float, passes: float = 1.0) -> float:
    """Seconds for one call at ``tflops`` achieved TFLOP/s and ``tbps`` achieved TB/s."""
    scale = 1.0
    if p.arch.kind != "cpu":
        from registry.arch import sm_count

        scale = sm_count(p.arch) / 132.0
    compute = attention_flops(p) / (tflops * 1e12 * scale)
    memory = passes * attention_bytes(p) / (tbps * 1e12 * scale)
    return max(compute, memory) + overhead_us * 1e-6
