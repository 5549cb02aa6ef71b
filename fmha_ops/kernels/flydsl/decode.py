"""FlyDSL paged-decode attention kernels for AMD CDNA3 (gfx942) and CDNA4 (gfx950).

Importing this module imports FlyDSL (its bundled LLVM conflicts with Triton's in one
process); the host side in :mod:`.host` never imports it. Launch through
:mod:`.launcher`, compile ahead of time with :mod:`.aot`.

One workgroup is one wave (64 lanes) and owns one (batch, kv head, 16-row tile, split).
Its 16 MFMA rows are the (query token, query head of this kv head) pairs, packed
``row = token * G + g`` with ``G = Hq // Hkv``. Per block of 16 keys it computes
``S^T = K Q^T`` and ``O^T += V^T P^T`` with ``v_mfma_f32_16x16x16`` (f16/bf16; fp8 KV
is widened with ``v_cvt_pk_f32_fp8``, which decodes e4m3fnuz on gfx942 and e4m3fn on
gfx950). The head dim is permuted so every lane reads contiguous 16-byte slices:
a lane reads K[key, kg*D/4 : (kg+1)*D/4] and V[key, m*D/16 : (m+1)*D/16].
"""
import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import rocdl
from flydsl.expr.typing import Vector as Vec

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
WAVE = 64
ROWS = 16  # MFMA M/N: query rows and keys per block


def _mfma(a, b, c, bf16):
    """``c + a @ b^T`` on one 16x16x16 tile; ``a``/``b`` are 4-element vectors."""
    if fx.const_expr(bf16):
        res = rocdl.mfma_f32_16x16x16bf16_1k(
            Vec.make_type(4, fx.Float32), [a.bitcast(fx.Int16).ir_value(), b.bitcast(fx.Int16).ir_value(), c.ir_value()]
        )
    else:
        res = rocdl.mfma_f32_16x16x16f16(Vec.make_type(4, fx.Float32), [a.ir_value(), b.ir_value(), c.ir_value()])
    return Vec(res, (4,), fx.Float32)


