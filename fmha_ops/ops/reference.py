"""The reference op: explicit softmax in float32 (or float64) torch, any device, every mask and dtype.

Quantized inputs are dequantized first (fp8 / int8 times their descales; with
``quantize_kv_to_fp8`` the KV is quantized per token to fp8 and back, exactly like the fast
paths), so every call the fast ops accept also runs here, slowly. Differentiable by autograd.
"""
from __future__ import annotations

import math

import torch

from .. import attn_bias as ab
from ..dispatch import register
from ..dtypes import FLOAT_DTYPES, FP8_DTYPES
from ..inputs import Inputs
from ..problem import Problem
from .base import AttentionBwOp, AttentionFwOp
from .common import dequantized_qkv

_DTYPES = frozenset(
    [(d, d, d) for d in FLOAT_DTYPES + FP8_DTYPES]
    + [(torch.int8, torch.int8, f) for f in FP8_DTYPES]
    + [(d, f, f) for d in (torch.float16, torch.bfloat16) for f in FP8_DTYPES]
)
_ALL_DESCALES = {
    "q": frozenset({"none", "tensor", "head", "block"}),
    "k": frozenset({"none", "tensor", "head", "block", "token"}),
    "v": frozenset({"none", "tensor", "head", "channel", "token"}),
}
_ROW_CHUNK_ELEMS = 1 << 27  # score elements per chunk of query rows


def reference_attention(inp: Inputs, compute_dtype: torch.dtype = torch.float32
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Mq, Hq, Kv) in ``compute_dtype``, lse (B, Hq, Mq) float32, natural log).

    Every mask kind, its window, a tensor bias and softcap (scores s -> c * tanh(s / c), then the bias); sinks
    (``fmha_ops.sinks``) join each row's log-sum-exp. Rows that see no key: out 0, lse -inf (with sinks: the sink).

    Example
    -------
    >>> out, lse = reference_attention(make_inputs(q, k, v, LowerTriangularMask()), torch.float64)
    """
    q, k, v = inp.query, inp.key, inp.value
    hq, hkv = q.shape[2], k.shape[2]
    qf, kf, vf = (t.to(compute_dtype) for t in dequantized_qkv(inp))
    if hq != hkv:
        kf = kf.repeat_interleave(hq // hkv, dim=2)
        vf = vf.repeat_interleave(hq // hkv, dim=2)
    b, mq, mk = q.shape[0], q.shape[1], k.shape[1]
    if b == 0:
        return q.new_zeros((0, mq, hq, v.shape[-1]), dtype=compute_dtype), q.new_zeros((0, hq, mq), dtype=torch.float32)
    bias = inp.attn_bias
    segments = list(bias.segments(mq, mk)) if bias else [ab.Segment(0, mq, (0, mk))]
    tensor_bias = None if bias is None or bias.tensor_bias is None else bias.tensor_bias.expand(b, hq, mq, mk)
    # unbind, not indexing, per batch element: the backward of b selects would add b full-size gradients
    per_batch = zip(qf.unbind(0), kf.unbind(0), vf.unbind(0),
                    [None] * b if tensor_bias is None else tensor_bias.unbind(0))
    outs, lses = [], []
    for qb, kb, vb, bias_b in per_batch:
        o_b, l_b = [], []
        for seg in segments:
            keys = seg.key_rows().to(q.device)
            extra = None if bias_b is None else bias_b[:, seg.q_start:seg.q_end][:, :, keys]
            o, lse = _attend(qb[seg.q_start:seg.q_end], kb[keys], vb[keys], seg, extra, inp)
            o_b.append(o)
            l_b.append(lse)
        outs.append(torch.cat(o_b, 0))
        lses.append(torch.cat(l_b, 1))
    if not outs:  # batch 0
        return (qf.new_zeros(q.shape[:3] + vf.shape[3:]) + qf.sum() * 0,
                torch.zeros((0, hq, mq), dtype=torch.float32, device=q.device))
    return torch.stack(outs), torch.stack(lses).float()


def _attend(q, k, v, seg: ab.Segment, bias: torch.Tensor | None, inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q (m, H, K), k (n, H, K), v (n, H, Kv), bias (H, m, n) or None -> out (m, H, Kv), lse (H, m)."""
    m, h, n = q.shape[0], q.shape[1], k.shape[0]
    visible = seg.visible(m, n, q.device)
    step = max(1, _ROW_CHUNK_ELEMS // max(1, h * n))
    outs, lses = [], []
    for r0 in range(0, max(m, 1), step):  # one empty chunk when m == 0 keeps the output in the graph
        r1 = min(m, r0 + step)
        s = torch.einsum("mhd,nhd->hmn", q[r0:r1], k) * inp.softmax_scale
        if inp.softcap > 0.0:
            s = inp.softcap * torch.tanh(s / inp.softcap)
        if bias is not None:
            s = s + bias[:, r0:r1].to(s.dtype)
        s = s.masked_fill(~visible[r0:r1], -math.inf)
        if n:  # rows that see no key get lse -inf; masking them first keeps their gradient 0, not nan
            dead = torch.isneginf(s.amax(dim=-1))
            lse = torch.logsumexp(s.masked_fill(dead[..., None], 0.0), dim=-1).masked_fill(dead, -math.inf)
        else:
            lse = s.new_full((h, r1 - r0), -math.inf)
        if inp.sinks is not None:  # the sink joins the denominator (a row without keys: lse = the sink)
            lse = torch.logaddexp(lse, inp.sinks.to(s.dtype)[:, None].expand_as(lse))
        probs = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0)[..., None])
        if inp.p > 0.0:
            probs = torch.nn.functional.dropout(probs, inp.p)
        outs.append(torch.einsum("hmn,nhd->mhd", probs, v))
        lses.append(lse)
    return torch.cat(outs, 0), torch.cat(lses, 1)


