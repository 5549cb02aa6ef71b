"""Attention sinks: one learned float32 logit per query head that joins every softmax denominator (GPT-OSS).

With sinks s_h the attention of query row i of head h is

    lse_i = log(sum_j exp(score_ij) + exp(s_h)),    out_i = sum_j exp(score_ij - lse_i) v_j

(scores after the softmax scale, the softcap and the mask; the sink is neither scaled nor capped, and has no value
row). A row that sees no key gets out 0 and lse s_h. The LSE the ops return includes the sink, so a backward that
recomputes P = exp(score - lse) needs nothing more for dq / dk / dv, and the sinks' own gradient is
``sink_grad_from_delta`` of the row sums delta = rowsum(dO * O) that a backward computes anyway (``sink_grad`` for a
backward that does not expose them: a pass over out and dO of its own). Their checks: ``validation.validate_sinks``.
transformers passes them as ``s_aux``, FlashAttention-4 as ``learnable_sink``.
A helper any layer may import; it imports no attention layer.
"""
from __future__ import annotations

import torch


def sink_grad_from_delta(delta: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Gradient of the loss w.r.t. the sink logits from the backward's row sums: dsink_h = -sum over rows of
    exp(sink_h - lse) delta, delta = rowsum(dO * O).

    A sink joins each row's denominator without a value row, so d out_i / d sink = -exp(sink - lse_i) out_i.
    delta and lse float32 (B, Hq, Mq) (varlen: (1, Hq, total_q)), lse in natural log, the sink included; sinks
    float32 (Hq,). Rows with a non-finite lse contribute 0 (with sinks a row that sees no key has lse = sink and out
    0, so it contributes 0 too). Returns float32 (Hq,). It reads 8 bytes per row (delta, lse), where ``sink_grad``
    passes over out and dO, 2 x Kv elements per row, and their float32 copies.

    Example
    -------
    >>> delta, lse = torch.ones(1, 2, 3), torch.zeros(1, 2, 3)
    >>> sink_grad_from_delta(delta, lse, torch.zeros(2)).tolist()
    [-3.0, -3.0]
    """
    weight = torch.exp(sinks.float()[None, :, None] - lse.float())
    return -(torch.where(torch.isfinite(lse), weight, 0.0) * delta).sum((0, 2))


def sink_grad(out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``sink_grad_from_delta`` with delta = rowsum(dO * O) computed here from float32 copies of out and grad_out:
    for backward ops that do not expose their own row sums (``AttentionBwOp.apply_bw_sinks``).

    out, grad_out (B, Mq, Hq, Kv); lse float32 (B, Hq, Mq) natural log, the sink included; sinks float32 (Hq,).
    Returns float32 (Hq,).

    Example
    -------
    >>> out, lse = torch.zeros(1, 3, 2, 4), torch.zeros(1, 2, 3)
    >>> sink_grad(out, torch.ones_like(out), lse, torch.zeros(2)).tolist()
    [-0.0, -0.0]
    """
    delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2)  # (B, Hq, Mq)
    return sink_grad_from_delta(delta, lse, sinks)
