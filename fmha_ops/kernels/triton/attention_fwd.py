"""Triton attention forward for fp8, i8fp8 (SageAttention-like) and bf16/fp16 inputs.

One kernel, specialised by ``tl.constexpr`` switches:

* fp8: q/k/v ``float8_e4m3fn`` (or ``float8_e4m3fnuz``); QK^T and PV on the fp8 tensor cores,
  P quantised to fp8 (scaled by 2**P_SHIFT so small probabilities stay normal numbers).
* i8fp8: q/k ``int8`` (QK^T accumulated in int32), v fp8, P as for fp8.
* bf16/fp16: q/k/v of that dtype, P cast to it.

Softmax runs in fp32 with exp2; q*k descales and the softmax scale are folded into one
multiplier per tile, the v descale is applied once at the end. Tiles move with TMA tensor
descriptors, whose zero padding and store clipping handle partial blocks, sequence ends and head
dims below the power-of-two block width. Without varlen the launcher makes them on the host (one
per tensor, over (B, H, rows, cols)); varlen bounds are per sequence, so there each program makes
its own on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from fmha_ops.kernels.triton.launch import cdiv, launch, next_pow2
from fmha_ops.quant import K_SCALE_BLOCK, Q_SCALE_BLOCK

_LOG2E = 1.4426950408889634


@triton.jit
def _head_desc(base, rows, cols, stride, R: tl.constexpr, C: tl.constexpr):
    """Device-made descriptor over one head's (rows, cols) matrix (row stride ``stride``), [R, C] tiles."""
    return tl.make_tensor_descriptor(base, shape=[rows, cols], strides=[stride, 1], block_shape=[R, C])


@triton.jit
def _load(desc, b, h, r, c, R: tl.constexpr, C: tl.constexpr, HOST_DESC: tl.constexpr):
    """An [R, C] tile at (r, c) of head (b, h): a host descriptor spans (B, H, rows, cols), a device one
    was made for the head."""
    if HOST_DESC:
        return desc.load([b, h, r, c]).reshape(R, C)
    else:
        return desc.load([r, c])


