"""Pieces shared by the Gluon fp8 attention forwards for Hopper (``attention_fwd.py``, ``attention_fwd_ws.py``):
register and shared-memory layouts, descales, the key-tile extent, the masked / unmasked softmax of one S tile
(int8 scores too), and, for the pipelined kernel, its per-(batch, head) device-side TMA descriptors, epilogue and
host-side argument list (the warp-specialized kernel takes host descriptors of whole tensors instead).

Conventions (both kernels): q (B, Mq, Hq, D), k and v (B, Mk, Hkv, D) fp8 e4m3fn with the last dim contiguous;
V reaches the kernel either as V^T (B, Hkv, D, L) from ``transpose_v`` (keys contiguous: the K-major B operand
of the fp8 PV wgmma) or, for kernels that transpose V tiles in shared memory, as v itself; out (B, Mq, Hq, D)
bf16, or fp8 e4m3fn in v's units (attention = out * v_descale); LSE float32 (B, Hq, Mq) natural log; descales
per tensor or per (batch, kv head).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

from ..softmax import INT_BIAS, LOG2E, hide_keys, natural_lse, row_inverse, softmax_step


@gluon.constexpr_function
def acc_layout(num_warps, n):
    """Register layout of an fp32 wgmma accumulator of ``n`` columns (m64 per warpgroup of 4 warps)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 32])


@gluon.constexpr_function
def p_operand_layout(num_warps, head_d):
    """Register layout of P as the fp8 A operand of the PV wgmma (whose accumulator has ``head_d`` columns)."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout(num_warps, head_d), k_width=4)


@gluon.constexpr_function
def fp8_tile_layout(rows, cols):
    """Shared-memory layout (NVMMA swizzle) of a [rows, cols] fp8 tile: TMA destination and wgmma operand."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float8e4nv)


@gluon.constexpr_function
def out_tile_layout(rows, cols, dtype):
    """Shared-memory layout of a [rows, cols] output tile of ``dtype`` (bf16 or fp8; TMA store source)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


@gluon.jit
def head_descriptors(Q, K, V, Out, b64, hq, hkv,
                     stride_qb, stride_qm, stride_qh, stride_kb, stride_km, stride_kh,
                     stride_vb, stride_v1, stride_v2, stride_ob, stride_om, stride_oh,
                     Mq, Mk, v_len,
                     Q_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                     V_ROWS: gl.constexpr, V_COLS: gl.constexpr, V_BMHK: gl.constexpr):
    """TMA descriptors of one (batch, query head): q and out (bf16 or fp8) [Mq, D] in ``Q_ROWS``-row tiles, k [Mk, D] in
    ``BLOCK_N``-key tiles, and V either as v itself (``V_BMHK``: [Mk, D], strides (stride_v1 = key, stride_v2 =
    head), [V_ROWS keys, V_COLS channels] tiles) or as V^T [D, v_len] (stride_v1 = head, stride_v2 = channel,
    [D, BLOCK_N] tiles). Rows and columns past the shapes read as zeros and are not stored."""
    hq64 = hq.to(gl.int64)
    hkv64 = hkv.to(gl.int64)
    q_desc = tma.make_tensor_descriptor(Q + b64 * stride_qb + hq64 * stride_qh, shape=[Mq, HEAD_D],
                                        strides=[stride_qm, 1], block_shape=[Q_ROWS, HEAD_D],
                                        layout=fp8_tile_layout(Q_ROWS, HEAD_D))
    k_desc = tma.make_tensor_descriptor(K + b64 * stride_kb + hkv64 * stride_kh, shape=[Mk, HEAD_D],
                                        strides=[stride_km, 1], block_shape=[BLOCK_N, HEAD_D],
                                        layout=fp8_tile_layout(BLOCK_N, HEAD_D))
    if V_BMHK:
        v_desc = tma.make_tensor_descriptor(V + b64 * stride_vb + hkv64 * stride_v2, shape=[Mk, HEAD_D],
                                            strides=[stride_v1, 1], block_shape=[V_ROWS, V_COLS],
                                            layout=fp8_tile_layout(V_ROWS, V_COLS))
    else:
        v_desc = tma.make_tensor_descriptor(V + b64 * stride_vb + hkv64 * stride_v1, shape=[HEAD_D, v_len],
                                            strides=[stride_v2, 1], block_shape=[HEAD_D, BLOCK_N],
                                            layout=fp8_tile_layout(HEAD_D, BLOCK_N))
    o_desc = tma.make_tensor_descriptor(Out + b64 * stride_ob + hq64 * stride_oh, shape=[Mq, HEAD_D],
                                        strides=[stride_om, 1], block_shape=[Q_ROWS, HEAD_D],
                                        layout=out_tile_layout(Q_ROWS, HEAD_D, Out.dtype.element_ty))
    return q_desc, k_desc, v_desc, o_desc


@gluon.jit
def head_descales(QD, KD, VD, b, hkv, qd_sb, qd_sh, kd_sb, kd_sh, vd_sb, vd_sh, sm_scale_log2):
    """(qk_scale = q_descale * k_descale * scale * log2(e), v_descale) of (batch ``b``, kv head ``hkv``)."""
    qd = gl.load(QD + b * qd_sb + hkv * qd_sh)
    kd = gl.load(KD + b * kd_sb + hkv * kd_sh)
    vd = gl.load(VD + b * vd_sb + hkv * vd_sh)
    return qd * kd * sm_scale_log2, vd


@gluon.jit
def key_tiles(m0, rows, Mq, Mk, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Key tiles that query rows [m0, m0 + rows) read: at least one (then fully masked), so rows that see no
    key take the masked path (out 0, lse -inf). Causal is bottom-right aligned."""
    if CAUSAL:
        kv_end = gl.maximum(gl.minimum(Mk, m0 + rows + Mk - Mq), 0)
    else:
        kv_end = Mk
    return gl.maximum(gl.cdiv(kv_end, BLOCK_N), 1)


