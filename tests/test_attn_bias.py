"""fmha_ops.attn_bias: masks materialize to hand-computed patterns; constructors validate; xformers conversion.

Also holds the independent test helpers (``hand_mask``, ``naive_attention``) that test_api.py and
test_properties.py import: dense boolean masks built by plain Python loops from the mask parameters,
never through ``AttentionBias.segments``.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fmha_ops import attn_bias as ab

# ---- independent helpers -------------------------------------------------------------------------------


def hand_mask(spec: dict, mq: int, mk: int) -> torch.Tensor:
    """(mq, mk) bool: which key rows each query row sees, from the mask's parameters alone.

    spec: {"kind": "none"|"causal"|"causal_br"} or
          {"kind": "varlen", "q": [...], "k": [...], "causal": ""|"tl"|"br"} or
          {"kind": "padded", "q": [...], "k": [...], "padding": P, "causal": ""|"br"} or
          {"kind": "paged", "q": [...], "k": [...], "table": [[...]], "page": S, "causal": ""|"br"}
    """
    m = [[False] * mk for _ in range(mq)]
    kind = spec["kind"]
    if kind in ("none", "causal", "causal_br"):
        for i in range(mq):
            for j in range(mk):
                m[i][j] = kind == "none" or (j <= i if kind == "causal" else j <= i + mk - mq)
        return torch.tensor(m, dtype=torch.bool).reshape(mq, mk)
    q0 = 0
    k0 = 0
    for b, (nq, nk) in enumerate(zip(spec["q"], spec["k"])):
        if kind == "varlen":
            rows = list(range(k0, k0 + nk))
            k0 += nk
        elif kind == "padded":
            rows = list(range(b * spec["padding"], b * spec["padding"] + nk))
        else:
            s = spec["page"]
            rows = [spec["table"][b][pos // s] * s + pos % s for pos in range(nk)]
        for i in range(nq):
            for t, r in enumerate(rows):
                c = spec.get("causal", "")
                if c == "tl":
                    vis = t <= i
                elif c == "br":
                    vis = t <= i + nk - nq
                else:
                    vis = True
                m[q0 + i][r] = vis
        q0 += nq
    return torch.tensor(m, dtype=torch.bool).reshape(mq, mk)


def make_bias(spec: dict, device="cpu") -> ab.AttentionBias | None:
    """Our mask object for a spec (see hand_mask)."""
    kind, c = spec["kind"], spec.get("causal", "")
    if kind == "none":
        return None
    if kind == "causal":
        return ab.LowerTriangularMask()
    if kind == "causal_br":
        return ab.LowerTriangularFromBottomRightMask()
    if kind == "varlen":
        m = ab.BlockDiagonalMask.from_seqlens(spec["q"], spec["k"], device=device)
        # bottom-right built directly: make_causal_from_bottomright refuses blocks with fewer keys than queries
        return {"": m, "tl": m.make_causal(), "br": ab.BlockDiagonalCausalFromBottomRightMask(m.q_seqinfo, m.k_seqinfo)}[c]
    cls = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask if c == "br" else ab.BlockDiagonalPaddedKeysMask
    padded = cls.from_seqlens(spec["q"], spec["padding"] if kind == "padded" else _cap(spec), spec["k"], device=device)
    if kind == "padded":
        return padded
    return padded.make_paged(torch.tensor(spec["table"], dtype=torch.int32, device=device), spec["page"])


def _cap(spec):
    return len(spec["table"][0]) * spec["page"]


def naive_attention(q, k, v, allowed: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """float64 softmax attention; q (B, Mq, Hq, K), k/v (B, Mk, Hkv, *) float tensors (already dequantized),
    allowed (Mq, Mk) bool (same for every batch) or None. Rows seeing no key give 0."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    if s.shape[-1] == 0:
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(s - mx)
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def naive_lse(q, k, allowed, scale=None) -> torch.Tensor:
    """(B, Hq, Mq) float64 log-sum-exp of the masked scores (-inf where no key is visible)."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    return torch.logsumexp(s, -1)


def as_bool(materialized: torch.Tensor) -> torch.Tensor:
    vals = materialized.unique()
    assert all(x == 0 or x == -math.inf for x in vals.tolist()), vals
    return materialized == 0


# ---- hand-computed masks ----------------------------------------------------------------------------------

T, F = True, False


def test_lower_triangular_literal():
    got = as_bool(ab.LowerTriangularMask().materialize((3, 5)))
    assert got.tolist() == [[T, F, F, F, F], [T, T, F, F, F], [T, T, T, F, F]]
    got = as_bool(ab.LowerTriangularMask().materialize((4, 2)))
    assert got.tolist() == [[T, F], [T, T], [T, T], [T, T]]


def test_lower_triangular_bottom_right_literal():
    got = as_bool(ab.LowerTriangularFromBottomRightMask().materialize((3, 5)))
    assert got.tolist() == [[T, T, T, F, F], [T, T, T, T, F], [T, T, T, T, T]]
    got = as_bool(ab.LowerTriangularFromBottomRightMask().materialize((4, 2)))
    assert got.tolist() == [[F, F], [F, F], [T, F], [T, T]]  # first rows see nothing


def test_block_diagonal_literal():
    m = ab.BlockDiagonalMask.from_seqlens([2, 0, 3], [1, 2, 2])
    got = as_bool(m.materialize((5, 5)))
    assert got.tolist() == [
        [T, F, F, F, F],
        [T, F, F, F, F],
        [F, F, F, T, T],
        [F, F, F, T, T],
        [F, F, F, T, T],
    ]
    got = as_bool(m.make_causal().materialize((5, 5)))
    assert got.tolist() == [
        [T, F, F, F, F],
        [T, F, F, F, F],
        [F, F, F, T, F],
        [F, F, F, T, T],
        [F, F, F, T, T],
    ]
    with pytest.raises(ValueError, match="sequence 0 has 2 queries but 1 keys"):
        m.make_causal_from_bottomright()  # xformers' rule; the mask itself allows it (FlashAttention's varlen)
    got = as_bool(ab.BlockDiagonalCausalFromBottomRightMask(m.q_seqinfo, m.k_seqinfo).materialize((5, 5)))
    assert got.tolist() == [
        [F, F, F, F, F],  # 2 queries, 1 key: the first query is before the key
        [T, F, F, F, F],
        [F, F, F, F, F],  # 3 queries, 2 keys
        [F, F, F, T, F],
        [F, F, F, T, T],
    ]


def test_padded_keys_literal():
    m = ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 2], kv_padding=3, kv_seqlen=[2, 3])
    assert as_bool(m.materialize((3, 6))).tolist() == [
        [T, T, F, F, F, F],
        [F, F, F, T, T, T],
        [F, F, F, T, T, T],
    ]
    c = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 2], kv_padding=3, kv_seqlen=[2, 3])
    assert as_bool(c.materialize((3, 6))).tolist() == [
        [T, T, F, F, F, F],
        [F, F, F, T, T, F],
        [F, F, F, T, T, T],
    ]
    empty = ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], kv_padding=2, kv_seqlen=[0, 1])
    assert as_bool(empty.materialize((2, 4))).tolist() == [[F, F, F, F], [F, F, T, F]]


def test_paged_literal():
    pad = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 2], kv_padding=4, kv_seqlen=[3, 4])
    m = pad.make_paged(torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), page_size=2)
    assert isinstance(m, ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask) and m.KIND == ab.PAGED_CAUSAL
    # seq 0: positions 0,1 on page 2 (rows 4,5), position 2 on page 0 (row 0); seq 1: pages 1 (rows 2,3), 3 (rows 6,7)
    assert as_bool(m.materialize((3, 8))).tolist() == [
        [T, F, F, F, T, T, F, F],
        [F, F, T, T, F, F, T, F],
        [F, F, T, T, F, F, T, T],
    ]
    nc = ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 2], 4, [3, 4]).make_paged(
        torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), 2)
    assert type(nc) is ab.PagedBlockDiagonalPaddedKeysMask and nc.KIND == ab.PAGED
    assert as_bool(nc.materialize((3, 8)))[1].tolist() == [F, F, T, T, F, F, T, T]


@pytest.mark.parametrize("seed", range(6))
def test_materialize_random_matches_hand_mask(seed):
    g = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    nseq = ri(1, 4)
    ql = [ri(0, 5) for _ in range(nseq)]
    kl = [ri(0, 6) for _ in range(nseq)]
    page = [1, 2, 3][seed % 3]
    maxpages = max(1, -(-max(kl) // page))
    pool = nseq * maxpages + 1
    perm = torch.randperm(pool, generator=g)[: nseq * maxpages].reshape(nseq, maxpages).tolist()
    specs = [
        {"kind": "varlen", "q": ql, "k": kl, "causal": c} for c in ("", "tl", "br")
    ] + [
        {"kind": "padded", "q": ql, "k": kl, "padding": max(kl) + 1, "causal": c} for c in ("", "br")
    ] + [
        {"kind": "paged", "q": ql, "k": kl, "table": perm, "page": page, "causal": c} for c in ("", "br")
    ]
    mq = sum(ql)
    for spec in specs:
        mk = {"varlen": sum(kl), "padded": nseq * (max(kl) + 1), "paged": nseq * maxpages * page}[spec["kind"]]
        got = make_bias(spec).materialize((2, 3, mq, mk), dtype=torch.float64)
        if spec["kind"] == "paged":  # xformers' convention: unpaged key count in, page-pool columns out
            mk = (max(max(r) for r in perm) + 1) * page
        assert got.shape == (2, 3, mq, mk) and got.dtype == torch.float64
        assert torch.equal(as_bool(got[1, 2]), hand_mask(spec, mq, mk)), spec
    for kind in ("causal", "causal_br"):
        for mq, mk in ((1, 1), (ri(1, 7), ri(1, 7)), (5, 5)):
            spec = {"kind": kind}
            assert torch.equal(as_bool(make_bias(spec).materialize((mq, mk))), hand_mask(spec, mq, mk))


# ---- constructors ------------------------------------------------------------------------------------------

def test_seqinfo_fields():
    m = ab.BlockDiagonalMask.from_seqlens([3, 0, 5])
    assert m.q_seqinfo.seqstart_py == [0, 3, 3, 8] and m.q_seqinfo.seqstart.dtype == torch.int32
    assert m.q_seqinfo.seqstart.tolist() == [0, 3, 3, 8]
    assert (m.q_seqinfo.max_seqlen, m.q_seqinfo.min_seqlen) == (5, 0)
    assert m.k_seqinfo is m.q_seqinfo and m.q_seqinfo.seqlens == [3, 0, 5]
    p = ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 8, [3, 8])
    assert p.k_seqinfo.seqlen.tolist() == [3, 8] and p.k_seqinfo.seqlen.dtype == torch.int32
    assert p.k_seqinfo.padding == 8
    moved = ab.BlockDiagonalCausalMask.from_seqlens([2], [3]).to("meta")
    assert type(moved) is ab.BlockDiagonalCausalMask and moved.q_seqinfo.seqstart.device.type == "meta"
    paged = p.make_paged(torch.zeros(2, 2, dtype=torch.int32), 4).to("meta")
    assert paged.block_tables.device.type == "meta" and paged.page_size == 4


@pytest.mark.parametrize("make,msg", [
    (lambda: ab.BlockDiagonalMask.from_seqlens([1, -1]), r"q_seqlen\[1\] must be >= 0, got -1"),
    (lambda: ab.BlockDiagonalMask.from_seqlens([1, 2], [1]), "q_seqlen has 2 sequences but kv_seqlen has 1"),
    (lambda: ab.BlockDiagonalPaddedKeysMask.from_seqlens([1], 4, [5]), r"kv_seqlen must be in \[0, kv_padding=4\]"),
    (lambda: ab.BlockDiagonalPaddedKeysMask.from_seqlens([1], 4, [-1]), r"kv_seqlen\[0\] must be >= 0, got -1"),
    (lambda: ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 4, [1]), "q_seqlen has 2 sequences but kv_seqlen"),
    (lambda: ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 4, [1, 2]).make_paged(
        torch.zeros(3, 2, dtype=torch.int32), 2), r"block_tables must be \(batch=2, max_pages\), got \(3, 2\)"),
    (lambda: ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 4, [1, 2]).make_paged(
        torch.zeros(2, dtype=torch.int32), 2), r"block_tables must be \(batch=2, max_pages\), got \(2,\)"),
    (lambda: ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 4, [1, 2]).make_paged(
        torch.zeros(2, 2, dtype=torch.int32), 0), "page_size must be >= 1, got 0"),
    (lambda: ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 8, [1, 5]).make_paged(
        torch.zeros(2, 2, dtype=torch.int32), 2), r"kv_seqlen \[1, 5\] exceeds block_tables capacity 4"),
])
def test_constructor_errors(make, msg):
    with pytest.raises(ValueError, match=msg):
        make()


def test_kinds_consistent():
    assert ab.CAUSAL_KINDS <= ab.ALL_KINDS and ab.VARLEN_KINDS <= ab.ALL_KINDS and ab.PAGED_KINDS <= ab.DECODE_KINDS
    classes = [ab.LowerTriangularMask, ab.LowerTriangularFromBottomRightMask, ab.BlockDiagonalMask,
               ab.BlockDiagonalCausalMask, ab.BlockDiagonalCausalFromBottomRightMask, ab.BlockDiagonalPaddedKeysMask,
               ab.BlockDiagonalCausalWithOffsetPaddedKeysMask, ab.PagedBlockDiagonalPaddedKeysMask,
               ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask, ab.TensorBias, ab.LowerTriangularMaskWithTensorBias,
               ab.BlockDiagonalGappyKeysMask, ab.BlockDiagonalCausalWithOffsetGappyKeysMask,
               ab.PagedBlockDiagonalGappyKeysMask, ab.PagedBlockDiagonalCausalWithOffsetGappyKeysMask]
    kinds = [c.KIND for c in classes]
    assert len(set(kinds)) == len(kinds) and set(kinds) | {ab.NONE} == ab.ALL_KINDS
    assert ab.GAPPY_KINDS <= ab.DECODE_KINDS and ab.TENSOR_KINDS <= ab.ALL_KINDS
    for c in classes:
        causal = issubclass(c, (ab.LowerTriangularMask, ab.LowerTriangularFromBottomRightMask)) or bool(
            getattr(c, "_CAUSAL", ""))
        assert (c.KIND in ab.CAUSAL_KINDS) == causal, c


# ---- xformers conversion (look-alike objects with xformers' class names and attribute names) --------------

def _xf(name: str, **attrs):
    """An object whose type is named ``name`` (as xformers' classes are) with the given attributes."""
    return type(name, (), {})() if not attrs else _with(type(name, (), {})(), attrs)


def _with(obj, attrs):
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def _xf_seqinfo(lens):
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return _xf("_SeqLenInfo", seqstart_py=starts, seqstart=torch.tensor(starts, dtype=torch.int32),
               max_seqlen=max(lens), min_seqlen=min(lens))


def _xf_padded(lens, padding):
    starts = list(range(0, len(lens) * padding + 1, padding))
    return _xf("_PaddedSeqLenInfo", seqlen_py=list(lens), seqlen=torch.tensor(lens, dtype=torch.int32), padding=padding,
               seqstart_py=starts, seqstart=torch.tensor(starts, dtype=torch.int32), max_seqlen=max(lens),
               min_seqlen=min(lens))


@pytest.mark.parametrize("name", ["LowerTriangularMask", "LowerTriangularFromBottomRightMask"])
def test_from_xformers_causal(name):
    ours = ab.from_xformers(_xf(name))
    assert type(ours) is getattr(ab, name)
    assert torch.equal(ours.materialize((3, 4)), getattr(ab, name)().materialize((3, 4)))


@pytest.mark.parametrize("name,causal", [("BlockDiagonalMask", ""), ("BlockDiagonalCausalMask", "tl"),
                                         ("BlockDiagonalCausalFromBottomRightMask", "br")])
def test_from_xformers_varlen(name, causal):
    xq, xk = [2, 0, 3], [1, 4, 2]
    ours = ab.from_xformers(_xf(name, q_seqinfo=_xf_seqinfo(xq), k_seqinfo=_xf_seqinfo(xk)))
    assert type(ours) is getattr(ab, name)
    spec = {"kind": "varlen", "q": xq, "k": xk, "causal": causal}
    assert torch.equal(as_bool(ours.materialize((5, 7))), hand_mask(spec, 5, 7))


@pytest.mark.parametrize("name,causal", [("BlockDiagonalPaddedKeysMask", ""),
                                         ("BlockDiagonalCausalWithOffsetPaddedKeysMask", "br")])
def test_from_xformers_padded(name, causal):
    ours = ab.from_xformers(_xf(name, q_seqinfo=_xf_seqinfo([1, 2]), k_seqinfo=_xf_padded([3, 0], 4)))
    assert type(ours) is getattr(ab, name) and ours.k_seqinfo.padding == 4
    spec = {"kind": "padded", "q": [1, 2], "k": [3, 0], "padding": 4, "causal": causal}
    assert torch.equal(as_bool(ours.materialize((3, 8))), hand_mask(spec, 3, 8))


@pytest.mark.parametrize("name,causal", [("PagedBlockDiagonalPaddedKeysMask", ""),
                                         ("PagedBlockDiagonalCausalWithOffsetPaddedKeysMask", "br")])
def test_from_xformers_paged(name, causal):
    table = [[3, 1], [0, 2]]
    obj = _xf(name, q_seqinfo=_xf_seqinfo([2, 1]), k_seqinfo=_xf_padded([3, 4], 4),
              block_tables=torch.tensor(table, dtype=torch.int32), page_size=2)
    ours = ab.from_xformers(obj)
    assert type(ours) is getattr(ab, name) and ours.page_size == 2
    spec = {"kind": "paged", "q": [2, 1], "k": [3, 4], "table": table, "page": 2, "causal": causal}
    assert torch.equal(as_bool(ours.materialize((3, 8))), hand_mask(spec, 3, 8))  # 2 sequences x 4 rows -> 4 pages


def test_from_xformers_unsupported_lists_supported():
    with pytest.raises(ValueError, match=r"attn_bias of type .*BlockDiagonalSparseMask is not supported; "
                                         r"supported: .*BlockDiagonalMask.*LowerTriangularMask"):
        ab.from_xformers(_xf("BlockDiagonalSparseMask"))


@pytest.mark.parametrize("batch,per_sequence", [(8, 1), (3, 4), (0, 1), (3, 0), (0, 0)])
def test_uniform_queries_match_from_seqlens_and_are_new_per_mask(batch, per_sequence):
    lens = torch.full((batch,), 5, dtype=torch.int32)
    mask = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_device_seqlens(per_sequence, 8, lens)
    want = ab._SeqLenInfo.from_seqlens([per_sequence] * batch)
    got = mask.q_seqinfo
    assert (got.seqstart_py, got.max_seqlen, got.min_seqlen) == (want.seqstart_py, want.max_seqlen, want.min_seqlen)
    assert got.seqstart.dtype == torch.int32 and torch.equal(got.seqstart, want.seqstart)
    other = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_device_seqlens(per_sequence, 8, lens)
    if batch and per_sequence:  # a mask's queries changed in place leave another mask's as they were
        mask.q_seqinfo.from_seqlens_inplace([0] * batch)
        assert other.q_seqinfo.seqstart_py == want.seqstart_py and torch.equal(other.q_seqinfo.seqstart, want.seqstart)
