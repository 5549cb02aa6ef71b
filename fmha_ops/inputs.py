"""``Inputs``: one attention call's arguments, their validation, and the problem signature.

Layout: BMHK. query (B, Mq, Hq, K), key (B, Mk, Hkv, K), value (B, Mk, Hkv, Kv), Hq % Hkv == 0
(GQA/MQA: query head h uses kv head h // (Hq // Hkv)). BMGHK (B, M, G, H, K) is accepted by the
public API and folded to BMHK before an ``Inputs`` is built. Masks are in ``attn_bias``.
Every tensor is contiguous in its last dim, except that value may instead be keys-contiguous
(stride 1 along the sequence, other strides multiples of 16 bytes): a (B, Mk, Hkv, Kv) view of a
(B, Hkv, Kv, L >= Mk) tensor, the K-major operand fp8 PV products read (ops declare V_KEYS_CONTIGUOUS).

Quantized inputs carry float32 descales; out = attention(q * q_descale, k * k_descale, v * v_descale).
Descale kinds (``Problem.descales`` holds one per role):
  "none"    no descale (float inputs only)
  "tensor"  one value (numel 1)
  "head"    (B, Hkv): per batch and kv head (FA3 convention; q's descale is indexed by its kv head);
            with a varlen (BlockDiagonal) mask (num_sequences, Hkv)
  "block"   q: (B, Hq, cdiv(Mq, Q_SCALE_BLOCK)), k: (B, Hkv, cdiv(Mk, K_SCALE_BLOCK)) (i8fp8 per-block
            grids; both 128, see fmha_ops.quant)
  "channel" v only: (B, Hkv, Kv)
  "token"   k/v only: key.shape[:-1], one per cached token and kv head (fp8 KV cache)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from registry import Arch, current_arch

from . import attn_bias as ab
from .quant import K_SCALE_BLOCK, Q_SCALE_BLOCK  # noqa: F401  (re-exported for the descale shapes)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


_FP8_BACKWARD = [False]
SIG_NEEDS_GRAD = 0  # index of the needs-grad flag in Inputs.signature()


class set_fp8_dequantized_backward:
    """Let fp8 / i8fp8 forward calls be differentiated: the backward runs on the dequantized values
    (q * q_descale, ...) with a bf16 backward kernel. A switch (``set_fp8_dequantized_backward(True)``)
    and a context manager (``with set_fp8_dequantized_backward(True): ...`` restores the old value)."""

    def __init__(self, enabled: bool = True) -> None:
        self._previous = _FP8_BACKWARD[0]
        _FP8_BACKWARD[0] = bool(enabled)

    def __enter__(self) -> "set_fp8_dequantized_backward":
        return self

    def __exit__(self, *exc) -> None:
        _FP8_BACKWARD[0] = self._previous


def fp8_dequantized_backward_enabled() -> bool:
    return _FP8_BACKWARD[0]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


@dataclass(frozen=True)
class Problem:
    """Everything that decides which op can run a call and how fast: hashable, built once per signature."""

    arch: Arch
    q_dtype: torch.dtype
    k_dtype: torch.dtype
    v_dtype: torch.dtype
    out_dtype: torch.dtype
    batch: int  # sequences (varlen/decode: number of sequences)
    seqlen_q: int  # longest query sequence
    seqlen_k: int  # longest key sequence (decode: cache capacity per sequence)
    total_q: int  # query tokens in the call
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    bias: str  # attn_bias kind (attn_bias.*)
    q_uniform: bool  # every sequence has seqlen_q queries
    page_size: int  # 0 unless paged
    descales: tuple[str, str, str]  # (q, k, v) descale kinds
    quantize_kv: bool
    dropout: bool
    needs_lse: bool
    needs_grad: bool
    deterministic: bool
    graph_capture: bool
    fp8_backward: bool = False  # set_fp8_dequantized_backward is on
    v_keys_contiguous: bool = False  # value is keys-contiguous (see the module docstring)
    tma_misaligned: tuple[str, ...] = ()  # inputs a TMA descriptor cannot address (``tma_misaligned``)

    @property
    def causal(self) -> bool:
        return self.bias in ab.CAUSAL_KINDS

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def kv_fp8(self) -> bool:
        """The KV is (or becomes, with quantize_kv) fp8 while the query is not."""
        return self.quantize_kv or (self.k_dtype in FP8_DTYPES and self.q_dtype not in FP8_DTYPES + (torch.int8,))

    def bucket(self) -> str:
        """Tuning-table key: exact dtypes, head dims, mask, GQA, page size; sizes rounded to powers of 2."""
        return "|".join([
            "/".join(dtype_name(d) for d in (self.q_dtype, self.k_dtype, self.v_dtype)),
            f"d{self.head_dim}/{self.head_dim_v}", self.bias, f"g{self.gqa_ratio}", f"p{self.page_size}",
            f"qkv{int(self.quantize_kv)}", f"bh{_p2(self.batch * self.heads_kv)}", f"q{_p2(self.seqlen_q)}",
            f"k{_p2(self.seqlen_k)}", f"grad{int(self.needs_grad)}",
        ])

    def __str__(self) -> str:
        dts = "/".join(dtype_name(d) for d in (self.q_dtype, self.k_dtype, self.v_dtype))
        extra = [f"page={self.page_size}"] if self.page_size else []
        extra += [f"descale={'/'.join(self.descales)}"] if self.descales != ("none",) * 3 else []
        extra += ["quantize_kv"] if self.quantize_kv else []
        extra += ["lse"] if self.needs_lse else []
        extra += ["grad"] if self.needs_grad else []
        extra += ["dropout"] if self.dropout else []
        extra += ["graph"] if self.graph_capture else []
        return (f"{dts}->{dtype_name(self.out_dtype)} B={self.batch} Mq={self.seqlen_q} Mk={self.seqlen_k} "
                f"Hq={self.heads_q} Hkv={self.heads_kv} K={self.head_dim} Kv={self.head_dim_v} "
                f"bias={self.bias} " + " ".join(extra + [f"on {self.arch}"]))


def value_layout(v: torch.Tensor) -> Any:
    """"last" (contiguous in the head dim), "keys" (keys-contiguous, see the module docstring), or the
    strides of a layout that is neither."""
    if v.shape[-1] == 0 or v.stride(-1) == 1:
        return "last"
    if (v.stride(1) == 1 or v.shape[1] <= 1) and all(
            v.stride(d) * v.element_size() % 16 == 0 for d in (0, 2, 3)):
        return "keys"
    return v.stride()


def tma_misaligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[str, ...]:
    """Names of the non-empty inputs whose start address is not a multiple of 16 bytes (a TMA descriptor
    needs it; the signature holds the same test, ``_misaligned``)."""
    return tuple(name for name, t in (("query", q), ("key", k), ("value", v)) if t.numel() and t.data_ptr() % 16)


def _misaligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    return (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15


def _p2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@dataclass
class Inputs:
    """One call. Tensors are BMHK; see the module docstring for descale shapes."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_bias: ab.AttentionBias | None = None
    p: float = 0.0
    scale: float | None = None
    output_dtype: torch.dtype | None = None
    is_partial: bool = False
    q_descale: torch.Tensor | None = None
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    quantize_kv_to_fp8: bool = False

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.query.shape[-1])

    @property
    def bias_kind(self) -> str:
        return ab.NONE if self.attn_bias is None else self.attn_bias.KIND

    @property
    def out_dtype(self) -> torch.dtype:
        if self.output_dtype is not None:
            return self.output_dtype
        return self.query.dtype if self.query.dtype in FLOAT_DTYPES else torch.bfloat16

    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and (
            self.query.requires_grad or self.key.requires_grad or self.value.requires_grad)

    def signature(self) -> tuple:
        """Hashable key of everything validation and selection depend on (the memo key);
        element ``SIG_NEEDS_GRAD`` says whether autograd needs this call's gradients."""
        q, k, v = self.query, self.key, self.value
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        return (self.needs_grad(), q.dtype, k.dtype, v.dtype, q.shape, k.shape, v.shape, q.device, k.device,
                v.device, q.stride(-1), k.stride(-1), value_layout(v), _bias_signature(self.attn_bias),
                _misaligned(q, k, v), _tensor_signature(self.q_descale), _tensor_signature(self.k_descale),
                _tensor_signature(self.v_descale), self.p, self.scale, self.output_dtype, self.is_partial,
                self.quantize_kv_to_fp8, torch.are_deterministic_algorithms_enabled(), capturing, _FP8_BACKWARD[0])

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the argument, the value and what is supported."""
        q, k, v = self.query, self.key, self.value
        for name, t in (("query", q), ("key", k), ("value", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.ndim != 4:
                raise ValueError(f"{name} must be 4-D BMHK (batch, seqlen, heads, headdim), got shape {tuple(t.shape)}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but query is on {q.device}; all inputs must share a device")
            if t is not v and t.shape[-1] and t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got stride {t.stride(-1)}")
        if value_layout(v) not in ("last", "keys"):
            raise ValueError(f"value must be contiguous in its last dim (stride 1), or keys-contiguous (stride 1 "
                             f"along the sequence dim 1, other strides multiples of 16 bytes); got strides {v.stride()}")
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"key {tuple(k.shape)} and value {tuple(v.shape)} must agree in (batch, seqlen, heads)")
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"query batch {q.shape[0]} != key batch {k.shape[0]}")
        if q.shape[3] != k.shape[3]:
            raise ValueError(f"query head dim {q.shape[3]} != key head dim {k.shape[3]}")
        hq, hkv = q.shape[2], k.shape[2]
        if hkv == 0 or hq % hkv:
            raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) (GQA/MQA)")
        if q.shape[3] == 0 or v.shape[3] == 0:
            raise ValueError(f"head dims must be >= 1, got K={q.shape[3]}, Kv={v.shape[3]}")
        self._validate_dtypes()
        self._validate_descales()
        if not (0.0 <= self.p < 1.0):
            raise ValueError(f"p (dropout) must be in [0, 1), got {self.p}")
        if self.scale is not None and not math.isfinite(self.scale):
            raise ValueError(f"scale must be a finite float, got {self.scale}")
        if self.output_dtype is not None and self.output_dtype not in FLOAT_DTYPES:
            raise ValueError(f"output_dtype={self.output_dtype} not supported; use one of "
                             f"{', '.join(map(dtype_name, FLOAT_DTYPES))}")
        self._validate_bias()

    def _validate_dtypes(self) -> None:
        q, k, v = self.query.dtype, self.key.dtype, self.value.dtype
        combo = f"query/key/value dtypes {dtype_name(q)}/{dtype_name(k)}/{dtype_name(v)}"
        supported = ("supported: all float16, all bfloat16, all float32; all fp8 e4m3 (with descales); "
                     "int8 query/key + fp8 value (i8fp8, with descales); float16/bfloat16 query with an "
                     "fp8 KV cache (per-token or per-head descales)")
        if q in FLOAT_DTYPES:
            if k == q and v == q:
                ok = True
            else:
                ok = q != torch.float32 and k in FP8_DTYPES and v == k
        elif q in FP8_DTYPES:
            ok = k == q and v == q
        elif q == torch.int8:
            ok = k == torch.int8 and v in FP8_DTYPES
        else:
            ok = False
        if not ok:
            raise ValueError(f"{combo} not supported; {supported}")
        quantized = q not in FLOAT_DTYPES
        for role, d in (("q_descale", self.q_descale), ("k_descale", self.k_descale), ("v_descale", self.v_descale)):
            if quantized and d is None:
                raise ValueError(f"{role} is required when query is {dtype_name(q)} (float32 descales; pass "
                                 f"torch.ones(1) for unit scales)")
        if q in FLOAT_DTYPES and k in FP8_DTYPES and (self.k_descale is None or self.v_descale is None):
            raise ValueError(f"k_descale and v_descale are required for a {dtype_name(k)} KV cache")
        if q in FLOAT_DTYPES and k == q and (self.q_descale is not None or self.k_descale is not None
                                             or self.v_descale is not None):
            raise ValueError(f"descales are only for quantized inputs; query/key/value are {dtype_name(q)}")
        if self.quantize_kv_to_fp8 and not (q in (torch.float16, torch.bfloat16) and k == q):
            raise ValueError(f"quantize_kv_to_fp8=True needs float16/bfloat16 query, key and value; got {combo}")

    def _validate_descales(self) -> None:
        kinds = descale_kinds(self)  # raises on bad shapes
        for role, d in (("q_descale", self.q_descale), ("k_descale", self.k_descale), ("v_descale", self.v_descale)):
            if d is None:
                continue
            if d.dtype != torch.float32:
                raise ValueError(f"{role} must be float32, got {dtype_name(d.dtype)}")
            if d.device != self.query.device:
                raise ValueError(f"{role} is on {d.device} but query is on {self.query.device}")
        if self.bias_kind in ab.DECODE_KINDS and "head" in kinds:
            raise ValueError(f"per-(batch, head) descales are not supported with {type(self.attn_bias).__name__} "
                             f"(queries packed in batch 1); pass per-token k/v descales of shape key.shape[:3]")
        if kinds[1] == "token" and self.query.dtype not in FLOAT_DTYPES:
            raise ValueError("per-token k/v descales are only for a float16/bfloat16 query with an fp8 KV cache")

    def _validate_bias(self) -> None:
        bias = self.attn_bias
        q, k = self.query, self.key
        if bias is None or isinstance(bias, (ab.LowerTriangularMask, ab.LowerTriangularFromBottomRightMask)):
            return
        if q.shape[0] != 1:
            raise ValueError(f"attn_bias {type(bias).__name__} needs batch 1 (sequences packed along dim 1), "
                             f"got query batch {q.shape[0]}")
        nq = bias.q_seqinfo.seqstart_py[-1]
        if q.shape[1] != nq:
            raise ValueError(f"query has {q.shape[1]} tokens but attn_bias q_seqinfo covers {nq}")
        if isinstance(bias, ab.BlockDiagonalMask):
            if len(bias.k_seqinfo.seqstart_py) != len(bias.q_seqinfo.seqstart_py):
                raise ValueError(f"attn_bias has {len(bias.q_seqinfo.seqstart_py) - 1} query sequences but "
                                 f"{len(bias.k_seqinfo.seqstart_py) - 1} key sequences")
            nk = bias.k_seqinfo.seqstart_py[-1]
            if k.shape[1] != nk:
                raise ValueError(f"key has {k.shape[1]} tokens but attn_bias k_seqinfo covers {nk}")
            return
        nseq = len(bias.q_seqinfo.seqstart_py) - 1
        if bias.k_seqinfo.seqlen.shape != (nseq,):
            raise ValueError(f"attn_bias has {nseq} query sequences but k_seqinfo.seqlen has shape "
                             f"{tuple(bias.k_seqinfo.seqlen.shape)}")
        if isinstance(bias, ab.PagedBlockDiagonalPaddedKeysMask):
            if k.shape[1] % bias.page_size:
                raise ValueError(f"paged key has {k.shape[1]} rows, not a multiple of page_size={bias.page_size}")
            if bias.block_tables.dtype != torch.int32 or bias.block_tables.device != q.device:
                raise ValueError(f"block_tables must be int32 on {q.device}, got {dtype_name(bias.block_tables.dtype)} "
                                 f"on {bias.block_tables.device}")
        elif k.shape[1] != nseq * bias.k_seqinfo.padding:
            raise ValueError(f"key has {k.shape[1]} rows but attn_bias expects {nseq} sequences x "
                             f"kv_padding {bias.k_seqinfo.padding}")
        if bias.k_seqinfo.seqlen.device != q.device:
            raise ValueError(f"attn_bias k_seqinfo.seqlen is on {bias.k_seqinfo.seqlen.device}, query on {q.device}; "
                             f"create the mask with device=")

    # ---- problem ----------------------------------------------------------------------------
    def problem(self, needs_lse: bool = False) -> Problem:
        q, k, v = self.query, self.key, self.value
        bias = self.attn_bias
        b, mq, hq, d = q.shape
        mk = k.shape[1]
        q_uniform, page = True, 0
        if isinstance(bias, ab.BlockDiagonalMask):
            b = len(bias.q_seqinfo.seqstart_py) - 1
            mq, mk = bias.q_seqinfo.max_seqlen, bias.k_seqinfo.max_seqlen
            q_uniform = bias.q_seqinfo.min_seqlen == mq
        elif isinstance(bias, (ab.BlockDiagonalPaddedKeysMask, ab.PagedBlockDiagonalPaddedKeysMask)):
            b = len(bias.q_seqinfo.seqstart_py) - 1
            mq = bias.q_seqinfo.max_seqlen
            q_uniform = bias.q_seqinfo.min_seqlen == mq
            if isinstance(bias, ab.PagedBlockDiagonalPaddedKeysMask):
                page = bias.page_size
                mk = bias.block_tables.shape[1] * page
            else:
                mk = bias.k_seqinfo.padding
        return Problem(
            arch=current_arch(q.device), q_dtype=q.dtype, k_dtype=k.dtype, v_dtype=v.dtype, out_dtype=self.out_dtype,
            batch=b, seqlen_q=mq, seqlen_k=mk, total_q=q.shape[0] * q.shape[1], heads_q=hq, heads_kv=k.shape[2],
            head_dim=d, head_dim_v=v.shape[3], bias=self.bias_kind, q_uniform=q_uniform, page_size=page,
            descales=descale_kinds(self), quantize_kv=self.quantize_kv_to_fp8, dropout=self.p > 0.0,
            needs_lse=needs_lse or self.is_partial, needs_grad=self.needs_grad(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            graph_capture=q.is_cuda and torch.cuda.is_current_stream_capturing(), fp8_backward=_FP8_BACKWARD[0],
            v_keys_contiguous=value_layout(v) == "keys", tma_misaligned=tma_misaligned(q, k, v),
        )


def descale_kinds(inp: Inputs) -> tuple[str, str, str]:
    """The (q, k, v) descale kinds; raises ValueError on a shape that is none of them."""
    q, k, v = inp.query, inp.key, inp.value
    b, mq, hq, _ = q.shape
    mk, hkv = k.shape[1], k.shape[2]
    varlen = isinstance(inp.attn_bias, ab.BlockDiagonalMask)
    head = (len(inp.attn_bias.q_seqinfo.seqstart_py) - 1 if varlen else b, hkv)
    shapes = {
        "q_descale": (inp.q_descale, {"head": head, "block": (b, hq, -(-mq // Q_SCALE_BLOCK))}),
        "k_descale": (inp.k_descale, {"head": head, "block": (b, hkv, -(-mk // K_SCALE_BLOCK)),
                                      "token": tuple(k.shape[:3])}),
        "v_descale": (inp.v_descale, {"head": head, "channel": (b, hkv, v.shape[3]), "token": tuple(v.shape[:3])}),
    }
    kinds = []
    for role, (t, allowed) in shapes.items():
        if t is None:
            kinds.append("none")
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{role} must be a float32 tensor, got {type(t).__name__}")
        shape = tuple(t.shape)
        if t.numel() == 1:
            kinds.append("tensor")
            continue
        for kind, want in allowed.items():
            if shape == want:
                kinds.append(kind)
                break
        else:
            listed = ", ".join(f"{kind} {want}" for kind, want in allowed.items())
            raise ValueError(f"{role} has shape {shape}; supported: a scalar (numel 1), {listed}")
    return tuple(kinds)  # type: ignore[return-value]


def _tensor_signature(t: torch.Tensor | None) -> Any:
    return None if t is None else (t.dtype, t.shape, t.device)


def _bias_signature(bias: ab.AttentionBias | None) -> Any:
    if bias is None:
        return None
    sig = bias.__dict__.get("_fmha_sig")
    if sig is None:
        sig = (type(bias),)
        if isinstance(bias, (ab.BlockDiagonalMask, ab.BlockDiagonalPaddedKeysMask, ab.PagedBlockDiagonalPaddedKeysMask)):
            qi = bias.q_seqinfo
            sig += (len(qi.seqstart_py), qi.seqstart_py[-1], qi.max_seqlen, qi.min_seqlen)
        if isinstance(bias, ab.BlockDiagonalMask):
            sig += (bias.k_seqinfo.seqstart_py[-1], bias.k_seqinfo.max_seqlen)
        elif isinstance(bias, (ab.BlockDiagonalPaddedKeysMask, ab.PagedBlockDiagonalPaddedKeysMask)):
            sig += (bias.k_seqinfo.padding, bias.k_seqinfo.seqlen.device)
        if isinstance(bias, ab.PagedBlockDiagonalPaddedKeysMask):
            sig += (bias.page_size, bias.block_tables.shape, bias.block_tables.dtype, bias.block_tables.device)
        bias.__dict__["_fmha_sig"] = sig
    return sig
