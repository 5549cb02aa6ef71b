"""Cases for memory_efficient_attention[_forward|_partial] and explain: valid calls on every mask, layout and
dtype family through the reference, SDPA and Triton ops, and each argument perturbed."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

import fmha_ops
from fmha_ops import attn_bias as ab

from . import expected as ex
from .common import (BAD_DTYPES, BAD_FLOATS, BAD_OPS, F8, TOLERANCE, Change, edit_arg, first, fp8_head, grow,
                     mismatch, names, rnd, set_args, strided_last, tensor_kind_errors)
from .runner import Case

FUNCTIONS = {
    "memory_efficient_attention": fmha_ops.memory_efficient_attention,
    "memory_efficient_attention_forward": fmha_ops.memory_efficient_attention_forward,
    "memory_efficient_attention_partial": fmha_ops.memory_efficient_attention_partial,
    "explain": fmha_ops.explain,
}
ROLES = ("query", "key", "value")
QKV = ("query", "key", "value")


@dataclass
class Base:
    """A valid call: ``make()`` -> keyword arguments; ``compute`` the dtype its tolerance is read for;
    ``ops`` the ops forced in turn (None: the selector's choice)."""

    name: str
    make: Callable[[], dict]
    compute: torch.dtype
    ops: tuple[str | None, ...]
    quantized: bool = False
    packed: bool = False  # a varlen / decode mask fixes the query and key lengths


def _qkv(b, mq, mk, hq, hkv, d, dtype, dv=None):
    return rnd(b, mq, hq, d, dtype=dtype), rnd(b, mk, hkv, d, dtype=dtype), rnd(b, mk, hkv, dv or d, dtype=dtype)


def _f16_gqa():
    q, k, v = _qkv(2, 5, 7, 4, 2, 16, torch.float16)
    return dict(query=q, key=k, value=v)


def _f32_causal():
    q, k, v = _qkv(2, 6, 6, 2, 2, 16, torch.float32)
    return dict(query=q, key=k, value=v, attn_bias=fmha_ops.LowerTriangularMask())


def _bf16_br():
    q, k, _ = _qkv(1, 3, 9, 2, 1, 32, torch.bfloat16)
    return dict(query=q, key=k, value=rnd(1, 9, 1, 16, dtype=torch.bfloat16),
                attn_bias=fmha_ops.LowerTriangularFromBottomRightMask())


def _fp8_head():
    q, k, v = _qkv(2, 5, 7, 4, 2, 16, torch.float32)
    (q8, qd), (k8, kd), (v8, vd) = fp8_head(q, 2), fp8_head(k, 2), fp8_head(v, 2)
    return dict(query=q8, key=k8, value=v8, q_descale=qd, k_descale=kd, v_descale=vd)


def _i8fp8_block():
    q, k = rnd(2, 5, 4, 16, dtype=torch.int8), rnd(2, 7, 2, 16, dtype=torch.int8)
    v8, _ = fp8_head(rnd(2, 7, 2, 16, dtype=torch.float32), 2)
    return dict(query=q, key=k, value=v8, q_descale=torch.rand(2, 4, 1) * 0.002 + 0.001,
                k_descale=torch.rand(2, 2, 1) * 0.002 + 0.001, v_descale=torch.rand(2, 2, 16) * 0.01 + 0.005)


def _varlen():
    q, k, v = _qkv(1, 7, 13, 4, 2, 16, torch.float16)
    bias = ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens([3, 0, 4], [5, 2, 6])
    return dict(query=q, key=k, value=v, attn_bias=bias)


def _varlen_fp8():
    q, k, v = _qkv(1, 7, 13, 4, 2, 16, torch.float32)
    bias = ab.BlockDiagonalMask.from_seqlens([3, 0, 4], [5, 2, 6])
    (q8, _), (k8, _), (v8, _) = fp8_head(q, 1), fp8_head(k, 1), fp8_head(v, 1)
    scales = [torch.rand(3, 2) * 0.003 + 0.001 for _ in range(3)]
    return dict(query=q8, key=k8, value=v8, attn_bias=bias, q_descale=scales[0], k_descale=scales[1],
                v_descale=scales[2])


def _paged():
    q = rnd(1, 2, 4, 16)
    k, v = rnd(1, 20, 2, 16), rnd(1, 20, 2, 16)
    bias = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 8, [6, 3]).make_paged(
        torch.tensor([[3, 1], [0, 4]], dtype=torch.int32), 4)
    return dict(query=q, key=k, value=v, attn_bias=bias)


