"""Paged decode benchmark: Triton split-K decoder (bf16 and fp8 KV) vs SDPA on contiguous KV.

Effective bandwidth = bytes of K and V (and fp8 scales) read / time. Each shape runs in its own
subprocess. Modes: ``graph`` = CUDA-graph replay timed by do_bench (the captured graph is checked
to write a poisoned output); ``clean`` = the same replay timed after a read-only L2 eviction
(do_bench's zeroing eviction leaves dirty lines that the timed call writes back); ``eager`` = back-to-back launcher calls between two CUDA events,
so host overhead that outruns the GPU shows. Baselines on contiguous (B, Hkv, L, D) KV in the
same process: SDPA cuDNN and FLASH backends, each with ``enable_gqa=True`` and with the query
heads of a KV head packed as query rows (``q (B, Hkv, Hq/Hkv, D)``, equivalent for Mq=1), best
of the two reported. Roofline: each variant's bytes are also streamed by a read-only kernel with the same
access pattern (``bench/diagnostics/stream_ceiling.py``), giving the share of the memory ceiling each decoder reaches.

    python bench/decoder_bench.py [--quick] [--sweep] [--out DIR] [--no-record]

Writes decode.json/.png to --out and the record bench/results/decode.md (not with --quick or --no-record).
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
    ("B64_L4096_p16", 64, 32, 8, 4096, 128, 16),
    ("B64_L4096_p256", 64, 32, 8, 4096, 128, 256),
    ("B8_L32768_p64", 8, 32, 8, 32768, 128, 64),
    ("B1_Hq64_L131072_p64", 1, 64, 8, 131072, 128, 64),
    ("B128_L1024_p64", 128, 32, 8, 1024, 128, 64),
    ("B64_L4096_p64_D64", 64, 32, 8, 4096, 64, 64),
    ("B64_L4096_p64_D256", 64, 32, 8, 4096, 256, 64),
]
TARGETS = {"B64_L4096_p64": 3.9, "B1_Hq64_L131072_p64": 3.8, "B128_L1024_p64": 3.5}


def eager_loop_ms(fn, iters: int = 40, reps: int = 7) -> float:
    """Median over ``reps`` of the mean time of ``iters`` back-to-back calls (host overhead included)."""
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


def graph_ms_checked(fn, out: torch.Tensor) -> tuple[float, float, bool]:
    """Times of ``fn`` replayed from a CUDA graph (do_bench, and after a clean L2 eviction), and whether a
    replay rewrote a poisoned ``out``."""
    ms, g = common.time_graph_ms(fn, warmup=10, rep=60)
    ms_clean = common.time_clean_l2_ms(g.replay)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    return ms, ms_clean, bool(not out.isnan().any())


def sdpa_ms(q, k, v, backend, pack: bool):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qq = q.view(B, Hkv, Hq // Hkv, D) if pack else q
    kwargs = {} if pack else {"enable_gqa": True}

    def fn():
        with sdpa_kernel(backend):
            return sdpa(qq, k, v, **kwargs)

    try:
        fn()
        return common.time_graph_ms(fn, warmup=10, rep=60)[0], fn().reshape(B, Hq, D)
    except Exception as e:  # backend refuses the shape
        return None, repr(e)[:120]


def run_shape(spec: dict) -> dict:
    from bench.diagnostics.stream_ceiling import stream_ms
    from fmha_ops.kernels.triton.decode import default_num_splits, gluon_fp8_decoder, paged_decode
    from fmha_ops.kv_cache import quantize_kv_fp8
    from torch.nn.attention import SDPBackend

    name, B, Hq, Hkv, L, D, ps = (spec[k] for k in ("name", "B", "Hq", "Hkv", "L", "D", "page"))
    dev = "cuda"
    torch.manual_seed(0)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    per_seq = L // ps
    perm = torch.randperm(B * per_seq, device=dev)
    bt = perm.view(B, per_seq).to(torch.int32)
    k_pages = torch.randn(B * per_seq, ps, Hkv, D, device=dev, dtype=torch.bfloat16)
    v_pages = torch.randn_like(k_pages)
    q = torch.randn(B, 1, Hq, D, device=dev, dtype=torch.bfloat16)
    seq = torch.full((B,), L, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, 1, device=dev)
    row = {"shape": name}
    nbytes_bf16 = 2 * B * Hkv * L * D * 2

    # contiguous KV for the baselines, gathered through the page table
    kd = k_pages[bt.long()].reshape(B, L, Hkv, D).transpose(1, 2).contiguous()
    vd = v_pages[bt.long()].reshape(B, L, Hkv, D).transpose(1, 2).contiguous()
    qd = q.transpose(1, 2).contiguous()
    ref = None
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        best, note = None, []
        for pack in (False, True):
            ms, res = sdpa_ms(qd, kd, vd, backend, pack)
            if ms is None:
                note.append(res)
                continue
            if best is None or ms < best[0]:
                best = (ms, res)
        row[f"{label}_TBps"] = nbytes_bf16 / best[0] / 1e9 if best else None
        if best is None:
            row[f"{label}_error"] = note
        elif label == "cudnn" or ref is None:
            ref = best[1]
    del kd, vd

    variants = [("bf16", k_pages, v_pages, None, None, nbytes_bf16)]
    k8, v8, ks, vs = quantize_kv_fp8(k_pages, v_pages)  # scales laid out as our cache builders do
    variants.append(("fp8", k8, v8, ks, vs, nbytes_bf16 // 2 + 2 * B * Hkv * L * 4))
    for kv, kc, vc, ksc, vsc, nbytes in variants:
        capability = torch.cuda.get_device_capability()
        gluon = kv == "fp8" and gluon_fp8_decoder(capability, D, Hq // Hkv, ps)
        splits = spec.get("splits") or default_num_splits(B, Hkv, per_seq * ps, Hq // Hkv, D, kv == "fp8", ps,
                                                          capability, sm)
        row[f"{kv}_splits"] = splits

        def call(splits=splits, **cfg):
            return paged_decode(q, kc, vc, seq, block_table=bt, scale=D ** -0.5, k_scale=ksc, v_scale=vsc,
                                out=out, lse=lse, **{"num_splits": splits, **cfg})

        ms_g, ms_c, graph_ok = graph_ms_checked(call, out)
        ms_e = eager_loop_ms(call)
        row[f"{kv}_graph_TBps"] = nbytes / ms_g / 1e9
        row[f"{kv}_clean_TBps"] = nbytes / ms_c / 1e9
        row[f"{kv}_clean_us"] = ms_c * 1e3
        row[f"{kv}_eager_TBps"] = nbytes / ms_e / 1e9
        row[f"{kv}_graph_us"] = ms_g * 1e3
        row[f"{kv}_graph_ok"] = graph_ok
        ceil_g, ceil_c = stream_ms(kc, vc, bt, seq, splits, 0 if ksc is None else 2 * ksc.numel() * 4)
        row[f"{kv}_ceiling_graph_us"] = ceil_g * 1e3
        row[f"{kv}_ceiling_us"] = ceil_c * 1e3
        row[f"{kv}_of_ceiling"] = ceil_c / ms_c
        call()
        if ref is not None:
            from fmha_ops.testing import error_report

            row[f"{kv}_rel_vs_cudnn"] = error_report(out.reshape(B, Hq, D).float(), ref.float())["rel"]
        if spec.get("sweep"):
            for variant in (kv, kv + "_gluon") if gluon else (kv,):
                row[f"{variant}_sweep"] = sweep(call, nbytes, variant, name)
    row["fp8_speedup"] = row["bf16_graph_us"] / row["fp8_graph_us"]
    row["fp8_speedup_clean"] = row["bf16_clean_us"] / row["fp8_clean_us"]
    row["fp8_speedup_bound"] = row["bf16_clean_us"] / row["fp8_ceiling_us"]
    row["fp8_speedup_bound_graph"] = row["bf16_graph_us"] / row["fp8_ceiling_graph_us"]
    return row


def _grid(**axes):
    cfgs = [{}]
    for key, values in axes.items():
        cfgs = [{**c, key: v} for c in cfgs for v in values]
    return cfgs


SWEEPS = {  # tuning variants timed (graph mode) when --sweep is given
    # fp8: Triton tile options (they select the Triton kernel); fp8_gluon: the Gluon decoder's (BLOCK_N, STAGES)
    # and split count, the tile set in place of `tile_config`'s for the timing
    "B64_L4096_p64": {"bf16": [], "fp8": _grid(block_n=(32, 64), num_warps=(1, 2), num_stages=(3, 4)),
                      "fp8_gluon": _grid(tile=((32, 2), (32, 3), (32, 4), (16, 4)), num_splits=(1, 2))},
    "B1_Hq64_L131072_p64": {"bf16": [], "fp8": [],
                            "fp8_gluon": _grid(tile=((32, 2), (32, 3)), num_splits=(32, 61, 64, 128))},
}


def sweep(call, nbytes, kv, name):
    """Graph-mode TB/s of ``call(**cfg)`` for each of the shape's ``kv`` variants."""
    res = []
    for cfg in SWEEPS[name][kv]:
        opts = dict(cfg)
        tile = opts.pop("tile", None)
        if tile is not None:
            from fmha_ops.kernels.gluon import decode as gluon_decode

            default_tiles, gluon_decode.tile_config = gluon_decode.tile_config, lambda page_size, tile_width, *_: tile
        try:
            ms = common.time_graph_ms(lambda: call(**opts), warmup=5, rep=30)[0]
            res.append({**cfg, "TBps": round(nbytes / ms / 1e9, 3)})
        except Exception as e:
            res.append({**cfg, "error": repr(e)[:100]})
        finally:
            if tile is not None:
                gluon_decode.tile_config = default_tiles
    print(name, kv, "sweep", json.dumps(res), flush=True)
    return res