@register
class ReferenceFwOp(AttentionFwOp):
    """Explicit-softmax float32 attention in torch: every mask (windows, tensor biases), dtype, descale and
    softcap; slow."""

    NAME = "torch_referenceF"
    ARCHS = ("cpu", "cuda>=0.0", "rocm")
    DTYPES = _DTYPES
    OUT_DTYPES = frozenset(FLOAT_DTYPES) | {torch.float8_e4m3fn}  # fp8: in v's units (validation's contract)
    HEAD_DIMS = range(1, 1025)
    HEAD_DIMS_V = range(1, 1025)
    NEGATIVE_SCALE = True
    BIAS_KINDS = ab.ALL_KINDS
    GQA = True
    PAGE_SIZES = range(1, 1 << 20)
    DESCALES = _ALL_DESCALES
    QUANTIZE_KV = True
    PARTIAL = True
    AUTOGRAD = True
    DROPOUT = True
    V_KEYS_CONTIGUOUS = True
    CUDA_GRAPH = False  # loops over sequences on the host
    WINDOW = True
    SOFTCAP = True
    SINKS = True
    KEY_START = True  # the paged masks' segments start at each sequence's key start
    PRIORITY = -100

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        if p.out_dtype == torch.float8_e4m3fn and p.descales[2] != "tensor":
            return [f"an fp8 output is in v's units: needs a per-tensor v_descale (got kind {p.descales[2]!r})"]
        return []

    @classmethod
    def apply(cls, inp, needs_lse):
        out, lse = reference_attention(inp)
        if inp.out_dtype == torch.float8_e4m3fn:  # attention = out * v_descale
            out = out / inp.v_descale.float().reshape(())
        return out.to(inp.out_dtype), (lse if needs_lse else None)

    @classmethod
    def estimate(cls, p: Problem) -> float:
        from .cost import attention_time

        return attention_time(p, tflops=0.0008 if p.arch.kind == "cpu" else 40.0, tbps=0.005 if p.arch.kind == "cpu" else 0.3, overhead_us=200.0,
                              passes=4.0, window=False)  # a window masks the materialized scores


@register
class ReferenceBwOp(AttentionBwOp):
    """Backward by float32 recomputation + torch autograd (any device, every mask)."""

    NAME = "torch_referenceB"
    ARCHS = ReferenceFwOp.ARCHS
    NEGATIVE_SCALE = True
    DTYPES = _DTYPES
    OUT_DTYPES = frozenset(FLOAT_DTYPES)
    HEAD_DIMS = ReferenceFwOp.HEAD_DIMS
    HEAD_DIMS_V = ReferenceFwOp.HEAD_DIMS_V
    BIAS_KINDS = ab.ALL_KINDS
    GQA = True
    PAGE_SIZES = ReferenceFwOp.PAGE_SIZES
    DESCALES = _ALL_DESCALES
    PARTIAL = True
    V_KEYS_CONTIGUOUS = True
    CUDA_GRAPH = False
    WINDOW = True
    SOFTCAP = True
    SINKS = True  # the given LSE includes them: this call's share exp(l - lse) leaves them out as a merge would
    PRIORITY = -100

    @classmethod
    def apply_bw(cls, inp, out, lse, grad_out):
        """Honours the given ``out`` / ``lse``: when they are the merge of this call's attention with others
        (over more keys), the gradients are this call's share, as a flash backward kernel computes them.
        With this call's own o, l: share = exp(l - lse); d o = share * grad_out and
        d l = share * rowsum(grad_out * (o - out)); given this call's own out and lse, share is 1 and d l 0."""
        leaves = [t.detach().requires_grad_(True) for t in dequantized_qkv(inp)]
        plain = Inputs(*leaves, attn_bias=inp.attn_bias, scale=inp.softmax_scale, softcap=inp.softcap)
        with torch.enable_grad():
            o, l = reference_attention(plain)
            seen = torch.isfinite(l) & torch.isfinite(lse)
            share = torch.where(seen, torch.exp(l.detach() - lse.float()), torch.zeros_like(l)).transpose(1, 2)
            g = grad_out.float()
            grad_l = share * (g * (o.detach() - out.float())).sum(-1)
            # without keys l is a constant, and an empty batch has no graph at all: their gradients are zeros
            pairs = [(t, dt) for t, dt in ((o, share[..., None] * g), (l, grad_l.transpose(1, 2))) if t.requires_grad]
            grads = (torch.autograd.grad([t for t, _ in pairs], leaves, [dt for _, dt in pairs], allow_unused=True)
                     if pairs else [None] * len(leaves))
        return tuple(torch.zeros_like(x) if dx is None else dx for x, dx in zip(leaves, grads))

    @classmethod
    def estimate(cls, p: Problem) -> float:
        return 2.5 * ReferenceFwOp.estimate(p)
