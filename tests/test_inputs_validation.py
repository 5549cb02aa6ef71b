"""fmha_ops.inputs: every validation error path names the argument and the offending value; valid
combinations pass; Problem fields and the signature reflect the call."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import fmha_ops
from fmha_ops import attn_bias as ab
from fmha_ops.inputs import Inputs
from fmha_ops.quant import K_SCALE_BLOCK, Q_SCALE_BLOCK
from fmha_ops.validation import descale_kinds

F8 = torch.float8_e4m3fn
F8NUZ = torch.float8_e4m3fnuz
B, MQ, MK, HQ, HKV, D = 2, 5, 7, 4, 2, 16


def t(*shape, dtype=torch.float32, device="cpu"):
    x = torch.randn(*shape) + 0.1
    if dtype == torch.int8:
        return (x * 20).round().clamp(-127, 127).to(torch.int8).to(device)
    return x.to(dtype).to(device)


def qkv(dtype=torch.float16, kdtype=None, vdtype=None, b=B, mq=MQ, mk=MK, hq=HQ, hkv=HKV, d=D, dv=None):
    kd = kdtype or dtype
    return t(b, mq, hq, d, dtype=dtype), t(b, mk, hkv, d, dtype=kd), t(b, mk, hkv, dv or d, dtype=vdtype or kd)


def ones(*shape):
    return torch.rand(*shape) + 0.5


def check(msg, **kw):
    q, k, v = kw.pop("q", None), kw.pop("k", None), kw.pop("v", None)
    dq, dk, dv = qkv()
    inp = Inputs(dq if q is None else q, dk if k is None else k, dv if v is None else v, **kw)
    with pytest.raises(ValueError, match=msg):
        inp.validate()


# ---- tensors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["query", "key", "value"])
def test_ndim(role):
    q, k, v = qkv()
    args = {"query": q, "key": k, "value": v}
    args[role] = args[role][0]
    shape = tuple(args[role].shape)
    with pytest.raises(ValueError, match=rf"{role} must be 4-D BMHK \(batch, seqlen, heads, headdim\), got shape "
                                         rf"{re_tuple(shape)}"):
        Inputs(args["query"], args["key"], args["value"]).validate()


def re_tuple(shape):
    return "\\(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + "\\)"


@pytest.mark.parametrize("role", ["query", "key", "value"])
def test_not_a_tensor(role):
    q, k, v = qkv()
    args = {"query": q, "key": k, "value": v}
    args[role] = args[role].tolist()
    with pytest.raises(ValueError, match=rf"{role} must be a torch.Tensor, got list"):
        Inputs(args["query"], args["key"], args["value"]).validate()


@pytest.mark.parametrize("role", ["key", "value"])
def test_device_mismatch(role):
    q, k, v = qkv()
    args = {"key": k, "value": v}
    args[role] = args[role].to("meta")
    with pytest.raises(ValueError, match=rf"{role} is on meta but query is on cpu; all inputs must share a device"):
        Inputs(q, args["key"], args["value"]).validate()


@pytest.mark.parametrize("role", ["query", "key", "value"])
def test_last_dim_stride(role):
    q, k, v = qkv()
    args = {"query": q, "key": k, "value": v}
    x = args[role]
    args[role] = torch.cat([x, x], dim=-1)[..., ::2]
    msg = (r"value must be contiguous in its last dim \(stride 1\), or keys-contiguous .*; got strides \(" if role == "value"
           else rf"{role} must be contiguous in its last dim \(stride 1\), got stride 2")
    with pytest.raises(ValueError, match=msg):
        Inputs(args["query"], args["key"], args["value"]).validate()


def test_keys_contiguous_value():
    """value may be a view of (B, Hkv, Kv, L) storage (stride 1 along the keys); ops must declare it."""
    q, k, v = qkv(torch.float32)
    storage = torch.randn(B, HKV, D, MK + 1)  # 32-byte channel stride
    vk = storage.permute(0, 3, 1, 2)[:, :MK]
    inp = Inputs(q, k, vk)
    inp.validate()
    assert inp.problem().v_keys_contiguous and not Inputs(q, k, v).problem().v_keys_contiguous
    out = fmha_ops.memory_efficient_attention(q, k, vk)
    torch.testing.assert_close(out, fmha_ops.memory_efficient_attention(q, k, vk.contiguous()))
    with pytest.raises(ValueError, match="keys-contiguous value .* not supported; pass value.contiguous"):
        fmha_ops.memory_efficient_attention(q, k, vk, op="sdpa_mathF")
    odd = torch.randn(B, HKV, D, MK + 4).permute(0, 3, 1, 2)[:, :MK]  # fp32 channel stride 44 bytes
    with pytest.raises(ValueError, match="or keys-contiguous"):
        Inputs(q, k, odd).validate()


def test_non_contiguous_other_dims_is_fine():
    q, k, v = qkv(torch.float32)
    q2 = torch.randn(B, HQ, MQ, D).transpose(1, 2)  # BHMK storage viewed as BMHK
    Inputs(q2, k, v).validate()


@pytest.mark.parametrize("kw,msg", [
    (dict(v=t(B, MK + 1, HKV, D, dtype=torch.float16)),
     rf"key \({B}, {MK}, {HKV}, {D}\) and value \({B}, {MK + 1}, {HKV}, {D}\) must agree in \(batch, seqlen, heads\)"),
    (dict(v=t(B, MK, HKV + 1, D, dtype=torch.float16)), r"must agree in \(batch, seqlen, heads\)"),
    (dict(k=t(B + 1, MK, HKV, D, dtype=torch.float16), v=t(B + 1, MK, HKV, D, dtype=torch.float16)),
     rf"query batch {B} != key batch {B + 1}"),
    (dict(k=t(B, MK, HKV, D + 8, dtype=torch.float16)), rf"query head dim {D} != key head dim {D + 8}"),
    (dict(k=t(B, MK, 3, D, dtype=torch.float16), v=t(B, MK, 3, D, dtype=torch.float16)),
     r"query heads \(4\) must be a multiple of key/value heads \(3\) \(GQA/MQA\)"),
    (dict(q=t(B, MQ, 2, D, dtype=torch.float16)), None),  # Hq == Hkv: valid
    (dict(k=t(B, MK, 0, D, dtype=torch.float16), v=t(B, MK, 0, D, dtype=torch.float16)),
     r"query heads \(4\) must be a multiple of key/value heads \(0\)"),
    (dict(q=t(B, MQ, HQ, 0, dtype=torch.float16), k=t(B, MK, HKV, 0, dtype=torch.float16)),
     r"query/key head dim K=0 and value head dim Kv=16 must be >= 1"),
    (dict(v=t(B, MK, HKV, 0, dtype=torch.float16)), r"query/key head dim K=16 and value head dim Kv=0 must be >= 1"),
])
def test_shapes(kw, msg):
    if msg is None:  # Hq == Hkv is valid
        q, k, v = qkv()
        Inputs(kw["q"], k, v).validate()
        return
    check(msg, **kw)


# ---- dtypes and descales ----------------------------------------------------------------------------------

BAD_COMBOS = [
    (torch.float16, torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16, torch.bfloat16),
    (torch.float32, F8, F8),  # fp8 KV needs a 16-bit query
    (torch.float64, torch.float64, torch.float64),
    (F8, torch.bfloat16, torch.bfloat16),
    (F8, F8, F8NUZ),
    (F8, F8, torch.int8),
    (torch.int8, torch.int8, torch.int8),
    (torch.int8, F8, F8),
    (torch.bfloat16, F8, F8NUZ),
    (torch.bfloat16, torch.int8, torch.int8),
    (torch.int32, torch.int32, torch.int32),
]


@pytest.mark.parametrize("dts", BAD_COMBOS, ids=lambda d: "/".join(str(x)[6:] for x in d))
def test_bad_dtype_combo(dts):
    q, k, v = qkv(dts[0], dts[1], dts[2])
    names = "/".join(str(x).replace("torch.", "") for x in dts)
    with pytest.raises(ValueError, match=rf"query/key/value dtypes {names} not supported; supported: all float16"):
        Inputs(q, k, v, q_descale=ones(1), k_descale=ones(1), v_descale=ones(1)).validate()


GOOD = [
    ((torch.float16,) * 3, {}),
    ((torch.bfloat16,) * 3, {}),
    ((torch.float32,) * 3, {}),
    ((F8,) * 3, dict(q_descale=ones(1), k_descale=ones(1), v_descale=ones(1))),
    ((F8NUZ,) * 3, dict(q_descale=ones(B, HKV), k_descale=ones(B, HKV), v_descale=ones(B, HKV))),
    ((torch.int8, torch.int8, F8), dict(q_descale=ones(B, HQ, 1), k_descale=ones(B, HKV, 1),
                                        v_descale=ones(B, HKV, D))),
    ((torch.bfloat16, F8, F8), dict(k_descale=ones(B, MK, HKV), v_descale=ones(B, MK, HKV))),
    ((torch.float16, F8, F8), dict(k_descale=ones(B, HKV), v_descale=ones(1))),
]


@pytest.mark.parametrize("dts,desc", GOOD, ids=range(len(GOOD)))
def test_good_combos_pass_and_kinds(dts, desc):
    q, k, v = qkv(*dts)
    inp = Inputs(q, k, v, **desc)
    inp.validate()
    kinds = descale_kinds(inp)
    assert len(kinds) == 3 and all(k in ("none", "tensor", "head", "block", "channel", "token") for k in kinds)
    assert inp.out_dtype == (dts[0] if dts[0] in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16)


def test_descale_kinds_detected():
    q, k, v = qkv(torch.int8, torch.int8, F8, mq=Q_SCALE_BLOCK + 2, mk=K_SCALE_BLOCK + 1)
    inp = Inputs(q, k, v, q_descale=ones(B, HQ, 2), k_descale=ones(B, HKV, 2), v_descale=ones(B, HKV, D))
    assert descale_kinds(inp) == ("block", "block", "channel")
    q, k, v = qkv(torch.bfloat16, F8, F8)
    assert descale_kinds(Inputs(q, k, v, k_descale=ones(B, MK, HKV), v_descale=ones(1, 1))) == ("none", "token",
                                                                                                  "tensor")


@pytest.mark.parametrize("dts,missing,msg", [
    ((F8,) * 3, "q_descale", r"q_descale is required when query is float8_e4m3fn"),
    ((F8,) * 3, "k_descale", r"k_descale is required when query is float8_e4m3fn"),
    ((F8,) * 3, "v_descale", r"v_descale is required when query is float8_e4m3fn"),
    ((torch.int8, torch.int8, F8), "q_descale", r"q_descale is required when query is int8"),
    ((torch.bfloat16, F8, F8), "k_descale", r"k_descale and v_descale are required for a float8_e4m3fn KV cache"),
    ((torch.float16, F8, F8), "v_descale", r"k_descale and v_descale are required for a float8_e4m3fn KV cache"),
])
def test_missing_descales(dts, missing, msg):
    q, k, v = qkv(*dts)
    desc = dict(q_descale=ones(1), k_descale=ones(1), v_descale=ones(1))
    if dts[0] not in (F8, torch.int8):
        desc.pop("q_descale")
    desc.pop(missing)
    with pytest.raises(ValueError, match=msg):
        Inputs(q, k, v, **desc).validate()


@pytest.mark.parametrize("role", ["q_descale", "k_descale", "v_descale"])
def test_descales_on_float_inputs_rejected(role):
    check(r"descales are only for quantized inputs; query/key/value are float16", **{role: ones(1)})


@pytest.mark.parametrize("role,shape,msg", [
    ("q_descale", (B, HQ), rf"q_descale has shape \({B}, {HQ}\); supported: a scalar \(numel 1\), head \({B}, {HKV}\), "
                           rf"block \({B}, {HQ}, 1\)"),
    ("k_descale", (3,), r"k_descale has shape \(3,\); supported: a scalar \(numel 1\), head .*block .*token"),
    ("v_descale", (B, HKV, D + 1), r"v_descale has shape .*supported: .*channel \(2, 2, 16\)"),
    ("k_descale", (B, HKV, D), r"k_descale has shape \(2, 2, 16\)"),  # channel is v-only
    ("q_descale", (B, MQ, HQ), r"q_descale has shape \(2, 5, 4\)"),  # token is k/v-only
    ("v_descale", (B, HKV, 1), r"v_descale has shape \(2, 2, 1\)"),  # block is q/k-only
    ("q_descale", (0,), r"q_descale has shape \(0,\)"),
])
def test_bad_descale_shapes(role, shape, msg):
    q, k, v = qkv(F8)
    desc = dict(q_descale=ones(1), k_descale=ones(1), v_descale=ones(1))
    desc[role] = ones(*shape) if shape != (0,) else torch.ones(0)
    with pytest.raises(ValueError, match=msg):
        Inputs(q, k, v, **desc).validate()


@pytest.mark.parametrize("role", ["q_descale", "k_descale", "v_descale"])
def test_bad_descale_dtype_device_type(role):
    q, k, v = qkv(F8)
    base = dict(q_descale=ones(1), k_descale=ones(1), v_descale=ones(1))
    for bad, msg in ((ones(B, HKV).half(), rf"{role} must be float32, got float16"),
                     (ones(1).double(), rf"{role} must be float32, got float64"),
                     (ones(B, HKV).to("meta"), rf"{role} is on meta but query is on cpu"),
                     (1.0, rf"{role} must be a float32 tensor, got float")):
        with pytest.raises(ValueError, match=msg):
            Inputs(q, k, v, **{**base, role: bad}).validate()


def test_token_descales_only_for_fp8_kv_cache():
    q, k, v = qkv(F8)
    with pytest.raises(ValueError, match=r"per-token k/v descales are only for a float16/bfloat16 query"):
        Inputs(q, k, v, q_descale=ones(1), k_descale=ones(B, MK, HKV), v_descale=ones(1)).validate()


@pytest.mark.parametrize("dts", [(torch.float32,) * 3, (F8,) * 3, (torch.bfloat16, F8, F8)])
def test_quantize_kv_needs_16bit(dts):
    q, k, v = qkv(*dts)
    desc = {} if dts[0] == torch.float32 else dict(k_descale=ones(1), v_descale=ones(1))
    if dts[0] == F8:
        desc["q_descale"] = ones(1)
    with pytest.raises(ValueError, match=r"quantize_kv_to_fp8=True needs float16/bfloat16 query, key and value"):
        Inputs(q, k, v, quantize_kv_to_fp8=True, **desc).validate()


# ---- scalars ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_p_out_of_range(p):
    check(rf"p \(dropout\) must be in \[0, 1\), got {p}", p=p)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), -float("inf")])
def test_scale_not_finite(scale):
    check(rf"scale must be a finite float, got {scale}", scale=scale)


@pytest.mark.parametrize("dt", [torch.float64, torch.int8, torch.int32])
def test_output_dtype(dt):
    check(rf"output_dtype={str(dt).replace('torch.', '')} not supported; supported: float16, bfloat16, float32",
          output_dtype=dt)


def test_fp8_output_dtype_needs_fp8_values_with_a_per_tensor_descale():
    check(r"output_dtype=float8_e4m3fn needs an fp8 e4m3fn value", output_dtype=F8)
    q, k, v = qkv(F8)
    head = torch.ones(q.shape[0], k.shape[2])
    check(r"output_dtype=float8_e4m3fn needs a per-tensor v_descale", q=q, k=k, v=v, output_dtype=F8,
          q_descale=head, k_descale=head, v_descale=head)


# ---- masks -------------------------------------------------------------------------------------------------

def test_varlen_bias_consistency():
    m = ab.BlockDiagonalMask.from_seqlens([2, 3], [4, 3])
    q, k, v = qkv(mq=5, mk=7)
    with pytest.raises(ValueError, match=r"attn_bias BlockDiagonalMask needs batch 1 \(sequences packed along dim 1\), "
                                         r"got query batch 2"):
        Inputs(q, k, v, m).validate()
    q, k, v = qkv(b=1, mq=6, mk=7)
    with pytest.raises(ValueError, match=r"query has 6 tokens but attn_bias q_seqinfo covers 5"):
        Inputs(q, k, v, m).validate()
    q, k, v = qkv(b=1, mq=5, mk=8)
    with pytest.raises(ValueError, match=r"key has 8 tokens but attn_bias k_seqinfo covers 7"):
        Inputs(q, k, v, m.make_causal()).validate()
    q, k, v = qkv(b=1, mq=5, mk=7)
    Inputs(q, k, v, m.make_causal_from_bottomright()).validate()


def test_varlen_bias_sequence_count_mismatch():
    """A BlockDiagonalMask built directly (not via from_seqlens) with different q/k sequence counts."""
    bad = ab.BlockDiagonalMask(ab._SeqLenInfo.from_seqlens([2, 3]), ab._SeqLenInfo.from_seqlens([7]))
    q, k, v = qkv(b=1, mq=5, mk=7)
    with pytest.raises(ValueError, match=r"2 query sequences but 1 key sequence"):
        Inputs(q, k, v, bad).validate()


def test_padded_bias_consistency():
    m = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 2], kv_padding=8, kv_seqlen=[3, 8])
    q, k, v = qkv(b=1, mq=3, mk=15)
    with pytest.raises(ValueError, match=r"key has 15 rows but attn_bias needs at least 2 sequences x kv_padding 8"):
        Inputs(q, k, v, m).validate()
    Inputs(*qkv(b=1, mq=3, mk=20), m).validate()  # rows past nseq * padding are allowed, as in xformers
    q, k, v = qkv(b=1, mq=4, mk=16)
    with pytest.raises(ValueError, match=r"query has 4 tokens but attn_bias q_seqinfo covers 3"):
        Inputs(q, k, v, m).validate()
    q, k, v = qkv(b=1, mq=3, mk=16)
    Inputs(q, k, v, m).validate()
    mixed = ab.BlockDiagonalPaddedKeysMask(ab._SeqLenInfo.from_seqlens([1, 1, 1]), m.k_seqinfo)
    with pytest.raises(ValueError, match=r"attn_bias has 3 query sequences but .*2"):
        Inputs(*qkv(b=1, mq=3, mk=16), mixed).validate()
    on_meta = ab.BlockDiagonalPaddedKeysMask(m.q_seqinfo, m.k_seqinfo.to("meta"))
    with pytest.raises(ValueError, match=r"attn_bias k_seqinfo.seq\w+ is on meta, query on cpu; create the mask "
                                         r"with device="):
        Inputs(q, k, v, on_meta).validate()


def test_paged_bias_consistency():
    pad = ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], kv_padding=8, kv_seqlen=[3, 8])
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    m = pad.make_paged(table, page_size=4)
    q, k, v = qkv(b=1, mq=2, mk=16)
    Inputs(q, k, v, m).validate()
    q, k, v = qkv(b=1, mq=2, mk=18)
    with pytest.raises(ValueError, match=r"paged key has 18 rows, not a multiple of page_size=4"):
        Inputs(q, k, v, m).validate()
    q, k, v = qkv(b=1, mq=2, mk=16)
    with pytest.raises(ValueError, match=r"block_tables must be int32 on cpu, got int64 on cpu"):
        Inputs(q, k, v, pad.make_paged(table.long(), 4)).validate()
    with pytest.raises(ValueError, match=r"block_tables must be int32 on cpu, got int32 on meta"):
        Inputs(q, k, v, pad.make_paged(table.to("meta"), 4)).validate()
    with pytest.raises(ValueError, match=r"needs batch 1"):
        Inputs(*qkv(b=2, mq=1, mk=16), m).validate()


def test_dense_tensor_bias_shape_checked():
    q, k, v = qkv(torch.float32)
    fmha_ops.memory_efficient_attention(q, k, v, torch.zeros(MQ, MK))  # broadcastable: accepted
    with pytest.raises(ValueError, match=r"attn_bias TensorBias has shape \(2, 3\); it must be broadcastable to"):
        fmha_ops.memory_efficient_attention(q, k, v, torch.zeros(2, 3))


def test_api_layout_errors():
    q, k, v = qkv(torch.float32)
    with pytest.raises(ValueError, match=r"query is 5-D \(BMGHK\) but key is 4-D and value 4-D"):
        fmha_ops.memory_efficient_attention(q[:, :, None], k, v)
    with pytest.raises(ValueError, match=r"query must be 4-D BMHK .* got shape \(5,\)"):
        fmha_ops.memory_efficient_attention(q[0, :, 0, 0], k, v)
    with pytest.raises(ValueError, match=r"query is 3-D \(BMK\) but key is 4-D and value 4-D"):
        fmha_ops.memory_efficient_attention(q[:, :, 0], k, v)  # BMK query with BMHK key
    for role in ("query", "key", "value"):  # a 0-d tensor is named, not an IndexError from its strides
        args = {"query": q, "key": k, "value": v, role: torch.tensor(1.0)}
        with pytest.raises(ValueError, match=rf"{role} must be 4-D BMHK .* got shape \(\)"):
            fmha_ops.memory_efficient_attention(**args)


def test_api_non_tensor_query_is_value_error():
    q, k, v = qkv(torch.float32)
    with pytest.raises(ValueError, match="query must be a torch.Tensor, got list"):
        fmha_ops.memory_efficient_attention(q.tolist(), k, v)


# ---- problem and signature ------------------------------------------------------------------------------

def test_problem_fields():
    m = ab.BlockDiagonalCausalMask.from_seqlens([2, 5, 1], [3, 6, 4])
    q, k, v = qkv(torch.bfloat16, b=1, mq=8, mk=13, hq=6, hkv=2, d=32, dv=16)
    p = Inputs(q, k, v, m).problem()
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.total_q, p.heads_q, p.heads_kv, p.head_dim, p.head_dim_v) == \
        (3, 5, 6, 8, 6, 2, 32, 16)
    assert p.bias == ab.BLOCK_DIAGONAL_CAUSAL and p.causal and not p.q_uniform and p.gqa_ratio == 3
    assert p.descales == ("none",) * 3 and p.out_dtype == torch.bfloat16 and not p.needs_lse
    pad = ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], kv_padding=8, kv_seqlen=[3, 8])
    paged = pad.make_paged(torch.tensor([[3, 0, 1], [1, 2, 0]], dtype=torch.int32), page_size=4)
    q, k, v = qkv(torch.float16, F8, b=1, mq=2, mk=16)
    pp = Inputs(q, k, v, paged, k_descale=ones(1), v_descale=ones(1)).problem(needs_lse=True)
    assert (pp.batch, pp.seqlen_q, pp.seqlen_k, pp.page_size, pp.bias) == (2, 1, 12, 4, ab.PAGED)
    assert pp.kv_fp8 and pp.needs_lse and pp.q_uniform and pp.descales == ("none", "tensor", "tensor")
    assert hash(pp) == hash(Inputs(q, k, v, paged, k_descale=ones(1), v_descale=ones(1)).problem(needs_lse=True))
    assert "page=4" in str(pp) and "descale=none/tensor/tensor" in str(pp) and "lse" in str(pp)
    assert pp.bucket().startswith("float16/float8_e4m3fn/float8_e4m3fn|d16/16|paged|g2|p4|")


def test_signature_tracks_what_validation_depends_on():
    q, k, v = qkv(torch.float32)
    base = Inputs(q, k, v).signature()
    assert base == Inputs(q.clone(), k.clone(), v.clone()).signature()  # values do not matter
    hash(base)
    variants = [
        Inputs(q.half(), k.half(), v.half()), Inputs(q[:, :3], k, v), Inputs(q, k, v, p=0.1),
        Inputs(q, k, v, scale=0.5), Inputs(q, k, v, output_dtype=torch.float16), Inputs(q, k, v, is_partial=True),
        Inputs(q, k, v, ab.LowerTriangularMask()), Inputs(q, k, v, ab.LowerTriangularFromBottomRightMask()),
        Inputs(torch.cat([q, q], -1)[..., ::2], k, v), Inputs(q.requires_grad_(True), k, v),
    ]
    sigs = [x.signature() for x in variants]
    assert base not in sigs and len(set(sigs)) == len(sigs)
    with torch.no_grad():
        assert Inputs(q, k, v).signature() == base  # requires_grad under no_grad: no grad needed


#: ``Problem`` fields no CPU call can vary, and the ``Signature`` item that holds each
_SIGNATURE_HOLDS_ELSEWHERE = {"arch": "devices (one device here)", "graph_capture": "capturing (a CUDA graph)"}


@contextlib.contextmanager
def _deterministic():
    """``torch.use_deterministic_algorithms(True)`` for a block."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _selection_variants() -> dict:
    """name -> two calls ``(Inputs, needs_lse, process state)`` that differ in what validation or selection reads:
    one variant at least for every ``Problem`` field and every ``Inputs`` field (``layout`` aside: only results read
    it)."""
    q, k, v = qkv(torch.float16, mk=8)
    base = (Inputs(q, k, v), False, contextlib.nullcontext)

    def call(q=q, k=k, v=v, needs_lse=False, state=contextlib.nullcontext, **fields):
        return Inputs(q, k, v, **fields), needs_lse, state

    pad = ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], kv_padding=8, kv_seqlen=[3, 8])
    table4 = torch.tensor([[3, 0, 1], [1, 2, 0]], dtype=torch.int32)
    table2 = torch.tensor([[3, 0, 1, 5], [1, 2, 0, 7]], dtype=torch.int32)
    pq, pk, pv = qkv(torch.float16, F8, b=1, mq=2, mk=16)
    fp8 = dict(q=pq, k=pk, v=pv, attn_bias=pad.make_paged(table4, page_size=4), k_descale=ones(1), v_descale=ones(1))
    lens = torch.tensor([3, 8], dtype=torch.int32)
    paged = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_device_seqlens
    fq, fk, fv = qkv(F8)
    dense_fp8 = dict(q=fq, k=fk, v=fv, q_descale=ones(1), k_descale=ones(1), v_descale=ones(1))
    keys_major = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    misaligned = torch.cat([torch.zeros(*q.shape[:-1], 4, dtype=q.dtype), q], dim=-1)[..., 4:]
    bias = t(B, HQ, MQ, 8)
    return {
        "dtypes": (base, call(*qkv(torch.bfloat16, mk=8))),
        "output_dtype": (base, call(output_dtype=torch.float32)),
        "batch": (base, call(*qkv(torch.float16, b=3, mk=8))),
        "seqlen_q": (base, call(*qkv(torch.float16, mq=3, mk=8))),
        "seqlen_k": (base, call(*qkv(torch.float16, mk=9))),
        "heads_q": (base, call(*qkv(torch.float16, mk=8, hq=6))),
        "heads_kv": (base, call(*qkv(torch.float16, mk=8, hkv=4))),
        "head_dim": (base, call(*qkv(torch.float16, mk=8, d=32))),
        "head_dim_v": (base, call(*qkv(torch.float16, mk=8, dv=32))),
        "mask kind": (base, call(attn_bias=ab.LowerTriangularMask())),
        "q_uniform": tuple(call(*qkv(torch.float16, b=1, mq=6, mk=8), attn_bias=ab.BlockDiagonalMask.from_seqlens(
            lens, [4, 4])) for lens in ([3, 3], [2, 4])),
        "page_size": (call(**fp8), call(**{**fp8, "attn_bias": pad.make_paged(table2, page_size=2)})),
        "kv descales": (call(**fp8), call(**{**fp8, "k_descale": ones(4, 4, HKV), "v_descale": ones(4, 4, HKV)})),
        "q descale": (call(**dense_fp8), call(**{**dense_fp8, "q_descale": ones(B, HKV)})),
        "quantize_kv": tuple(call(*qkv(torch.float16, b=1, mq=2, mk=16), attn_bias=fp8["attn_bias"],
                                  quantize_kv_to_fp8=quantize) for quantize in (False, True)),
        "dropout": (base, call(p=0.1)),
        "needs_lse": (base, call(needs_lse=True)),
        "is_partial": (base, call(is_partial=True)),
        "needs_grad": (base, call(q=q.clone().requires_grad_())),
        "deterministic": (base, call(state=_deterministic)),
        "fp8_backward": (base, call(state=lambda: fmha_ops.set_fp8_dequantized_backward(True))),
        "value keys-contiguous": (base, call(v=keys_major)),
        "misaligned": (base, call(q=misaligned)),
        "window_left": (call(attn_bias=ab.LowerTriangularFromBottomRightMask()),
                        call(attn_bias=ab.LowerTriangularFromBottomRightLocalAttentionMask(3))),
        "window_right": (call(attn_bias=ab.LocalAttentionFromBottomRightMask(2, -1)),
                         call(attn_bias=ab.LocalAttentionFromBottomRightMask(2, 1))),
        "softcap": (base, call(softcap=30.0)),
        "negative scale": (call(scale=0.5), call(scale=-0.5)),
        "bias_grad": (call(attn_bias=ab.TensorBias(bias)),
                      call(attn_bias=ab.TensorBias(bias.clone().requires_grad_()))),
        "sinks": (base, call(sinks=ones(HQ))),
        "key_start": tuple(call(*qkv(torch.float16, b=1, mq=2, mk=16), attn_bias=paged(1, lens, table4, 4,
                                                                                        key_start=start))
                           for start in (None, torch.zeros(2, dtype=torch.int32))),
    }