COLUMNS = ["shape", "bf16_splits", "fp8_splits", "bf16_graph_TBps", "bf16_eager_TBps", "fp8_graph_TBps", "fp8_eager_TBps",
           "fp8_speedup", "bf16_clean_TBps", "fp8_clean_TBps", "fp8_speedup_clean", "bf16_of_ceiling", "fp8_of_ceiling",
           "fp8_speedup_bound_graph", "fp8_speedup_bound", "cudnn_TBps", "flash_TBps", "target_TBps", "bf16_graph_ok", "fp8_graph_ok",
           "bf16_rel_vs_cudnn", "fp8_rel_vs_cudnn"]


RECORD_COLUMNS = ["shape", "bf16_graph_TBps", "bf16_eager_TBps", "fp8_graph_TBps", "fp8_eager_TBps", "fp8_speedup",
                  "fp8_speedup_clean", "cudnn_TBps", "xformers_TBps"]
RECORD_LABELS = ["shape", "bf16 graph (TB/s)", "bf16 eager", "fp8 graph", "fp8 eager", "fp8 speedup",
                 "fp8 speedup, clean L2", "cuDNN bf16", "xformers bf16"]
RECORD_NOTES = ("Paged KV (B batch, L keys, p page size), one query token, D=128 and Hq/Hkv = 32/8 unless named; "
                "effective TB/s = K+V bytes (+ fp8 per-token scales) / time; fp8 speedup = bf16 time / fp8 time. "
                "graph: CUDA-graph replay (do_bench median); eager: back-to-back calls; clean L2: graph replay after "
                "a read-only L2 eviction (do_bench's zeroing eviction leaves dirty lines the timed call writes "
                "back). cuDNN: torch SDPA on contiguous bf16 KV, graph; xformers empty where the package is not "
                "installed.")
