"""FlashAttention-3 (Hopper) forward and backward ops, used when a FlashAttention-3 build is installed.

Two builds are found, the first importable one wins:

* ``flash_attn_interface`` (+ ``flash_attn_config``): upstream FlashAttention-3 built from its ``hopper/``
  directory: forward and backward, paged KV, local windows, fp16 (unless its build flags disable them);
* ``fa3_fwd_interface`` (+ ``fa3_fwd_config``): the ``fa3-fwd`` wheel (``pip install 'fmha-ops[fa3]'``), the same
  forward kernels prebuilt for sm90, without backward, paged KV, local windows or fp16.

Each build ships a config module whose ``CONFIG["build_flags"]`` says what it was compiled without
(``FLASHATTENTION_DISABLE_<FEATURE>``; fa3-fwd is forward-only whatever its config says, or without one); the ops
declare exactly that (``BUILD``), and a call needing a feature the build lacks is refused with the flag named. What
FA3 takes beyond that, on sm90:

==============  ============================================================================================
dtypes          bf16 (fp16 where built); fp8 e4m3 q/k/v with (B, Hkv) float32 descales (per-tensor ones are
                broadcast), bf16 out
head dims       K up to 256 (multiples of 8; fp8: of 16), rounded up to the kernel's 64/96/128/192/256;
                Kv != K where K is in 129..192 and Kv in 97..128 (DeepSeek-V3's 192/128), or bf16 with
                K <= 64 and Kv <= 512
masks           none; bottom-right causal (top-left causal where Mq == Mk); varlen ``BlockDiagonal``, non-causal
                or bottom-right causal; decode on a contiguous (padded keys) or paged cache with per-sequence
                lengths, uniform query lengths; local windows; softcap
GQA / LSE       yes / natural log (B, Hq, Mq) (varlen: (Hq, total))
==============  ============================================================================================

The forward returns the LSE, so a call that needs gradients pairs it with a selected backward op (``fa3B``
where the build has one). Not taken: dropout, dense tensor biases, gappy keys, per-token KV scales (the fp8-KV
decoders take those), bf16 queries over an fp8 cache, keys-contiguous values. FA3 reads device lengths and key
starts as given (it clamps neither, unlike our decoders' index guards): their values are checked on the host, or
on the device in check mode (``fmha_ops.checks``).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from typing import ClassVar, Mapping

import torch

from .. import attn_bias as ab
from ..dispatch import register
from ..inputs import Inputs
from ..problem import Problem
from .base import AttentionBwOp, AttentionFwOp
from .common import (OptionalPackage, decode_key_start, decode_outputs, decode_views, decode_window,
                     half_backward_operands, import_failure, kv_head_descales, varlen_args, window_fields, window_size)
from .cost import attention_time, backward_time, head_dim_rate

_BF16, _FP16, _FP8 = (torch.bfloat16,) * 3, (torch.float16,) * 3, (torch.float8_e4m3fn,) * 3
#: the head dims FA3 compiles kernels for; a call's K is rounded up to the next one the build has
KERNEL_HEAD_DIMS = (64, 96, 128, 192, 256)
#: Kv != K pairs FA3 has kernels for: K in (128, 192] with Kv in (96, 128], and (bf16) K <= 64 with Kv <= 512
WIDE_K, WIDE_K_V = (128, 192), (96, 128)
NARROW_K, NARROW_K_MAX_V = 64, 512
_DENSE = frozenset({ab.NONE, ab.CAUSAL, ab.CAUSAL_BR})
_VARLEN = frozenset({ab.BLOCK_DIAGONAL, ab.BLOCK_DIAGONAL_CAUSAL_BR})
_PADDED = frozenset({ab.PADDED_KEYS, ab.PADDED_KEYS_CAUSAL})
_PAGED = frozenset({ab.PAGED, ab.PAGED_CAUSAL})
#: key splits of a prefill call: none, as FA3's flash_attn_func (its split heuristic is for KV-cache decode)
PREFILL_SPLITS = 1


@dataclasses.dataclass(frozen=True)
class FA3Build:
    """The FlashAttention-3 build found in this environment (nothing imported but its pure-Python config).

    ``module``: the interface module (None: none installed), ``package``: what installs it, ``flags``: the
    config's ``build_flags`` (``FLASHATTENTION_DISABLE_<FEATURE>`` -> bool; empty: a build without a config,
    taken as upstream's default, everything built).

    Example
    -------
    >>> FA3Build("fa3_fwd_interface", "fa3-fwd", {"FLASHATTENTION_DISABLE_BACKWARD": True}).has("BACKWARD")
    False
    """

    module: str | None
    package: str
    flags: Mapping[str, bool]

    def has(self, feature: str) -> bool:
        """Whether the build was compiled with ``feature`` (a ``FLASHATTENTION_DISABLE_<feature>`` flag unset)."""
        return not self.flags.get(f"FLASHATTENTION_DISABLE_{feature}", False)

    def missing(self, feature: str, what: str) -> list[str]:
        """A reason naming ``what`` and the flag when the build lacks ``feature``, else none."""
        if self.has(feature):
            return []
        return [f"{what} not supported by this FlashAttention-3 build ({self.package}: "
                f"FLASHATTENTION_DISABLE_{feature})"]

    @property
    def max_head_dim(self) -> int:
        dims = [d for d in KERNEL_HEAD_DIMS if self.has(f"HDIM{d}")]
        return max(dims, default=0)


#: what the fa3-fwd wheel is built without whatever its config says (or when it ships none): it is forward-only
FA3_FWD_FLAGS = {"FLASHATTENTION_DISABLE_BACKWARD": True}
#: (interface module, config module, what installs it, flags its config cannot unset), the first one found wins
BUILDS = (("flash_attn_interface", "flash_attn_config", "FlashAttention-3 built from flash-attention's hopper/", {}),
          ("fa3_fwd_interface", "fa3_fwd_config", "fa3-fwd", FA3_FWD_FLAGS))


def find_build() -> FA3Build:
    """The installed FlashAttention-3 build (``BUILDS`` order), or ``FA3Build(None, ...)`` when none is."""
    for module, config, package, fixed in BUILDS:
        if importlib.util.find_spec(module) is None:
            continue
        flags: dict[str, bool] = {}
        if importlib.util.find_spec(config) is not None:
            flags = dict(importlib.import_module(config).CONFIG.get("build_flags", {}))
        return FA3Build(module, package, flags | fixed)
    return FA3Build(None, "fa3-fwd", {})


BUILD = find_build()


def fa3_package_reason() -> str | None:
    """None when a FlashAttention-3 build is installed, else why not (no import, no GPU needed)."""
    if BUILD.module is not None:
        return None
    return ("FlashAttention-3 is not installed (pip install 'fmha-ops[fa3]' for the fa3-fwd forward build, or build "
            "flash-attention's hopper/ for flash_attn_interface)")


#: the keyword arguments of FA3's C++ forward this adapter passes (checked against the installed op's schema)
FWD_ARGUMENTS = frozenset({"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k",
                           "page_table", "kv_batch_idx", "leftpad_k", "q_descale", "k_descale", "v_descale",
                           "softmax_scale", "is_causal", "window_size_left", "window_size_right", "softcap",
                           "num_splits"})


@functools.lru_cache(maxsize=1)
def interface():
    """The imported FA3 interface module (loads its CUDA extension)."""
    return importlib.import_module(BUILD.module)


@functools.lru_cache(maxsize=1)
def forward_kernel():
    """FA3's C++ forward, ``torch.ops.<its namespace>.fwd``, called directly with keywords: the interface's Python
    custom op around it cost 104 us of host time per call on the H200's host (bench/diagnostics/fa3_adapter.py),
    more than the kernel of an 8x1000 call."""
    module = interface()
    namespace = getattr(module, "fa3_fwd_cuda", None) or getattr(module, "flash_attn_3_cuda")
    return namespace.fwd


def fa3_import_reason() -> str | None:
    failed = import_failure(BUILD.module)
    if failed:
        return failed
    names = {a.name for a in forward_kernel().default._schema.arguments}
    if not FWD_ARGUMENTS <= names:
        return (f"the installed FlashAttention-3 forward takes no {sorted(FWD_ARGUMENTS - names)} (this adapter calls "
                f"the fwd op of fa3-fwd 0.0.3 / FlashAttention-3 3.0)")
    return None


def head_dim_reasons(p: Problem) -> list[str]:
    """FA3's head-dim rules beyond the declared ranges: the build's largest kernel, fp8's 16-byte rows, and the
    Kv != K pairs it has kernels for."""
    r = []
    k, kv = p.head_dim, p.head_dim_v
    if k > BUILD.max_head_dim:
        r.append(f"head dim K={k} above this build's largest kernel ({BUILD.max_head_dim})")
    if p.q_dtype == torch.float8_e4m3fn and (k % 16 or kv % 16):
        r.append(f"fp8 head dims K={k}, Kv={kv} must be multiples of 16")
    if kv != k:
        wide = WIDE_K[0] < k <= WIDE_K[1] and WIDE_K_V[0] < kv <= WIDE_K_V[1]
        narrow = k <= NARROW_K and kv <= NARROW_K_MAX_V and p.q_dtype == torch.bfloat16
        if not (wide or narrow):
            r.append(f"value head dim Kv={kv} with K={k} not supported; supported: K in {WIDE_K[0] + 1}..{WIDE_K[1]} "
                     f"with Kv in {WIDE_K_V[0] + 1}..{WIDE_K_V[1]}, or bf16 K <= {NARROW_K} with "
                     f"Kv <= {NARROW_K_MAX_V}")
        elif not BUILD.has("HDIMDIFF192" if wide else "HDIMDIFF64"):
            r.append(f"Kv={kv} != K={k} not supported by this FlashAttention-3 build ({BUILD.package})")
    return r


def mask_reasons(p: Problem) -> list[str]:
    """Masks FA3 cannot express beyond its declared kinds: top-left causal with Mq != Mk (FA3's causal is
    bottom-right), and ragged query lengths over a KV cache."""
    r = []
    if p.bias == ab.CAUSAL and p.seqlen_q != p.seqlen_k:
        r.append(f"top-left causal with Mq={p.seqlen_q} != Mk={p.seqlen_k} not supported "
                 f"(FA3's causal mask is bottom-right aligned)")
    if p.bias in _PADDED | _PAGED and not p.q_uniform:
        r.append("query sequences of different lengths over a KV cache not supported (uniform lengths only)")
    return r


def one_page_per_sequence(p: Problem) -> bool:
    """A paged mask whose pages are whole cache rows (a contiguous cache indexed per sequence, as
    ``flash_attn_with_kvcache`` lays out a dense cache): FA3's dense KV-cache path with ``kv_batch_idx`` takes it."""
    return p.page_size == p.seqlen_k