def _padded_fp8_token():
    q = rnd(1, 2, 4, 16)
    k, v = rnd(1, 18, 2, 16, dtype=torch.float32), rnd(1, 18, 2, 16, dtype=torch.float32)
    ks, vs = k.abs().amax(-1) / 448 + 1e-3, v.abs().amax(-1) / 448 + 1e-3
    bias = ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 9, [9, 4])
    return dict(query=q, key=(k / ks[..., None]).to(F8), value=(v / vs[..., None]).to(F8), attn_bias=bias,
                k_descale=ks, v_descale=vs)


def _bmghk():
    q = rnd(2, 5, 2, 2, 16, dtype=torch.float32)
    k = rnd(2, 7, 2, 1, 16, dtype=torch.float32).expand(2, 7, 2, 2, 16)
    v = rnd(2, 7, 2, 1, 16, dtype=torch.float32).expand(2, 7, 2, 2, 16)
    return dict(query=q, key=k, value=v)


def _bmk():
    q, k, v = _qkv(3, 5, 7, 1, 1, 8, torch.float32)
    return dict(query=q[:, :, 0], key=k[:, :, 0], value=v[:, :, 0])


def _decode_bmhk():
    q, k, v = _qkv(2, 1, 9, 4, 2, 16, torch.float16)
    return dict(query=q, key=k, value=v, attn_bias=fmha_ops.LowerTriangularFromBottomRightMask())


REF, MATH, FLASH = "torch_referenceF", "sdpa_mathF", "sdpa_flashF"
BASES = [
    Base("f16_gqa", _f16_gqa, torch.float16, (None, REF, MATH, FLASH, "triton_attnF")),
    Base("f32_causal", _f32_causal, torch.float32, (None, REF, MATH, FLASH)),
    Base("bf16_br_dv16", _bf16_br, torch.bfloat16, (None, REF)),
    Base("fp8_head", _fp8_head, F8, (None, REF, "triton_fp8F"), quantized=True),
    Base("i8fp8_block", _i8fp8_block, torch.int8, (None, REF, "triton_i8fp8F"), quantized=True),
    Base("varlen_causal", _varlen, torch.float16, (None, REF, "triton_attnF"), packed=True),
    Base("varlen_fp8", _varlen_fp8, F8, (None, REF, "triton_fp8F"), quantized=True, packed=True),
    Base("paged_causal", _paged, torch.float16, (None, REF, "triton_decoderF", "triton_splitKF"), packed=True),
    Base("padded_fp8_token", _padded_fp8_token, F8, (None, REF, "triton_decoderF"), quantized=True, packed=True),
    Base("bmghk", _bmghk, torch.float32, (None, REF, MATH)),
    Base("bmk", _bmk, torch.float32, (None, REF, MATH)),
    Base("decode_bmhk", _decode_bmhk, torch.float16, (None, REF, "triton_decoderF", "triton_splitKF")),
]


def out_dtype(fn: str, kw: dict) -> torch.dtype:
    if kw.get("output_dtype") is not None:
        return kw["output_dtype"]
    if fn == "memory_efficient_attention_partial":
        return torch.float32
    qd = kw["query"].dtype
    return qd if qd in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16


def check_for(fn: str, kw: dict, compute: torch.dtype) -> Callable[[Any], str | None]:
    """The check of a call of ``fn`` with arguments ``kw`` against the float64 reference."""
    def check(res):
        if fn == "explain":
            if res.selected is None:
                return f"explain selected no op:\n{res}"
            return None
        want, lse = ex.attention(**kw)
        tol = max(TOLERANCE[compute], TOLERANCE.get(out_dtype(fn, kw), 0.0))
        if fn == "memory_efficient_attention_partial":
            if not isinstance(res, tuple) or len(res) != 2:
                return f"partial returned {type(res).__name__}, not (out, lse)"
            return first(mismatch(res[0], want, out_dtype(fn, kw), tol),
                         mismatch(res[1], lse, torch.float32, tol * 4, "lse"))
        return mismatch(res, want, out_dtype(fn, kw), tol)
    return check


