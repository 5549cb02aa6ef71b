"""Cases for the fmha_ops.quant helpers and the mask constructors."""
from __future__ import annotations

import math

import torch

from fmha_ops import attn_bias as ab
from fmha_ops import quant

from .common import F8, call_body, edit_arg, mismatch, rnd, set_args, tensor_kind_errors
from .runner import Case






def _bmhk(*shape):
    return lambda: rnd(*shape, dtype=torch.float32)


def _fp8_round(kw, res):
    x8, d = res
    hkv = d.shape[1]
    b, m, h, dd = kw["x"].shape
    deq = x8.double().reshape(b, m, hkv, h // hkv, dd) * d.double()[:, None, :, None, None]
    return mismatch(deq.reshape(b, m, h, dd), kw["x"].double(), None, 0.07, "dequantized")


def _qkv_round(kw, res):
    q8, k8, v8, qd, kd, vd = res
    bad = []
    for x, x8, d in ((kw["q"], q8, qd), (kw["k"], k8, kd), (kw["v"], v8, vd)):
        b, m, h, dd = x.shape
        hkv = d.shape[1]
        deq = x8.double().reshape(b, m, hkv, h // hkv, dd) * d.double()[:, None, :, None, None]
        bad.append(mismatch(deq.reshape(x.shape), x.double(), None, 0.07, "dequantized"))
    return next((m for m in bad if m), None)


def _blocks_round(kw, res):
    xq, d = res
    deq = quant.dequantize_blocks(xq, d, kw["block"])
    tol = 0.01 if kw.get("dtype", torch.int8) == torch.int8 else 0.07
    return mismatch(deq, kw["x"].double(), None, tol, "dequantized")


def _i8fp8_check(kw, res):
    if not isinstance(res, quant.I8FP8Inputs):
        return f"quantize_i8fp8 returned {type(res).__name__}"
    v = res.v.double() * (res.v_descale.double()[:, None] if res.v_descale.numel() > 1 else res.v_descale.double())
    return mismatch(v, kw["v"].double(), None, 0.07, "dequantized v")


def quant_cases() -> tuple[list[Case], list[Case]]:
    def fp8_make():
        return dict(x=_bmhk(2, 5, 4, 16)(), num_kv_heads=2)

    def qkv_make():
        return dict(q=_bmhk(2, 5, 4, 16)(), k=_bmhk(2, 7, 2, 16)(), v=_bmhk(2, 7, 2, 16)())

    def blocks_make():
        return dict(x=_bmhk(2, 150, 2, 16)(), block=128)

    def deq_make():
        xq, d = quant.quantize_blocks(_bmhk(2, 150, 2, 16)(), 128)
        return dict(xq=xq, descale=d, block=128)

    def chan_make():
        return dict(v=_bmhk(2, 7, 2, 16)(), dtype=F8)

    def chan_q_make():
        v = _bmhk(2, 7, 2, 16)()
        return dict(v=v, descale=quant.fp8_channel_descale(v, F8), dtype=F8)

    valid = [Case("quant.quantize_fp8/gqa", call_body(quant.quantize_fp8, fp8_make, check=_fp8_round), valid=True),
             Case("quant.quantize_fp8/default_heads", call_body(quant.quantize_fp8, fp8_make, set_args(num_kv_heads=None),
                                                            check=_fp8_round), valid=True),
             Case("quant.quantize_qkv_fp8/gqa", call_body(quant.quantize_qkv_fp8, qkv_make, check=_qkv_round), valid=True),
             Case("quant.quantize_blocks/int8", call_body(quant.quantize_blocks, blocks_make, check=_blocks_round), valid=True),
             Case("quant.quantize_blocks/fp8", call_body(quant.quantize_blocks, blocks_make, set_args(dtype=F8),
                                                     check=_blocks_round), valid=True)]
    for g in ("block", "head", "tensor"):
        for vg in ("channel", "tensor"):
            valid.append(Case(f"quant.quantize_i8fp8/{g}/{vg}",
                              call_body(quant.quantize_i8fp8, qkv_make, set_args(qk_granularity=g, v_granularity=vg),
                                    check=_i8fp8_check), valid=True))
    invalid = []

    def add(name, fn, make, variants):
        invalid.extend(Case(f"quant.{name}/{l}", call_body(fn, make, ch), nm) for l, nm, ch in variants)

    tk = [(l, f) for l, f in tensor_kind_errors() if l not in ("float64",)]

    def tensor_args(*args):
        out = []
        for a in args:  # meta is a device like any other for a one-tensor helper
            out += [(f"{a}/{l}", (a,), edit_arg(a, f)) for l, f in tk if len(args) > 1 or l != "meta"]
        return out

    bad_dtype = [("dtype=float16", ("dtype",), set_args(dtype=torch.float16)), ("dtype=str", ("dtype",), set_args(dtype="fp8"))]
    add("quantize_fp8", quant.quantize_fp8, fp8_make, tensor_args("x") + bad_dtype + [
        ("num_kv_heads=3", ("num_kv_heads",), set_args(num_kv_heads=3)), ("num_kv_heads=0", ("num_kv_heads",), set_args(num_kv_heads=0)),
        ("num_kv_heads=-2", ("num_kv_heads",), set_args(num_kv_heads=-2)), ("num_kv_heads=2.0", ("num_kv_heads",), set_args(num_kv_heads=2.0))])
    add("quantize_qkv_fp8", quant.quantize_qkv_fp8, qkv_make, tensor_args("q", "k", "v") + bad_dtype + [
        ("k/heads3", ("k", "q"), edit_arg("k", lambda t: torch.cat([t, t[:, :, :1]], 2))),
        ("k/headdim8", ("k", "q"), edit_arg("k", lambda t: t[..., :8])),
        ("v/seqlen-1", ("v", "k"), edit_arg("v", lambda t: t[:, :-1]))])
    add("quantize_blocks", quant.quantize_blocks, blocks_make, tensor_args("x") + [
        ("block=0", ("block",), set_args(block=0)), ("block=-1", ("block",), set_args(block=-1)),
        ("block=2.5", ("block",), set_args(block=2.5)), ("dtype=float16", ("dtype",), set_args(dtype=torch.float16)),
        ("dtype=int32", ("dtype",), set_args(dtype=torch.int32))])
    add("dequantize_blocks", quant.dequantize_blocks, deq_make, tensor_args("xq", "descale") + [
        ("descale/blocks-1", ("descale", "xq", "block"), edit_arg("descale", lambda d: d[..., :1])),
        ("descale/heads-1", ("descale", "xq"), edit_arg("descale", lambda d: d[:, :1])),
        ("block=0", ("block",), set_args(block=0)), ("block=64", ("block", "descale"), set_args(block=64))])
    add("fp8_channel_descale", quant.fp8_channel_descale, chan_make, tensor_args("v") + [
        ("dtype=int8", ("dtype",), set_args(dtype=torch.int8)), ("dtype=float16", ("dtype",), set_args(dtype=torch.float16))])
    add("quantize_fp8_channels", quant.quantize_fp8_channels, chan_q_make, tensor_args("v", "descale") + [
        ("descale/shape", ("descale", "v"), edit_arg("descale", lambda d: d[:, :, :8])),
        ("descale/nan", ("descale",), edit_arg("descale", lambda d: torch.full_like(d, math.nan))),
        ("dtype=int8", ("dtype",), set_args(dtype=torch.int8))])
    add("quantize_i8fp8", quant.quantize_i8fp8, qkv_make, tensor_args("q", "k", "v") + [
        ("scale=nan", ("scale",), set_args(scale=math.nan)), ("scale=str", ("scale",), set_args(scale="1")),
        ("scale=inf", ("scale",), set_args(scale=math.inf)),
        ("qk_granularity=zz", ("qk_granularity",), set_args(qk_granularity="zz")),
        ("v_granularity=zz", ("v_granularity",), set_args(v_granularity="zz")),
        ("fp8_dtype=int8", ("fp8_dtype",), set_args(fp8_dtype=torch.int8)),
        ("k/headdim8", ("k", "q"), edit_arg("k", lambda t: t[..., :8])),
        ("k/heads3", ("k", "q"), edit_arg("k", lambda t: torch.cat([t, t[:, :, :1]], 2))),
        ("v/seqlen-1", ("v", "k"), edit_arg("v", lambda t: t[:, :-1])),
        ("smooth_k=str", ("smooth_k",), set_args(smooth_k="no"))])
    return valid, invalid


def _starts(kw, res):
    want = [0]
    for n in kw["q_seqlen"]:
        want.append(want[-1] + n)
    return None if res.q_seqinfo.seqstart_py == want else f"seqstart_py {res.q_seqinfo.seqstart_py} != {want}"


def mask_cases() -> tuple[list[Case], list[Case]]:
    bd = ab.BlockDiagonalMask.from_seqlens
    pk = ab.BlockDiagonalPaddedKeysMask.from_seqlens

    def bd_make():
        return dict(q_seqlen=[2, 0, 3], kv_seqlen=[4, 1, 2])

    def pk_make():
        return dict(q_seqlen=[1, 1], kv_padding=8, kv_seqlen=[5, 8])

    valid = [Case("attn_bias.BlockDiagonalMask.from_seqlens/valid", call_body(bd, bd_make, check=_starts), valid=True),
             Case("attn_bias.BlockDiagonalPaddedKeysMask.from_seqlens/valid", call_body(pk, pk_make, check=_starts),
                  valid=True)]
    invalid = [Case(f"attn_bias.BlockDiagonalMask.from_seqlens/{l}", call_body(bd, bd_make, ch), nm) for l, nm, ch in [
        ("q_seqlen=negative", ("q_seqlen",), set_args(q_seqlen=[2, -1, 3])),
        ("q_seqlen=float", ("q_seqlen",), set_args(q_seqlen=[2, 0.5, 3])),
        ("q_seqlen=str", ("q_seqlen",), set_args(q_seqlen="23")),
        ("q_seqlen=int", ("q_seqlen",), set_args(q_seqlen=3)),
        ("kv_seqlen=fewer", ("kv_seqlen", "q_seqlen"), set_args(kv_seqlen=[4, 1])),
        ("kv_seqlen=negative", ("kv_seqlen",), set_args(kv_seqlen=[4, -1, 2]))]]
    invalid += [Case(f"attn_bias.BlockDiagonalPaddedKeysMask.from_seqlens/{l}", call_body(pk, pk_make, ch), nm)
                for l, nm, ch in [
        ("kv_seqlen>padding", ("kv_seqlen", "kv_padding"), set_args(kv_seqlen=[5, 9])),
        ("kv_seqlen=negative", ("kv_seqlen",), set_args(kv_seqlen=[5, -1])),
        ("kv_padding=0", ("kv_padding", "kv_seqlen"), set_args(kv_padding=0)),
        ("kv_padding=-1", ("kv_padding", "kv_seqlen"), set_args(kv_padding=-1)),
        ("kv_seqlen=fewer", ("kv_seqlen", "q_seqlen"), set_args(kv_seqlen=[5])),
        ("kv_padding=str", ("kv_padding",), set_args(kv_padding="8"))]]

    def paged(table, page_size):
        def fn():
            return pk(**pk_make()).make_paged(table, page_size), None
        return fn
    t = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    for l, nm, table, ps in [("block_tables=1d", ("block_tables",), t[0], 4),
                             ("block_tables=rows3", ("block_tables",), torch.cat([t, t[:1]]), 4),
                             ("page_size=0", ("page_size",), t, 0), ("page_size=-4", ("page_size",), t, -4),
                             ("capacity<kv_seqlen", ("block_tables", "page_size", "kv_seqlen"), t, 2),
                             ("block_tables=list", ("block_tables",), t.tolist(), 4)]:
        invalid.append(Case(f"attn_bias.make_paged/{l}", paged(table, ps), nm))
    return valid, invalid
