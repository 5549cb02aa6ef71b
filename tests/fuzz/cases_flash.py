"""Cases for flash_attn_func, flash_attn_varlen_func, fp8_attention / i8fp8_attention and merge_attentions."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

import fmha_ops

from . import reference as ref
from .common import (BAD_DTYPES, BAD_FLOATS, BAD_OPS, F8, TOLERANCE, Change, edit_arg, first, fp8_head, grow,
                     mismatch, names, rnd, set_args, strided_last, tensor_kind_errors)
from .expected import dequantize
from .runner import Case

QKV = ("q", "k", "v")




def _tensor_variants(role: str, seq_dim: int, head_dim_ok: bool) -> list[tuple[str, tuple[str, ...], Change]]:
    partners = names(*QKV)
    out = []
    for label, f in tensor_kind_errors():
        nm = partners if label.startswith("ndim") or label in ("float64", "int32", "bool", "complex64") else names(role)
        out.append((label, names(role, "q") if label == "meta" else nm, edit_arg(role, f)))
    out += [("heads+1", partners, edit_arg(role, lambda t: grow(t, seq_dim + 1))),
            ("strided_last", names(role), edit_arg(role, strided_last)),
            ("headdim0", partners, edit_arg(role, lambda t: t[..., :0]))]
    if not head_dim_ok:
        out.append(("headdim-8", partners, edit_arg(role, lambda t: grow(t, -1, -8))))
    return out


# ---- flash_attn_func ------------------------------------------------------------------------------------

def _dense(dtype, causal=False, lse=False):
    def make():
        kw = dict(q=rnd(2, 5, 4, 16, dtype=dtype), k=rnd(2, 7, 2, 16, dtype=dtype), v=rnd(2, 7, 2, 16, dtype=dtype),
                  causal=causal, return_attn_probs=lse)
        return kw
    return make


def _dense_fp8(causal=False, lse=False):
    def make():
        (q, qd), (k, kd), (v, vd) = (fp8_head(rnd(2, m, h, 16, dtype=torch.float32), 2)
                                     for m, h in ((5, 4), (7, 2), (7, 2)))
        return dict(q=q, k=k, v=v, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, return_attn_probs=lse)
    return make


def _out_and_lse(kw: dict, res: Any, out: torch.Tensor, lse: torch.Tensor) -> str | None:
    """A flash_attn_* result (out, or (out, lse) with return_attn_probs) against the reference's."""
    dt = kw["q"].dtype if kw["q"].dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
    tol = TOLERANCE[kw["q"].dtype if kw["q"].dtype != torch.float8_e4m3fn else F8]
    if kw.get("return_attn_probs"):
        if not isinstance(res, tuple) or len(res) != 2:
            return f"return_attn_probs=True returned {type(res).__name__}, not (out, lse)"
        return first(mismatch(res[0], out, dt, tol), mismatch(res[1], lse, torch.float32, 4 * tol, "lse"))
    return mismatch(res, out, dt, tol)


def _flash_check(kw: dict) -> Callable[[Any], str | None]:
    def check(res):
        q = dequantize(kw["q"], kw.get("q_descale"), "q", None)
        k = dequantize(kw["k"], kw.get("k_descale"), "k", None)
        v = dequantize(kw["v"], kw.get("v_descale"), "v", None)
        scale = kw.get("softmax_scale")
        out, lse = ref.dense(q, k, v, 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
                             "bottom_right" if kw.get("causal") else None)
        return _out_and_lse(kw, res, out, lse)
    return check


FLASH_BASES = {
    "f16": _dense(torch.float16), "f16_causal_lse": _dense(torch.float16, True, True),
    "f32_lse": _dense(torch.float32, False, True), "bf16_causal": _dense(torch.bfloat16, True),
    "fp8": _dense_fp8(), "fp8_causal_lse": _dense_fp8(True, True),
}


def _body(fn, make, change=None, lenient=True, checker=_flash_check):
    def body():
        kw = make() if change is None else change(make())
        res = fn(**kw)
        return res, (checker(kw) if lenient else None)
    return body