def call(fn: str, kw: dict, op):
    extra = {} if op is None else {"op": op}
    return FUNCTIONS[fn](**kw, **extra)


def valid_body(base: Base, fn: str, op, change: Change | None = None):
    def body():
        kw = base.make()
        if change is not None:
            kw = change(kw)
        return call(fn, kw, op), check_for(fn, kw, base.compute)
    return body


def invalid_body(base: Base, fn: str, op, change: Change, lenient: bool = False):
    def body():
        kw = change(base.make())
        res = call(fn, kw, op)
        return res, (check_for(fn, kw, base.compute) if lenient else None)
    return body




# ---- valid calls -------------------------------------------------------------------------------------

def _grad_body(base: Base, ops):
    """Gradients of sum(out * w) against float64 autograd through the reference."""
    def body():
        kw = base.make()
        leaves = {r: kw[r].detach().clone().requires_grad_(True) for r in QKV}
        out = fmha_ops.memory_efficient_attention(**{**kw, **leaves}, **({} if ops is None else {"op": ops}))
        w = torch.randn(out.shape, dtype=torch.float64)
        grads = torch.autograd.grad((out.double() * w).sum(), [leaves[r] for r in QKV])

        def check(_):
            ref_leaves = {r: kw[r].detach().double().requires_grad_(True) for r in QKV}
            o, _ = ex.attention(**{**kw, **ref_leaves})
            want = torch.autograd.grad((o * w).sum(), [ref_leaves[r] for r in QKV])
            tol = TOLERANCE[base.compute] * 4
            return first(*(mismatch(g, wg, kw[r].dtype, tol, f"d{r}") for g, wg, r in zip(grads, want, QKV)))
        return out, check
    return body


def _dropout_body(base: Base):
    """p > 0: the output has the call's shape and dtype and is finite (no reference for random masks)."""
    def body():
        kw = base.make()
        out = fmha_ops.memory_efficient_attention(**kw, p=0.3)

        def check(res):
            want, _ = ex.attention(**kw)
            if res.shape != want.shape or res.dtype != out_dtype("memory_efficient_attention", kw):
                return f"dropout out {tuple(res.shape)} {res.dtype}"
            return None if bool(torch.isfinite(res.float()).all()) else "dropout out has NaN/Inf"
        return out, check
    return body


def _empty(dim: int, roles=QKV) -> Change:
    return lambda kw: {**kw, **{r: kw[r].narrow(dim, 0, 0) for r in roles}}


