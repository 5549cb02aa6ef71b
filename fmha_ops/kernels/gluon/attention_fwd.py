"""fp8 attention forward for Hopper (sm90) in Gluon: async wgmma, TMA rings, softmax overlapped with PV.

Shapes, dtypes, layouts (the conventions of ``kernels/triton/attention_fwd.py``):

* q (B, Mq, Hq, D), k (B, Mk, Hkv, D): ``float8_e4m3fn``, last dim contiguous, other strides free;
  D in {64, 128, 256}; Hq % Hkv == 0 (query head h reads kv head h // (Hq // Hkv)).
* v (B, Mk, Hkv, D) fp8, copied by ``transpose_v`` to (B, Hkv, D, L) so the PV wgmma gets a K-major B operand.
* descales float32: None, per tensor (numel 1) or per (batch, kv head) ``(B, Hkv)``.
* out bf16 (B, Mq, Hq, D); lse float32 (B, Hq, Mq), natural log (optional).
* causal is bottom-right aligned: query i sees key j iff j <= i + Mk - Mq; rows that see no key give
  out = 0 and lse = -inf. Any Mq, Mk: TMA zero padding and store clipping handle partial tiles.

One CTA = one warpgroup (4 warps) owning BLOCK_M = 64 query rows (block_m=128: two warpgroups); two CTAs
share an SM. Iteration j runs softmax(S_j) (exp2 on MUFU, FP32 ops) while the tensor cores still work on the
async P_{j-1} V_{j-1} wgmma, then issues S_{j+1} = Q K_{j+1}^T and P_j V_j as async wgmmas and waits for S_{j+1}
only (the FA3 intra-warpgroup overlap). P_j is converted to the PV operand layout in the iteration that uses it.
K and V tiles stream through separate STAGES-deep shared-memory rings filled by TMA and guarded by mbarriers; a
K slot is refilled as soon as its S has read it, a V slot once its PV has.
Softmax in exp2 with scale * q_descale * k_descale folded into one multiplier; P is scaled by 2**P_SHIFT
before the fp8 cast (small probabilities stay normal e4m3 numbers) and the shift is removed from the LSE.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from ..attention_host import ensure_allocator, fp8_forward_args
from ..softmax import p_shift
from ..triton.launch import cdiv, launch
from ..triton.transpose_v import transpose_v
from .attention_common import (
    acc_layout,
    compile_for_sm90,
    fp8_tile_layout,
    head_descales,
    head_descriptors,
    key_tiles,
    launch_args,
    out_factor,
    out_tile_layout,
    p_operand_layout,
    store_output,
    tile_softmax,
    unmasked_end,
)

HEAD_DIMS = (64, 128, 256)
_P_SHIFT = p_shift(torch.float8_e4m3fn)


@gluon.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, QD, KD, VD, sm_scale_log2, v_len,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_km, stride_kh,
    stride_vb, stride_v1, stride_v2,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh,
    Mq, Mk, Hq, GROUP,
    HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, P_SHIFT: gl.constexpr, num_warps: gl.constexpr,
):
    pid_m = gl.program_id(0)
    if CAUSAL:  # longest rows first
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    b = bh // Hq
    hq = bh % Hq
    hkv = hq // GROUP
    m0 = pid_m * BLOCK_M
    b64 = b.to(gl.int64)
    diag = Mk - Mq
    n_tiles = key_tiles(m0, BLOCK_M, Mq, Mk, BLOCK_N, CAUSAL)
    full_end = unmasked_end(m0, Mq, Mk, BLOCK_N, CAUSAL)

    # S and O accumulators of one m64 wgmma per warpgroup; P feeds the PV wgmma from registers
    s_layout: gl.constexpr = acc_layout(num_warps, BLOCK_N)
    o_layout: gl.constexpr = acc_layout(num_warps, HEAD_D)
    p_layout: gl.constexpr = p_operand_layout(num_warps, HEAD_D)
    s_row: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_desc, k_desc, v_desc, o_desc = head_descriptors(
        Q, K, V, Out, b64, hq, hkv, stride_qb, stride_qm, stride_qh, stride_kb, stride_km, stride_kh,
        stride_vb, stride_v1, stride_v2, stride_ob, stride_om, stride_oh, Mq, Mk, v_len,
        BLOCK_M, BLOCK_N, HEAD_D, BLOCK_N, HEAD_D, False)

    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, HEAD_D], fp8_tile_layout(BLOCK_M, HEAD_D))
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_D], fp8_tile_layout(BLOCK_N, HEAD_D))
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_D, BLOCK_N], fp8_tile_layout(HEAD_D, BLOCK_N))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    K_BYTES: gl.constexpr = BLOCK_N * HEAD_D
    mbarrier.expect(q_bar, BLOCK_M * HEAD_D)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        ok = i < n_tiles
        mbarrier.expect(k_bars.index(i), K_BYTES, pred=ok)
        tma.async_copy_global_to_shared(k_desc, [i * BLOCK_N, 0], k_bars.index(i), k_smem.index(i), pred=ok)
        mbarrier.expect(v_bars.index(i), K_BYTES, pred=ok)
        tma.async_copy_global_to_shared(v_desc, [0, i * BLOCK_N], v_bars.index(i), v_smem.index(i), pred=ok)

    qk_scale, vd = head_descales(QD, KD, VD, b, hkv, qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh, sm_scale_log2)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=s_row)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_row)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_row)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)

    # S_0 (nothing to overlap with yet)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    ok = STAGES < n_tiles
    mbarrier.expect(k_bars.index(0), K_BYTES, pred=ok)
    tma.async_copy_global_to_shared(k_desc, [STAGES * BLOCK_N, 0], k_bars.index(0), k_smem.index(0), pred=ok)
    acc = warpgroup_mma_init(acc)

    # iteration j: softmax(S_j) while P_{j-1} V_{j-1} runs; then issue S_{j+1} and P_j V_j, wait for S_{j+1} only.
    # P_j is converted and consumed in the same iteration (a loop-carried fp8 tensor costs byte shuffles)
    for j in range(n_tiles - 1):
        start_n = j * BLOCK_N
        p, m_i, l_i, alpha = tile_softmax(s, m_i, l_i, qk_scale, start_n, full_end, Mk, diag, offs_m, CAUSAL,
                                           P_SHIFT, BLOCK_N, s_layout)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        # P_{j-1} V_{j-1} has read V slot (j-1) % STAGES: refill it with tile j - 1 + STAGES
        vs_prev = (j + STAGES - 1) % STAGES
        nxt = j - 1 + STAGES
        ok = (j > 0) & (nxt < n_tiles)
        mbarrier.expect(v_bars.index(vs_prev), K_BYTES, pred=ok)
        tma.async_copy_global_to_shared(v_desc, [0, nxt * BLOCK_N], v_bars.index(vs_prev), v_smem.index(vs_prev),
                                        pred=ok)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row), 1)
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        ks = (j + 1) % STAGES
        mbarrier.wait(k_bars.index(ks), ((j + 1) // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        vs = j % STAGES
        mbarrier.wait(v_bars.index(vs), (j // STAGES) & 1)
        acc = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        # S_{j+1} has read K slot ks: refill it with tile j + 1 + STAGES
        nxt = j + 1 + STAGES
        ok = nxt < n_tiles
        mbarrier.expect(k_bars.index(ks), K_BYTES, pred=ok)
        tma.async_copy_global_to_shared(k_desc, [nxt * BLOCK_N, 0], k_bars.index(ks), k_smem.index(ks), pred=ok)

    # last tile (always masked when it is partial or on the causal diagonal)
    last = n_tiles - 1
    start_n = last * BLOCK_N
    p, m_i, l_i, alpha = tile_softmax(s, m_i, l_i, qk_scale, start_n, full_end, Mk, diag, offs_m, CAUSAL,
                                       P_SHIFT, BLOCK_N, s_layout)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row), 1)
    p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    vs = last % STAGES
    mbarrier.wait(v_bars.index(vs), (last // STAGES) & 1)
    acc = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    o_smem = gl.allocate_shared_memory(Out.dtype.element_ty, [BLOCK_M, HEAD_D],
                                       out_tile_layout(BLOCK_M, HEAD_D, Out.dtype.element_ty))
    store_output(acc, m_i, l_i, out_factor(vd, Out), o_smem, o_desc, m0,
                 Lse + b64 * stride_lb + hq.to(gl.int64) * stride_lh, offs_m, Mq, WRITE_LSE, P_SHIFT, o_layout)


@dataclass(frozen=True)
class GluonFwdConfig:
    """Tiles of the Gluon kernel; the defaults' reasons are H200 sweeps (fp8 TFLOP/s at 4x32x4096 / 2x16x16384,
    ``bench/diagnostics/gluon_fwd_probe.py``)."""

    #: query rows per CTA, 64 per warpgroup: 64 (two CTAs per SM) 728 / 779, 128 (two warpgroups) 618 / 690
    block_m: int = 64
    #: keys per tile: 128 at D <= 128 (64 keys 668 / 686), 64 at D256 (registers)
    block_n: int = 128
    #: K/V ring depth: 2 (3 stages 743 / 771 at D128, within noise; D64 504 vs 493, D256 822 / 871 vs 811 / 853)
    stages: int = 2


def default_config(head_dim: int, causal: bool) -> GluonFwdConfig:
    """Tiles for head dim ``head_dim`` (the same for causal or not)."""
    return GluonFwdConfig(block_n=128 if head_dim <= 128 else 64)


def attention_forward(q, k, v, *, scale: float, causal: bool = False, q_descale=None, k_descale=None,
                      v_descale=None, return_lse: bool = False, config: GluonFwdConfig | None = None, out=None,
                      out_dtype: torch.dtype = torch.bfloat16):
    """fp8 attention forward on Hopper (see the module docstring for shapes, dtypes and layouts).

    Returns (out (B, Mq, Hq, D), lse float32 (B, Hq, Mq) natural log, or None). ``out_dtype``: bfloat16, or
    float8_e4m3fn in v's units (attention = out.float() * v_descale). ``config`` overrides ``default_config``;
    ``out`` is an optional preallocated ``out_dtype`` output.

    Example::

        q, k, v = (torch.randn(2, 4096, 16, 128, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
        out, _ = attention_forward(q, k, v, scale=128 ** -0.5, causal=True)
    """
    B, Mq, Hq, D = q.shape
    Mk, Hkv = k.shape[1], k.shape[2]
    cfg = config or default_config(D, causal)
    BM, BN, ST = cfg.block_m, cfg.block_n, cfg.stages
    if ST < 2:
        raise ValueError(f"config {cfg}: the K/V rings need at least 2 stages")
    prep = fp8_forward_args(q, k, v, q_descale, k_descale, v_descale, return_lse, out, HEAD_DIMS, out_dtype)
    if prep.done:
        return prep.out, prep.lse
    out, lse = prep.out, prep.lse
    ensure_allocator()
    vt, _ = transpose_v(v)
    launch(_attn_fwd_kernel)[(cdiv(Mq, BM), B * Hq)](
        q, k, vt, out, lse if lse is not None else prep.qd,
        *launch_args(q, k, vt, vt.stride()[:3], Mk, out, lse, prep, scale),
        HEAD_D=D, BLOCK_M=BM, BLOCK_N=BN, STAGES=ST, CAUSAL=causal, WRITE_LSE=return_lse, P_SHIFT=_P_SHIFT,
        num_warps=BM // 16,
    )
    return out, lse


def compile_sm90(head_dim=128, block_n=128, stages=2, causal=False, write_lse=False, block_m=64, out_fp8=False):
    """Compile the kernel ahead of time for sm90 (no GPU needed); returns the CompiledKernel (asm: ptx, cubin).

    Example: ``"wgmma" in compile_sm90(64, causal=True).asm["ptx"]`` -> True.
    """
    const = {"HEAD_D": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "STAGES": stages, "CAUSAL": causal,
             "WRITE_LSE": write_lse, "P_SHIFT": _P_SHIFT, "num_warps": block_m // 16}
    return compile_for_sm90(_attn_fwd_kernel, const, block_m // 16, out_fp8=out_fp8)
