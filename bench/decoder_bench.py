"""Paged decode through the public call: ``flash_attn_with_kvcache`` (bf16 and fp8 KV) vs cuDNN on contiguous KV.

Times what users call, ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, page_table=, [k_descale=,
v_descale=,] causal=True)`` on a paged cache (fp8: ``kv_cache.build_fp8_paged_cache``'s layout), eager
(back-to-back calls between two CUDA events, so host cost that outruns the GPU shows) and as a CUDA-graph replay
(do_bench median; the replay is checked to rewrite a poisoned output; do_bench evicts the L2 by zeroing a buffer,
whose dirty lines are written back during the timed replay, so a ``clean`` column replays after a read-only
eviction instead, ``common.time_clean_l2_ms``), and the same call planned once
(``fmha_ops.plan_kvcache``) and run per step (``PagedDecodePlan.run``), eager and graph; beside it the kernel alone
(the kernel the selector's op runs, with that op's split count, graph replay) and the host time per call of the
three (``common.host_us``: issue time of back-to-back calls) and, in the same process, torch SDPA pinned to
cuDNN on contiguous (B, Hkv, L, D) bf16 KV (best of ``enable_gqa=True`` and the query heads of a KV head packed as
query rows, equivalent for one query token). Effective TB/s = bytes of K and V (and fp8 per-token scales) / time;
fp8 speedup = bf16 time / fp8 time. Beside the uniform shapes, small batches of ragged lengths (B7-B33, each
sequence 1 to L keys) show where a call's host time outruns its kernel: from B8 eager calls should take at most
``EAGER_OVER_GRAPH`` times the graph replay, bf16 and fp8 (the ``eager_target`` column). Each shape runs in its own
subprocess.

    python bench/decoder_bench.py [--quick | --shapes NAME,...] [--out DIR] [--no-record]

Writes decode.json/.png to --out and the record bench/results/decode.md (not with --quick or --no-record; with
--shapes the record holds those shapes).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import common  # noqa: E402

SHAPES = [  # name, B, Hq, Hkv, L, D, page_size
    ("B64_L4096_p64", 64, 32, 8, 4096, 128, 64),
    ("B128_L1024_p64", 128, 32, 8, 1024, 128, 64),
    ("B64_L4096_p16", 64, 32, 8, 4096, 128, 16),
    ("B64_L4096_p256", 64, 32, 8, 4096, 128, 256),
    ("B8_L32768_p64", 8, 32, 8, 32768, 128, 64),
    ("B1_Hq64_L131072_p64", 1, 64, 8, 131072, 128, 64),
    ("B64_L4096_p64_D64", 64, 32, 8, 4096, 64, 64),
    ("B64_L4096_p64_D256", 64, 32, 8, 4096, 256, 64),
]
#: small batches of ragged lengths (each sequence 1 to L keys, seeded), where a call's host time can outrun its kernel
RAGGED_SHAPES = [
    ("B7_L4096_p64_ragged", 7, 32, 8, 4096, 128, 64),
    ("B16_L4096_p64_ragged", 16, 32, 8, 4096, 128, 64),
    ("B33_L4096_p64_ragged", 33, 32, 8, 4096, 128, 64),
]
#: fp8 speedup through flash_attn_with_kvcache (graph) over its bf16, and eager time over graph time
TARGETS = {"B64_L4096_p64": (1.8, 1.10), "B128_L1024_p64": (1.8, None)}
#: eager flash_attn_with_kvcache at most this many times its CUDA-graph replay (bf16 and fp8 caches) from this batch
EAGER_OVER_GRAPH, EAGER_MIN_BATCH = 1.2, 8


def eager_ms(fn, iters: int = 40, reps: int = 7) -> float:
    """Median over ``reps`` of the mean time of ``iters`` back-to-back calls (host cost included)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return sorted(times)[len(times) // 2]


def graph_ms_checked(fn, out: torch.Tensor) -> tuple[float, bool]:
    """do_bench median of ``fn`` replayed from a CUDA graph, and whether a replay rewrote a poisoned ``out``."""
    ms, g = common.time_graph_ms(fn, warmup=10, rep=60)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    return ms, bool(not out.isnan().any())


def cudnn_ms(q, k, v):
    """(graph ms, out (B, Hq, D)) of cuDNN SDPA on contiguous BHMK KV, the faster of GQA and packed rows."""
    run = common.sdpa("CUDNN_ATTENTION")
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    best = None
    for packed in (False, True):
        qq = q.view(B, Hkv, Hq // Hkv, D) if packed else q
        fn = (lambda qq=qq, packed=packed: run(qq, k, v, False, not packed))
        ms = common.or_none(lambda fn=fn: common.time_graph_ms(fn, warmup=10, rep=60)[0])
        if ms is not None and (best is None or ms < best[0]):
            best = (ms, fn().reshape(B, Hq, D))
    return best or (None, None)


def kernel_call(op_name: str, q, kc, vc, seq, bt, ks, vs, out, lse):
    """The call of the kernel ``op_name`` runs, with the op's split count (no host work beyond the launch)."""
    from registry import current_arch

    from fmha_ops.kernels.softmax import LOG2E
    from fmha_ops.kernels.triton.decode import paged_decode, programmatic_launch, reduce_splits, split_buffers
    from fmha_ops.ops.gluon_decode import GluonFp8DecodeFwOp
    from fmha_ops.ops.triton_decode import TritonDecoderFwOp, TritonSplitKFwOp

    B, _, Hq, D = q.shape
    Hkv, ps = kc.shape[2], kc.shape[1]
    arch = current_arch(q.device)
    scale = D ** -0.5
    if op_name == GluonFp8DecodeFwOp.NAME:
        from fmha_ops.kernels.gluon import decode as gluon

        splits = GluonFp8DecodeFwOp.num_splits(B, Hkv, bt.shape[1] * ps, Hq // Hkv, D, ps, arch)
        o_buf, l_buf, o_strides, l_strides = split_buffers(q, splits, out, lse)
        pdl = splits > 1 and programmatic_launch(q.device)

        def call():
            gluon.launch(q, kc, vc, ks, vs, seq, bt, o_buf, l_buf, o_strides, l_strides, scale * LOG2E.value,
                         splits, ps, pdl)
            if splits > 1:
                reduce_splits(o_buf, l_buf, out, lse, pdl)
        return call, splits
    op = {TritonDecoderFwOp.NAME: TritonDecoderFwOp, TritonSplitKFwOp.NAME: TritonSplitKFwOp}[op_name]
    splits = op.num_splits(B, Hkv, bt.shape[1] * ps, Hq // Hkv, D, ks is not None, arch)
    return (lambda: paged_decode(q, kc, vc, seq, block_table=bt, scale=scale, k_scale=ks, v_scale=vs,
                                 num_splits=splits, out=out, lse=lse)), splits


def selected_op(q, kc, vc, seq, bt, ks, vs) -> str:
    """The op ``flash_attn_with_kvcache`` runs for this call, from the selector's ``FMHA_OPS_LOG`` line."""
    import contextlib
    import io

    import fmha_ops

    buf = io.StringIO()
    os.environ["FMHA_OPS_LOG"] = "1"
    fmha_ops.SELECTOR.refresh_env()
    try:
        with contextlib.redirect_stderr(buf):
            fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seq, page_table=bt, k_descale=ks,
                                             v_descale=vs, causal=True)
    finally:
        os.environ.pop("FMHA_OPS_LOG")
        fmha_ops.SELECTOR.refresh_env()
    return buf.getvalue().strip().rsplit("-> ", 1)[-1]


def run_shape(spec: dict) -> dict:
    import fmha_ops
    from fmha_ops.kv_cache import build_fp8_paged_cache
    from fmha_ops.testing import error_report

    name, B, Hq, Hkv, L, D, ps = (spec[k] for k in ("name", "B", "Hq", "Hkv", "L", "D", "page"))
    dev = "cuda"
    torch.manual_seed(0)
    k = torch.randn(B, L, Hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, 1, Hq, D, device=dev, dtype=torch.bfloat16)
    if spec.get("ragged"):  # 1 to L keys per sequence; cuDNN's contiguous call would read all L: not timed
        seq = torch.randint(1, L + 1, (B,), device=dev, dtype=torch.int32)
    else:
        seq = torch.full((B,), L, device=dev, dtype=torch.int32)
    keys = int(seq.sum())
    row = {"shape": name}
    nbytes_bf16 = 2 * keys * Hkv * D * 2

    ms, ref = (None, None) if spec.get("ragged") else cudnn_ms(
        q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
    row["cudnn_us"] = ms * 1e3 if ms else None
    row["cudnn_TBps"] = nbytes_bf16 / ms / 1e9 if ms else None

    k8, v8, ks, vs, bt = build_fp8_paged_cache(k, v, ps)  # the fp8 cache, and the page table both caches share
    per_seq = L // ps
    k_pages = k.view(B * per_seq, ps, Hkv, D)[bt.flatten().argsort()]  # bf16 pages in the same order
    v_pages = v.view(B * per_seq, ps, Hkv, D)[bt.flatten().argsort()]
    del k, v
    variants = [("bf16", k_pages, v_pages, None, None, nbytes_bf16),
                ("fp8", k8, v8, ks, vs, nbytes_bf16 // 2 + 2 * keys * Hkv * 4)]
    for kv, kc, vc, ksc, vsc, nbytes in variants:
        out = torch.empty_like(q)
        lse = torch.empty(B, Hq, 1, device=dev)

        def api():
            return fmha_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seq, page_table=bt, k_descale=ksc,
                                                    v_descale=vsc, causal=True)

        def api_into_out():
            out.copy_(api())

        op = selected_op(q, kc, vc, seq, bt, ksc, vsc)  # first: it reads the selector's log of a fresh selection
        kernel, splits = kernel_call(op, q, kc, vc, seq, bt, ksc, vsc, out, lse)
        plan = fmha_ops.plan_kvcache(q, kc, vc, cache_seqlens=seq, page_table=bt, k_descale=ksc, v_descale=vsc,
                                     causal=True)

        def planned():
            return plan.run(q)

        row[f"{kv}_op"], row[f"{kv}_splits"] = op, splits
        ms_graph, api_graph = common.time_graph_ms(api, warmup=10, rep=60)
        ms_clean = common.time_clean_l2_ms(api_graph.replay)
        ms_eager = eager_ms(api)
        ms_kernel, graph_ok = graph_ms_checked(kernel, out)
        ms_plan_graph = common.time_graph_ms(planned, warmup=10, rep=60)[0]
        ms_plan_eager = eager_ms(planned)
        row[f"{kv}_api_host_us"] = common.host_us(api, iters=200, warmup=20)
        row[f"{kv}_plan_host_us"] = common.host_us(planned, iters=200, warmup=20)
        row[f"{kv}_kernel_host_us"] = common.host_us(kernel, iters=200, warmup=20)
        api_into_out()
        if ref is not None:
            row[f"{kv}_rel_vs_cudnn"] = error_report(out.reshape(B, Hq, D).float(), ref.float())["rel"]
        row.update({f"{kv}_graph_us": ms_graph * 1e3, f"{kv}_graph_clean_us": ms_clean * 1e3,
                    f"{kv}_graph_clean_TBps": nbytes / ms_clean / 1e9, f"{kv}_eager_us": ms_eager * 1e3,
                    f"{kv}_kernel_us": ms_kernel * 1e3, f"{kv}_graph_TBps": nbytes / ms_graph / 1e9,
                    f"{kv}_eager_TBps": nbytes / ms_eager / 1e9, f"{kv}_kernel_TBps": nbytes / ms_kernel / 1e9,
                    f"{kv}_graph_ok": graph_ok, f"{kv}_eager_over_graph": ms_eager / ms_graph,
                    f"{kv}_plan_graph_us": ms_plan_graph * 1e3, f"{kv}_plan_eager_us": ms_plan_eager * 1e3,
                    f"{kv}_plan_graph_TBps": nbytes / ms_plan_graph / 1e9,
                    f"{kv}_plan_eager_TBps": nbytes / ms_plan_eager / 1e9,
                    f"{kv}_plan_eager_over_graph": ms_plan_eager / ms_graph})
    row["fp8_speedup_graph"] = row["bf16_graph_us"] / row["fp8_graph_us"]
    row["fp8_speedup_graph_clean"] = row["bf16_graph_clean_us"] / row["fp8_graph_clean_us"]
    row["fp8_speedup_eager"] = row["bf16_eager_us"] / row["fp8_eager_us"]
    row["fp8_speedup_kernel"] = row["bf16_kernel_us"] / row["fp8_kernel_us"]
    row["fp8_speedup_plan_eager"] = row["bf16_plan_eager_us"] / row["fp8_plan_eager_us"]
    row["eager_target"] = (max(row["bf16_eager_over_graph"], row["fp8_eager_over_graph"]) <= EAGER_OVER_GRAPH
                           if B >= EAGER_MIN_BATCH else None)
    return row


COLUMNS = ["shape", "bf16_op", "fp8_op", "bf16_splits", "fp8_splits", "bf16_graph_TBps", "bf16_eager_TBps",
           "bf16_kernel_TBps", "fp8_graph_TBps", "fp8_eager_TBps", "fp8_kernel_TBps", "fp8_speedup_graph",
           "fp8_speedup_graph_clean", "bf16_graph_clean_TBps", "fp8_graph_clean_TBps",
           "fp8_speedup_eager", "fp8_speedup_kernel", "bf16_eager_over_graph", "fp8_eager_over_graph", "eager_target",
           "fp8_plan_eager_over_graph",
           "fp8_speedup_plan_eager", "fp8_api_host_us", "fp8_plan_host_us", "fp8_kernel_host_us", "bf16_api_host_us",
           "bf16_plan_host_us", "bf16_kernel_host_us",
           "cudnn_TBps", "target_speedup", "target_eager_over_graph", "bf16_graph_ok", "fp8_graph_ok",
           "bf16_rel_vs_cudnn", "fp8_rel_vs_cudnn"]

RECORD = common.Record(
    "decode", "Decode (paged KV cache)", "PYTHONPATH=$PWD python bench/decoder_bench.py",
    {"shape": "shape", "bf16_graph_TBps": "bf16 graph (TB/s)", "bf16_eager_TBps": "bf16 eager",
     "bf16_kernel_TBps": "bf16 kernel", "fp8_graph_TBps": "fp8 graph", "fp8_eager_TBps": "fp8 eager",
     "fp8_kernel_TBps": "fp8 kernel", "fp8_speedup_graph": "fp8 speedup (graph)",
     "fp8_speedup_graph_clean": "fp8 speedup (graph, clean L2)",
     "fp8_speedup_kernel": "fp8 speedup (kernel)", "bf16_eager_over_graph": "bf16 eager / graph",
     "fp8_eager_over_graph": "fp8 eager / graph", "eager_target": "eager <= 1.2x graph (B >= 8)",
     "fp8_plan_eager_TBps": "fp8 plan.run eager", "fp8_api_host_us": "fp8 host us (call)",
     "fp8_plan_host_us": "fp8 host us (plan.run)", "fp8_kernel_host_us": "fp8 host us (kernel)",
     "bf16_api_host_us": "bf16 host us (call)", "bf16_plan_host_us": "bf16 host us (plan.run)",
     "bf16_kernel_host_us": "bf16 host us (kernel)", "cudnn_TBps": "cuDNN bf16"},
    "Paged KV (B batch, L keys, p page size), one query token, D=128 and Hq/Hkv = 32/8 unless named; ragged: each "
    "sequence holds 1 to L keys (seeded; no cuDNN column); effective TB/s = K+V bytes of the keys held (+ fp8 "
    "per-token scales) / time; fp8 speedup = bf16 time / fp8 time. graph / eager: "
    "`flash_attn_with_kvcache` replayed from a CUDA graph (do_bench median) / called back to back; kernel: the kernel "
    "of the selected op alone (graph); plan.run: `plan_kvcache` once, `run(q)` back to back; host us: issue time per "
    "call of back-to-back calls; clean L2: the graph replayed after a read-only L2 eviction (do_bench's zeroing "
    "leaves dirty lines whose write-back lands in the timed call). cuDNN: torch SDPA on contiguous bf16 KV, graph.")


def main():
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--shapes", default=None, help="comma-separated shape names (default: all; --quick: the first two)")
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_shape(json.loads(args.one))), flush=True)
        return
    out = common.out_dir(args.out)
    every = SHAPES + RAGGED_SHAPES
    shapes = SHAPES[:2] if args.quick else every
    if args.shapes:
        wanted = args.shapes.split(",")
        unknown = sorted(set(wanted) - {s[0] for s in every})
        if unknown:
            p.error(f"unknown --shapes {unknown}; known: {[s[0] for s in every]}")
        shapes = [s for s in every if s[0] in wanted]
    rows = []
    for shape in shapes:
        name, B, Hq, Hkv, L, D, ps = shape
        spec = dict(name=name, B=B, Hq=Hq, Hkv=Hkv, L=L, D=D, page=ps, ragged=shape in RAGGED_SHAPES)
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True,
                              text=True, timeout=300)
        res = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("RESULT ")), flush=True)
        if not res:
            print(f"{name} failed:\n{proc.stderr[-3000:]}", flush=True)
            rows.append({"shape": name, "error": proc.stderr[-500:]})
            continue
        row = json.loads(res[0][7:])
        row["target_speedup"], row["target_eager_over_graph"] = TARGETS.get(name, (None, None))
        rows.append(row)
        print(f"{name}: fp8 speedup graph {row['fp8_speedup_graph']:.3f} (clean L2 "
              f"{row['fp8_speedup_graph_clean']:.3f}) kernel {row['fp8_speedup_kernel']:.3f}, eager/graph "
              f"bf16 {row['bf16_eager_over_graph']:.3f} fp8 {row['fp8_eager_over_graph']:.3f}, plan.run eager/graph "
              f"{row['fp8_plan_eager_over_graph']:.3f}; host us fp8 call {row['fp8_api_host_us']:.1f} plan.run "
              f"{row['fp8_plan_host_us']:.1f} kernel {row['fp8_kernel_host_us']:.1f}, bf16 call "
              f"{row['bf16_api_host_us']:.1f} ({row['fp8_op']}, {row['fp8_splits']} splits)", flush=True)
    env = common.environment()
    common.print_table(rows, COLUMNS)
    common.write_json(out, "decode", rows)
    png = common.bar_plot(out, "decode", rows, "shape", ["bf16_graph_TBps", "bf16_eager_TBps", "bf16_kernel_TBps",
                                                         "fp8_graph_TBps", "fp8_eager_TBps", "fp8_kernel_TBps",
                                                         "cudnn_TBps"],
                          "TB/s (effective)", "Paged decode through flash_attn_with_kvcache, H200")
    if not (args.no_record or args.quick):
        print("record:", RECORD.write(rows, env, png))


if __name__ == "__main__":
    main()