def build_reasons(p: Problem) -> list[str]:
    """Features of the call the installed build was compiled without."""
    r = []
    if p.bias in _PAGED and not one_page_per_sequence(p):
        r += BUILD.missing("PAGEDKV", "a paged KV cache (pages shorter than the cache)")
    if p.bias in _VARLEN:
        r += BUILD.missing("VARLEN", "variable-length sequences")
    if p.windowed:
        r += BUILD.missing("LOCAL", "local attention windows")
    if p.softcap:
        r += BUILD.missing("SOFTCAP", "softcap")
    if p.q_dtype == torch.float16:
        r += BUILD.missing("FP16", "float16")
    if p.q_dtype == torch.float8_e4m3fn:
        r += BUILD.missing("FP8", "fp8")
    return r


def _built(features: Mapping[str, frozenset], default: frozenset = frozenset()) -> frozenset:
    """``default`` joined with the values of every feature the build has."""
    out = default
    for feature, values in features.items():
        if BUILD.has(feature):
            out = out | values
    return out


class _FA3Op(OptionalPackage):
    """Declarations shared by the forward and backward ops (read off ``BUILD``)."""

    ARCHS = ("cuda>=9.0,<10.0",)
    DTYPES = _built({"FP16": frozenset({_FP16}), "FP8": frozenset({_FP8})}, frozenset({_BF16}))
    HEAD_DIMS = range(8, 257, 8)
    HEAD_DIMS_V = range(8, NARROW_K_MAX_V + 1, 8)
    GQA = True
    PARTIAL = True
    SOFTCAP = BUILD.has("SOFTCAP")
    WINDOW = BUILD.has("LOCAL")
    DESCALES = {r: frozenset({"none", "tensor", "head"}) for r in "qkv"}
    CUDA_GRAPH = True
    #: FA3 loads q / k / v through TMA descriptors (16-byte aligned starts and strides)
    ALIGNMENT = "TMA descriptors (FlashAttention-3)"
    package_reason = staticmethod(fa3_package_reason)
    import_reason = staticmethod(fa3_import_reason)


