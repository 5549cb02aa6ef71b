"""Context-parallel attention: layouts, every rank's ring steps in one process (CPU, and the GPU kernels),
and the real ring over gloo processes (2 and 4 ranks) against single-process float64 attention."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fmha_ops
from fmha_ops import context_parallel as cp
from fmha_ops.context_parallel.schedule import geometry, step_blocks
from fmha_ops.context_parallel.steps import KVShard, backward_step, forward_step
from fmha_ops.testing import error_report, transformer_like

FP8 = torch.float8_e4m3fn


def reference(q, k, v, causal, cu_seqlens=None, scale=None):
    """float64 attention of whole sequences (BMHK; with ``cu_seqlens`` per packed sequence); differentiable."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    s = torch.einsum("bmhd,bnhd->bhmn", q, k) * scale
    n = q.shape[1]
    seq = torch.zeros(n, dtype=torch.long)
    if cu_seqlens is not None:
        for b, (a, e) in enumerate(zip(cu_seqlens, cu_seqlens[1:])):
            seq[a:e] = b
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed &= torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    p = torch.softmax(s.masked_fill(~allowed.to(s.device), -math.inf), dim=-1)
    return torch.einsum("bhmn,bnhd->bmhd", p, v)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


# ---- layouts --------------------------------------------------------------------------------

