"""flash_attn_with_kvcache in CUDA graphs: a call keeps no tensor it allocates (a tensor cached on a first call
made inside a graph capture or a ``torch.compile(mode="reduce-overhead")`` recording would live in the graph's
memory pool), an fp8 cache's per-token scales reach the kernel as the caller's tensors (no copy, any strides),
and the decode step compiled with ``mode="reduce-overhead"`` replays CUDA graphs with eager's results."""
from __future__ import annotations

import pytest
import torch

import fmha_ops
from fmha_ops.kernels.triton import launch as launch_module
from fmha_ops.kv_cache import build_fp8_paged_cache, paged_from_dense
from fmha_ops.testing import error_report
from tests.allocations import kept_tensors
from tests.conftest import DEVICE

DTYPE = torch.float16 if DEVICE == "cpu" else torch.bfloat16
REL = 2e-3 if DEVICE == "cpu" else 8e-3


def _paged(B, L, Hkv, D, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, L, Hkv, D, generator=g).to(DTYPE) for _ in range(2))
    (kp, vp), table = paged_from_dense([k, v], page_size, generator=g)
    k8, v8, ks, vs, table8 = build_fp8_paged_cache(k, v, page_size, generator=g)
    return [t.to(DEVICE) for t in (k, v, kp, vp, table, k8, v8, ks, vs, table8)]