@register
class FA3FwOp(_FA3Op, AttentionFwOp):
    """FlashAttention-3 forward: bf16 (fp16) and fp8 with (B, Hkv) descales, dense, varlen and KV-cache decode."""

    NAME = "fa3F"
    OUT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})  # FA3 writes bf16 for fp8; cast
    BIAS_KINDS = _DENSE | _PADDED | _PAGED | _built({"VARLEN": _VARLEN})
    #: any page size with a paged build; without one, pages as long as the cache (``one_page_per_sequence``)
    PAGE_SIZES = range(1, 1 << 24)
    #: ``leftpad_k``: sequence b's keys are slots [start, length) of its row, the causal mask aligned to the length
    KEY_START = True
    #: achieved TFLOP/s on the H200 at 8192 tokens by (dtype family, causal) and head dim (the tuning grid's fa3F
    #: rows, medians over GQA 1 and 4); shorter calls pay ``LATENCY_US`` and, causal, the diagonal tiles' waste
    RATES: ClassVar[dict[tuple[str, bool], dict[int, float]]] = {
        ("bf16", False): {64: 527.0, 128: 674.0, 256: 725.0}, ("bf16", True): {64: 515.0, 128: 645.0, 256: 680.0},
        ("fp8", False): {64: 625.0, 128: 930.0, 256: 1145.0}, ("fp8", True): {64: 600.0, 128: 880.0, 256: 1105.0}}
    #: fixed time of a call on the device (launch, prologue, the last wave's tail): the grid's 512- and 2048-token
    #: rows sit ~20 us above their work at the 8192-token rates
    LATENCY_US = 20.0
    #: the key tile of FA3's causal kernels: a causal call computes (1 + CAUSAL_TILE / Mk) x its visible half
    CAUSAL_TILE = 128
    #: achieved TB/s of its KV-cache (decode) calls
    TBPS = 3.5
    #: the interface's custom op and the C++ argument checks, per call
    HOST_US = 35.0

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        return head_dim_reasons(p) + mask_reasons(p) + build_reasons(p)

    @classmethod
    def apply(cls, inp: Inputs, needs_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        kind = inp.bias_kind
        if kind in _PADDED | _PAGED:
            return _decode(inp, needs_lse)
        causal, (left, right) = window_size(kind, *window_fields(inp))
        kwargs = dict(softmax_scale=inp.softmax_scale, is_causal=causal,
                      window_size_left=-1 if left is None else left, window_size_right=-1 if right is None else right,
                      softcap=inp.softcap, num_splits=PREFILL_SPLITS, **kv_head_descales(inp))
        fwd = forward_kernel()
        if kind in _VARLEN:
            out, lse = fwd(q=inp.query[0], k=inp.key[0], v=inp.value[0], **varlen_args(inp), **kwargs)[:2]
            out, lse = out[None], lse[None]
        else:
            out, lse = fwd(q=inp.query, k=inp.key, v=inp.value, **kwargs)[:2]
        if out.dtype != inp.out_dtype:
            out = out.to(inp.out_dtype)
        return out, (lse if needs_lse else None)

    @classmethod
    def launcher(cls, inp: Inputs, needs_lse: bool):
        """The launch plan of dense and varlen calls laid out like ``inp`` (``AttentionFwOp.launcher``'s contract):
        FA3's forward with the layout's keywords bound once (``_bound_forward``), per call only the tensors and the
        descales; a varlen call's is ``varlen_launcher``'s on the batch-1 views. Decode masks: ``apply``'s plan
        (``decode_launcher`` is their fast path)."""
        kind = inp.bias_kind
        if kind in _PADDED | _PAGED:
            return super().launcher(inp, needs_lse)
        if kind in _VARLEN:
            packed = cls.varlen_launcher(inp, needs_lse)

            def run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks=None):
                out, lse = packed(query[0], key[0], value[0], attn_bias, q_descale, k_descale, v_descale)
                return out[None], (lse[None] if needs_lse else None)
            return run
        fwd, descales, out_dtype = _bound_forward(inp)
        if descales is None:
            def run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks=None):
                out, lse = fwd(q=query, k=key, v=value)[:2]
                return (out if out.dtype == out_dtype else out.to(out_dtype)), (lse if needs_lse else None)
            return run

        def run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks=None):
            out, lse = fwd(q=query, k=key, v=value, **descales(q_descale, k_descale, v_descale, attn_bias))[:2]
            return (out if out.dtype == out_dtype else out.to(out_dtype)), (lse if needs_lse else None)
        return run

    @classmethod
    def varlen_launcher(cls, inp: Inputs, needs_lse: bool):
        """FA3's varlen forward on the packed tensors (``AttentionFwOp.varlen_launcher``'s contract), its keywords
        bound once (``_bound_forward``); per call the tensors, the mask's starts and longest sequences and the
        descales."""
        fwd, descales, out_dtype = _bound_forward(inp)

        def run(query, key, value, attn_bias, q_descale, k_descale, v_descale, sinks=None):
            q_info, k_info = attn_bias.q_seqinfo, attn_bias.k_seqinfo
            out, lse = fwd(q=query, k=key, v=value, cu_seqlens_q=q_info.seqstart, cu_seqlens_k=k_info.seqstart,
                           max_seqlen_q=q_info.max_seqlen, max_seqlen_k=k_info.max_seqlen,
                           **({} if descales is None else descales(q_descale, k_descale, v_descale, attn_bias)))[:2]
            return (out if out.dtype == out_dtype else out.to(out_dtype)), (lse if needs_lse else None)
        return run

    @classmethod
    def decode_launcher(cls, inp: Inputs, needs_lse: bool, own_workspace: bool = True):
        """``launch(q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table, out, lse, seqlen_offset=0,
        sinks=None, key_start=None)`` for decode calls like ``inp`` (``fmha_ops.decode_plan``, the
        ``flash_attn_with_kvcache`` fast path): FA3's KV-cache forward on q (B, Mq, Hq, D) and the caches as
        ``decode_views`` lays them out, at lengths ``seqlens + seqlen_offset`` (added on the device) from the key
        starts ``key_start`` (int32 (B,), FA3's ``leftpad_k``; None: 0), its output copied into ``out`` and, when
        given, ``lse``.
        FA3 sizes its own splits and workspace per call (``own_workspace`` is not needed); k/v scales and sinks are
        None (the op takes no per-token scales, and declares no sinks: the selector never gives it a call with
        them)."""
        kwargs = _decode_kwargs(inp)
        whole_rows = _whole_rows(inp)
        fwd = forward_kernel()

        def launch(q, k_cache, v_cache, k_scale, v_scale, seqlens, table, out, lse, seqlen_offset=0, sinks=None,
                   key_start=None):
            if seqlen_offset:
                seqlens = seqlens + seqlen_offset
            o, row_lse = fwd(q=q, k=k_cache, v=v_cache, seqused_k=seqlens, leftpad_k=key_start,
                             **_cache_index(table, whole_rows), **kwargs)[:2]
            out.copy_(o.view(out.shape))
            if lse is not None:
                lse.copy_(row_lse)
        return launch

    @classmethod
    def estimate(cls, p: Problem) -> float:
        family = "fp8" if p.q_dtype == torch.float8_e4m3fn else "bf16"
        tflops = head_dim_rate(cls.RATES[family, p.causal], max(p.head_dim, p.head_dim_v))
        if p.causal:
            tflops /= 1.0 + cls.CAUSAL_TILE / max(p.seqlen_k, 1)
        return attention_time(p, tflops, cls.TBPS, cls.LATENCY_US)