COMMAND = "PYTHONPATH=$PWD python bench/decoder_bench.py"


def record(rows: list[dict], env: dict, png: str | None = None) -> str:
    """Write bench/results/decode.md from main's rows."""
    body = common.markdown_table(rows, RECORD_COLUMNS, RECORD_LABELS) + "\n\n" + RECORD_NOTES
    return common.write_record("decode", "Decode (paged KV cache)", COMMAND, body, env, png)


def main():
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--sweep", action="store_true", help="time tuning variants on the first shapes too")
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_shape(json.loads(args.one))), flush=True)
        return
    out = common.out_dir(args.out)
    shapes = SHAPES[:1] + SHAPES[4:5] if args.quick else SHAPES
    rows = []
    for name, B, Hq, Hkv, L, D, ps in shapes:
        spec = dict(name=name, B=B, Hq=Hq, Hkv=Hkv, L=L, D=D, page=ps,
                    sweep=args.sweep and name in SWEEPS)
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True,
                              text=True, timeout=300)
        res = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("RESULT ")), flush=True)
        if not res:
            print(f"{name} failed:\n{proc.stderr[-3000:]}", flush=True)
            rows.append({"shape": name, "error": proc.stderr[-500:]})
            continue
        row = json.loads(res[0][7:])
        row["target_TBps"] = TARGETS.get(name)
        rows.append(row)
    env = common.environment()
    common.print_table(rows, COLUMNS)
    common.write_json(out, "decode", rows)
    png = common.bar_plot(out, "decode", rows, "shape", ["bf16_graph_TBps", "bf16_clean_TBps", "bf16_eager_TBps",
                                                         "fp8_graph_TBps", "fp8_clean_TBps", "cudnn_TBps",
                                                         "flash_TBps"],
                          "TB/s (effective)", "Paged decode, H200")
    if not (args.no_record or args.quick):
        print("record:", record(rows, env, png))


if __name__ == "__main__":
    main()