@gluon.jit
def unmasked_end(row0, Mq, Mk, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Key index below which no tile needs a mask for any query row from ``row0`` on (whole tiles only)."""
    if CAUSAL:
        end = gl.maximum(gl.minimum(Mk, row0 + Mk - Mq + 1), 0) // BLOCK_N * BLOCK_N
    else:
        end = Mk // BLOCK_N * BLOCK_N
    return end


@gluon.jit
def tile_softmax(s, m_i, l_i, qk_scale, start_n, full_end, seqlen_k, hi, offs_m,
                 CAUSAL: gl.constexpr, P_SHIFT: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                 OFF: gl.constexpr = 0.0):
    """``softmax_step`` on one S tile (raw scores, ``OFF`` added: ``int_scores``'s offset, else 0), with the
    key/causal masks only on tiles at or past ``full_end`` (partial or diagonal); returns (p fp32 scaled by
    2**P_SHIFT, m, l, alpha)."""
    if start_n >= full_end:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = hide_keys(s, offs_m, cols, seqlen_k, 0, hi, False, CAUSAL)
        p, m_i, l_i, alpha = softmax_step(s, None, m_i, l_i, qk_scale, OFF, P_SHIFT, True)
    else:
        p, m_i, l_i, alpha = softmax_step(s, None, m_i, l_i, qk_scale, OFF, P_SHIFT, False)
    return p, m_i, l_i, alpha


#: the float32 that int32 score 0 reads as after ``int_scores`` (INT_BIAS = its bits, 1.5 * 2**23)
INT_OFF = gl.constexpr(12582912.0)


@gluon.jit
def int_scores(s):
    """int32 scores (int8 QK^T) as float32 ``INT_OFF + s``: one integer add per score instead of a conversion;
    the softmax's scaling FMA removes the offset (``tile_softmax(..., OFF=INT_OFF)``). |s| <= 128 * 128 * 256
    = 2**22 at D 256."""
    return (s + INT_BIAS).to(gl.float32, bitcast=True)


@gluon.jit
def out_factor(vd, Out):
    """What the epilogue multiplies acc / l by: v's descale for a bf16 output; 1 for an fp8 output, which stays in
    v's units (attention = out * v_descale)."""
    if Out.dtype.element_ty == gl.float8e4nv:
        factor = vd * 0.0 + 1.0
    else:
        factor = vd
    return factor


@gluon.jit
def store_output(acc, m_i, l_i, out_scale, o_smem, o_desc, row0, lse_ptr, offs_m, Mq,
                 WRITE_LSE: gl.constexpr, P_SHIFT: gl.constexpr, o_layout: gl.constexpr):
    """out = acc / l * out_scale in ``o_smem``'s dtype (bf16, or fp8 e4m3 saturated to +-448) through ``o_smem``
    and a TMA store at row ``row0`` (rows past Mq are clipped); the natural-log LSE of rows ``offs_m`` < Mq when
    ``WRITE_LSE``. Waits for the store."""
    inv = gl.convert_layout(row_inverse(l_i) * out_scale, gl.SliceLayout(1, o_layout))
    o_smem.store((acc * gl.expand_dims(inv, 1)).to(o_smem.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0, 0], o_smem)
    if WRITE_LSE:
        gl.store(lse_ptr + offs_m, natural_lse(m_i, l_i, P_SHIFT), mask=offs_m < Mq)
    tma.store_wait(pendings=0)


def launch_args(q, k, v_arg, v_strides, v_len, out, lse, prep, scale):
    """Positional arguments of the pipelined kernel after its tensor pointers' leading five (Q, K, V, Out, Lse), in
    kernel order: descale pointers, ``scale * log2(e)``, ``v_len``, strides, descale strides, Mq, Mk, Hq, group.

    ``v_strides``: (batch, key, head) of v (``V_BMHK`` kernels) or (batch, head, channel) of V^T.

    Example: ``kernel[grid](q, k, vt, out, lse_or_dummy, *launch_args(q, k, vt, vt.stride()[:3], L, out, lse,
    prep, 0.088), ...)``.
    """
    B, Mq, Hq, _ = q.shape
    Mk, Hkv = k.shape[1], k.shape[2]
    return (prep.qd, prep.kd, prep.vd, scale * LOG2E.value, v_len,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            *v_strides,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
            *prep.descale_strides,
            Mq, Mk, Hq, Hq // Hkv)


#: int32 scalar arguments of the pipelined kernel (their names in kernel order), for ahead-of-time compiles
INT_ARGS = ("v_len", "stride_qb", "stride_qm", "stride_qh", "stride_kb", "stride_km", "stride_kh", "stride_vb",
            "stride_v1", "stride_v2", "stride_ob", "stride_om", "stride_oh", "stride_lb", "stride_lh",
            "qd_sb", "qd_sh", "kd_sb", "kd_sh", "vd_sb", "vd_sh", "Mq", "Mk", "Hq", "GROUP")


def compile_for_sm90(kernel, constexprs: dict, num_warps: int, maxnreg: int | None = None, out_fp8: bool = False):
    """Compile the pipelined Gluon fp8 forward kernel ahead of time for sm90 (no GPU needed); returns the
    CompiledKernel (asm: ttgir, ptx, cubin). ``constexprs`` maps the kernel's constexpr names to values;
    ``out_fp8``: an fp8 e4m3 output instead of bf16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "V": "*fp8e4nv", "Out": "*fp8e4nv" if out_fp8 else "*bf16",
           "Lse": "*fp32", "QD": "*fp32", "KD": "*fp32", "VD": "*fp32", "sm_scale_log2": "fp32",
           **dict.fromkeys(INT_ARGS, "i32"), **dict.fromkeys(constexprs, "constexpr")}
    src = GluonASTSource(kernel, sig, constexprs={(list(sig).index(n),): v for n, v in constexprs.items()})
    options = {"num_warps": num_warps}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