def _bound_forward(inp: Inputs):
    """(fwd, descales, out dtype) of dense and varlen calls laid out like ``inp``: FA3's forward with the layout's
    keywords bound (scale, causal, window, softcap, splits), and ``descales(q_descale, k_descale, v_descale, mask)``
    -> its descale keywords, as ``kv_head_descales`` makes them (None for a call without descales). Which descale
    is per tensor, and so broadcast to (sequences, Hkv), is fixed by the plan key's shapes (``_descale_views``)."""
    causal, (left, right) = window_size(inp.bias_kind, *window_fields(inp))
    fwd = functools.partial(forward_kernel(), softmax_scale=inp.softmax_scale, is_causal=causal,
                            window_size_left=-1 if left is None else left,
                            window_size_right=-1 if right is None else right, softcap=inp.softcap,
                            num_splits=PREFILL_SPLITS)
    flat, given = _descale_views(inp)
    if not given:
        return fwd, None, inp.out_dtype
    kv_heads, batch, varlen = inp.key.shape[2], inp.query.shape[0], inp.bias_kind in _VARLEN
    q_flat, k_flat, v_flat = flat

    def descales(q_descale, k_descale, v_descale, bias) -> dict:
        shape = (len(bias.q_seqinfo.seqstart_py) - 1 if varlen else batch, kv_heads)
        return dict(q_descale=q_descale if q_flat is None else q_descale.expand(shape) if q_flat else
                    q_descale.reshape(()).expand(shape),
                    k_descale=k_descale if k_flat is None else k_descale.expand(shape) if k_flat else
                    k_descale.reshape(()).expand(shape),
                    v_descale=v_descale if v_flat is None else v_descale.expand(shape) if v_flat else
                    v_descale.reshape(()).expand(shape))
    return fwd, descales, inp.out_dtype