def _load_row(ptr, n, elem, fp8, cdt):
    """Load ``n`` contiguous KV elements at ``ptr`` as Float32 values (16-byte vector loads)."""
    vals = []
    if fx.const_expr(fp8):
        for j in fx.range_constexpr(max(n // 16, 1)):
            w = min(n, 16)
            raw = fx.ptr_load(ptr + j * 16, Vec.make_type(w, elem)).bitcast(fx.Int32)
            for word in fx.range_constexpr(w // 4):
                for half in fx.range_constexpr(2):
                    pair = Vec(rocdl.cvt_pk_f32_fp8(Vec.make_type(2, fx.Float32), raw[word], half == 1), (2,), fx.Float32)
                    vals.append(pair[0])
                    vals.append(pair[1])
    else:
        for j in fx.range_constexpr(n // 8):
            v = fx.ptr_load(ptr + j * 8, Vec.make_type(8, cdt)).to(fx.Float32)
            for e in fx.range_constexpr(8):
                vals.append(v[e])
    return vals


@flyc.kernel
def paged_decode_kernel(
    Q: fx.Tensor, K: fx.Tensor, V: fx.Tensor, KS: fx.Tensor, VS: fx.Tensor, BT: fx.Tensor, SL: fx.Tensor,
    O: fx.Tensor, LSE: fx.Tensor,
    q_sb: fx.Int32, q_sm: fx.Int32, q_sh: fx.Int32,
    kv_sp: fx.Int32, kv_ss: fx.Int32, kv_sh: fx.Int32,
    sc_sp: fx.Int32, sc_ss: fx.Int32, sc_sh: fx.Int32, bt_sb: fx.Int32,
    o_sb: fx.Int32, o_ss: fx.Int32, o_sm: fx.Int32, o_sh: fx.Int32,
    l_sb: fx.Int32, l_ss: fx.Int32, l_sh: fx.Int32, l_sm: fx.Int32,
    Mq: fx.Int32, G: fx.Int32, Hkv: fx.Int32, page_size: fx.Int32, num_splits: fx.Int32, row_tiles: fx.Int32,
    scale: fx.Float32,
    D: fx.Constexpr[int], BF16: fx.Constexpr[bool], FP8: fx.Constexpr[bool], OUT_F32: fx.Constexpr[bool],
):
    cdt = fx.BFloat16 if fx.const_expr(BF16) else fx.Float16
    odt = fx.Float32 if fx.const_expr(OUT_F32) else cdt
    kdt = fx.get_iter(K).element_type
    pid = fx.block_idx.x
    split = fx.block_idx.y
    lane = fx.thread_idx.x
    n = lane % 16
    kg = lane // 16
    rt = pid % row_tiles
    bh = pid // row_tiles
    hkv = bh % Hkv
    b = bh // Hkv

    qp = fx.get_iter(Q)
    kp = fx.get_iter(K)
    vp = fx.get_iter(V)
    ksp = fx.get_iter(KS)
    vsp = fx.get_iter(VS)
    btp = fx.get_iter(BT)
    op = fx.get_iter(O)
    lp = fx.get_iter(LSE)

    seqlen = fx.ptr_load(fx.get_iter(SL) + b)
    per_split = (seqlen + num_splits - 1) // num_splits
    chunk = (per_split + 15) // 16 * 16
    k_start = split * chunk
    k_end = fx.arith.min(seqlen, k_start + chunk)
    nblocks = (fx.arith.max(k_end - k_start, 0) + 15) // 16

    rows = Mq * G
    r = rt * ROWS + n
    row_ok = r < rows
    rc = fx.arith.min(r, rows - 1)
    qi = rc // G
    hq = hkv * G + rc % G

    # Q operand of S^T = K Q^T: lane holds Q[row n, kg*D/4 + t*4 + (0..3)] for step t.
    q_ptr = qp + (b * q_sb + qi * q_sm + hq * q_sh + kg * (D // 4))
    qf = _load_row(q_ptr, D // 4, cdt, False, cdt)
    qzero = fx.Float32(0.0)
    qops = []
    for t in fx.range_constexpr(D // 16):
        qops.append(Vec.from_elements([row_ok.select(qf[t * 4 + i], qzero) for i in range(4)], fx.Float32).to(cdt))

    qk_scale = scale * LOG2E
    neg_inf = fx.Float32(float("-inf"))
    m_run = neg_inf
    l_run = fx.Float32(0.0)
    acc = [Vec.filled(4, 0.0, fx.Float32) for _ in range(D // 16)]
    kv_head_off = hkv * kv_sh
    bt_row = btp + b * bt_sb
    for j in range(nblocks):
        kbase = k_start + j * 16
        last = k_end - 1
        # K: lane reads key kbase+n, head-dim slice kg.
        key = fx.arith.min(kbase + n, last)
        page = fx.ptr_load(bt_row + key // page_size)
        k_off = fx.Int64(page) * fx.Int64(kv_sp) + fx.Int64(key % page_size * kv_ss + kv_head_off + kg * (D // 4))
        kf = _load_row(kp + k_off, D // 4, kdt, FP8, cdt)
        s = Vec.filled(4, 0.0, fx.Float32)
        for t in fx.range_constexpr(D // 16):
            s = _mfma(Vec.from_elements(kf[t * 4:t * 4 + 4], fx.Float32).to(cdt), qops[t], s, BF16)
        # s[i] = S^T[key kg*4+i, row n]; V rows and scales for those keys.
        sv = []
        vrows = []
        vscale = []
        for i in fx.range_constexpr(4):
            key_i = kbase + kg * 4 + i
            kc = fx.arith.min(key_i, last)
            pg = fx.ptr_load(bt_row + kc // page_size)
            slot = kc % page_size
            x = s[i] * qk_scale
            if fx.const_expr(FP8):
                sc_off = fx.Int64(pg) * fx.Int64(sc_sp) + fx.Int64(slot * sc_ss + hkv * sc_sh)
                x = x * fx.ptr_load(ksp + sc_off)
                vscale.append(fx.ptr_load(vsp + sc_off))
            sv.append((key_i < k_end).select(x, neg_inf))
            v_off = fx.Int64(pg) * fx.Int64(kv_sp) + fx.Int64(slot * kv_ss + kv_head_off + n * (D // 16))
            vrows.append(_load_row(vp + v_off, D // 16, kdt, FP8, cdt))
        mx = fx.arith.max(fx.arith.max(sv[0], sv[1]), fx.arith.max(sv[2], sv[3]))
        mx = fx.arith.max(mx, mx.shuffle_xor(16, WAVE))
        mx = fx.arith.max(mx, mx.shuffle_xor(32, WAVE))
        m_new = fx.arith.max(m_run, mx)
        alpha = fx.math.exp2(m_run - m_new)
        p = [fx.math.exp2(sv[i] - m_new) for i in range(4)]
        l_run = l_run * alpha + (p[0] + p[1]) + (p[2] + p[3])
        m_run = m_new
        if fx.const_expr(FP8):
            p = [p[i] * vscale[i] for i in range(4)]
        pop = Vec.from_elements(p, fx.Float32).to(cdt)
        for t in fx.range_constexpr(D // 16):
            vop = Vec.from_elements([vrows[i][t] for i in range(4)], fx.Float32).to(cdt)
            acc[t] = _mfma(vop, pop, acc[t] * alpha, BF16)

    l_tot = l_run + l_run.shuffle_xor(16, WAVE)
    l_tot = l_tot + l_tot.shuffle_xor(32, WAVE)
    inv = (l_tot > 0.0).select(1.0 / l_tot, qzero)
    lse = (m_run + fx.math.log2(l_tot)) * LN2
    if row_ok:
        o_base = op + (b * o_sb + split * o_ss + qi * o_sm + hq * o_sh)
        # acc[t][i] = O[row n, d = (kg*4+i)*D/16 + t]
        for i in fx.range_constexpr(4):
            vals = [acc[t][i] * inv for t in range(D // 16)]
            fx.ptr_store(Vec.from_elements(vals, fx.Float32).to(odt), o_base + (kg * 4 + i) * (D // 16))
        if kg == 0:
            fx.ptr_store(lse, lp + (b * l_sb + split * l_ss + hq * l_sh + qi * l_sm))


@flyc.jit
def paged_decode(
    Q: fx.Tensor, K: fx.Tensor, V: fx.Tensor, KS: fx.Tensor, VS: fx.Tensor, BT: fx.Tensor, SL: fx.Tensor,
    O: fx.Tensor, LSE: fx.Tensor,
    q_sb: fx.Int32, q_sm: fx.Int32, q_sh: fx.Int32,
    kv_sp: fx.Int32, kv_ss: fx.Int32, kv_sh: fx.Int32,
    sc_sp: fx.Int32, sc_ss: fx.Int32, sc_sh: fx.Int32, bt_sb: fx.Int32,
    o_sb: fx.Int32, o_ss: fx.Int32, o_sm: fx.Int32, o_sh: fx.Int32,
    l_sb: fx.Int32, l_ss: fx.Int32, l_sh: fx.Int32, l_sm: fx.Int32,
    B: fx.Int32, Mq: fx.Int32, G: fx.Int32, Hkv: fx.Int32, page_size: fx.Int32, num_splits: fx.Int32,
    scale: fx.Float32,
    D: fx.Constexpr[int], BF16: fx.Constexpr[bool], FP8: fx.Constexpr[bool], OUT_F32: fx.Constexpr[bool],
    stream: fx.Stream = fx.Stream(None),
):
    row_tiles = (Mq * G + ROWS - 1) // ROWS
    paged_decode_kernel(
        Q, K, V, KS, VS, BT, SL, O, LSE, q_sb, q_sm, q_sh, kv_sp, kv_ss, kv_sh, sc_sp, sc_ss, sc_sh, bt_sb,
        o_sb, o_ss, o_sm, o_sh, l_sb, l_ss, l_sh, l_sm, Mq, G, Hkv, page_size, num_splits, row_tiles, scale,
        D, BF16, FP8, OUT_F32,
    ).launch(grid=(B * Hkv * row_tiles, num_splits, 1), block=(WAVE, 1, 1), stream=stream)


@flyc.kernel
def split_reduce_kernel(
    PO: fx.Tensor, PL: fx.Tensor, O: fx.Tensor, LSE: fx.Tensor,
    po_sb: fx.Int32, po_ss: fx.Int32, po_sm: fx.Int32, po_sh: fx.Int32,
    pl_sb: fx.Int32, pl_ss: fx.Int32, pl_sh: fx.Int32, pl_sm: fx.Int32,
    o_sb: fx.Int32, o_sm: fx.Int32, o_sh: fx.Int32, l_sb: fx.Int32, l_sh: fx.Int32, l_sm: fx.Int32,
    Mq: fx.Int32, Hq: fx.Int32, num_splits: fx.Int32,
    D: fx.Constexpr[int], BF16: fx.Constexpr[bool],
):
    odt = fx.BFloat16 if fx.const_expr(BF16) else fx.Float16
    per_lane = D // WAVE
    pid = fx.block_idx.x
    lane = fx.thread_idx.x
    h = pid % Hq
    qi = (pid // Hq) % Mq
    b = pid // (Hq * Mq)
    pl_base = fx.get_iter(PL) + (b * pl_sb + h * pl_sh + qi * pl_sm)
    po_base = fx.get_iter(PO) + (b * po_sb + qi * po_sm + h * po_sh + lane * per_lane)
    neg_inf = fx.Float32(float("-inf"))
    zero = fx.Float32(0.0)
    m = neg_inf
    for s in range(num_splits):
        m = fx.arith.max(m, fx.ptr_load(pl_base + s * pl_ss))
    den = zero
    acc = Vec.filled(per_lane, 0.0, fx.Float32)
    for s in range(num_splits):
        ls = fx.ptr_load(pl_base + s * pl_ss)
        w = (ls > neg_inf).select(fx.math.exp2((ls - m) * LOG2E), zero)
        den = den + w
        acc = acc + fx.ptr_load(po_base + s * po_ss, Vec.make_type(per_lane, fx.Float32)) * w
    inv = (den > 0.0).select(1.0 / den, zero)
    fx.ptr_store((acc * inv).to(odt), fx.get_iter(O) + (b * o_sb + qi * o_sm + h * o_sh + lane * per_lane))
    if lane == 0:
        fx.ptr_store(m + fx.math.log2(den) * LN2, fx.get_iter(LSE) + (b * l_sb + h * l_sh + qi * l_sm))


@flyc.jit
def split_reduce(
    PO: fx.Tensor, PL: fx.Tensor, O: fx.Tensor, LSE: fx.Tensor,
    po_sb: fx.Int32, po_ss: fx.Int32, po_sm: fx.Int32, po_sh: fx.Int32,
    pl_sb: fx.Int32, pl_ss: fx.Int32, pl_sh: fx.Int32, pl_sm: fx.Int32,
    o_sb: fx.Int32, o_sm: fx.Int32, o_sh: fx.Int32, l_sb: fx.Int32, l_sh: fx.Int32, l_sm: fx.Int32,
    B: fx.Int32, Mq: fx.Int32, Hq: fx.Int32, num_splits: fx.Int32,
    D: fx.Constexpr[int], BF16: fx.Constexpr[bool],
    stream: fx.Stream = fx.Stream(None),
):
    split_reduce_kernel(
        PO, PL, O, LSE, po_sb, po_ss, po_sm, po_sh, pl_sb, pl_ss, pl_sh, pl_sm,
        o_sb, o_sm, o_sh, l_sb, l_sh, l_sm, Mq, Hq, num_splits, D, BF16,
    ).launch(grid=(B * Mq * Hq, 1, 1), block=(WAVE, 1, 1), stream=stream)
