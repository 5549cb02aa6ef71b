"""Local (sliding-window) attention and softcap in the Triton forward and backward kernels, against a float64
(CPU) / float32 (GPU) reference that applies the visibility rule to a dense score matrix.

Visibility (the kernels' contract): key j is visible from query i iff the causal rule allows it (if causal) and
i_al - window_left <= j <= i_al + window_right, i_al = i + Mk - Mq (per sequence) unless the mask is causal
top-left (i_al = i); -1 = unbounded. softcap c: scores s become c * tanh(s / c) before the softmax.

CPU runs go through the Triton interpreter with small tiles, so windows smaller and larger than a tile, tiles
wholly outside the window (skipped) and boundary tiles (masked) all occur.
"""
import dataclasses
import math
import struct

import pytest
import torch
import triton
import triton.language as tl

import tests.test_kernel_attention_bwd  # noqa: F401  (patches the interpreter's loop bounds / bf16 dot)
from fmha_ops.kernels.softmax import HIDDEN_INT_SCORE, INT_BIAS, hide_keys
from fmha_ops.testing import error_report
from tests.compiled_child import run_compiled
from tests.conftest import DEVICE

REF = torch.float64 if DEVICE == "cpu" else torch.float32


def visible(Mq, Mk, causal, bottom_right, window_left, window_right):
    """[Mq, Mk] bool: the visibility rule for one sequence."""
    i = torch.arange(Mq)[:, None]
    j = torch.arange(Mk)[None, :]
    i_al = i + (Mk - Mq if bottom_right or not causal else 0)
    vis = torch.ones(Mq, Mk, dtype=torch.bool)
    if causal:
        vis &= j <= i_al
    if window_left >= 0:
        vis &= j >= i_al - window_left
    if window_right >= 0:
        vis &= j <= i_al + window_right
    return vis


def varlen_visible(seqlens_q, seqlens_k, *mask):
    """Block-diagonal [sum q, sum k] visibility of packed sequences, ``visible(..., *mask)`` per sequence."""
    vis = torch.zeros(sum(seqlens_q), sum(seqlens_k), dtype=torch.bool)
    q0 = k0 = 0
    for mq, mk in zip(seqlens_q, seqlens_k):
        vis[q0:q0 + mq, k0:k0 + mk] = visible(mq, mk, *mask)
        q0, k0 = q0 + mq, k0 + mk
    return vis


def reference(q, k, v, scale, vis, softcap=0.0):
    """(out, lse) of masked softmax attention, BMHK, GQA by head grouping, in q's dtype; differentiable.
    Rows without a visible key: out 0, lse -inf."""
    g = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bmhd,bnhd->bhmn", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    vis = vis.to(q.device)
    lse = s.detach().masked_fill(~vis, float("-inf")).logsumexp(-1)
    p = torch.softmax(s.masked_fill(~vis, -1e30), -1) * vis.any(-1)[:, None].to(s.dtype)
    return torch.einsum("bhmn,bnhd->bmhd", p, vv), lse