@triton.jit
def _tile(acc, l_i, m_i, q, k_desc, v_desc, kd_ptr, qk_scale, k_row0, start_n, seqlen_k, diag, offs_m, offs_n,
          MASKED: tl.constexpr, CAUSAL: tl.constexpr, QK_INT8: tl.constexpr, K_BLOCKSCALE: tl.constexpr,
          PV_FP8: tl.constexpr, V_T: tl.constexpr, P_SHIFT: tl.constexpr,
          K_SCALE_BLOCK: tl.constexpr, v_row0, b, hkv,
          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HOST_DESC: tl.constexpr):
    """One BLOCK_N step of the online softmax. Scores are in log2 units after ``qk_scale``."""
    k = _load(k_desc, b, hkv, k_row0 + start_n, 0, BLOCK_N, BLOCK_D, HOST_DESC)
    if QK_INT8:
        # int32 -> fp32 without I2F (16/clk/SM, as slow as exp2): |s| < 2**22 for D <= 256, so adding
        # 1.5 * 2**23 puts s in the mantissa of a float worth OFF + s; the scaling FMA removes OFF
        s = (tl.dot(q, k.T, out_dtype=tl.int32) + 0x4B400000).to(tl.float32, bitcast=True)
        OFF: tl.constexpr = 12582912.0
    else:
        s = tl.dot(q, k.T)
        OFF: tl.constexpr = 0.0
    if K_BLOCKSCALE:  # one k descale per tile: K_SCALE_BLOCK is a multiple of BLOCK_N
        qk_scale = qk_scale * tl.load(kd_ptr + start_n // K_SCALE_BLOCK)
    if MASKED:
        cols = start_n + offs_n
        keep = cols[None, :] < seqlen_k
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
        s = tl.where(keep, (s - OFF) * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen no key yet keep m = -inf; subtract 0 instead to avoid inf - inf
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(s - (m_sub - P_SHIFT)[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
    else:
        # scale > 0, so the row max commutes with the scaling; one FMA per score feeds exp2
        m_ij = tl.maximum(m_i, (tl.max(s, 1) - OFF) * qk_scale)
        p = tl.math.exp2(s * qk_scale - (m_ij + (OFF * qk_scale - P_SHIFT))[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_T:
        v = _load(v_desc, b, hkv, 0, v_row0 + start_n, BLOCK_DV, BLOCK_N, HOST_DESC).T
    else:
        v = _load(v_desc, b, hkv, k_row0 + start_n, 0, BLOCK_N, BLOCK_DV, HOST_DESC)
    if PV_FP8 or not v.dtype.is_fp8():
        p = p.to(v.dtype)
    else:
        p = p.to(tl.float16)
        v = v.to(tl.float16)
    acc = tl.dot(p, v, acc * alpha[:, None])
    return acc, l_i, m_ij


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, QD, KD, VD, CuQ, CuK, CuVT, sm_scale_log2,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_km, stride_kh,
    stride_vb, stride_vm, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh,
    Mq, Mk, Hq, GROUP,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, VARLEN: tl.constexpr,
    QK_INT8: tl.constexpr, PV_FP8: tl.constexpr, V_T: tl.constexpr,
    P_SHIFT: tl.constexpr, Q_BLOCKSCALE: tl.constexpr, K_BLOCKSCALE: tl.constexpr, V_PER_CHANNEL: tl.constexpr,
    Q_SCALE_BLOCK: tl.constexpr, K_SCALE_BLOCK: tl.constexpr,
    WRITE_LSE: tl.constexpr, REVERSE_M: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, HOST_DESC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if REVERSE_M:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = bh // Hq
    hq = bh % Hq
    hkv = hq // GROUP
    if VARLEN:
        q_start = tl.load(CuQ + b)
        seqlen_q = tl.load(CuQ + b + 1) - q_start
        k_start = tl.load(CuK + b)
        seqlen_k = tl.load(CuK + b + 1) - k_start
        if V_T:
            v_start = tl.load(CuVT + b)
        else:
            v_start = k_start
        b_off = bh * 0
    else:
        q_start = 0
        seqlen_q = Mq
        k_start = 0
        seqlen_k = Mk
        v_start = 0
        b_off = b
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    b64 = b_off.to(tl.int64)
    if BOTTOM_RIGHT:
        diag = seqlen_k - seqlen_q
    else:
        diag = 0
    if CAUSAL:
        kv_end = tl.maximum(tl.minimum(seqlen_k, m0 + BLOCK_M + diag), 0)
        full_end = tl.maximum(tl.minimum(seqlen_k, m0 + diag + 1), 0) // BLOCK_N * BLOCK_N
    else:
        kv_end = seqlen_k
        full_end = seqlen_k // BLOCK_N * BLOCK_N

    if HOST_DESC:  # Q, K, V, Out are descriptors over (B, H, rows, cols), made by the launcher
        q_desc = Q
        k_desc = K
        v_desc = V
        o_desc = Out
    else:
        q_desc = _head_desc(Q + b64 * stride_qb + hq.to(tl.int64) * stride_qh, q_start + seqlen_q, D, stride_qm,
                            BLOCK_M, BLOCK_D)
        k_desc = _head_desc(K + b64 * stride_kb + hkv.to(tl.int64) * stride_kh, k_start + seqlen_k, D, stride_km,
                            BLOCK_N, BLOCK_D)
        v_base = V + b64 * stride_vb + hkv.to(tl.int64) * stride_vh
        if V_T:  # V is (B, Hkv, DV, Mk): keys contiguous, the K-major operand the fp8 wgmma needs
            v_desc = _head_desc(v_base, DV, v_start + seqlen_k, stride_vm, BLOCK_DV, BLOCK_N)
        else:
            v_desc = _head_desc(v_base, k_start + seqlen_k, DV, stride_vm, BLOCK_N, BLOCK_DV)
        o_desc = _head_desc(Out + b64 * stride_ob + hq.to(tl.int64) * stride_oh, q_start + seqlen_q, DV, stride_om,
                            BLOCK_M, BLOCK_DV)

    if Q_BLOCKSCALE:
        qd = tl.load(QD + b * qd_sb + hq * qd_sh + m0 // Q_SCALE_BLOCK)
    else:
        qd = tl.load(QD + b * qd_sb + hkv * qd_sh)
    kd_ptr = KD + b * kd_sb + hkv * kd_sh
    if K_BLOCKSCALE:
        qk_scale = qd * sm_scale_log2
    else:
        qk_scale = qd * tl.load(kd_ptr) * sm_scale_log2

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    q = _load(q_desc, b_off, hq, q_start + m0, 0, BLOCK_M, BLOCK_D, HOST_DESC)

    for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, k_desc, v_desc, kd_ptr, qk_scale, k_start, start_n, seqlen_k, diag,
                              offs_m, offs_n, False, CAUSAL, QK_INT8, K_BLOCKSCALE, PV_FP8, V_T,
                              P_SHIFT, K_SCALE_BLOCK, v_start, b_off, hkv, BLOCK_N, BLOCK_D, BLOCK_DV, HOST_DESC)
    for start_n in tl.range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, k_desc, v_desc, kd_ptr, qk_scale, k_start, start_n, seqlen_k, diag,
                              offs_m, offs_n, True, CAUSAL, QK_INT8, K_BLOCKSCALE, PV_FP8, V_T,
                              P_SHIFT, K_SCALE_BLOCK, v_start, b_off, hkv, BLOCK_N, BLOCK_D, BLOCK_DV, HOST_DESC)

    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    vd_ptr = VD + b * vd_sb + hkv * vd_sh
    if V_PER_CHANNEL:
        offs_dv = tl.arange(0, BLOCK_DV)
        vd = tl.load(vd_ptr + offs_dv, mask=offs_dv < DV, other=0.0)
        out = acc * inv_l[:, None] * vd[None, :]
    else:
        out = acc * (inv_l * tl.load(vd_ptr))[:, None]
    out = out.to(o_desc.dtype)
    if HOST_DESC:
        o_desc.store([b_off, hq, m0, 0], out.reshape(1, 1, BLOCK_M, BLOCK_DV))
    else:
        o_desc.store([q_start + m0, 0], out)
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i)) - P_SHIFT) * 0.6931471805599453)
        tl.store(Lse + b64 * stride_lb + hq.to(tl.int64) * stride_lh + q_start + offs_m, lse, mask=offs_m < seqlen_q)


@triton.jit
def _transpose_v_kernel(V, VT, CuK, CuVT, Mk, Hkv, stride_vb, stride_vm, stride_vh, stride_tb, stride_th, stride_td,
                        DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DV: tl.constexpr, VARLEN: tl.constexpr):
    """VT[b, h, d, dst + t] = V[b, src + t, h, d] for one (BLOCK_T tokens, BLOCK_DV channels) tile of a sequence."""
    bh = tl.program_id(1)
    b = bh // Hkv
    h = (bh % Hkv).to(tl.int64)
    if VARLEN:
        src = tl.load(CuK + b)
        n = tl.load(CuK + b + 1) - src
        dst = tl.load(CuVT + b)
        b = bh * 0
    else:
        src = 0
        n = Mk
        dst = 0
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask = (offs_t[:, None] < n) & (offs_d[None, :] < DV)
    b64 = b.to(tl.int64)
    x = tl.load(V + b64 * stride_vb + h * stride_vh + (src + offs_t[:, None]) * stride_vm + offs_d[None, :], mask=mask)
    tl.store(VT + b64 * stride_tb + h * stride_th + offs_d[:, None] * stride_td + dst + offs_t[None, :], tl.trans(x),
             mask=tl.trans(mask))


def transpose_v(v: torch.Tensor, cu_seqlens_k=None, max_seqlen_k=None):
    """V (B, Mk, Hkv, Dv), last dim contiguous -> (VT (B, Hkv, Dv, L) contiguous, cu_vt or None).

    Keys become the contiguous dim (the K-major operand of the fp8 PV wgmma). Without varlen L = Mk rounded up
    to 16. With varlen (B == 1) each sequence starts at a multiple of 16 in VT (TMA box coordinates on the
    contiguous dim must be 16-byte aligned); cu_vt (nseq + 1,) int32 holds those starts. Padding is unwritten.
    """
    B, Mk, Hkv, Dv = v.shape
    varlen = cu_seqlens_k is not None
    if varlen:
        nseq = cu_seqlens_k.numel() - 1
        lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        cu_vt = torch.zeros(nseq + 1, dtype=torch.int32, device=v.device)
        cu_vt[1:] = torch.cumsum((lens + 15) // 16 * 16, 0)
        L, rows, grid_t = cdiv(Mk, 16) * 16 + 16 * nseq, nseq, cdiv(max_seqlen_k, 128)
    else:
        cu_vt, L, rows, grid_t = None, cdiv(Mk, 16) * 16, B, cdiv(Mk, 128)
    vt = torch.empty((B, Hkv, Dv, L), dtype=v.dtype, device=v.device)
    if vt.numel() == 0 or grid_t == 0:
        return vt, cu_vt
    BD = min(64, next_pow2(Dv))
    raw = torch.uint8 if v.element_size() == 1 else torch.int16
    launch(_transpose_v_kernel)[(grid_t, rows * Hkv, cdiv(Dv, BD))](
        v.view(raw), vt.view(raw), cu_seqlens_k, cu_vt, Mk, Hkv, v.stride(0), v.stride(1), v.stride(2),
        vt.stride(0), vt.stride(1), vt.stride(2), DV=Dv, BLOCK_T=128, BLOCK_DV=BD, VARLEN=varlen, num_warps=4)
    return vt, cu_vt


_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_ONES: dict = {}


def _ones(device: torch.device) -> torch.Tensor:
    t = _ONES.get(device)
    if t is None:
        t = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def _scratch(size: int, align: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side TMA descriptors need a global scratch allocator (128 B per descriptor). Triton keeps it in a
    ContextVar, so each thread (the autograd engine's, a data loader's) starts without one: set ours where none
    is set; an allocator the caller set is kept."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def default_config(head_dim: int, causal: bool, seqlen_k: int = 0, quantized: bool = False) -> dict:
    """Tile sizes and launch options per head dim, from the H200 sweeps in bench/results/attention_fwd.md.

    One warpgroup per program (4 warps, BLOCK_M 64) lets two programs share an SM, which overlaps one's
    softmax with the other's MMAs; 8-warp BLOCK_M 128 tiles measured 20% slower. Causal at head dim <= 128
    takes 64-key tiles below 4096 keys (``seqlen_k``), where the masked diagonal tiles weigh more (step 13).
    ``quantized`` (fp8 or i8fp8 inputs): at head dim <= 64 without a causal mask registers are capped at 128, which
    fits a fourth program per SM (step 15: +1-2% fp8, +4-5% i8fp8).
    """
    if head_dim <= 128:
        cfg = dict(block_m=64, block_n=64 if causal and seqlen_k < 4096 else 128, num_warps=4, num_stages=3)
        if quantized and head_dim <= 64 and not causal:
            cfg.update(maxnreg=128)
        return cfg
    return dict(block_m=64, block_n=64, num_warps=4, num_stages=3)


def _desc4(t, shape, strides, block):
    """Host TMA descriptor over ``t`` seen as (B, H, rows, cols) (``strides`` of the first three; cols are
    contiguous), loading [1, 1, *block] tiles; out-of-bounds rows and cols read as 0, stores are clipped."""
    return TensorDescriptor(t, list(shape), [*strides, 1], [1, 1, *block])


def _descale_args(t, device, B, H, name):
    """(tensor, stride_b, stride_h) for a per-tensor or per-(batch, head) float32 descale."""
    if t is None:
        return _ones(device), 0, 0
    assert t.dtype == torch.float32, f"{name} must be float32"
    if t.numel() == 1:
        return t.reshape(1), 0, 0
    assert t.shape == (B, H), f"{name} must have numel 1 or shape {(B, H)}, got {tuple(t.shape)}"
    return t, t.stride(0), t.stride(1)


def _block_descale_args(t, shape, scale_block, tile):
    """(tensor, stride_b, stride_h) for a per-block descale of ``shape``; one scale block spans whole tiles."""
    assert t.shape == shape and (shape[-1] == 1 or t.stride(-1) == 1), (tuple(t.shape), shape)
    assert scale_block % tile == 0, (scale_block, tile)
    return t, t.stride(0), t.stride(1)


def attention_forward(q, k, v, *, scale: float, causal: bool = False, causal_bottom_right: bool = True,
                      q_descale=None, k_descale=None, v_descale=None,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                      out_dtype=None, return_lse=False, pv_fp8: bool = True,
                      v_transposed: bool | None = None, block_m=None, block_n=None, num_warps=None, num_stages=None,
                      maxnreg=None, warp_specialize: bool = False, out=None):
    """Attention forward, BMHK layout.

    q: (B, Mq, Hq, D), k: (B, Mk, Hkv, D), v: (B, Mk, Hkv, Dv); last dim contiguous, other strides free; v may
    instead be keys-contiguous (v.stride(1) == 1: a view of a (B, Hkv, Dv, L) tensor, read as is; not with varlen);
    Hq % Hkv == 0 (query head h reads kv head h // (Hq // Hkv)); D, Dv multiples of 16, <= 256.
    dtypes: fp8/fp8/fp8 (e4m3fn or e4m3fnuz), int8/int8/fp8 (i8fp8) -> bf16 by default; bf16 or fp16 for all
    three -> same dtype. Computes softmax(scale * (q*qd)(k*kd)^T) (v*vd) with float32 descales:
    None, numel 1, (B, Hkv) (q indexed by its kv head; (nseq, Hkv) for varlen); for fp8 or int8 q/k also per block along the sequence,
    q_descale (B, Hq, cdiv(Mq, Q_SCALE_BLOCK)), k_descale (B, Hkv, cdiv(Mk, K_SCALE_BLOCK)); v_descale may be
    per channel (B, Hkv, Dv).
    Varlen: B == 1, sequences packed along dim 1, cu_seqlens_q/k int32 (nseq + 1,) on the device,
    max_seqlen_q/k host ints (per-block descales are not supported with varlen).
    Causal: key j visible to query i iff j <= i + Mk - Mq (bottom-right, FA2/FA3) or j <= i (top-left);
    rows that see no key give out = 0 and lse = -inf.
    Returns (out (B, Mq, Hq, Dv), lse float32 natural log (B, Hq, Mq) or None).
    Options: pv_fp8=False runs PV in fp16 for fp8 v (more accurate, slower); v_transposed (default: True for fp8 v on CUDA) copies
    a last-dim-contiguous V to (B, Hkv, Dv, Mk) first; block sizes and
    launch options override ``default_config``; ``out`` is an optional preallocated (B, Mq, Hq, Dv) output.
    """
    B, Mq, Hq, D = q.shape
    _, Mk, Hkv, Dv = v.shape
    assert k.shape[:3] == v.shape[:3] and k.shape[3] == D and k.shape[0] == B, "q/k/v shapes disagree"
    assert Hq % Hkv == 0, "Hq must be a multiple of Hkv"
    v_keys = v.stride(-1) != 1
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q/k last dim must be contiguous"
    assert not v_keys or v.stride(1) == 1 or Mk <= 1, "v must be contiguous in its last dim or keys-contiguous"
    assert D % 16 == 0 and Dv % 16 == 0 and D <= 256 and Dv <= 256, "head dims must be multiples of 16, <= 256"
    qk_int8 = q.dtype == torch.int8
    fp8_v = v.dtype in _FP8
    if qk_int8:
        assert k.dtype == torch.int8 and fp8_v, "i8fp8 needs int8 q/k and fp8 v"
    else:
        assert q.dtype == k.dtype == v.dtype, "q/k/v dtypes must match (except int8 q/k with fp8 v)"
        assert fp8_v or q.dtype in (torch.bfloat16, torch.float16), f"unsupported dtype {q.dtype}"
    if out_dtype is None:
        out_dtype = torch.bfloat16 if fp8_v else q.dtype
    varlen = cu_seqlens_q is not None
    if varlen:
        assert B == 1 and cu_seqlens_k is not None and max_seqlen_q is not None, "varlen needs B == 1, cu_seqlens_k, max_seqlen_q"
        nseq = cu_seqlens_q.numel() - 1
        grid_m = max_seqlen_q
    else:
        nseq = B
        grid_m = Mq
    device = q.device
    cfg = default_config(max(D, Dv), causal, (max_seqlen_k or 0) if varlen else Mk, fp8_v)
    BM = block_m or cfg["block_m"]
    BN = block_n or cfg["block_n"]
    if v_transposed is None:
        v_transposed = v_keys or (fp8_v and device.type == "cuda")
    assert v_transposed or not v_keys, "a keys-contiguous v is read transposed (v_transposed=False impossible)"
    assert not (varlen and v_keys), "a keys-contiguous v is not supported with varlen"

    # descales
    q_block = q_descale is not None and q_descale.dim() == 3
    k_block = k_descale is not None and k_descale.dim() == 3
    assert not (varlen and (q_block or k_block)), "per-block descales are not supported with varlen"
    if q_block:
        qd, qd_sb, qd_sh = _block_descale_args(q_descale, (B, Hq, cdiv(Mq, Q_SCALE_BLOCK)), Q_SCALE_BLOCK, BM)
    else:
        qd, qd_sb, qd_sh = _descale_args(q_descale, device, nseq, Hkv, "q_descale")
    if k_block:
        kd, kd_sb, kd_sh = _block_descale_args(k_descale, (B, Hkv, cdiv(Mk, K_SCALE_BLOCK)), K_SCALE_BLOCK, BN)
    else:
        kd, kd_sb, kd_sh = _descale_args(k_descale, device, nseq, Hkv, "k_descale")
    v_chan = v_descale is not None and v_descale.dim() == 3
    if v_chan:
        assert v_descale.shape == (nseq, Hkv, Dv) and v_descale.stride(-1) == 1 and v_descale.dtype == torch.float32
        vd, vd_sb, vd_sh = v_descale, v_descale.stride(0), v_descale.stride(1)
    else:
        vd, vd_sb, vd_sh = _descale_args(v_descale, device, nseq, Hkv, "v_descale")

    if out is None:
        out = torch.empty((B, Mq, Hq, Dv), dtype=out_dtype, device=device)
    else:
        assert out.shape == (B, Mq, Hq, Dv) and out.stride(-1) == 1, "out must be (B, Mq, Hq, Dv), last dim contiguous"
    lse = torch.empty((B, Hq, Mq), dtype=torch.float32, device=device) if return_lse else None
    if out.numel() == 0:
        if lse is not None:
            lse.fill_(float("-inf"))
        return out, lse
    if varlen and device.type == "cuda":  # only varlen programs make their descriptors on the device
        _ensure_allocator()
    if v_keys:
        v_arg, v_strides, cu_vt = v, (v.stride(0), v.stride(3), v.stride(2)), None
    elif v_transposed:
        vt, cu_vt = transpose_v(v, cu_seqlens_k, max_seqlen_k)
        v_arg, v_strides = vt, (vt.stride(0), vt.stride(2), vt.stride(1))
    else:
        v_arg, v_strides = v, (v.stride(0), v.stride(1), v.stride(2))

    p_shift = 0 if not (fp8_v and pv_fp8) else (8 if v.dtype == torch.float8_e4m3fn else 7)
    BD, BDV = next_pow2(D), next_pow2(Dv)
    host_desc = not varlen
    if host_desc:  # one descriptor per tensor, spanning (B, H, rows, cols); varlen needs per-sequence bounds
        Mk1 = max(Mk, 1)  # never read when Mk == 0; a descriptor needs positive sizes
        sb, srow, sh = v_strides
        qkvo = (_desc4(q, (B, Hq, Mq, D), (q.stride(0), q.stride(2), q.stride(1)), (BM, BD)),
                _desc4(k, (B, Hkv, Mk1, D), (k.stride(0), k.stride(2), k.stride(1)), (BN, BD)),
                _desc4(v_arg, (B, Hkv, Dv, Mk1) if v_transposed else (B, Hkv, Mk1, Dv), (sb, sh, srow),
                       (BDV, BN) if v_transposed else (BN, BDV)),
                _desc4(out, (B, Hq, Mq, Dv), (out.stride(0), out.stride(2), out.stride(1)), (BM, BDV)))
    else:
        qkvo = (q, k, v_arg, out)
    grid = (cdiv(grid_m, BM), nseq * Hq)
    launch(_attn_fwd_kernel)[grid](
        *qkvo, lse if lse is not None else qd, qd, kd, vd,
        cu_seqlens_q if varlen else qd, cu_seqlens_k if varlen else qd, cu_vt if varlen and v_transposed else qd,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        *v_strides,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
        qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh,
        Mq, Mk, Hq, Hq // Hkv,
        D=D, DV=Dv, BLOCK_D=BD, BLOCK_DV=BDV,
        BLOCK_M=BM, BLOCK_N=BN,
        CAUSAL=causal, BOTTOM_RIGHT=causal_bottom_right, VARLEN=varlen,
        QK_INT8=qk_int8, PV_FP8=pv_fp8 and fp8_v, V_T=v_transposed,
        P_SHIFT=p_shift, Q_BLOCKSCALE=q_block, K_BLOCKSCALE=k_block, V_PER_CHANNEL=v_chan,
        Q_SCALE_BLOCK=Q_SCALE_BLOCK, K_SCALE_BLOCK=K_SCALE_BLOCK,
        WRITE_LSE=return_lse, REVERSE_M=causal, WARP_SPECIALIZE=warp_specialize, HOST_DESC=host_desc,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
        maxnreg=maxnreg or cfg.get("maxnreg"),
    )
    return out, lse