def _calls():
    """name -> a call of flash_attn_with_kvcache (or a decode op) on shapes no other test uses."""
    B, L, Hkv, D = 5, 37, 2, 16
    k, v, kp, vp, table, k8, v8, ks, vs, table8 = _paged(B, L, Hkv, D, 8, seed=11)
    q = torch.randn(B, 1, 6, D).to(DEVICE, DTYPE)
    lens = torch.tensor([37, 20, 1, 0, 9], dtype=torch.int32, device=DEVICE)
    new = torch.randn(B, 1, Hkv, D).to(DEVICE, DTYPE)
    rows = torch.tensor([4, 0, 2, 1, 3], dtype=torch.int32, device=DEVICE)
    append_at = torch.tensor([36, 19, 0, 0, 8], dtype=torch.int32, device=DEVICE)
    fa = fmha_ops.flash_attn_with_kvcache
    return {
        "paged": lambda: fa(q, kp, vp, cache_seqlens=lens, page_table=table, causal=True),
        "paged fp8": lambda: fa(q, k8, v8, cache_seqlens=lens, page_table=table8, k_descale=ks, v_descale=vs,
                                causal=True),
        "paged append": lambda: fa(q, kp, vp, new, new, cache_seqlens=append_at, page_table=table,
                                   causal=True),
        "dense": lambda: fa(q, k, v, cache_seqlens=lens, causal=True),
        "dense int lengths": lambda: fa(q, k, v, cache_seqlens=30),
        "dense cache_batch_idx": lambda: fa(q, k, v, cache_seqlens=lens, cache_batch_idx=rows),
        "decode op, no mask": lambda: fmha_ops.memory_efficient_attention(q, k, v, op="triton_decoderF"),
        "split-K op, no mask": lambda: fmha_ops.memory_efficient_attention(q, k, v, op="triton_splitKF"),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_calls_keep_no_tensor_they_allocate(name):
    """The first call of a layout (validation, mask, selection, plans) and the repeated one (fast paths) leave
    nothing allocated behind: no lengths, page tables or sequence starts cached for later calls."""
    call = _calls()[name]
    for attempt in ("first", "repeated"):
        assert kept_tensors(call) == [], f"{name}, {attempt} call"


def _launched_tensors(monkeypatch) -> list:
    """The tensors every kernel launch of ``fmha_ops.kernels.triton.launch`` receives, appended per launch, keyed
    (``CachedKernel``) or bound (``BoundLaunch``: a plan's repeated launches; its first call, which takes the keyed
    path, is appended twice)."""
    seen: list = []
    launch, bound = launch_module.CachedKernel._launch, launch_module.BoundLaunch.__call__

    def spy(self, grid, args, kwargs):
        seen.append([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])
        return launch(self, grid, args, kwargs)

    def bound_spy(self, *args):
        seen.append([a for a in args if isinstance(a, torch.Tensor)])
        return bound(self, *args)

    monkeypatch.setattr(launch_module.CachedKernel, "_launch", spy)
    monkeypatch.setattr(launch_module.BoundLaunch, "__call__", bound_spy)
    return seen


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _reference(q, k_cache, v_cache, ks, vs, table, lens):
    """float64 decode of one query token per sequence against a paged fp8 cache with per-token scales."""
    B, _, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        pages = table[b].cpu().long()
        k = (k_cache.cpu().double()[pages] * ks.cpu().double()[pages][..., None]).reshape(-1, Hkv, D)[:n]
        v = (v_cache.cpu().double()[pages] * vs.cpu().double()[pages][..., None]).reshape(-1, Hkv, D)[:n]
        k, v = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
        s = torch.einsum("hd,nhd->hn", q[b, 0].cpu().double(), k) * D ** -0.5
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out[:, None]


_FP8_DECODE_OPS = ["triton_decoderF", "triton_splitKF"] + (["gluon_fp8_decodeF"] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("op", _FP8_DECODE_OPS)
@pytest.mark.parametrize("layout", ["keys contiguous", "token major", "strided"])
def test_fp8_cache_scales_reach_the_kernel_as_given(monkeypatch, layout, op):
    """build_fp8_paged_cache's scales (each head's slots contiguous), token-major ones and a strided view: the
    decode kernel reads the caller's tensors (first call and the repeated one), with the float64 result."""
    B, L, Hkv, D, page = 3, 45, 2, 64, 16
    _, _, _, _, _, k8, v8, ks, vs, table = _paged(B, L, Hkv, D, page, seed=12)
    if layout == "token major":
        ks, vs = ks.contiguous(), vs.contiguous()
    elif layout == "strided":  # every other slot of a buffer twice as wide
        wide = [torch.empty(*t.shape[:2], 2 * Hkv, device=DEVICE) for t in (ks, vs)]
        for w, t in zip(wide, (ks, vs)):
            w[..., ::2] = t
        ks, vs = (w[..., ::2] for w in wide)
    q = torch.randn(B, 1, 4, D).to(DEVICE, DTYPE)
    lens = torch.tensor([45, 16, 3], dtype=torch.int32, device=DEVICE)
    seen = _launched_tensors(monkeypatch)
    for attempt in ("first", "repeated"):
        seen.clear()
        with fmha_ops.use_ops(op):
            out = fmha_ops.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, k_descale=ks,
                                                   v_descale=vs, causal=True)
        decoder = seen[0]  # the decoder runs first (a split reduce may follow)
        assert any(_same_tensor(t, ks) for t in decoder) and any(_same_tensor(t, vs) for t in decoder), attempt
        want = _reference(q, k8, v8, ks, vs, table, lens)
        assert error_report(out.cpu().double(), want)["rel"] < REL, attempt


# ---- on the GPU -------------------------------------------------------------------------------------------

def _gpu_decode_inputs(B=4, L=300, Hq=8, Hkv=2, D=128, page=64, seed=5):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k, v = (torch.randn(B, L, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k8, v8, ks, vs, table = build_fp8_paged_cache(k, v, page)
    order = table.flatten().argsort()
    per_seq = table.shape[1]
    pad = per_seq * page - L
    kp, vp = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)).view(B * per_seq, page, Hkv, D)[order]
              for t in (k, v))
    q = torch.randn(B, 1, Hq, D, device="cuda", generator=g, dtype=torch.bfloat16)
    lens = torch.tensor([L, 17, 1, 256][:B], dtype=torch.int32, device="cuda")
    return q, lens, table, (kp, vp, {}), (k8, v8, dict(k_descale=ks, v_descale=vs))