def valid_cases() -> list[Case]:
    cases = []
    for base in BASES:
        for fn in FUNCTIONS:
            for op in base.ops:
                if fn == "memory_efficient_attention_partial" and op in (MATH, FLASH):
                    continue  # SDPA returns no LSE
                same = set_args(output_dtype=base.make()["query"].dtype) if op == "triton_attnF" else None
                cases.append(Case(f"{fn}/{base.name}/op={op}", valid_body(base, fn, op, same), valid=True))
        if not base.quantized:
            for fn in ("memory_efficient_attention", "memory_efficient_attention_partial"):
                for s in (0.0, -0.7, 3.0):  # any finite scale is an attention
                    cases.append(Case(f"{fn}/{base.name}/scale={s}", valid_body(base, fn, None, set_args(scale=s)),
                                      valid=True))
    plain = [b for b in BASES if not b.quantized and not b.packed]
    for base in plain:
        for fn in ("memory_efficient_attention", "memory_efficient_attention_partial"):
            for dim, what in ((0, "batch0"), (1, "mq0")):
                roles = ("query",) if dim == 1 else QKV
                cases.append(Case(f"{fn}/{base.name}/{what}", valid_body(base, fn, None, _empty(dim, roles)),
                                  valid=True))
            cases.append(Case(f"{fn}/{base.name}/mk0", valid_body(base, fn, REF, _empty(1, ("key", "value"))),
                              valid=True))
        for od in (torch.float32, torch.float16, torch.bfloat16):
            cases.append(Case(f"memory_efficient_attention/{base.name}/output_dtype={od}",
                              valid_body(base, "memory_efficient_attention", None, set_args(output_dtype=od)), valid=True))
        cases.append(Case(f"memory_efficient_attention/{base.name}/dropout", _dropout_body(base), valid=True))
        cases.append(Case(f"memory_efficient_attention/{base.name}/grad", _grad_body(base, None), valid=True))
        cases.append(Case(f"memory_efficient_attention/{base.name}/grad/mq0",
                          _grad_body(_with(base, _empty(1, ("query",))), None), valid=True))
    for base in BASES:  # backward ops behind a forward op without autograd
        if base.name in ("f16_gqa", "varlen_causal"):
            for bw in ("torch_referenceB", "triton_attnB"):
                mq0 = () if base.packed else (("/mq0", _empty(1, ("query",))),)
                for what, change in (("", None),) + mq0:
                    b = base if change is None else _with(base, change)
                    cases.append(Case(f"memory_efficient_attention/{base.name}/grad/op={bw}{what}",
                                      _grad_body(b, ("triton_attnF", bw)), valid=True))
    for base in BASES:
        if base.name in ("f16_gqa", "decode_bmhk"):
            for fn in ("memory_efficient_attention", "memory_efficient_attention_partial"):
                cases.append(Case(f"{fn}/{base.name}/quantize_kv_to_fp8",
                                  valid_body(base, fn, None, set_args(quantize_kv_to_fp8=True)), valid=True))
    return cases


def _with(base: Base, change: Change) -> Base:
    return Base(base.name, lambda: change(base.make()), base.compute, base.ops, base.quantized, base.packed)


# ---- invalid calls -----------------------------------------------------------------------------------

def tensor_variants(base: Base, role: str) -> list[tuple[str, tuple[str, ...], Change]]:
    """(label, names a clear message may use, change) for one of query/key/value."""
    partners = names(*QKV)
    out = []
    for label, f in tensor_kind_errors():
        nm = partners if label.startswith("ndim") or label in ("float64", "int32", "bool", "complex64") else names(role)
        if label == "meta":
            nm = names(role, "query")
        out.append((label, nm, edit_arg(role, f)))
    five = base.name == "bmghk"
    bdim, hdim = 0, (3 if five else 2)
    out += [
        ("batch+1", partners, edit_arg(role, lambda t: grow(t, bdim))),
        ("headdim-8", partners, edit_arg(role, lambda t: grow(t, -1, -8))),
        ("strided_last", names(role), edit_arg(role, strided_last)),
        ("headdim0", partners, edit_arg(role, lambda t: t[..., :0])),
    ]
    if base.name != "bmk" and not (role == "query" and base.make()["key"].shape[hdim] == 1):  # MQA takes any Hq
        out.append(("heads+1", partners, edit_arg(role, lambda t: grow(t, hdim))))
    if role == "value":
        out = [o for o in out if o[0] != "headdim-8"]  # Kv != K is allowed
    if role != "query" or base.packed:
        out.append(("seqlen+1", partners + ("attn_bias",), edit_arg(role, lambda t: grow(t, 1))))
    if five and role == "key":
        out.append(("groups-1", partners, edit_arg(role, lambda t: t[:, :, :1])))
        out.append(("groups-1_kv", partners, lambda kw: {**kw, "key": kw["key"][:, :, :1],
                                                        "value": kw["value"][:, :, :1]}))
    return out


