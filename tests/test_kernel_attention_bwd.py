"""Triton attention backward kernel vs float32/float64 torch autograd of a reference attention.

CPU: tiny shapes through the Triton interpreter (default tiles and small tiles that exercise
multi-block loops, diagonal and tail masks). GPU (``-m gpu``): real sizes, head dims 64/128/256.
"""
import math
import os

import pytest
import torch

from tests.conftest import DEVICE


def _patch_interpreter():
    """Work around two triton 3.6 interpreter bugs (CPU tests only; the GPU is unaffected):
    numpy >= 2.4 refuses ``int()`` of a size-1 array, which the interpreter uses for runtime loop
    bounds (``tl.range(lo, hi)``); and ``tl.dot`` multiplies bf16 operands as their raw uint16 bits."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_fmha_bwd_patched", False):
        return
    interpreter._fmha_bwd_patched = True
    orig_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    orig_dot = interpreter.InterpreterBuilder.create_dot

    def bf16_to_f32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args):
        return orig_dot(self, bf16_to_f32(a), bf16_to_f32(b), d, *args)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()
from fmha_ops.testing import error_report, transformer_like

# Tolerances on relative L2 error of each gradient (bf16 operands in p, ds: ~2^-9 rounding per term).
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _small_cfg():
    from fmha_ops.kernels.triton.attention_bwd import BwdConfig

    return BwdConfig(16, 32, 4, 1, 32, 16, 4, 1)


def ref_attention(q, k, v, scale, causal, bottom_right, seqlens_q=None, seqlens_k=None):
    """out, lse (natural log, -inf for rows with no visible key) in BMHK; differentiable."""
    Mq, Hq = q.shape[1], q.shape[2]
    Mk, Hkv = k.shape[1], k.shape[2]
    if seqlens_q is not None:  # varlen packed: block-diagonal mask
        sq = torch.repeat_interleave(torch.arange(len(seqlens_q)), torch.tensor(seqlens_q))
        sk = torch.repeat_interleave(torch.arange(len(seqlens_k)), torch.tensor(seqlens_k))
        cq = torch.cumsum(torch.tensor([0] + list(seqlens_q)), 0)
        ck = torch.cumsum(torch.tensor([0] + list(seqlens_k)), 0)
        iq = torch.arange(Mq) - cq[sq]
        jk = torch.arange(Mk) - ck[sk]
        vis = sq[:, None] == sk[None, :]
        off = (torch.tensor(seqlens_k)[sq] - torch.tensor(seqlens_q)[sq])[:, None] if bottom_right else 0
    else:
        iq, jk = torch.arange(Mq), torch.arange(Mk)
        vis = torch.ones(Mq, Mk, dtype=torch.bool)
        off = Mk - Mq if bottom_right else 0
    if causal:
        vis = vis & (jk[None, :] <= iq[:, None] + off)
    vis = vis.to(q.device)
    g = Hq // Hkv
    kk = k.repeat_interleave(g, dim=2)
    vv = v.repeat_interleave(g, dim=2)
    s = torch.einsum("bmhd,bnhd->bhmn", q, kk) * scale
    lse = s.detach().masked_fill(~vis, float("-inf")).logsumexp(-1)
    p = torch.softmax(s.masked_fill(~vis, -1e30), -1) * vis.any(-1)[:, None].to(s.dtype)
    out = torch.einsum("bhmn,bnhd->bmhd", p, vv)
    return out, lse


def _inputs(shape_q, shape_kv, dv, dtype, dist, seed):
    if dist == "normal":
        g = torch.Generator(device="cpu").manual_seed(seed)
        q = torch.randn(*shape_q, generator=g)
        k = torch.randn(*shape_kv, generator=g)
        v = torch.randn(*shape_kv[:3], dv, generator=g)
    else:
        q, k, v = (t.float() for t in transformer_like(shape_q, shape_kv, dtype=dtype, seed=seed))
        if dv != shape_kv[3]:
            v = torch.randn(*shape_kv[:3], dv, generator=torch.Generator().manual_seed(seed + 1))
    do = torch.randn(*shape_q[:3], dv, generator=torch.Generator().manual_seed(seed + 2))
    return [t.to(dtype).to(DEVICE) for t in (q, k, v, do)]


def _check(B, Mq, Mk, Hq, Hkv, D, Dv=None, *, causal=False, bottom_right=True, dtype=torch.bfloat16,
           dist="normal", seed=0, cfg=None, seqlens=None, strided=False):
    from fmha_ops.kernels.triton.attention_bwd import attention_backward

    Dv = Dv or D
    q, k, v, do = _inputs((B, Mq, Hq, D), (B, Mk, Hkv, D), Dv, dtype, dist, seed)
    if strided:  # q, k inside a wider buffer (non-contiguous rows and heads)
        qb = torch.randn(B, Mq, Hq + 1, D + 16, device=DEVICE, dtype=dtype)
        qb[:, :, 1:, 8:8 + D] = q
        q = qb[:, :, 1:, 8:8 + D]
        kb = torch.randn(B, Mk, 2, Hkv, D, device=DEVICE, dtype=dtype)
        kb[:, :, 1] = k
        k = kb[:, :, 1]
    ref_dtype = torch.float64 if DEVICE == "cpu" else torch.float32
    qr, kr, vr = (t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v))
    scale = 1.0 / math.sqrt(D)
    sq, sk = seqlens if seqlens else (None, None)
    out, lse = ref_attention(qr, kr, vr, scale, causal, bottom_right, sq, sk)
    out.backward(do.to(ref_dtype))
    kw = {}
    if seqlens:
        cq = torch.tensor([0] + list(sq), device=DEVICE).cumsum(0).to(torch.int32)
        ck = torch.tensor([0] + list(sk), device=DEVICE).cumsum(0).to(torch.int32)
        kw = {"cu_seqlens_q": cq, "cu_seqlens_k": ck, "max_seqlen_q": max(sq), "max_seqlen_k": max(sk)}
    dq, dk, dv = (torch.full(t.shape, float("nan"), device=DEVICE, dtype=dtype) for t in (q, k, v))
    res = attention_backward(do, q, k, v, out.detach().to(dtype), lse.float(), scale=scale, causal=causal,
                             causal_bottom_right=bottom_right, dq=dq, dk=dk, dv=dv, config=cfg, **kw)
    assert res[0] is dq and res[1] is dk and res[2] is dv
    reports = {}
    for name, got, ref in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        assert got.dtype == dtype
        assert not got.isnan().any(), f"{name}: unwritten (NaN) elements"
        rep = error_report(got, ref)
        reports[name] = rep
        if ref.abs().max() == 0:  # e.g. dq of a row that sees one key: only bf16 rounding of `out` remains
            assert rep["max"] < 1e-4, (name, rep)
        else:
            assert rep["rel"] < TOL[dtype], (name, rep)
            assert rep["cos"] > 1 - 2 * TOL[dtype] ** 2, (name, rep)
    blind = lse.isinf().transpose(1, 2).to(DEVICE)  # (B, Mq, Hq): rows that see no key
    assert (dq[blind] == 0).all()
    return reports


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("causal,bottom_right", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("Mq,Mk", [(17, 17), (1, 40), (45, 23), (64, 96)])
def test_bwd_cpu_shapes(small, causal, bottom_right, Mq, Mk):
    if small and (Mq, Mk) == (1, 40):
        pytest.skip("covered by the default-tile case")
    _check(2, Mq, Mk, 2, 1, 32, causal=causal, bottom_right=bottom_right, cfg=_small_cfg() if small else None,
           seed=Mq * 7 + Mk)


@pytest.mark.parametrize("hq,hkv", [(1, 1), (4, 1), (6, 2), (16, 1)])
def test_bwd_cpu_gqa(hq, hkv):
    _check(1, 33, 37, hq, hkv, 16, causal=True, cfg=_small_cfg(), seed=hq)


@pytest.mark.parametrize("dist", ["normal", "transformer_like"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bwd_cpu_dtypes_dists(dtype, dist):
    r = _check(1, 50, 70, 2, 2, 64, dtype=dtype, dist=dist, causal=True, cfg=_small_cfg(), seed=3)
    print(dtype, dist, r)


def test_bwd_cpu_dv_differs_and_strided():
    _check(1, 40, 29, 4, 2, 32, 64, causal=True, cfg=_small_cfg(), strided=True, seed=5)


@pytest.mark.parametrize("bottom_right", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_cpu_varlen(causal, bottom_right):
    seqlens = ([5, 0, 1, 37, 18, 3], [7, 4, 1, 30, 0, 3])
    _check(1, sum(seqlens[0]), sum(seqlens[1]), 4, 2, 32, causal=causal, bottom_right=bottom_right,
           cfg=_small_cfg(), seqlens=seqlens, seed=11)


def test_bwd_cpu_empty():
    from fmha_ops.kernels.triton.attention_bwd import attention_backward

    q = torch.randn(1, 0, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(1, 5, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(1, 2, 0, device=DEVICE)
    dq, dk, dv = attention_backward(q, q, k, k, q, lse, scale=0.1)
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()


GPU_CASES = [
    # B, Mq, Mk, Hq, Hkv, D, causal, bottom_right
    (2, 1000, 1000, 8, 8, 128, False, True),
    (2, 1000, 1000, 8, 2, 128, True, True),
    (1, 1, 1000, 16, 1, 64, True, True),
    (1, 4097, 4097, 4, 1, 64, True, False),
    (2, 1000, 1700, 8, 4, 256, True, True),
    (1, 1700, 1000, 8, 4, 256, True, True),
    (2, 777, 513, 16, 16, 256, False, True),
    (2, 17, 17, 12, 3, 128, True, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["normal", "transformer_like"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_bwd_gpu(case, dist):
    B, Mq, Mk, Hq, Hkv, D, causal, br = case
    r = _check(B, Mq, Mk, Hq, Hkv, D, causal=causal, bottom_right=br, dist=dist, seed=B * Mq + D)
    print(case, dist, {n: {k: f"{x:.3g}" for k, x in rep.items()} for n, rep in r.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_bwd_gpu_varlen(D, causal):
    seqlens = ([1000, 0, 1, 17, 513, 2049], [900, 5, 1, 0, 513, 2100])
    r = _check(1, sum(seqlens[0]), sum(seqlens[1]), 8, 2, D, causal=causal, seqlens=seqlens, seed=D,
               dist="transformer_like")
    print("varlen", D, causal, r)


@pytest.mark.gpu
def test_bwd_gpu_fp16_strided_deterministic():
    from fmha_ops.kernels.triton.attention_bwd import attention_backward

    _check(2, 1000, 1000, 8, 2, 128, causal=True, dtype=torch.float16, strided=True, seed=9)
    q, k, v, do = _inputs((2, 2048, 8, 128), (2, 2048, 2, 128), 128, torch.bfloat16, "normal", 1)
    scale = 128 ** -0.5
    out, lse = ref_attention(q.float(), k.float(), v.float(), scale, True, True)
    a = attention_backward(do, q, k, v, out.to(q.dtype), lse, scale=scale, causal=True)
    b = attention_backward(do, q, k, v, out.to(q.dtype), lse, scale=scale, causal=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