def _descale_views(inp: Inputs) -> tuple[tuple[bool | None, ...], bool]:
    """How ``FA3FwOp.launcher`` hands FA3 a call's descales: per descale None (a (sequences, Hkv) one, as given), True
    (a per-tensor one of at most 2 dims: ``expand`` alone) or False (a per-tensor one of more dims: ``reshape(())``
    first), and whether the call has descales (``kv_head_descales``: none without a q descale)."""
    descales = (inp.q_descale, inp.k_descale, inp.v_descale)
    if inp.q_descale is None:
        return (None,) * 3, False
    return tuple(None if d.numel() != 1 else d.ndim <= 2 for d in descales), True


def _decode(inp: Inputs, needs_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode-mask call through FA3's KV-cache path: per-sequence lengths (``seqused_k``) and key starts
    (``leftpad_k``), the page table."""
    q, k_cache, v_cache, seqlens, block_table, _, _ = decode_views(inp)
    out, lse = forward_kernel()(q=q, k=k_cache, v=v_cache, seqused_k=seqlens, leftpad_k=decode_key_start(inp),
                                **_cache_index(block_table, _whole_rows(inp)),
                                **_decode_kwargs(inp), **kv_head_descales(inp))[:2]
    if out.dtype != inp.out_dtype:
        out = out.to(inp.out_dtype)
    return decode_outputs(inp, q, out, lse, needs_lse)


def _decode_kwargs(inp: Inputs) -> dict:
    """FA3's KV-cache keywords of a decode-mask call: causal (bottom-right per sequence), the window's left bound,
    softcap, and FA3's own split heuristic (``num_splits=0``, as its ``flash_attn_with_kvcache``)."""
    return dict(softmax_scale=inp.softmax_scale, is_causal=inp.bias_kind in ab.CAUSAL_KINDS,
                window_size_left=decode_window(inp), softcap=inp.softcap, num_splits=0)


def _whole_rows(inp: Inputs) -> bool:
    """A paged call with one page per sequence (``one_page_per_sequence``): its pages are cache rows."""
    bias = inp.attn_bias
    return inp.bias_kind in _PAGED and bias.page_size == bias.k_seqinfo.padding


def _cache_index(block_table: torch.Tensor | None, whole_rows: bool) -> dict:
    """How FA3 finds each sequence's keys: a page table, or (pages as long as the cache) the cache row of each
    sequence (``kv_batch_idx``, int32 (B,))."""
    if block_table is None:
        return {}
    if whole_rows:
        return {"kv_batch_idx": block_table[:, 0]}
    return {"page_table": block_table}


@register
class FA3BwOp(_FA3Op, AttentionBwOp):
    """FlashAttention-3 backward (builds with a backward: upstream's ``flash_attn_interface``) on bf16/fp16 values,
    given any forward's output and natural-log LSE; fp8 forward inputs are differentiated at their dequantized
    values (cast to bf16) under ``set_fp8_dequantized_backward(True)``."""

    NAME = "fa3B"
    OUT_DTYPES = FA3FwOp.OUT_DTYPES
    HEAD_DIMS_V = None  # the backward is declared for Kv == K only
    BIAS_KINDS = _DENSE | _built({"VARLEN": _VARLEN})
    #: achieved TFLOP/s of the backward's work by head dim (FA3's paper on the H100: ~450-550 bf16)
    RATES: ClassVar[dict[int, float]] = {64: 450.0, 128: 520.0, 256: 400.0}
    TBPS, OVERHEAD_US = 2.5, 30.0
    HOST_US = 45.0

    @classmethod
    def available(cls) -> str | None:
        if BUILD.module is not None and not BUILD.has("BACKWARD"):
            return f"this FlashAttention-3 build ({BUILD.package}) has no backward (FLASHATTENTION_DISABLE_BACKWARD)"
        return super().available()

    @classmethod
    def extra_reasons(cls, p: Problem) -> list[str]:
        return [r for r in head_dim_reasons(p) if not r.startswith("fp8")] + mask_reasons(p) + build_reasons(p)

    @classmethod
    def apply_bw(cls, inp: Inputs, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, out, grad_out = half_backward_operands(inp, out, grad_out)
        causal, (left, right) = window_size(inp.bias_kind, *window_fields(inp))
        varlen = inp.bias_kind in _VARLEN
        if varlen:
            q, k, v, out, grad_out, lse = q[0], k[0], v[0], out[0], grad_out[0], lse[0]
            seq = varlen_args(inp)
            lens = (seq["cu_seqlens_q"], seq["cu_seqlens_k"], None, None, seq["max_seqlen_q"], seq["max_seqlen_k"])
        else:
            lens = (None,) * 6
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        interface()._flash_attn_backward(grad_out, q, k, v, out, lse, *lens, dq, dk, dv, inp.softmax_scale, causal,
                                         -1 if left is None else left, -1 if right is None else right, inp.softcap,
                                         torch.are_deterministic_algorithms_enabled())
        if varlen:
            return dq[None], dk[None], dv[None]
        return dq, dk, dv

    @classmethod
    def estimate(cls, p: Problem) -> float:
        return backward_time(p, cls.RATES, cls.TBPS, cls.OVERHEAD_US)