def _selected_on(variant) -> tuple:
    """(Signature, Problem) of one call as the selector keys and builds them."""
    from fmha_ops.validation import make_problem

    inp, needs_lse, state = variant
    with state():
        return inp.signature(needs_lse), make_problem(inp, needs_lse)


@pytest.mark.parametrize("name", list(_selection_variants()))
def test_signature_changes_with_every_difference_selection_reads(name):
    """Two calls whose ``Problem`` (what the declarations and the cost models read) differ have different memo keys:
    a field selection reads but ``Inputs.signature`` leaves out fails here."""
    (sig_a, prob_a), (sig_b, prob_b) = (_selected_on(x) for x in _selection_variants()[name])
    assert prob_a != prob_b, f"the variant {name!r} changes no Problem field"
    assert sig_a != sig_b, f"calls differing in {name!r} share a signature: the selector would reuse one's op"


def test_signature_variants_cover_every_field_selection_reads():
    """Every ``Problem`` field and every ``Inputs`` field is varied by some case above: a new field needs a variant
    (and so an item of ``Signature`` that holds it)."""
    from fmha_ops.problem import Problem

    varied_problem, varied_inputs = set(), set()
    for pair in _selection_variants().values():
        (_, a), (_, b) = (_selected_on(x) for x in pair)
        varied_problem |= {f.name for f in dataclasses.fields(Problem) if getattr(a, f.name) != getattr(b, f.name)}
        x, y = pair[0][0], pair[1][0]
        varied_inputs |= {f.name for f in dataclasses.fields(Inputs)
                          if _differs(getattr(x, f.name), getattr(y, f.name))}
    missing = {f.name for f in dataclasses.fields(Problem)} - varied_problem - set(_SIGNATURE_HOLDS_ELSEWHERE)
    assert not missing, f"Problem fields no variant changes: {sorted(missing)}"
    assert not {f.name for f in dataclasses.fields(Inputs)} - varied_inputs - {"layout"}


