"""Cases for flash_attn_with_kvcache (dense, cache_batch_idx, paged, appends, fp8 caches) and the
fmha_ops.kv_cache builders."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

import fmha_ops
from fmha_ops import kv_cache

from . import reference as ref
from .common import (BAD_FLOATS, F8, TOLERANCE, Change, call_body, edit_arg, first, grow, mismatch, names, rnd, set_args,
                     tensor_kind_errors)
from .runner import Case

PAGES, PAGE, HKV, D = 5, 4, 2, 16




def _i32(*v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32)


def _make(layout: str, append: bool, fp8: bool = False, causal: bool = False, lse: bool = False):
    """A valid call: layout "dense", "batch_idx" or "paged"; ``append`` passes 2 new tokens per sequence."""
    def make():
        mq = 2 if append else 1
        kw: dict = dict(q=rnd(2, mq, 4, D), causal=causal or append, return_softmax_lse=lse)
        if layout == "paged":
            shape, kw["page_table"] = (PAGES, PAGE, HKV, D), _i32([3, 1], [0, 4])
            kw["cache_seqlens"] = _i32(5, 3) if append else _i32(6, 3)
        else:
            shape = (3 if layout == "batch_idx" else 2, 8, HKV, D)
            kw["cache_seqlens"] = _i32(5, 3)
            if layout == "batch_idx":
                kw["cache_batch_idx"] = _i32(2, 0)
        if fp8:
            k8, v8, ks, vs = kv_cache.quantize_kv_fp8(rnd(*shape, dtype=torch.float32), rnd(*shape, dtype=torch.float32))
            kw.update(k_cache=k8, v_cache=v8, k_descale=ks, v_descale=vs)
        else:
            kw.update(k_cache=rnd(*shape), v_cache=rnd(*shape))
        if append:
            kw.update(k=rnd(2, 2, HKV, D), v=rnd(2, 2, HKV, D))
        return kw
    return make


def _cache_rows(kw: dict, cache: torch.Tensor, scale: torch.Tensor | None, b: int, n: int) -> torch.Tensor:
    x = cache.double() if scale is None else cache.double() * scale.double()[..., None]
    return ref.sequence_keys(x, b, n, kw.get("page_table"), kw.get("cache_batch_idx"))


def _check(kw: dict, before: dict) -> Callable[[Any], str | None]:
    """Output against float64 attention over the cache (appended tokens included), and the cache written
    exactly at the appended positions."""
    def check(res):
        outs, lses = [], []
        append = kw.get("k") is not None
        seqlens = kw["cache_seqlens"].tolist() if isinstance(kw["cache_seqlens"], torch.Tensor) else [kw["cache_seqlens"]] * 2
        scale = kw.get("softmax_scale")
        scale = 1 / math.sqrt(D) if scale is None else float(scale)
        for b in range(kw["q"].shape[0]):
            n = seqlens[b]
            k = _cache_rows(before, before["k_cache"], before.get("k_descale"), b, n)
            v = _cache_rows(before, before["v_cache"], before.get("v_descale"), b, n)
            if append:
                k, v = torch.cat([k, kw["k"][b].double()]), torch.cat([v, kw["v"][b].double()])
            o, l = ref.attend(kw["q"][b], k, v, scale, "bottom_right" if kw.get("causal") else None)
            outs.append(o)
            lses.append(l)
        out, lse = torch.stack(outs), torch.stack(lses)
        tol = TOLERANCE[F8 if kw["k_cache"].dtype == F8 else torch.float16]
        if kw.get("return_softmax_lse"):
            if not isinstance(res, tuple) or len(res) != 2:
                return f"return_softmax_lse=True returned {type(res).__name__}"
            bad = first(mismatch(res[0], out, kw["q"].dtype, tol), mismatch(res[1], lse, torch.float32, 4 * tol, "lse"))
        else:
            bad = mismatch(res, out, kw["q"].dtype, tol)
        return bad or (_written(kw, before, seqlens) if append else _unchanged(kw, before))
    return check


def _unchanged(kw: dict, before: dict) -> str | None:
    for name in ("k_cache", "v_cache"):
        if not torch.equal(kw[name].view(torch.uint8), before[name].view(torch.uint8)):
            return f"{name} was modified by a call without k/v"
    return None


def _written(kw: dict, before: dict, seqlens: list[int]) -> str | None:
    """The new tokens landed at cache_seqlens[b]..+Mnew of sequence b and nothing else changed."""
    for name, new, sname in (("k_cache", kw["k"], "k_descale"), ("v_cache", kw["v"], "v_descale")):
        cache, old = kw[name], before[name]
        touched = torch.zeros(cache.shape[:2], dtype=torch.bool)
        for b in range(new.shape[0]):
            for t in range(new.shape[1]):
                pos = seqlens[b] + t
                if "page_table" in kw and kw["page_table"] is not None:
                    row = (int(kw["page_table"][b, pos // cache.shape[1]]), pos % cache.shape[1])
                else:
                    row = (int(kw["cache_batch_idx"][b]) if kw.get("cache_batch_idx") is not None else b, pos)
                touched[row] = True
                got = cache[row].double() * (kw[sname][row].double()[..., None] if kw.get(sname) is not None else 1.0)
                bad = mismatch(got, new[b, t].double(), None, TOLERANCE[F8] if cache.dtype == F8 else 1e-3,
                               f"{name} appended row")
                if bad:
                    return bad
        if not torch.equal(cache.view(torch.uint8)[~touched], old.view(torch.uint8)[~touched]):
            return f"{name} changed outside the appended positions"
    return None


LENIENT = ("v_cache/headdim-8",)  # Kv != K is attention too (the reference op runs it)


def _body(make, change=None, lenient=False):
    def body():
        kw = make() if change is None else change(make())
        before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        res = fmha_ops.flash_attn_with_kvcache(**kw)
        return res, (_check(kw, before) if lenient else None)
    return body


BASES = {
    "dense": _make("dense", False), "dense_lse": _make("dense", False, lse=True),
    "batch_idx": _make("batch_idx", False), "paged_causal": _make("paged", False, causal=True),
    "dense_append": _make("dense", True), "paged_append_lse": _make("paged", True, lse=True),
    "fp8_paged": _make("paged", False, fp8=True), "fp8_paged_append": _make("paged", True, fp8=True),
    "fp8_dense_append": _make("dense", True, fp8=True),
}


def _poke(d: torch.Tensor, value: float) -> torch.Tensor:
    """A copy of ``d`` (same strides) with entry [0, 0, 0] (a key every base attends) set to ``value``."""
    out = d.clone()
    out[0, 0, 0] = value
    return out


def _variants(b: str) -> list[tuple[str, tuple[str, ...], Change]]:
    paged, append, fp8 = "paged" in b, "append" in b, "fp8" in b
    v: list[tuple[str, tuple[str, ...], Change]] = []
    for role in ("q", "k_cache", "v_cache") + (("k", "v") if append else ()):
        for label, f in tensor_kind_errors():
            if role in ("k", "v") and label == "None":
                continue  # k and v are optional together (k alone is covered below)
            if fp8 and role in ("k_cache", "v_cache") and label in ("list",):
                continue
            nm = (role, "k_cache", "v_cache", "q", "k", "v") if label.startswith("ndim") else names(role)
            v.append((f"{role}/{label}", nm, edit_arg(role, f)))
        hd = 1 if role == "q" else 2
        v += [(f"{role}/heads+1", (role, "q", "k_cache", "v_cache", "k", "v"), edit_arg(role, lambda t: grow(t.float(), hd).to(t.dtype))),
              (f"{role}/headdim-8", (role, "q", "k_cache", "v_cache", "k", "v"), edit_arg(role, lambda t: t[..., :8].contiguous()))]
    v += [("v_cache/rows+1", ("v_cache", "k_cache"), edit_arg("v_cache", lambda t: grow(t.float(), 0).to(t.dtype))),
          ("q/batch+1", ("q", "cache_seqlens", "page_table", "k_cache", "cache_batch_idx"), edit_arg("q", lambda t: grow(t, 0)))]
    cap = 8
    v += [("cache_seqlens/beyond", ("cache_seqlens",), set_args(cache_seqlens=_i32(4, 4000))),
          ("cache_seqlens/capacity+1", ("cache_seqlens",), set_args(cache_seqlens=_i32(cap + 1, 3))),
          ("cache_seqlens/negative", ("cache_seqlens",), set_args(cache_seqlens=_i32(-1, 3))),
          ("cache_seqlens/int_beyond", ("cache_seqlens",), set_args(cache_seqlens=100)),
          ("cache_seqlens/int_negative", ("cache_seqlens",), set_args(cache_seqlens=-1)),
          ("cache_seqlens/int64", ("cache_seqlens",), edit_arg("cache_seqlens", lambda t: t.long())),
          ("cache_seqlens/float", ("cache_seqlens",), edit_arg("cache_seqlens", lambda t: t.float())),
          ("cache_seqlens/shape3", ("cache_seqlens",), set_args(cache_seqlens=_i32(1, 2, 3))),
          ("cache_seqlens/2d", ("cache_seqlens",), edit_arg("cache_seqlens", lambda t: t[None])),
          ("cache_seqlens/None", ("cache_seqlens",), set_args(cache_seqlens=None)),
          ("cache_seqlens/str", ("cache_seqlens",), set_args(cache_seqlens="5")),
          ("cache_seqlens/meta", ("cache_seqlens",), edit_arg("cache_seqlens", lambda t: t.to("meta")))]
    if paged:
        v += [("page_table/entry=num_pages", ("page_table",), set_args(page_table=_i32([3, PAGES], [0, 4]))),
              ("page_table/entry=-1", ("page_table",), set_args(page_table=_i32([3, -1], [0, 4]))),
              ("page_table/1d", ("page_table",), edit_arg("page_table", lambda t: t[0])),
              ("page_table/int64", ("page_table",), edit_arg("page_table", lambda t: t.long())),
              ("page_table/rows3", ("page_table",), edit_arg("page_table", lambda t: torch.cat([t, t[:1]]))),
              ("page_table/float", ("page_table",), edit_arg("page_table", lambda t: t.float())),
              ("page_table/meta", ("page_table",), edit_arg("page_table", lambda t: t.to("meta"))),
              ("page_table/list", ("page_table",), edit_arg("page_table", lambda t: t.tolist())),
              ("page_table+cache_batch_idx", ("cache_batch_idx", "page_table"), set_args(cache_batch_idx=_i32(0, 1)))]
    else:
        v += [("cache_batch_idx/beyond", ("cache_batch_idx",), set_args(cache_batch_idx=_i32(0, 7))),
              ("cache_batch_idx/negative", ("cache_batch_idx",), set_args(cache_batch_idx=_i32(0, -1))),
              ("cache_batch_idx/2d", ("cache_batch_idx",), set_args(cache_batch_idx=_i32([0, 1]))),
              ("cache_batch_idx/shape3", ("cache_batch_idx",), set_args(cache_batch_idx=_i32(0, 1, 1))),
              ("cache_batch_idx/float", ("cache_batch_idx",), set_args(cache_batch_idx=torch.tensor([0.0, 1.0]))),
              ("k_cache/batch_mismatch", ("k_cache", "v_cache", "cache_batch_idx", "q"),
               lambda kw: {**kw, **{r: kw[r][:1] for r in ("k_cache", "v_cache")}, "cache_batch_idx": None})]
    if append:
        v += [("k_without_v", ("k", "v"), set_args(v=None)), ("v_without_k", ("k", "v"), set_args(k=None)),
              ("k/1head", ("k",), edit_arg("k", lambda t: t[:, :, :1])),
              ("kv/1head", ("k", "v", "k_cache"), lambda kw: {**kw, "k": kw["k"][:, :, :1], "v": kw["v"][:, :, :1]}),
              ("kv/headdim8", ("k", "v", "k_cache"), lambda kw: {**kw, "k": kw["k"][..., :8].contiguous(),
                                                                 "v": kw["v"][..., :8].contiguous()}),
              ("kv/batch1", ("k", "v", "q"), lambda kw: {**kw, "k": kw["k"][:1], "v": kw["v"][:1]}),
              ("k/float32", ("k",), edit_arg("k", lambda t: t.float())),
              ("kv/past_the_end", ("k", "cache_seqlens", "k_cache", "page_table"),
               set_args(cache_seqlens=_i32(7, 3))),
              ("kv/mnew_differs", ("k", "v"), edit_arg("v", lambda t: t[:, :1]))]
    if fp8:
        v += [("k_descale_only", ("v_descale", "k_descale"), set_args(v_descale=None)),
              ("no_descales", ("k_descale", "v_descale"), set_args(k_descale=None, v_descale=None)),
              ("k_descale/float", ("k_descale",), set_args(k_descale=0.5)),
              ("k_descale/batch_heads", ("k_descale",), set_args(k_descale=torch.ones(2, HKV))),
              ("k_descale/nan", ("k_descale",), edit_arg("k_descale", lambda d: _poke(d, math.nan))),
              ("v_descale/inf", ("v_descale",), edit_arg("v_descale", lambda d: _poke(d, math.inf))),
              ("k_descale/float16", ("k_descale",), edit_arg("k_descale", lambda d: d.half())),
              ("k_descale/shape", ("k_descale",), edit_arg("k_descale", lambda d: d[:, :1].contiguous()))]
    else:
        v += [("k_descale/given", ("k_descale",), lambda kw: {**kw, "k_descale": torch.ones(kw["k_cache"].shape[:3]),
                                                              "v_descale": torch.ones(kw["v_cache"].shape[:3])})]
    v += [(f"softmax_scale={l}", ("softmax_scale",), set_args(softmax_scale=x)) for l, x in BAD_FLOATS]
    v += [("q_descale", ("q_descale",), set_args(q_descale=torch.ones(1))),
          ("rotary_cos", ("rotary_cos",), set_args(rotary_cos=torch.ones(8, 8))),
          ("cache_leftpad/beyond", ("cache_leftpad",), set_args(cache_leftpad=_i32(0, 4))),
          ("cache_leftpad/negative", ("cache_leftpad",), set_args(cache_leftpad=_i32(-1, 0))),
          ("cache_leftpad/int64", ("cache_leftpad",), set_args(cache_leftpad=torch.tensor([0, 0]))),
          ("cache_leftpad/shape3", ("cache_leftpad",), set_args(cache_leftpad=_i32(0, 0, 0))),
          ("cache_leftpad/list", ("cache_leftpad",), set_args(cache_leftpad=[0, 0])),
          ("causal=str", ("causal",), set_args(causal="yes"))]
    return v


def kvcache_cases() -> tuple[list[Case], list[Case]]:
    valid = [Case(f"flash_attn_with_kvcache/{b}", _body(m, lenient=True), valid=True) for b, m in BASES.items()]
    for b in ("dense", "paged_causal", "dense_append"):
        valid.append(Case(f"flash_attn_with_kvcache/{b}/cache_seqlens=int",
                          _body(BASES[b], set_args(cache_seqlens=3), lenient=True), valid=True))
        valid.append(Case(f"flash_attn_with_kvcache/{b}/cache_seqlens=0",
                          _body(BASES[b], set_args(cache_seqlens=_i32(0, 0)), lenient=True), valid=True))
        for s in (0.0, -0.5):
            valid.append(Case(f"flash_attn_with_kvcache/{b}/softmax_scale={s}",
                              _body(BASES[b], set_args(softmax_scale=s), lenient=True), valid=True))
    invalid = []
    for b, make in BASES.items():
        invalid += [Case(f"flash_attn_with_kvcache/{b}/{l}", _body(make, ch, lenient=l in LENIENT), nm)
                    for l, nm, ch in _variants(b)]
    return valid, invalid


# ---- fmha_ops.kv_cache builders ----------------------------------------------------------------------------


def _roundtrip_fp8(kw, res):
    x8, s = res[0], res[1]
    return mismatch(x8.double() * s.double()[..., None], kw["x"].double(), None, 0.07, "dequantized")


def _paged_roundtrip(kw, res):
    pages, table = res
    for x, p in zip(kw["tensors"], pages):
        back = kv_cache.dense_from_paged(p, table, x.shape[1])
        if not torch.equal(back, x):
            return "dense_from_paged(paged_from_dense(x)) != x"
    return None


def _dense_check(kw, res):
    want = ref.sequence_keys(kw["pages"], 0, kw["length"], kw["block_table"], None)
    return mismatch(res[0], want, kw["pages"].dtype, 0.0)


def _build_check(kw, res):
    kc, vc, ks, vs, table = res
    L = kw["k"].shape[1]
    for x, c, s in ((kw["k"], kc, ks), (kw["v"], vc, vs)):
        deq = kv_cache.dense_from_paged(c.float() * s[..., None], table, L)
        bad = mismatch(deq, x.double(), None, 0.07, "dequantized cache")
        if bad:
            return bad
    return None


def builder_cases() -> tuple[list[Case], list[Case]]:
    def qmake():
        return dict(x=rnd(2, 6, 2, 16, dtype=torch.float32))

    def pmake():
        return dict(tensors=[rnd(2, 6, 2, 16), rnd(2, 6, 2, 16)], page_size=4, num_pages=7)

    def dmake():
        pages = rnd(5, 4, 2, 16)
        return dict(pages=pages, block_table=_i32([3, 1, 4]), length=10)

    def bmake():
        return dict(k=rnd(2, 6, 2, 16), v=rnd(2, 6, 2, 16), page_size=4)

    valid = [Case("kv_cache.quantize_fp8/f32", call_body(kv_cache.quantize_fp8, qmake, check=_roundtrip_fp8), valid=True),
             Case("kv_cache.paged_from_dense/f16", call_body(kv_cache.paged_from_dense, pmake, check=_paged_roundtrip),
                  valid=True),
             Case("kv_cache.dense_from_paged/f16", call_body(kv_cache.dense_from_paged, dmake, check=_dense_check),
                  valid=True),
             Case("kv_cache.build_fp8_paged_cache/f16", call_body(kv_cache.build_fp8_paged_cache, bmake,
                                                                 check=_build_check), valid=True)]
    invalid = []

    def add(fn, name, make, variants):
        invalid.extend(Case(f"kv_cache.{name}/{l}", call_body(fn, make, ch), nm) for l, nm, ch in variants)

    tk = [(l, f) for l, f in tensor_kind_errors() if l not in ("float64", "ndim+1", "ndim-1", "meta")]  # any (..., D)
    add(kv_cache.quantize_fp8, "quantize_fp8", qmake,
        [(f"x/{l}", ("x",), edit_arg("x", f)) for l, f in tk]
        + [("dtype=float16", ("dtype",), set_args(dtype=torch.float16)), ("dtype=str", ("dtype",), set_args(dtype="fp8")),
           ("dtype=int8", ("dtype",), set_args(dtype=torch.int8))])
    add(kv_cache.paged_from_dense, "paged_from_dense", pmake,
        [("page_size=0", ("page_size",), set_args(page_size=0)), ("page_size=-1", ("page_size",), set_args(page_size=-1)),
         ("page_size=2.5", ("page_size",), set_args(page_size=2.5)), ("page_size=str", ("page_size",), set_args(page_size="4")),
         ("num_pages=too_few", ("num_pages",), set_args(num_pages=3)), ("num_pages=-1", ("num_pages",), set_args(num_pages=-1)),
         ("tensors=empty", ("tensors",), set_args(tensors=[])),
         ("tensors=one_tensor", ("tensors",), edit_arg("tensors", lambda t: t[0])),
         ("tensors=batch_mismatch", ("tensors",), edit_arg("tensors", lambda t: [t[0], t[1][:1]])),
         ("tensors=length_mismatch", ("tensors",), edit_arg("tensors", lambda t: [t[0], t[1][:, :3]])),
         ("tensors=1d", ("tensors",), edit_arg("tensors", lambda t: [t[0].flatten()])),
         ("tensors=list", ("tensors",), edit_arg("tensors", lambda t: [t[0].tolist()])),
         ("generator=str", ("generator",), set_args(generator="x"))])
    add(kv_cache.dense_from_paged, "dense_from_paged", dmake,
        [("block_table/entry=num_pages", ("block_table",), set_args(block_table=_i32([3, 1, 5]))),
         ("block_table/entry=-1", ("block_table",), set_args(block_table=_i32([3, 1, -1]))),
         ("block_table/1d", ("block_table",), edit_arg("block_table", lambda t: t[0])),
         ("block_table/float", ("block_table",), edit_arg("block_table", lambda t: t.float())),
         ("block_table/list", ("block_table",), edit_arg("block_table", lambda t: t.tolist())),
         ("length=capacity+1", ("length",), set_args(length=13)), ("length=-1", ("length",), set_args(length=-1)),
         ("length=str", ("length",), set_args(length="4")),
         ("pages/1d", ("pages",), edit_arg("pages", lambda t: t.flatten())),
         ("pages/list", ("pages",), edit_arg("pages", lambda t: t.tolist()))])
    add(kv_cache.build_fp8_paged_cache, "build_fp8_paged_cache", bmake,
        [("page_size=0", ("page_size",), set_args(page_size=0)), ("dtype=float16", ("dtype",), set_args(dtype=torch.float16)),
         ("k/v_shape_mismatch", ("k", "v"), edit_arg("v", lambda t: t[:, :3])),
         ("k/3d", ("k",), edit_arg("k", lambda t: t[0])), ("k/list", ("k",), edit_arg("k", lambda t: t.tolist())),
         ("num_pages=too_few", ("num_pages",), set_args(num_pages=2))])
    add(kv_cache.dequantize_fp8, "dequantize_fp8", lambda: dict(x8=rnd(2, 3, 16).to(F8), scale=torch.rand(2, 3)),
        [("scale/shape", ("scale", "x8"), edit_arg("scale", lambda s: s[:, :2])), ("scale/list", ("scale",), set_args(scale=[1.0])),
         ("x8/list", ("x8",), set_args(x8=[1.0]))])
    add(kv_cache.keys_contiguous, "keys_contiguous", lambda: dict(scale=torch.rand(4, 2)),
        [("scale/1d", ("scale",), edit_arg("scale", lambda s: s[0])), ("scale/list", ("scale",), set_args(scale=[1.0]))])
    add(kv_cache.quantize_kv_fp8, "quantize_kv_fp8", lambda: dict(k=rnd(4, 2, 16), v=rnd(4, 2, 16)),
        [("k/list", ("k",), set_args(k=[1.0])), ("dtype=float16", ("dtype",), set_args(dtype=torch.float16)),
         ("v/int32", ("v",), edit_arg("v", lambda t: t.int()))])
    return valid, invalid