def descale_variants(base: Base, role: str) -> list[tuple[str, tuple[str, ...], Change, bool]]:
    """(label, names, change, lenient) for one of q/k/v_descale."""
    arg = f"{role}_descale"
    nm = (arg,)
    if arg not in base.make():  # a float query (or float KV) takes no descale of this role
        return [("given", nm, set_args(**{arg: torch.ones(1)}), False),
                ("float", nm, set_args(**{arg: 0.5}), False)]
    out = [
        ("float", nm, set_args(**{arg: 0.5}), False),
        ("list", nm, edit_arg(arg, lambda d: d.tolist()), False),
        ("None", nm, set_args(**{arg: None}), False),
        ("float16", nm, edit_arg(arg, lambda d: d.half()), False),
        ("float64", nm, edit_arg(arg, lambda d: d.double()), False),
        ("int32", nm, edit_arg(arg, lambda d: d.int()), False),
        ("shape3", nm, set_args(**{arg: torch.ones(3)}), False),
        ("ndim+1", nm, edit_arg(arg, lambda d: d[None].expand(2, *d.shape).contiguous()), False),
        ("dim0+1", nm, edit_arg(arg, lambda d: grow(d.float(), 0).abs()), False),
        ("nan", nm, edit_arg(arg, lambda d: d.flatten().index_fill(0, torch.tensor([0]), math.nan).view(d.shape)), False),
        ("inf", nm, edit_arg(arg, lambda d: d.flatten().index_fill(0, torch.tensor([0]), math.inf).view(d.shape)), False),
        ("meta", nm, edit_arg(arg, lambda d: d.to("meta")), False),
        ("negative", nm, edit_arg(arg, lambda d: -d), True),
    ]
    return out


def mask_variants(base: Base) -> list[tuple[str, tuple[str, ...], Change]]:
    bias_names = ("attn_bias",)
    out = [
        ("dense_unbroadcastable", bias_names, set_args(attn_bias=torch.zeros(2, 3))),
        ("str", bias_names, set_args(attn_bias="causal")),
        ("int", bias_names, set_args(attn_bias=5)),
        ("class", bias_names, set_args(attn_bias=fmha_ops.LowerTriangularMask)),
        ("list", bias_names, set_args(attn_bias=[fmha_ops.LowerTriangularMask()])),
    ]
    if base.name.startswith("varlen"):
        out += [
            ("q_total+1", bias_names, lambda kw: {**kw, "attn_bias": ab.BlockDiagonalMask.from_seqlens([3, 1, 4], [5, 2, 6])}),
            ("q_total-1", bias_names, lambda kw: {**kw, "attn_bias": ab.BlockDiagonalMask.from_seqlens([3, 0, 3], [5, 2, 6])}),
            ("k_total+1", bias_names, lambda kw: {**kw, "attn_bias": ab.BlockDiagonalMask.from_seqlens([3, 0, 4], [5, 2, 7])}),
            ("k_total-1", bias_names, lambda kw: {**kw, "attn_bias": ab.BlockDiagonalMask.from_seqlens([3, 0, 4], [5, 2, 5])}),
            ("batch2", names(*QKV) + bias_names, lambda kw: {**kw, **{r: kw[r].expand(2, *kw[r].shape[1:]) for r in QKV}}),
            ("nseq_mismatch", bias_names + ("kv_seqlen",), lambda kw: {**kw, "attn_bias": ab.BlockDiagonalMask.from_seqlens([3, 4], [5, 2, 6])}),
            ("negative_len", bias_names + ("q_seqlen",), lambda kw: {**kw, "attn_bias": ab.BlockDiagonalMask.from_seqlens([3, -1, 5], [5, 2, 6])}),
        ]
    if base.name == "paged_causal":
        def table(f):
            return lambda kw: {**kw, "attn_bias": _paged_bias(kw["attn_bias"], f(kw["attn_bias"].block_tables))}
        tn = bias_names + ("block_tables",)
        out += [
            ("table_entry=num_pages", tn, table(lambda t: t.index_fill(1, torch.tensor([1]), 5))),
            ("table_entry=-1", tn, table(lambda t: t.index_fill(1, torch.tensor([1]), -1))),
            ("table_int64", tn, table(lambda t: t.long())),
            ("table_1d", tn, table(lambda t: t[0])),
            ("table_rows+1", tn, table(lambda t: torch.cat([t, t[:1]]))),
            ("table_meta", tn, table(lambda t: t.to("meta"))),
            ("page_size0", tn + ("page_size",), lambda kw: {**kw, "attn_bias": _paged_bias(kw["attn_bias"], None, 0)}),
            ("page_size3", tn + ("page_size",), lambda kw: {**kw, "attn_bias": _paged_bias(kw["attn_bias"], None, 3)}),
            ("kv_seqlen>padding", bias_names + ("kv_seqlen", "kv_padding"),
             lambda kw: {**kw, "attn_bias": ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 8, [9, 3])}),
            ("kv_seqlen<0", bias_names + ("kv_seqlen",),
             lambda kw: {**kw, "attn_bias": ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 8, [-1, 3])}),
        ]
    if base.name == "padded_fp8_token":
        out += [
            ("rows<nseq*padding", bias_names + ("key", "kv_padding"),
             lambda kw: {**kw, "attn_bias": ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 64, [8, 4])}),
            ("nseq_mismatch", bias_names + ("kv_seqlen", "q_seqlen"),
             lambda kw: {**kw, "attn_bias": ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 9, [9, 4, 2])}),
        ]
    return out