def _randn(*shape, seed, dtype=torch.float16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _window_kwargs(causal, bottom_right, wl, wr, softcap):
    return dict(causal=causal, causal_bottom_right=bottom_right, window_left=wl, window_right=wr, softcap=softcap)


# B, Mq, Mk, Hq, Hkv, D, causal, bottom_right, window_left, window_right, softcap, block_m, block_n
CASES = [
    (1, 70, 70, 2, 1, 32, True, True, 20, -1, 0.0, 16, 16),      # causal + left window larger than a tile
    (2, 33, 47, 4, 2, 16, False, True, 5, 7, 0.0, 16, 16),      # both sides, smaller than a tile, GQA
    (1, 40, 40, 2, 2, 32, False, True, 0, 0, 0.0, 16, 16),      # window 0: the aligned key only
    (1, 50, 30, 2, 1, 16, True, False, 9, -1, 0.0, 16, 16),     # top-left causal + left window
    (1, 17, 90, 3, 1, 16, False, True, -1, 3, 0.0, 16, 32),     # right bound only, Mk > Mq
    (1, 64, 64, 2, 2, 64, True, True, 200, -1, 0.0, 16, 16),    # window wider than the sequence
    (1, 29, 29, 2, 1, 32, False, True, -1, -1, 5.0, 16, 16),    # softcap alone
    (2, 45, 45, 2, 2, 16, True, True, 13, -1, 2.0, 16, 16),     # softcap + window
    (1, 1, 37, 2, 1, 16, False, True, 4, 4, 0.0, 16, 16),       # one query
]


@pytest.mark.parametrize("one_loop", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_forward_window_softcap(case, one_loop):
    from fmha_ops.kernels.triton.attention_fwd import FwdConfig, attention_forward

    B, Mq, Mk, Hq, Hkv, D, causal, br, wl, wr, cap, bm, bn = case
    q, k, v = (_randn(B, m, h, D, seed=i + Mq) for i, (m, h) in enumerate(((Mq, Hq), (Mk, Hkv), (Mk, Hkv))))
    scale = D ** -0.5 * (4.0 if cap else 1.0)  # larger scores, so the cap bends them
    out = torch.full((B, Mq, Hq, D), float("nan"), dtype=q.dtype, device=DEVICE)
    o, lse = attention_forward(q, k, v, scale=scale, return_lse=True, config=FwdConfig(bm, bn, one_loop=one_loop),
                               out=out, **_window_kwargs(causal, br, wl, wr, cap))
    vis = visible(Mq, Mk, causal, br, wl, wr)
    ref, ref_lse = reference(*(t.to(REF) for t in (q, k, v)), scale, vis, cap)
    assert not torch.isnan(o).any(), "unwritten output"
    assert error_report(o, ref)["rel"] < 3e-3, error_report(o, ref)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without keys must have lse = -inf"
    fin = ~torch.isinf(ref_lse)
    assert (lse[fin].double() - ref_lse[fin].double()).abs().max() < 1e-3
    full_vis = visible(Mq, Mk, causal, br, -1, -1)
    if cap or not torch.equal(vis, full_vis):  # the window / cap changes the answer (the test can fail)
        full, _ = reference(*(t.to(REF) for t in (q, k, v)), scale, full_vis)
        assert error_report(full, ref)["rel"] > 1e-2


@pytest.mark.parametrize("one_loop", [False, True])
@pytest.mark.parametrize("dtype", ["fp8", "i8fp8"])
def test_forward_window_quantized(dtype, one_loop):
    """fp8 and int8 q/k take the same window and softcap path (fp16 PV on the CPU: the interpreter's fp8 casts)."""
    from fmha_ops.kernels.triton.attention_fwd import FwdConfig, attention_forward

    B, M, H, D = 1, 60, 2, 32
    q, k, v = (_randn(B, M, H, D, seed=s, dtype=torch.float32) for s in (1, 2, 3))
    fp8 = torch.float8_e4m3fn
    if dtype == "fp8":
        qq, kq = q.to(fp8), k.to(fp8)
        qf, kf, qd = qq.float(), kq.float(), None
    else:
        qq, kq = (t.mul(16).round().clamp(-127, 127).to(torch.int8) for t in (q, k))
        qf, kf, qd = qq.float() / 16, kq.float() / 16, torch.full((1,), 1 / 256, device=DEVICE)
    vq = v.to(fp8)
    kw = _window_kwargs(True, True, 11, -1, 3.0)
    o, _ = attention_forward(qq, kq, vq, scale=D ** -0.5, q_descale=qd, pv_fp8=False, v_transposed=False,
                             config=FwdConfig(16, 32, one_loop=one_loop), **kw)
    ref, _ = reference(*(t.to(REF) for t in (qf, kf, vq.float())), D ** -0.5, visible(M, M, True, True, 11, -1), 3.0)
    assert error_report(o, ref)["rel"] < 1e-2, error_report(o, ref)


def test_forward_window_varlen():
    from fmha_ops.kernels.triton.attention_fwd import FwdConfig, attention_forward

    seq_q, seq_k = [5, 40, 0, 23], [9, 33, 4, 23]
    H, D = 2, 16
    q, k, v = (_randn(1, sum(s), H, D, seed=i) for i, s in enumerate((seq_q, seq_k, seq_k)))
    cu = [torch.tensor([0] + s, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE) for s in (seq_q, seq_k)]
    mask = (True, True, 6, -1)
    o, _ = attention_forward(q, k, v, scale=0.3, causal=True, window_left=6, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1],
                             max_seqlen_q=max(seq_q), max_seqlen_k=max(seq_k), config=FwdConfig(16, 16))
    ref, _ = reference(*(t.to(REF) for t in (q, k, v)), 0.3, varlen_visible(seq_q, seq_k, *mask))
    assert error_report(o, ref)["rel"] < 3e-3, error_report(o, ref)


BWD_CASES = [
    # B, Mq, Mk, Hq, Hkv, D, causal, bottom_right, window_left, window_right, softcap
    (1, 70, 70, 2, 1, 32, True, True, 20, -1, 0.0),
    (2, 33, 47, 4, 2, 16, False, True, 5, 7, 0.0),
    (1, 40, 40, 2, 2, 32, False, True, 0, 0, 0.0),
    (1, 50, 30, 2, 1, 16, True, False, 9, -1, 0.0),
    (1, 17, 90, 2, 1, 16, False, True, -1, 3, 0.0),
    (1, 29, 29, 2, 1, 32, False, True, -1, -1, 5.0),
    (1, 45, 45, 2, 2, 16, True, True, 13, -1, 2.0),
]


def _backward_check(q, k, v, do, scale, vis, kw, cfg, varlen=None, tol=4e-3):
    from fmha_ops.kernels.triton.attention_bwd import attention_backward

    qr, kr, vr = (t.detach().to(REF).requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(qr, kr, vr, scale, vis, kw.get("softcap", 0.0))
    ref.backward(do.to(REF))
    out = ref.detach().to(q.dtype)
    lse = ref_lse.float()
    dq, dk, dv = attention_backward(do, q, k, v, out, lse, scale=scale, config=cfg, **kw, **(varlen or {}))
    for name, got, want in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        err = error_report(got, want)
        if want.abs().max() == 0:  # e.g. dq, dk under window 0: one visible key, p = 1 whatever the score
            assert err["max"] < 1e-5, (name, err)
        else:
            assert err["rel"] < tol, (name, err)


@pytest.mark.parametrize("case", BWD_CASES)
def test_backward_window_softcap(case):
    from fmha_ops.kernels.triton.attention_bwd import BwdConfig

    B, Mq, Mk, Hq, Hkv, D, causal, br, wl, wr, cap = case
    q, k, v, do = (_randn(B, m, h, D, seed=i + Mk) for i, (m, h) in enumerate(((Mq, Hq), (Mk, Hkv), (Mk, Hkv),
                                                                                 (Mq, Hq))))
    scale = D ** -0.5 * (4.0 if cap else 1.0)
    _backward_check(q, k, v, do, scale, visible(Mq, Mk, causal, br, wl, wr), _window_kwargs(causal, br, wl, wr, cap),
                    BwdConfig(16, 16, 4, 1, 16, 16, 4, 1))


def test_backward_window_varlen():
    from fmha_ops.kernels.triton.attention_bwd import BwdConfig

    seq_q, seq_k = [5, 40, 0, 23], [9, 33, 4, 23]
    H, D = 2, 16
    q, k, v, do = (_randn(1, sum(s), H, D, seed=i) for i, s in enumerate((seq_q, seq_k, seq_k, seq_q)))
    cu = [torch.tensor([0] + s).cumsum(0).to(torch.int32).to(DEVICE) for s in (seq_q, seq_k)]
    varlen = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=max(seq_q), max_seqlen_k=max(seq_k))
    _backward_check(q, k, v, do, 0.3, varlen_visible(seq_q, seq_k, True, True, 6, -1),
                    _window_kwargs(True, True, 6, -1, 0.0), BwdConfig(16, 16, 4, 1, 16, 16, 4, 1), varlen)


# ----------------------------------------------------------------------------------------- GPU suite


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("one_loop", [False, True])
@pytest.mark.parametrize("window,causal,cap", [((255, -1), True, 0.0), ((100, 30), False, 0.0),
                                               ((1000, -1), True, 30.0), ((-1, -1), False, 30.0)])
def test_gpu_forward_window(dtype, window, causal, cap, one_loop):
    from fmha_ops.kernels.triton.attention_fwd import FwdConfig, attention_forward, default_config

    B, M, H, D = 2, 2000, 4, 128
    q, k, v = (torch.randn(B, M, H, D, device="cuda") for _ in range(3))
    qq, kq, vq = (t.to(dtype) for t in (q, k, v))
    scale = D ** -0.5 * 2
    cfg = dataclasses.replace(default_config(D, causal, M, dtype != torch.bfloat16), one_loop=one_loop)
    o, lse = attention_forward(qq, kq, vq, scale=scale, return_lse=True, config=cfg,
                               **_window_kwargs(causal, True, *window, cap))
    ref, ref_lse = reference(qq.float(), kq.float(), vq.float(), scale, visible(M, M, causal, True, *window), cap)
    tol = 2e-2 if dtype == torch.bfloat16 else 6e-2
    assert error_report(o, ref)["rel"] < tol, error_report(o, ref)
    fin = ~torch.isinf(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("window,causal,cap", [((255, -1), True, 0.0), ((100, 30), False, 0.0),
                                               ((300, -1), True, 30.0)])
def test_gpu_backward_window(window, causal, cap):
    B, M, H, D = 1, 1500, 4, 128
    q, k, v, do = (torch.randn(B, M, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    _backward_check(q, k, v, do, D ** -0.5 * 2, visible(M, M, causal, True, *window),
                    _window_kwargs(causal, True, *window, cap), None, tol=2e-2)


@triton.jit
def _hide_keys_kernel(S, Out, row0, col0, seqlen_k, lo, hi, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    r = tl.arange(0, 32)
    c = tl.arange(0, 64)
    s = tl.load(S + r[:, None] * 64 + c[None, :])
    tl.store(Out + r[:, None] * 64 + c[None, :], hide_keys(s, row0 + r, col0 + c, seqlen_k, lo, hi, MASK_LEFT,
                                                           MASK_RIGHT))


def _hide_keys_case(device, seed):
    """hide_keys on a [32, 64] tile of float32 scores and of int32 ones (the int8 path's QK^T, hidden as
    ``HIDDEN_INT_SCORE``) against the rule ``first <= j <= last``, j < seqlen_k, for random tile offsets, window
    bounds (rows seeing no key included) and sequence ends; returns the mismatch count."""
    g = torch.Generator().manual_seed(seed)
    bad = 0
    for _ in range(6):
        row0, col0 = (int(torch.randint(0, 200, (1,), generator=g)) for _ in range(2))
        seqlen_k = int(torch.randint(0, 300, (1,), generator=g))
        lo, hi = sorted(int(x) for x in torch.randint(-120, 120, (2,), generator=g))
        if torch.rand(1, generator=g) < 0.3:
            lo, hi = hi, lo  # an empty range: no row sees a key
        scores = (torch.randn(32, 64, generator=g), torch.randint(-2 ** 22, 2 ** 22, (32, 64), generator=g))
        for s, hidden in zip(scores, (float("-inf"), HIDDEN_INT_SCORE.value)):
            s = s.to(device)
            for left in (False, True):
                for right in (False, True):
                    out = torch.empty_like(s)
                    _hide_keys_kernel[(1,)](s, out, row0, col0, seqlen_k, lo, hi, MASK_LEFT=left, MASK_RIGHT=right)
                    i = row0 + torch.arange(32)[:, None]
                    j = col0 + torch.arange(64)[None, :]
                    keep = (j < seqlen_k) & ((j >= i + lo) | (not left)) & ((j <= i + hi) | (not right))
                    ref = torch.where(keep, s.cpu(), torch.tensor(hidden, dtype=s.dtype))
                    bad += int((out.cpu() != ref).sum())
    return bad


def test_hidden_int_score_reads_as_minus_infinity():
    """A hidden int32 score plus the int8 path's offset INT_BIAS has the bits of -inf, and it lies below every
    score the int8 QK^T can reach (|s| <= 128 * 128 * 256)."""
    bits = (HIDDEN_INT_SCORE.value + INT_BIAS.value) & 0xFFFFFFFF
    assert struct.unpack("<f", struct.pack("<I", bits))[0] == float("-inf")
    assert HIDDEN_INT_SCORE.value < -(128 * 128 * 256)


@pytest.mark.parametrize("seed", [0, 1])
def test_hide_keys_matches_rule(seed):
    assert _hide_keys_case("cpu", seed) == 0


@pytest.mark.gpu
def test_gpu_hide_keys_matches_rule():
    assert _hide_keys_case("cuda", 0) == 0 and _hide_keys_case("cuda", 1) == 0


_SM90_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fmha_ops.kernels.triton.attention_fwd import _attn_fwd_kernel
from bench.diagnostics.aot import plain_signature

for dtype, causal, left, one_loop in [("fp8", True, True, False), ("bf16", False, True, False),
                                      ("i8fp8", True, False, False), ("fp8", True, True, True)]:
    qk, v = {"fp8": ("fp8e4nv", "fp8e4nv"), "i8fp8": ("i8", "fp8e4nv"), "bf16": ("bf16", "bf16")}[dtype]
    quantized = dtype != "bf16"
    bn = 128 if quantized else 64
    descs = {"Q": f"tensordesc<{qk}[1, 1, 64, 128]>", "K": f"tensordesc<{qk}[1, 1, {bn}, 128]>",
             "V": f"tensordesc<{v}[1, 1, 128, {bn}]>" if quantized else f"tensordesc<{v}[1, 1, {bn}, 128]>",
             "Out": "tensordesc<bf16[1, 1, 64, 128]>"}
    consts = {"D": 128, "DV": 128, "BLOCK_M": 64, "BLOCK_N": bn, "MASK_LEFT": left, "MASK_RIGHT": causal,
              "BOTTOM_RIGHT": True, "SOFTCAP": True, "VARLEN": False, "V_T": quantized, "P_SHIFT": 8 if quantized else 0,
              "Q_BLOCKSCALE": False, "K_BLOCKSCALE": False, "V_PER_CHANNEL": False, "WRITE_LSE": True,
              "Q_DESCALED": quantized, "K_DESCALED": quantized, "V_DESCALED": quantized, "ONE_LOOP": one_loop,
              "SINKS": not one_loop}
    sig = plain_signature(_attn_fwd_kernel, consts, {
        **descs, **dict.fromkeys(("Lse", "QD", "KD", "VD", "CuQ", "CuK", "CuVT", "Sinks"), "*fp32"),
        **dict.fromkeys(("sm_scale_log2", "softcap_log2"), "fp32")})
    k = triton.compile(ASTSource(_attn_fwd_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3})
    assert "tanh.approx.f32" in k.asm["ptx"], dtype
    print("compiled", dtype, causal, left, one_loop)
"""


def test_forward_softcap_window_compiles_for_sm90():
    """The interpreter runs what the compiler may reject (a constexpr rebound in a branch): compile softcap +
    window / causal kernels (fp8, bf16, i8fp8; with sinks but the one-loop one) for sm90 ahead of time, in a
    process without the interpreter."""
    r = run_compiled(_SM90_COMPILE)
    assert r.returncode == 0 and r.stdout.count("compiled") == 4, r.stderr[-3000:]


def test_window_arguments_checked():
    from fmha_ops.kernels.triton.attention_fwd import attention_forward

    q = _randn(1, 4, 1, 16, seed=0)
    with pytest.raises(AssertionError):
        attention_forward(q, q, q, scale=1.0, window_left=-2)
    with pytest.raises(AssertionError):
        attention_forward(q, q, q, scale=1.0, softcap=math.inf)