@pytest.mark.gpu
def test_gpu_first_calls_leave_no_device_memory_allocated():
    """Every first call (new layouts: validation, masks, selection, plans, kernel compiles) returns the device's
    allocated memory to where it was once its result is dropped."""
    q, lens, table, (kp, vp, _), (k8, v8, scales) = _gpu_decode_inputs(B=3, L=200, seed=9)
    lens = lens[:3].clone()
    new = torch.randn(3, 1, 2, 128, device="cuda", dtype=torch.bfloat16)
    fa = fmha_ops.flash_attn_with_kvcache
    dense = kp[:3].contiguous()
    calls = {
        "paged": lambda: fa(q, kp, vp, cache_seqlens=lens, page_table=table, causal=True),
        "paged fp8": lambda: fa(q, k8, v8, cache_seqlens=lens, page_table=table, causal=True, **scales),
        "paged append": lambda: fa(q, kp, vp, new, new, cache_seqlens=lens - 1, page_table=table, causal=True),
        "dense int lengths": lambda: fa(q, dense, dense, cache_seqlens=40),
        "decode op, no mask": lambda: fmha_ops.memory_efficient_attention(q, dense, dense, op="triton_decoderF"),
    }
    for name, call in calls.items():
        for attempt in ("first", "repeated"):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = call()
            del out
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == before, f"{name}, {attempt} call"


@pytest.mark.gpu
def test_gpu_decode_under_reduce_overhead_without_an_eager_call_first():
    """bf16 paged and fp8-cache decode compiled with mode="reduce-overhead" (nothing ran eagerly at these shapes
    before): no cudagraph skip, and each replay follows new queries and lengths written in place, as eager does."""
    from torch._dynamo.utils import counters

    q, lens, table, (kp, vp, _), (k8, v8, scales) = _gpu_decode_inputs(B=4, L=300, Hq=12, Hkv=3, seed=6)

    def step(q, lens):
        bf16 = fmha_ops.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=table, causal=True)
        fp8 = fmha_ops.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, causal=True,
                                               **scales)
        return bf16, fp8

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    with torch._inductor.config.patch(compile_threads=1):  # a few tiny kernels: no compile worker pool to start
        for i in range(4):
            q.copy_(torch.randn(q.shape, generator=g, device="cuda", dtype=q.dtype))
            lens.copy_(torch.randint(0, 301, lens.shape, generator=g, device="cuda", dtype=torch.int32))
            got = [t.clone() for t in compiled(q, lens)]
            for name, have, want in zip(("bf16", "fp8"), got, step(q, lens)):
                assert error_report(have.float(), want.float())["rel"] < 1e-3, (name, i)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_strided_lengths_and_page_table_read_as_their_values():
    """Lengths and page-table rows given as strided views (every other entry of a wider buffer) decode as their
    contiguous copies do, on the first call and the repeated one."""
    B, L, Hkv, D, page = 3, 45, 2, 16, 8
    _, _, kp, vp, table, *_ = _paged(B, L, Hkv, D, page, seed=13)
    q = torch.randn(B, 1, 4, D).to(DEVICE, DTYPE)
    lens = torch.tensor([45, 8, 2], dtype=torch.int32, device=DEVICE)
    wide_lens = torch.stack([lens, torch.zeros_like(lens)], 1)  # (B, 2): lengths 2 ints apart
    wide_table = torch.stack([table, torch.full_like(table, -1)], 2).view(B, -1)  # bad pages between
    strided = dict(cache_seqlens=wide_lens[:, 0], page_table=wide_table[:, ::2])
    assert strided["cache_seqlens"].stride() == (2,) and strided["page_table"].stride(1) == 2
    want = fmha_ops.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=table, causal=True)
    for attempt in ("first", "repeated"):
        got = fmha_ops.flash_attn_with_kvcache(q, kp, vp, causal=True, **strided)
        assert torch.equal(got.cpu(), want.cpu()), attempt