def _paged_bias(bias, table=None, page_size=None):
    return type(bias)(bias.q_seqinfo, bias.k_seqinfo, bias.block_tables if table is None else table,
                      bias.page_size if page_size is None else page_size)


def scalar_variants(base: Base) -> list[tuple[str, tuple[str, ...], Change, bool]]:
    out = []
    for label, val in [("neg", -0.1), ("one", 1.0), ("1.5", 1.5)] + BAD_FLOATS[:5]:
        out.append((f"p={label}", ("p",), set_args(p=val), False))
    for label, val in BAD_FLOATS:
        out.append((f"scale={label}", ("scale",), set_args(scale=val), False))
    out.append(("scale=int", ("scale",), set_args(scale=1), True))
    for label, val in BAD_OPS + [("bw_op", "torch_referenceB")]:
        out.append((f"op={label}", ("op",), set_args(op=val), False))
    for label, val in BAD_DTYPES:
        out.append((f"output_dtype={label}", ("output_dtype",), set_args(output_dtype=val), False))
    out.append(("quantize_kv_to_fp8=str", ("quantize_kv_to_fp8",), set_args(quantize_kv_to_fp8="yes"), False))
    if base.quantized or base.compute == torch.float32:
        out.append(("quantize_kv_to_fp8=True", ("quantize_kv_to_fp8",), set_args(quantize_kv_to_fp8=True), False))
    return out


def invalid_cases() -> list[Case]:
    cases = []
    for base in BASES:
        variants = []
        for role in ROLES:
            variants += [(f"{role}/{label}", nm, ch, False) for label, nm, ch in tensor_variants(base, role)]
        for role in "qkv":
            variants += [(f"{role}_descale/{label}", nm, ch, len_) for label, nm, ch, len_ in descale_variants(base, role)]
        variants += [(f"attn_bias/{label}", nm, ch, False) for label, nm, ch in mask_variants(base)]
        variants += scalar_variants(base)
        for i, (label, nm, change, lenient) in enumerate(variants):
            for j, fn in enumerate(FUNCTIONS):
                op = base.ops[(i + j) % len(base.ops)]
                if label.startswith("op=") or lenient:
                    op = None  # the variant sets op itself / a lenient call must reach a capable op
                cases.append(Case(f"{fn}/{base.name}/{label}/op={op}", invalid_body(base, fn, op, change, lenient), nm))
        if not base.quantized:
            cases.append(Case(f"memory_efficient_attention_partial/{base.name}/query/requires_grad",
                              _partial_grad_body(base), names("query") + ("requires_grad",)))
    cases += _explain_cases()
    return cases


def _partial_grad_body(base: Base):
    """Inputs requiring grad: partial attention returns no gradients, so it must refuse them."""
    def body():
        kw = base.make()
        kw["query"] = kw["query"].requires_grad_(True)
        return fmha_ops.memory_efficient_attention_partial(**kw), None
    return body


def _explain_cases() -> list[Case]:
    base = BASES[0]
    out = []
    for kind in ("zz", "", "FW", 3, None):
        out.append(Case(f"explain/{base.name}/kind={kind!r}",
                        invalid_body(base, "explain", None, set_args(kind=kind)), ("kind",)))
    for partial in ("yes", 2.0):
        out.append(Case(f"explain/{base.name}/partial={partial!r}",
                        invalid_body(base, "explain", None, set_args(partial=partial)), ("partial",)))
    return out
