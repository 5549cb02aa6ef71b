"""Helpers more than one backend uses: platform limits of the Triton ops, the decode ops' views of a
call, and dequantization of quantized inputs.

Backends import from here (and from ``base`` / ``cost``), never from each other.
"""
from __future__ import annotations

import os

import torch

from registry import current_arch, fp8_dtype

from .. import attn_bias as ab
from ..inputs import Inputs
from ..problem import Problem
from ..quant import K_SCALE_BLOCK, Q_SCALE_BLOCK
from ..validation import descale_kinds

# ---- Triton platforms ----------------------------------------------------------------------------

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
#: where the Triton ops run: sm89+ GPUs, and the CPU under ``TRITON_INTERPRET=1`` (tests)
TRITON_ARCHS = ("cuda>=8.9",) + (("cpu",) if TRITON_INTERPRET else ())


def interpreter_reasons(p: Problem) -> list[str]:
    """Platform limits of the Triton ops: the interpreter (CPU) computes bfloat16 tl.dot wrongly, and
    float8_e4m3fnuz is an AMD format (NVIDIA GPUs take float8_e4m3fn)."""
    dts = (p.q_dtype, p.k_dtype, p.v_dtype)
    if p.arch.kind == "cpu" and torch.bfloat16 in dts:
        return ["bfloat16 is not computed correctly by the Triton interpreter (CPU); use float16 there"]
    if p.arch.kind == "cuda" and torch.float8_e4m3fnuz in dts:
        return ["float8_e4m3fnuz is not an NVIDIA format; use float8_e4m3fn"]
    return []


# ---- decode ops' views of a call -----------------------------------------------------------------

#: the masks the paged-decode ops take: dense BMHK calls (none / bottom-right causal) and the decode masks
DECODE_MASKS = frozenset({ab.NONE, ab.CAUSAL_BR, ab.PADDED_KEYS, ab.PADDED_KEYS_CAUSAL, ab.PAGED, ab.PAGED_CAUSAL})


def decode_reasons(p: Problem) -> list[str]:
    """What the paged-decode kernels (Triton and Gluon) share: output in the query's dtype or float32, causal
    among several new tokens, per-token (not per-(batch, head)) scales with a paged cache."""
    r = []
    if p.out_dtype not in (p.q_dtype, torch.float32):
        r.append(f"output dtype must be the query's ({p.q_dtype}) or float32")
    if p.bias in (ab.NONE, ab.PADDED_KEYS, ab.PAGED) and p.seqlen_q > 1:
        r.append("non-causal decode with more than one query per sequence not supported")
    if p.page_size and "head" in p.descales[1:]:
        r.append("per-(batch, head) KV descales with a paged cache not supported (use per-token scales)")
    return r