def _differs(x, y) -> bool:
    """Two values of an ``Inputs`` field differ: other objects for tensors and masks, else unequal values."""
    if isinstance(x, (torch.Tensor, ab.AttentionBias)) or isinstance(y, (torch.Tensor, ab.AttentionBias)):
        return x is not y
    return x != y


def test_forward_requires_grad_gets_an_lse_after_a_plain_call_of_its_shape():
    """The selector's key holds whether the caller needs the LSE: a plain call first (whose pick may return none)
    leaves the LSE of ``memory_efficient_attention_forward_requires_grad`` as a call of its own gives it."""
    q, k, v = qkv(torch.float32)
    with torch.no_grad():
        fmha_ops.memory_efficient_attention(q, k, v)
    out, lse = fmha_ops.memory_efficient_attention_forward_requires_grad(q, k, v)
    assert lse is not None and lse.shape == (B, HQ, MQ)
    torch.testing.assert_close(out, fmha_ops.memory_efficient_attention(q, k, v))


def test_misaligned_inputs_are_not_given_to_tma_ops():
    """A query starting 8 bytes into its storage: TMA ops (triton_attnF here) say so and are skipped; a forced
    one raises naming the input; the selector's pick computes the right answer."""
    q, k, v = qkv(torch.float16)
    qm = torch.cat([torch.zeros(B, MQ, HQ, 4, dtype=torch.float16), q], dim=-1)[..., 4:]
    assert qm.data_ptr() % 16 == 8 and torch.equal(qm, q)
    assert Inputs(qm, k, v).problem().misaligned == ("query start address 8 bytes past a 16-byte boundary",)
    assert not Inputs(q, k, v).problem().misaligned
    with pytest.raises(ValueError, match="query start address 8 bytes past a 16-byte boundary: not a multiple of 16"):
        fmha_ops.memory_efficient_attention(qm, k, v, op="triton_attnF")
    out = fmha_ops.memory_efficient_attention(qm, k, v)
    torch.testing.assert_close(out, fmha_ops.memory_efficient_attention(q, k, v), atol=2e-3, rtol=2e-3)