def flash_cases() -> tuple[list[Case], list[Case]]:
    fn = fmha_ops.flash_attn_func
    valid = [Case(f"flash_attn_func/{b}", _body(fn, m), valid=True) for b, m in FLASH_BASES.items()]
    for b in ("f16", "f32_lse"):
        for s in (0.0, -0.5, 2.0):
            valid.append(Case(f"flash_attn_func/{b}/softmax_scale={s}",
                              _body(fn, FLASH_BASES[b], set_args(softmax_scale=s, causal=True)), valid=True))
    invalid = []
    for b, make in FLASH_BASES.items():
        variants = []
        for role in QKV:
            variants += [(f"{role}/{l}", nm, ch) for l, nm, ch in _tensor_variants(role, 1, role == "v")]
        variants += [(f"softmax_scale={l}", ("softmax_scale",), set_args(softmax_scale=x)) for l, x in BAD_FLOATS]
        variants += [("qv", ("qv",), lambda kw: {**kw, "qv": kw["q"]}),
                     ("window_size=3tuple", ("window_size",), set_args(window_size=(1, 2, 3))),
                     ("window_size=str", ("window_size",), set_args(window_size="ab")),
                     ("softcap=str", ("softcap",), set_args(softcap="x")),
                     ("attention_chunk=-1", ("attention_chunk",), set_args(attention_chunk=-1))]
        for role in QKV:
            arg = f"{role}_descale"
            if b.startswith("fp8"):
                variants += [(f"{arg}/float", (arg,), set_args(**{arg: 0.5})),
                             (f"{arg}/None", (arg,), set_args(**{arg: None})),
                             (f"{arg}/nan", (arg,), edit_arg(arg, lambda d: torch.full_like(d, math.nan))),
                             (f"{arg}/inf", (arg,), edit_arg(arg, lambda d: torch.full_like(d, math.inf))),
                             (f"{arg}/shape3", (arg,), set_args(**{arg: torch.ones(3)})),
                             (f"{arg}/float16", (arg,), edit_arg(arg, lambda d: d.half()))]
            else:
                variants += [(f"{arg}/given", (arg,), set_args(**{arg: torch.ones(1)}))]
        invalid += [Case(f"flash_attn_func/{b}/{l}", _body(fn, make, ch, lenient=False), nm) for l, nm, ch in variants]
    return valid, invalid


# ---- flash_attn_varlen_func -------------------------------------------------------------------------------

CU_Q, CU_K = [0, 3, 3, 7], [0, 5, 7, 13]