def decode_views(inp: Inputs):
    """(q (B, Mq, Hq, D), k_cache, v_cache, seqlens, block_table, k_scale, v_scale) for a decode kernel.

    Caches are (B, L, Hkv, D) or, paged, (pages, page_size, Hkv, D) views of the call's key / value; seqlens
    int32 (B,) (the mask's, or for a dense call a new tensor of L per sequence: nothing is cached across calls, so
    a call captured in a CUDA graph keeps no graph-pool memory alive); block_table int32 (B, max_pages) or None; k/v scales float32 per token (shaped like the caches
    without D, in the caller's layout when given per page; stride 0 where a per-tensor or per-head descale
    repeats) or None. With ``quantize_kv_to_fp8``
    the caches are quantized to the arch's fp8 per token first.
    """
    q, k, v, bias = inp.query, inp.key, inp.value, inp.attn_bias
    ks, vs = inp.k_descale, inp.v_descale
    per_token = ks is not None and ks.shape == k.shape[:3]  # shaped like the key (pool) without D
    block_table = None
    if bias is None or bias.KIND in (ab.NONE, ab.CAUSAL_BR):  # dense, local windows included
        seqlens = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
    else:
        nseq = len(bias.q_seqinfo.seqstart_py) - 1
        q = q.view(nseq, q.shape[1] // max(nseq, 1), *q.shape[2:])
        seqlens = bias.k_seqinfo.seqlen
        if isinstance(bias, ab.PagedBlockDiagonalPaddedKeysMask):
            block_table, rows = bias.block_tables, (-1, bias.page_size)
        else:
            rows = (nseq, bias.k_seqinfo.padding)
            used = nseq * bias.k_seqinfo.padding  # key rows past the last sequence's padding are unused
            k, v = k[:, :used], v[:, :used]
            if per_token:
                ks, vs = ks[:, :used], vs[:, :used]
        k, v = k.view(*rows, *k.shape[2:]), v.view(*rows, *v.shape[2:])
        if per_token:
            ks, vs = ks.view(k.shape[:3]), vs.view(v.shape[:3])
    if inp.quantize_kv_to_fp8:
        from ..kv_cache import quantize_kv_fp8

        k, v, ks, vs = quantize_kv_fp8(k, v, fp8_dtype(current_arch(q.device)))
    elif ks is not None:
        ks, vs = _token_scale(ks, k), _token_scale(vs, v)
    return q, k, v, seqlens, block_table, ks, vs


def decode_window(inp: Inputs) -> int:
    """The decode kernels' ``window_left`` (-1 = unbounded): the mask's. Its ``window_right`` never bounds a decode
    query's keys: causal masks stop at the query's own position, and a non-causal decode call has one query, the
    sequence's last token."""
    return -1 if inp.attn_bias is None else inp.attn_bias.window_left


def decode_key_start(inp: Inputs) -> torch.Tensor | None:
    """The decode kernels' ``key_start``: the mask's per-sequence first keys, int32 (B,) on the device, or None."""
    return None if inp.attn_bias is None else inp.attn_bias.key_start


def decode_keys(max_len: int, window_left: int, mq: int) -> int:
    """Keys a sequence's queries can see at most (what a split count is chosen for): ``max_len``, or a window's
    ``window_left + mq`` when that is shorter."""
    return max_len if window_left < 0 else min(max_len, window_left + mq)


def decode_outputs(inp: Inputs, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, needs_lse: bool):
    """A decode kernel's (B, Mq, Hq, D) out and (B, Hq, Mq) lse in the call's layout (packed when the mask
    packs the queries into batch 1: out (1, B * Mq, Hq, D), lse (1, Hq, B * Mq))."""
    out = out.view(inp.query.shape[:3] + out.shape[3:])
    if not needs_lse:
        return out, None
    if inp.attn_bias is not None and inp.query.shape[0] == 1 and q.shape[0] != 1:
        lse = lse.permute(1, 0, 2).reshape(1, lse.shape[1], -1)
    return out, lse


def _token_scale(d: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """A tensor / (B, Hkv) / per-token descale as a per-token view (stride 0 where it repeats)."""
    if d.numel() == 1:
        return d.reshape(1, 1, 1).expand(cache.shape[:3])
    if d.dim() == 2:  # (B, Hkv) over a dense (B, L, Hkv, D) cache
        return d[:, None, :].expand(cache.shape[:3])
    return d


def sink_arg(inp: Inputs) -> torch.Tensor | None:
    """The call's sinks as the kernels read them (float32 (Hq,), contiguous), or None."""
    return None if inp.sinks is None else inp.sinks.detach().contiguous()


# ---- dequantization ------------------------------------------------------------------------------

def dequantize(x: torch.Tensor, descale: torch.Tensor | None, kind: str, block: int = 0) -> torch.Tensor:
    """float32 ``x * descale`` for a BMHK tensor and a descale of ``kind`` (see fmha_ops.inputs).
    ``block`` is the row block of a "block" descale (Q_SCALE_BLOCK for q, K_SCALE_BLOCK for k)."""
    xf = x.float()
    if kind == "none":
        return xf
    d = descale.float()
    m, h = x.shape[1], x.shape[2]
    if kind == "tensor":
        return xf * d.reshape(())
    if kind == "head":  # (B, Hkv); a query head uses its kv head's value
        return xf * d.repeat_interleave(h // d.shape[1], dim=1)[:, None, :, None]
    if kind == "block":
        return xf * d.repeat_interleave(block, dim=2)[:, :, :m].permute(0, 2, 1)[..., None]
    if kind == "channel":
        return xf * d[:, None, :, :]
    if kind == "token":  # shaped like x without its last dim, or like a paged pool of the same tokens
        return xf * d.reshape(x.shape[:-1])[..., None]
    raise ValueError(f"unknown descale kind {kind!r}")


def dequantized_qkv(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 q, k, v as the kernels see them: times their descales (or quantized per token to the
    arch's fp8 and back when ``quantize_kv_to_fp8``)."""
    q, k, v = inp.query, inp.key, inp.value
    kinds = descale_kinds(inp)
    descales = [inp.q_descale, inp.k_descale, inp.v_descale]
    if isinstance(inp.attn_bias, ab.BlockDiagonalMask):  # per-sequence descales -> per token
        for i, (info, kind) in enumerate(zip((inp.attn_bias.q_seqinfo, inp.attn_bias.k_seqinfo, inp.attn_bias.k_seqinfo),
                                             kinds)):
            if kind == "head":
                seq = torch.repeat_interleave(torch.arange(len(info.seqlens)), torch.tensor(info.seqlens))
                d = descales[i][seq.to(q.device)]
                descales[i] = d.repeat_interleave((q if i == 0 else k).shape[2] // d.shape[1], dim=1)[None]
                kinds = kinds[:i] + ("token",) + kinds[i + 1:]
    if inp.quantize_kv_to_fp8:
        from ..kv_cache import quantize_fp8

        f8 = fp8_dtype(current_arch(q.device))
        (k8, ks), (v8, vs) = quantize_fp8(k, f8), quantize_fp8(v, f8)
        kf, vf = k8.float() * ks[..., None], v8.float() * vs[..., None]
    else:
        kf = dequantize(k, descales[1], kinds[1], K_SCALE_BLOCK)
        vf = dequantize(v, descales[2], kinds[2])
    return dequantize(q, descales[0], kinds[0], Q_SCALE_BLOCK), kf, vf


def half_backward_operands(inp: Inputs, out: torch.Tensor, grad_out: torch.Tensor):
    """(q, k, v, out, grad_out) for a bf16/fp16 backward kernel: the call's half-precision tensors as they are, fp8
    ones dequantized (times their descales) and cast to bf16; out and grad_out in q's dtype."""
    q, k, v = inp.query, inp.key, inp.value
    if q.dtype not in (torch.bfloat16, torch.float16):
        q, k, v = (t.to(torch.bfloat16) for t in dequantized_qkv(inp))
    return q, k, v, out.to(q.dtype), grad_out.to(q.dtype)


# ---- ops backed by an optional pip package ------------------------------------------------------------

class OptionalPackage:
    """Mixin for an op whose kernels come from an optional pip package: ``available()`` reports a missing or
    unsupported package first (on any machine, before the arch check), then the registry's checks, then
    whatever ``import_reason()`` finds (the import itself, the runtime behind it). Each op sets both."""

    package_reason: staticmethod
    import_reason: staticmethod

    @classmethod
    def available(cls) -> str | None:
        return cls.package_reason() or super().available()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return cls.import_reason()


def installed_version(distribution: str, extra: str) -> tuple[str | None, str | None]:
    """``(version, None)`` when the pip ``distribution`` is installed, else ``(None, why)`` naming the
    ``fmha-ops[extra]`` that installs it."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution), None
    except importlib.metadata.PackageNotFoundError:
        return None, f"package {distribution!r} is not installed (pip install 'fmha-ops[{extra}]')"


def import_failure(module: str) -> str | None:
    """None when ``module`` imports, else why not (packages that load CUDA libraries at import can fail
    in any way, so every exception is reported)."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001
        return f"{module} failed to import: {type(e).__name__}: {e}"
    return None


# ---- FlashAttention-convention arguments (FA3, FA4) -------------------------------------------------

def window_size(bias_kind: str, window_left: int, window_right: int) -> tuple[bool, tuple[int | None, int | None]]:
    """FlashAttention's ``(causal, window_size)`` for a mask kind and our window fields (-1 = unbounded).

    FlashAttention (3 and 4) aligns windows bottom-right: key j is visible from query i iff
    i + Mk - Mq - left <= j <= i + Mk - Mq + right, and ``causal`` sets right = 0. Our bottom-right and
    non-causal kinds align the same way; the top-left kinds reach a FlashAttention op only with Mq == Mk, where
    the alignments agree. A causal kind's right bound is at most 0, so only its left bound passes.

    >>> window_size("causal_bottom_right", 128, -1)
    (True, (128, None))
    >>> window_size("none", -1, -1)
    (False, (None, None))
    """
    left = window_left if window_left >= 0 else None
    if bias_kind in ab.CAUSAL_KINDS:
        return True, (left, None)
    return False, (left, window_right if window_right >= 0 else None)


def window_fields(inp: Inputs) -> tuple[int, int]:
    """The call mask's ``(window_left, window_right)`` (-1 = unbounded; no mask: both -1)."""
    bias = inp.attn_bias
    return getattr(bias, "window_left", -1), getattr(bias, "window_right", -1)


def varlen_args(inp: Inputs) -> dict:
    """FlashAttention's varlen keywords for a ``BlockDiagonal*`` mask: int32 cumulative starts on the device and
    the longest query / key sequence."""
    b = inp.attn_bias
    return dict(cu_seqlens_q=b.q_seqinfo.seqstart, cu_seqlens_k=b.k_seqinfo.seqstart,
                max_seqlen_q=b.q_seqinfo.max_seqlen, max_seqlen_k=b.k_seqinfo.max_seqlen)


def kv_head_descales(inp: Inputs) -> dict:
    """FlashAttention's fp8 descales ``{q,k,v}_descale``: float32 (sequences, Hkv), per-tensor ones broadcast as
    stride-0 views (masks with sequence lengths: one row per sequence); {} without descales."""
    if inp.q_descale is None:
        return {}
    info = getattr(inp.attn_bias, "q_seqinfo", None)
    rows = inp.query.shape[0] if info is None else len(info.seqstart_py) - 1
    shape = (rows, inp.key.shape[2])
    return {f"{r}_descale": d.reshape(()).expand(shape) if d.numel() == 1 else d
            for r, d in (("q", inp.q_descale), ("k", inp.k_descale), ("v", inp.v_descale))}