def test_misaligned_strides_are_not_given_to_tma_ops():
    """Rows 2 * (K + 4) bytes apart (a slice of wider rows, start aligned): the descriptor strides are not 16-byte
    multiples, so TMA ops refuse the key naming it; a keys-contiguous value (unit seq stride) and a size-1 dim's
    stride do not count; the memo key tells the layouts apart."""
    q, k, v = qkv(torch.float16)
    ks = torch.cat([k, torch.zeros(*k.shape[:-1], 4, dtype=k.dtype)], dim=-1)[..., :k.shape[-1]]
    assert ks.data_ptr() % 16 == 0 and torch.equal(ks, k)
    assert Inputs(q, ks, v).problem().misaligned == (f"key head stride {D + 4} elements ({2 * (D + 4)} bytes)",)
    assert Inputs(q, ks, v).signature() != Inputs(q, k, v).signature()
    q8, k8, v8 = qkv(torch.float16, mk=8)  # keys-contiguous value: (B, Hkv, Dv, 8 keys) rows of 16 bytes
    assert not Inputs(q8, k8, v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)).problem().misaligned
    assert not Inputs(q[:1].as_strided(q[:1].shape, (3,) + q.stride()[1:]), k[:1], v[:1]).problem().misaligned
    with pytest.raises(ValueError, match=r"key head stride 20 elements \(40 bytes\): not a multiple of 16 bytes, "
                                         r"which this op's TMA descriptors"):
        fmha_ops.memory_efficient_attention(q, ks, v, op="triton_attnF")
    torch.testing.assert_close(fmha_ops.memory_efficient_attention(q, ks, v),
                               fmha_ops.memory_efficient_attention(q, k, v), atol=2e-3, rtol=2e-3)


def test_varlen_mask_on_another_device_is_named_and_keyed():
    """A varlen mask whose starts live on another device than the query: a ValueError naming the field and the
    fix (a kernel would read a host pointer); the device is part of the mask's signature, so a plan made for one
    device is never reused for a mask on another."""
    q = torch.randn(1, 5, 2, 8)
    mask = ab.BlockDiagonalMask.from_seqlens([2, 3], [4, 1])
    elsewhere = mask.to("meta")
    with pytest.raises(ValueError, match=r"attn_bias q_seqinfo.seqstart is on meta, query on cpu; create the mask "
                                         r"with device=query.device"):
        Inputs(q, torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), elsewhere).validate()
    assert mask.signature() != elsewhere.signature()