def test_chunk_ids():
    assert [cp.chunk_ids(r, 4, "zigzag") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert cp.chunk_ids(2, 4, "contiguous") == (2,)


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_unshard_round_trip(layout, world):
    x = torch.randn(2, 2 * world * 5, 3)
    parts = [cp.shard(x, r, world, layout) for r in range(world)]
    assert all(p.shape == (2, 10, 3) for p in parts)
    assert torch.equal(cp.unshard(parts, layout), x)
    cu = [0, 2 * world * 3, 2 * world * 3, 2 * world * 7]  # an empty sequence in the middle
    xv = torch.randn(1, cu[-1], 2)
    parts = [cp.shard(xv, r, world, layout, cu_seqlens=cu) for r in range(world)]
    assert parts[0].shape[1] == cp.shard_cu_seqlens(cu, world, layout)[-1]
    assert torch.equal(cp.unshard(parts, layout, cu_seqlens=cu), xv)


def test_zigzag_positions():
    pos = torch.arange(12)
    assert cp.shard(pos, 1, 3, dim=0).tolist() == [2, 3, 8, 9]
    packed = torch.arange(12)  # sequences of 8 and 4 tokens; rank 1 holds chunks 1 and 2 of each
    assert cp.shard(packed, 1, 2, dim=0, cu_seqlens=torch.tensor([0, 8, 12])).tolist() == [2, 3, 4, 5, 9, 10]


def test_uneven_lengths_raise():
    with pytest.raises(ValueError, match="multiple of 4"):
        cp.shard(torch.randn(1, 18, 1), 0, 2)
    with pytest.raises(ValueError, match="sequence 1 has 3 tokens"):
        cp.shard_cu_seqlens([0, 4, 7], 2, "contiguous")
    with pytest.raises(ValueError, match="layout='ring'"):
        cp.shard(torch.randn(1, 8, 1), 0, 2, "ring")


def test_schedule_balances_zigzag_causal():
    world = 4
    for rank in range(world):
        work = [sum((1 if b.q_rows == "all" else 0.5) * (1 if b.kv_rows == "all" else 0.5) * (0.5 if b.causal else 1)
                    for b in step_blocks(rank, (rank - s) % world, "zigzag", True)) for s in range(world)]
        assert work == [0.5] + [0.5] * (world - 1)


# ---- every rank's ring steps in one process -------------------------------------------------

def simulate(q, k, v, grad_out, world, layout, causal, cu_seqlens=None, q_descale=None, kv_descales=None,
             op=None, backward=True):
    """Run each rank's forward (and backward) steps in turn on its shards, passing shards by hand.
    Returns the unsharded (out, dq, dk, dv) (grads None without ``backward``)."""
    sh = lambda t, r: cp.shard(t, r, world, layout, cu_seqlens=cu_seqlens)  # noqa: E731
    starts = None if cu_seqlens is None else cp.shard_cu_seqlens(cu_seqlens, world, layout)
    local = None if starts is None else tuple(b - a for a, b in zip(starts, starts[1:]))
    geom = geometry(q.shape[1] // world, local, layout, q.device)
    kvs = [KVShard(sh(k, r), sh(v, r), *(kv_descales[r] if kv_descales else (None, None))) for r in range(world)]
    qs = [sh(q, r) for r in range(world)]
    outs, lses = [], []
    for r in range(world):
        acc = None
        for s in range(world):
            src = (r - s) % world
            acc = forward_step(acc, qs[r], kvs[src], step_blocks(r, src, layout, causal), geom, None, q_descale, op)
        outs.append(acc.out.to(torch.float32))
        lses.append(acc.lse)
    out = cp.unshard(outs, layout, cu_seqlens=cu_seqlens)
    if not backward:
        return out, None, None, None
    dqs = [torch.zeros(qs[r].shape, device=q.device) for r in range(world)]
    dks = [torch.zeros(kvs[r].key.shape, device=q.device) for r in range(world)]
    dvs = [torch.zeros(kvs[r].value.shape, device=q.device) for r in range(world)]
    for r in range(world):
        o, go = outs[r].to(q.dtype), sh(grad_out, r)
        for s in range(world):
            src = (r - s) % world
            backward_step(dqs[r], dks[src], dvs[src], qs[r], kvs[src], o, lses[r], go,
                          step_blocks(r, src, layout, causal), geom, None, q_descale)
    return (out, cp.unshard(dqs, layout, cu_seqlens=cu_seqlens), cp.unshard(dks, layout, cu_seqlens=cu_seqlens),
            cp.unshard(dvs, layout, cu_seqlens=cu_seqlens))


def _check_simulated(q, k, v, world, layout, causal, cu_seqlens=None, tol=1e-5, grad_tol=1e-5):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*leaves, causal, cu_seqlens)
    go = torch.randn(ref.shape, dtype=q.dtype, device=q.device, generator=None)
    ref.backward(go.double())
    out, dq, dk, dv = simulate(q, k, v, go, world, layout, causal, cu_seqlens)
    assert _rel(out, ref) < tol, (layout, causal, _rel(out, ref))
    for name, got, leaf in (("dq", dq, leaves[0]), ("dk", dk, leaves[1]), ("dv", dv, leaves[2])):
        assert _rel(got, leaf.grad) < grad_tol, (name, layout, causal, _rel(got, leaf.grad))


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_simulated_ring_cpu(layout, causal):
    torch.manual_seed(0)
    world = 3
    q, k, v = transformer_like((1, 2 * world * 5, 4, 16), (1, 2 * world * 5, 2, 16), dtype=torch.float32)
    _check_simulated(q, k, v, world, layout, causal)
    cu = [0, 2 * world * 2, 2 * world * 2, 2 * world * 5]
    q, k, v = transformer_like((1, cu[-1], 2, 8), (1, cu[-1], 1, 8), dtype=torch.float32, seed=1)
    _check_simulated(q, k, v, world, layout, causal, cu)


def test_partial_backward_given_merged_lse():
    """Two key slices' backwards with the merged out / lse sum to the whole attention's gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 8, dtype=torch.float64).float() for _ in range(3))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference(*leaves, False)
    go = torch.randn(ref.shape)
    ref.backward(go.double())
    cut = [slice(0, 4), slice(4, 9)]
    parts = [fmha_ops.memory_efficient_attention_partial(q, k[:, s], v[:, s]) for s in cut]
    out, lse = fmha_ops.merge_attentions([p[0] for p in parts], [p[1] for p in parts])
    grads = [cp.partial_attention_backward(go, out, lse, q, k[:, s], v[:, s]) for s in cut]
    assert _rel(grads[0][0] + grads[1][0], leaves[0].grad) < 1e-5
    assert _rel(torch.cat([grads[0][1], grads[1][1]], 1), leaves[1].grad) < 1e-5
    assert _rel(torch.cat([grads[0][2], grads[1][2]], 1), leaves[2].grad) < 1e-5


GPU_WORLD, GPU_SHAPE = 4, (1, 4 * 2 * 160, 8, 2, 128)  # W; B, N, Hq, Hkv, D
BF16_TOL = 2e-2  # relative L2 error of bf16 attention and its gradients vs float64 (the kernel tests' bound)


def _gpu_inputs():
    b, n, hq, hkv, d = GPU_SHAPE
    q, k, v = transformer_like((b, n, hq, d), (b, n, hkv, d), dtype=torch.bfloat16, device="cuda")
    return q, k, v, torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_ring_steps_gpu_bf16(layout):
    """Each rank's causal steps through the GPU kernels (bf16 forward and backward), merged, against float64
    attention of the whole sequence, and as close as one call over the whole sequence."""
    q, k, v, go = _gpu_inputs()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*leaves, True)
    ref.backward(go.double())
    whole = fmha_ops.memory_efficient_attention(q, k, v, fmha_ops.LowerTriangularMask())
    out, dq, dk, dv = simulate(q, k, v, go, GPU_WORLD, layout, True)
    rep, rep_whole = error_report(out, ref), error_report(whole, ref)
    assert rep["rel"] < max(2 * rep_whole["rel"], 5e-3), (rep, rep_whole)
    for name, got, leaf in (("dq", dq, leaves[0]), ("dk", dk, leaves[1]), ("dv", dv, leaves[2])):
        rep = error_report(got, leaf.grad)
        assert rep["rel"] < BF16_TOL and rep["cos"] > 1 - 2 * BF16_TOL ** 2, (name, rep)


@pytest.mark.gpu
def test_ring_steps_gpu_no_host_sync():
    """Once warm, the steps (partial attention, merge, block backward) never wait on the GPU."""
    q, k, v, go = _gpu_inputs()
    simulate(q, k, v, go, GPU_WORLD, "zigzag", True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        simulate(q, k, v, go, GPU_WORLD, "zigzag", True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_ring_steps_gpu_varlen():
    q, k, v, _ = _gpu_inputs()
    w = GPU_WORLD
    cu = [0, 2 * w * 40, 2 * w * 40, 2 * w * 120]  # an empty sequence between two
    qv, kv, vv = (t[:, :cu[-1]] for t in (q, k, v))
    ref = reference(qv, kv, vv, True, cu)
    out, _, _, _ = simulate(qv, kv, vv, None, w, "zigzag", True, cu, backward=False)
    rep = error_report(out, ref)
    assert rep["rel"] < 5e-3, rep


@pytest.mark.gpu
def test_ring_steps_gpu_fp8():
    """fp8 steps: each rank's K/V shard quantized with its own per-tensor scale (the descales travel with it)."""
    q, k, v, _ = _gpu_inputs()
    w = GPU_WORLD
    sh = lambda t, r: cp.shard(t, r, w, "zigzag")  # noqa: E731
    q_scale = q.float().abs().amax().reshape(1) / 448
    q8 = (q.float() / q_scale).to(FP8)
    k8s, v8s, descales = [], [], []
    for r in range(w):
        ks, vs = sh(k, r).float().abs().amax().reshape(1) / 448, sh(v, r).float().abs().amax().reshape(1) / 448
        k8s.append((sh(k, r).float() / ks).to(FP8))
        v8s.append((sh(v, r).float() / vs).to(FP8))
        descales.append((ks, vs))
    deq = lambda parts, i: cp.unshard([p.float() * descales[r][i] for r, p in enumerate(parts)])  # noqa: E731
    ref = reference(q8.float() * q_scale, deq(k8s, 0), deq(v8s, 1), True)
    out, _, _, _ = simulate(q8, cp.unshard(k8s), cp.unshard(v8s), None, w, "zigzag", True, q_descale=q_scale,
                            kv_descales=descales, backward=False)
    rep = error_report(out, ref)
    assert rep["cos"] > 0.998, rep


@pytest.mark.gpu
def test_ring_transfer_nccl_one_rank(tmp_path):
    """The CUDA transfer path (side stream, NCCL batch_isend_irecv, stream waits) on a ring of one rank, which
    sends to itself: the buffer arrives, later work on the compute stream sees it, and no host sync."""
    from fmha_ops.context_parallel.ring import Packet, Ring

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        k, v = torch.randn(1, 64, 2, 128, device="cuda").bfloat16(), torch.randn(1, 64, 2, 128, device="cuda").bfloat16()
        packet = Packet([k, v, torch.ones(1, device="cuda")])
        ring = Ring(dist.group.WORLD, k.device)
        buf = packet.pack([k, v, torch.full((1,), 3.0, device="cuda")], k.device)
        ring.start(buf).finish()  # warm: communicator creation syncs
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = ring.start(buf).finish()
            k2, v2, d2 = packet.unpack(got)
            total = k2.float().sum() + v2.float().sum() + d2.sum()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(k2, k) and torch.equal(v2, v) and d2.item() == 3.0
        assert torch.allclose(total, k.float().sum() + v.float().sum() + 3.0)
    finally:
        dist.destroy_process_group()


# ---- the ring over gloo processes -----------------------------------------------------------

def _cases(world):
    """(name, settings) of the cases one spawn runs: dense and varlen, GQA, 17 tokens per chunk."""
    cases = [(f"{layout}-{'causal' if causal else 'full'}", dict(layout=layout, causal=causal))
             for layout in cp.LAYOUTS for causal in (False, True)]
    cases.append(("zigzag-causal-varlen", dict(layout="zigzag", causal=True, varlen=True)))
    if world == 2:
        cases += [("contiguous-full-varlen", dict(layout="contiguous", causal=False, varlen=True)),
                  ("zigzag-causal-mesh", dict(layout="zigzag", causal=True, mesh=True)),
                  ("zigzag-causal-fp8", dict(layout="zigzag", causal=True, fp8=True)),
                  ("contiguous-causal-fp8-grad", dict(layout="contiguous", causal=True, fp8=True, grad=True))]
    else:
        cases.append(("zigzag-causal-mesh2d", dict(layout="zigzag", causal=True, mesh=True)))
    return cases


def _run_case(rank, world, settings, seed):
    from torch.distributed.device_mesh import init_device_mesh

    layout, causal = settings["layout"], settings["causal"]
    group, cp_rank, cp_world = None, rank, world
    kwargs = {}
    if settings.get("mesh"):
        shape, names = ((world,), ("cp",)) if world == 2 else ((2, world // 2), ("dp", "cp"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        group, cp_rank, cp_world = mesh, mesh.get_local_rank("cp"), mesh.size(names.index("cp"))
        kwargs["mesh_dim"] = None if world == 2 else "cp"
        seed += mesh.get_local_rank("dp") if world > 2 else 0  # each dp replica its own data
    per_chunk = 17
    cu = None
    if settings.get("varlen"):
        parts = 2 * cp_world
        cu = [0, parts * 3, parts * 3, parts * 9]
        n, b = cu[-1], 1
    else:
        n, b = per_chunk * 2 * cp_world, 2
    q, k, v = transformer_like((b, n, 4, 16), (b, n, 2, 16), dtype=torch.float32, seed=seed)
    go = torch.randn(b, n, 4, 16, generator=torch.Generator().manual_seed(seed))
    sh = lambda t: cp.shard(t, cp_rank, cp_world, layout, cu_seqlens=cu)  # noqa: E731
    if settings.get("fp8"):  # each rank quantizes its own shards: the descales differ and must travel
        qi, ki, vi = sh(q), sh(k), sh(v)
        scales = [t.abs().amax().reshape(1) / 448 for t in (qi, ki, vi)]
        q8, k8, v8 = ((t / s).to(FP8).requires_grad_(settings.get("grad", False)) for t, s in zip((qi, ki, vi), scales))
        with fmha_ops.set_fp8_dequantized_backward(settings.get("grad", False)):
            out = cp.attention(q8, k8, v8, causal=causal, group=group, layout=layout, q_descale=scales[0],
                               k_descale=scales[1], v_descale=scales[2], output_dtype=torch.float32)
        deq = [t.detach().float() * s for t, s in zip((q8, k8, v8), scales)]
        whole = [torch.empty(0)] * 3
        gathered = [[torch.empty_like(t) for _ in range(cp_world)] for t in deq]
        for g, t in zip(gathered, deq):
            dist.all_gather(g, t)
        whole = [cp.unshard(g, layout) for g in gathered]
        if not settings.get("grad"):
            return {"out": _rel(out, sh(reference(*whole, causal)))}
        leaves = [t.double().requires_grad_() for t in whole]
        ref = reference(*leaves, causal)
        ref.backward(go.double())
        out.backward(sh(go))  # outside the switch: the backward runs in the forward's context
        # gradients w.r.t. the dequantized values, returned in the inputs' dtype (fp8)
        errs = {name: _rel(t.grad.float(), sh(leaf.grad)) for name, t, leaf in zip(("dq", "dk", "dv"), (q8, k8, v8), leaves)}
        return {"out": _rel(out, sh(ref)), **errs}
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference(*leaves, causal, cu)
    ref.backward(go.double())
    qi, ki, vi = (sh(t).requires_grad_() for t in (q, k, v))
    out, lse = cp.attention(qi, ki, vi, causal=causal, group=group, layout=layout, cu_seqlens=cu, return_lse=True,
                            **kwargs)
    out.backward(sh(go))
    errs = {"out": _rel(out, sh(ref))}
    errs.update({name: _rel(t.grad, sh(leaf.grad)) for name, t, leaf in zip(("dq", "dk", "dv"), (qi, ki, vi), leaves)})
    assert lse.shape == (b, 4, qi.shape[1])
    return errs


def _gloo_worker(rank, world, store, result_dir):
    torch.set_num_threads(1)  # ranks share the cores; more threads each only contend
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results = {name: _run_case(rank, world, settings, seed) for seed, (name, settings) in enumerate(_cases(world))}
        with pytest.raises(ValueError, match="multiple of 2"):
            cp.attention(*(torch.randn(1, 3, 2, 8) for _ in range(3)), causal=True)
        with pytest.raises(NotImplementedError, match="k_descale of shape"):
            x = torch.randn(1, 4, 2, 16).to(FP8)
            cp.attention(x, x, x, q_descale=torch.ones(1), k_descale=torch.ones(1, 2, 4), v_descale=torch.ones(1))
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _tolerance(case, what):
    """Max error relative to the largest reference value: float32 rounding; fp8 inputs (dequantized exactly,
    so only the attention's own rounding); fp8 gradients come back rounded to e4m3 (3 mantissa bits)."""
    if "fp8" not in case:
        return 3e-5
    return 7e-2 if what != "out" else 2e-2


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ring_matches_single_process(world, tmp_path):
    mp.spawn(_gloo_worker, (world, str(tmp_path / "store"), str(tmp_path)), nprocs=world)
    worst = {}
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.json") as f:
            for case, errs in json.load(f).items():
                for what, e in errs.items():
                    worst[(case, what)] = max(worst.get((case, what), 0.0), e)
    bad = {k: e for k, e in worst.items() if e > _tolerance(*k)}
    assert not bad, bad
    assert {c for c, _ in worst} == {name for name, _ in _cases(world)}


def test_geometry_is_the_plan_of_its_shard():
    from fmha_ops.plans import PLANS

    cpu = torch.device("cpu")
    packed = geometry(8, (4, 4), "zigzag", cpu)
    assert geometry(8, (4, 4), "zigzag", cpu) is packed  # one build per shard layout, held by the plan cache
    assert geometry(8, (2, 6), "zigzag", cpu) is not packed and geometry(8, None, "zigzag", cpu) is not packed
    PLANS.clear()
    rebuilt = geometry(8, (4, 4), "zigzag", cpu)
    assert rebuilt is not packed
    assert torch.equal(rebuilt.rows("first").sel, packed.rows("first").sel)