def _varlen(dtype, causal=False, lse=False, fp8=False):
    def make():
        q, k, v = rnd(7, 4, 16, dtype=torch.float32), rnd(13, 2, 16, dtype=torch.float32), rnd(13, 2, 16, dtype=torch.float32)
        kw = dict(cu_seqlens_q=torch.tensor(CU_Q, dtype=torch.int32), cu_seqlens_k=torch.tensor(CU_K, dtype=torch.int32),
                  max_seqlen_q=4, max_seqlen_k=6, causal=causal, return_attn_probs=lse)
        if fp8:
            (q8, _), (k8, _), (v8, _) = fp8_head(q[None], 1), fp8_head(k[None], 1), fp8_head(v[None], 1)
            ds = [torch.rand(3, 2) * 0.003 + 0.001 for _ in range(3)]
            return {**kw, "q": q8[0], "k": k8[0], "v": v8[0], "q_descale": ds[0], "k_descale": ds[1], "v_descale": ds[2]}
        return {**kw, "q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype)}
    return make


def _varlen_check(kw: dict) -> Callable[[Any], str | None]:
    def check(res):
        cu_q = [int(x) for x in torch.as_tensor(kw["cu_seqlens_q"]).tolist()]
        cu_k = [int(x) for x in torch.as_tensor(kw["cu_seqlens_k"]).tolist()]
        rows_q = torch.repeat_interleave(torch.arange(len(cu_q) - 1), torch.tensor(cu_q).diff())
        rows_k = torch.repeat_interleave(torch.arange(len(cu_k) - 1), torch.tensor(cu_k).diff())
        q = dequantize(kw["q"][None], kw.get("q_descale"), "q", None, rows_q)[0]
        k = dequantize(kw["k"][None], kw.get("k_descale"), "k", None, rows_k)[0]
        v = dequantize(kw["v"][None], kw.get("v_descale"), "v", None, rows_k)[0]
        scale = kw.get("softmax_scale")
        out, lse = ref.varlen(q, k, v, cu_q, cu_k, 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
                              "bottom_right" if kw.get("causal") else None)
        return _out_and_lse(kw, res, out, lse)
    return check


VARLEN_BASES = {
    "f16": _varlen(torch.float16), "f16_causal_lse": _varlen(torch.float16, True, True),
    "f32_lse": _varlen(torch.float32, False, True), "fp8_causal": _varlen(None, True, False, True),
}


def _cu(arg: str, values) -> Change:
    return set_args(**{arg: torch.tensor(values, dtype=torch.int32)})


def varlen_cases() -> tuple[list[Case], list[Case]]:
    fn = fmha_ops.flash_attn_varlen_func
    valid = [Case(f"flash_attn_varlen_func/{b}", _body(fn, m, checker=_varlen_check), valid=True)
             for b, m in VARLEN_BASES.items()]
    for b in ("f16", "f32_lse"):
        valid.append(Case(f"flash_attn_varlen_func/{b}/max_seqlen_larger",
                          _body(fn, VARLEN_BASES[b], set_args(max_seqlen_q=9, max_seqlen_k=20), checker=_varlen_check),
                          valid=True))
        for s in (0.0, -0.5):
            valid.append(Case(f"flash_attn_varlen_func/{b}/softmax_scale={s}",
                              _body(fn, VARLEN_BASES[b], set_args(softmax_scale=s, causal=True), checker=_varlen_check),
                              valid=True))
    invalid = []
    for b, make in VARLEN_BASES.items():
        variants = []
        for role in QKV:
            variants += [(f"{role}/{l}", nm, ch) for l, nm, ch in _tensor_variants(role, 0, role == "v")]
            variants.append((f"{role}/tokens+1", names(role, "cu_seqlens_q" if role == "q" else "cu_seqlens_k"),
                             edit_arg(role, lambda t: grow(t, 0))))
        for arg, cu, total in (("cu_seqlens_q", CU_Q, 7), ("cu_seqlens_k", CU_K, 13)):
            nm = (arg,)
            variants += [
                (f"{arg}/non_monotonic", nm, _cu(arg, [cu[0], cu[2] + 1, cu[2], cu[3]])),
                (f"{arg}/start1", nm, _cu(arg, [1] + cu[1:])),
                (f"{arg}/end-1", nm, _cu(arg, cu[:3] + [total - 1])),
                (f"{arg}/end+1", nm, _cu(arg, cu[:3] + [total + 1])),
                (f"{arg}/far_beyond", nm, _cu(arg, cu[:3] + [total + 4000])),
                (f"{arg}/negative", nm, _cu(arg, [0, -2] + cu[2:])),
                (f"{arg}/fewer_sequences", nm + ("cu_seqlens_q", "cu_seqlens_k"), _cu(arg, [0, cu[2], total])),
                (f"{arg}/float32", nm, edit_arg(arg, lambda t: t.float())),
                (f"{arg}/2d", nm, edit_arg(arg, lambda t: t[None])),
                (f"{arg}/empty", nm, edit_arg(arg, lambda t: t[:0])),
                (f"{arg}/str", nm, set_args(**{arg: "0,3"})),
                (f"{arg}/meta", nm, edit_arg(arg, lambda t: t.to("meta"))),
            ]
        for arg, true_max in (("max_seqlen_q", 4), ("max_seqlen_k", 6)):
            nm = (arg,)
            variants += [(f"{arg}=smaller", nm, set_args(**{arg: true_max - 1})), (f"{arg}=0", nm, set_args(**{arg: 0})),
                         (f"{arg}=-1", nm, set_args(**{arg: -1})), (f"{arg}=str", nm, set_args(**{arg: "4"})),
                         (f"{arg}=2.5", nm, set_args(**{arg: 2.5}))]
        variants += [(f"softmax_scale={l}", ("softmax_scale",), set_args(softmax_scale=x)) for l, x in BAD_FLOATS]
        variants += [("seqused_q", ("seqused_q",), _cu("seqused_q", [3, 0, 4])),
                     ("seqused_k", ("seqused_k",), _cu("seqused_k", [5, 2, 6]))]
        if b.startswith("fp8"):
            for role in QKV:
                arg = f"{role}_descale"
                variants += [(f"{arg}/float", (arg,), set_args(**{arg: 0.5})),
                             (f"{arg}/batch_shape", (arg,), edit_arg(arg, lambda d: d[:1])),
                             (f"{arg}/nan", (arg,), edit_arg(arg, lambda d: torch.full_like(d, math.nan)))]
        invalid += [Case(f"flash_attn_varlen_func/{b}/{l}", _body(fn, make, ch, lenient=False), nm)
                    for l, nm, ch in variants]
    return valid, invalid


# ---- fp8_attention / i8fp8_attention ---------------------------------------------------------------------

def _quantized_make(dtype, causal):
    def make():
        return dict(q=rnd(2, 5, 4, 16, dtype=dtype), k=rnd(2, 7, 2, 16, dtype=dtype), v=rnd(2, 7, 2, 16, dtype=dtype),
                    causal=causal)
    return make


def _quantized_check(kw):
    def check(res):
        scale = kw.get("softmax_scale")
        out, _ = ref.dense(kw["q"], kw["k"], kw["v"], 1 / math.sqrt(16) if scale is None else float(scale),
                           "bottom_right" if kw.get("causal") else None)
        return mismatch(res, out, kw["q"].dtype, 0.15)
    return check


def quantized_cases() -> tuple[list[Case], list[Case]]:
    valid, invalid = [], []
    for name in ("fp8_attention", "i8fp8_attention"):
        fn = getattr(fmha_ops, name)
        for dt in (torch.bfloat16, torch.float16):
            for causal in (False, True):
                for op in (None, "torch_referenceF"):
                    b = f"{str(dt)[6:]}{'_causal' if causal else ''}"
                    extra = {} if op is None else {"op": op}
                    valid.append(Case(f"{name}/{b}/op={op}", _body(fn, _quantized_make(dt, causal), set_args(**extra),
                                                                    checker=_quantized_check), valid=True))
        make = _quantized_make(torch.bfloat16, True)
        variants = []
        for role in QKV:
            variants += [(f"{role}/{l}", nm, ch) for l, nm, ch in _tensor_variants(role, 1, role == "v")]
            variants.append((f"{role}/fp8", names(role), edit_arg(role, lambda t: t.to(F8))))
        variants += [(f"softmax_scale={l}", ("softmax_scale",), set_args(softmax_scale=x)) for l, x in BAD_FLOATS]
        variants += [(f"op={l}", ("op",), set_args(op=x)) for l, x in BAD_OPS]
        variants.append(("causal=str", ("causal",), set_args(causal="yes")))
        invalid += [Case(f"{name}/bf16/{l}", _body(fn, make, ch, lenient=l.endswith("strided_last"),
                                                   checker=_quantized_check), nm)
                    for l, nm, ch in variants]  # the quantization reads any strides: strided inputs are fine
    return valid, invalid


# ---- merge_attentions -------------------------------------------------------------------------------------

def _merge_make(groups=False, as_list=False, dtype=torch.float32):
    def make():
        g = (2,) if groups else ()
        attn = rnd(3, 2, 5, *g, 4, 16, dtype=torch.float32).to(dtype)
        lse = rnd(3, 2, *g, 4, 5, dtype=torch.float32) * 2
        lse[1, 0, ..., 0] = -math.inf  # a part that saw no key for some rows
        if as_list:
            return dict(attn_split=list(attn.unbind(0)), lse_split=list(lse.unbind(0)))
        return dict(attn_split=attn, lse_split=lse)
    return make


def _merge_check(kw):
    def check(res):
        attn = kw["attn_split"] if isinstance(kw["attn_split"], torch.Tensor) else torch.stack(kw["attn_split"])
        lse = kw["lse_split"] if isinstance(kw["lse_split"], torch.Tensor) else torch.stack(kw["lse_split"])
        if attn.ndim == 6:
            s, b, m, g, h, d = attn.shape
            out, l = ref.merge(attn.reshape(s, b, m, g * h, d), lse.reshape(s, b, g * h, m))
            out, l = out.reshape(b, m, g, h, d), l.reshape(b, g, h, m)
        else:
            out, l = ref.merge(attn, lse)
        dt = kw.get("output_dtype") or attn.dtype
        tol = TOLERANCE[dt] if dt in TOLERANCE else 1e-6
        if not isinstance(res, tuple) or len(res) != 2:
            return f"merge_attentions returned {type(res).__name__}"
        if not kw.get("write_lse", True):
            return first(mismatch(res[0], out, dt, tol), None if res[1] is None else "lse returned with write_lse=False")
        return first(mismatch(res[0], out, dt, tol), mismatch(res[1], l, torch.float32, 1e-5, "lse"))
    return check


def merge_cases() -> tuple[list[Case], list[Case]]:
    fn = fmha_ops.merge_attentions
    bases = {"tensor": _merge_make(), "groups": _merge_make(groups=True), "list": _merge_make(as_list=True),
             "bf16": _merge_make(dtype=torch.bfloat16)}
    valid = []
    for b, make in bases.items():
        valid.append(Case(f"merge_attentions/{b}", _body(fn, make, checker=_merge_check), valid=True))
        valid.append(Case(f"merge_attentions/{b}/write_lse=False",
                          _body(fn, make, set_args(write_lse=False), checker=_merge_check), valid=True))
        valid.append(Case(f"merge_attentions/{b}/output_dtype=float16",
                          _body(fn, make, set_args(output_dtype=torch.float16), checker=_merge_check), valid=True))
    invalid = []
    tensor_args = ("attn_split", "lse_split")
    for b, make in bases.items():
        variants = []
        if b != "list":
            for arg in tensor_args:
                variants += [(f"{arg}/{l}", tensor_args, edit_arg(arg, f)) for l, f in tensor_kind_errors()
                             if l not in ("float64",)]
                variants += [(f"{arg}/splits+1", tensor_args, edit_arg(arg, lambda t: grow(t.float(), 0).to(t.dtype))),
                             (f"{arg}/batch+1", tensor_args, edit_arg(arg, lambda t: grow(t.float(), 1).to(t.dtype)))]
            variants.append(("lse_split/last+1", tensor_args, edit_arg("lse_split", lambda t: grow(t, -1))))
            variants += [
                ("lse_split/+inf", ("lse_split",), edit_arg("lse_split", lambda t: t.index_fill(0, torch.tensor([0]), math.inf))),
                ("lse_split/nan", ("lse_split",), edit_arg("lse_split", lambda t: t.index_fill(0, torch.tensor([0]), math.nan))),
                ("attn_split/int32_parts", ("attn_split",), edit_arg("attn_split", lambda t: (t * 10).int())),
                ("attn_split/fp8", ("attn_split",), edit_arg("attn_split", lambda t: t.to(F8))),
            ]
        else:
            variants += [("attn_split/empty", tensor_args, set_args(attn_split=[], lse_split=[])),
                         ("attn_split/ragged", tensor_args, edit_arg("attn_split", lambda p: p[:1] + [grow(p[1], 1)] + p[2:])),
                         ("attn_split/not_tensors", tensor_args, edit_arg("attn_split", lambda p: [x.tolist() for x in p])),
                         ("lse_split/fewer", tensor_args, edit_arg("lse_split", lambda p: p[:2]))]
        variants += [(f"output_dtype={l}", ("output_dtype",), set_args(output_dtype=x)) for l, x in BAD_DTYPES
                     if l != "float64"]
        variants.append(("write_lse=str", ("write_lse",), set_args(write_lse="no")))
        invalid += [Case(f"merge_attentions/{b}/{l}", _body(fn, make, ch, lenient=False), nm) for l, nm, ch in variants]
    return valid, invalid
