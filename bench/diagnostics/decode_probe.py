"""Diagnose fp8-KV decode speed: bf16 vs fp8 KV on layouts with the same bytes, and an ncu driver.

``--variants`` times the fp8 kernel variants in ``VARIANTS`` (fp8 path, tile, stages, registers) on
three decode shapes against the bf16 default of the same run, with each variant's error against a
float32 reference of the dequantized cache; prints a table and writes ``decode_variants.json``.
``--layouts`` times the Triton decoder (CUDA-graph replay, do_bench median) for bf16 and fp8 KV on
(a) B=64, Hq=32, Hkv=8, L=4096, page 64 (one KV head's key row is a 128/256-byte
chunk every Hkv*D elements), (b) the same bytes with Hkv=1 (B=512, Hq=4: each head's keys contiguous
inside a page), (c) a dense cache, for the configs in ``CONFIGS``; prints a table and writes
``decode_probe.json``. ``--ncu`` runs bf16 then fp8 at shape (a) twice each (the first pair compiles),
for ``ncu -k regex:_decode_kernel --launch-skip 2 --launch-count 2``.

    python bench/diagnostics/decode_probe.py --variants --layouts --out DIR
    ncu --clock-control none --set full -k regex:_decode_kernel --launch-skip 2 --launch-count 2 \
        python bench/diagnostics/decode_probe.py --ncu
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch

from bench import common

LAYOUTS = {  # name: (B, Hq, Hkv, L, D, page or 0 for dense)
    "B64_Hkv8_p64": (64, 32, 8, 4096, 128, 64),
    "B512_Hkv1_p64": (512, 4, 1, 4096, 128, 64),
    "B64_Hkv8_dense": (64, 32, 8, 4096, 128, 0),
}
SHAPES = {  # name: (B, Hq, Hkv, L, D, page)
    "B64_L4096_p64": (64, 32, 8, 4096, 128, 64),
    "B1_Hq64_L131072_p64": (1, 64, 8, 131072, 128, 64),
    "B128_L1024_p64": (128, 32, 8, 1024, 128, 64),
}
VARIANTS = {  # name: paged_decode keyword arguments for fp8 KV ("default" = the launcher's choice)
    "default": {},
    "bn64_ns3": {"block_n": 64, "num_stages": 3},
}
CONFIGS = [None, (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 4), (256, 4, 2), (128, 8, 3), (256, 8, 3)]


def make(B, Hq, Hkv, L, D, page, fp8: bool):
    from fmha_ops.kv_cache import quantize_fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    if page:
        n_pages = B * L // page
        k = torch.randn(n_pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        bt = torch.randperm(n_pages, device="cuda", generator=g).view(B, L // page).to(torch.int32)
    else:
        k = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        bt = None
    v = torch.randn_like(k)
    seq = torch.full((B,), L, device="cuda", dtype=torch.int32)
    ks = vs = None
    if fp8:
        k, ks = quantize_fp8(k)
        v, vs = quantize_fp8(v)
    return q, k, v, ks, vs, seq, bt


def caller(shape, fp8: bool, cfg):
    from fmha_ops.kernels.triton.decode import paged_decode

    B, Hq, Hkv, L, D, _ = shape
    q, k, v, ks, vs, seq, bt = make(*shape, fp8)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, 1, device="cuda")
    kw = dict(zip(("block_n", "num_warps", "num_stages"), cfg)) if cfg else {}

    def call():
        return paged_decode(q, k, v, seq, block_table=bt, scale=D ** -0.5, k_scale=ks, v_scale=vs,
                            out=out, lse=lse, **kw)
    nbytes = 2 * B * Hkv * L * (D * (1 if fp8 else 2) + (4 if fp8 else 0))
    return call, nbytes


def layouts(out_dir: str) -> None:
    rows = []
    for name, shape in LAYOUTS.items():
        bf16_call, bf16_bytes = caller(shape, False, None)
        bf16_ms, _ = common.time_graph_ms(bf16_call)
        for cfg in CONFIGS:
            try:
                call, nbytes = caller(shape, True, cfg)
                ms, _ = common.time_graph_ms(call)
            except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is reported, not fatal
                rows.append({"layout": name, "cfg": str(cfg), "error": type(e).__name__})
                continue
            rows.append({"layout": name, "cfg": str(cfg or "default"), "bf16_us": bf16_ms * 1e3,
                         "bf16_TBps": bf16_bytes / bf16_ms / 1e9, "fp8_us": ms * 1e3,
                         "fp8_TBps": nbytes / ms / 1e9, "fp8_speedup": bf16_ms / ms})
            torch.cuda.empty_cache()
    common.print_table(rows, ("layout", "cfg", "bf16_us", "bf16_TBps", "fp8_us", "fp8_TBps", "fp8_speedup", "error"))
    common.write_json(out_dir, "decode_probe", rows)


def _variant_rows(name: str, shape, splits: int, fp8: bool, bf16_ms: float | None) -> list[dict]:
    """Time (graph) and check every variant of one shape and KV dtype against a float32 reference."""
    from fmha_ops.kernels.triton.decode import paged_decode
    from fmha_ops.kv_cache import dequantize_fp8

    B, Hq, Hkv, L, D, _ = shape
    q, k, v, ks, vs, seq, bt = make(*shape, fp8)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, 1, device="cuda")
    kd, vd = (dequantize_fp8(k, ks), dequantize_fp8(v, vs)) if fp8 else (k.float(), v.float())
    # float32 reference on the (dequantized) cache, gathered through the page table
    kd = kd[bt.long()].reshape(B, L, Hkv, D)
    vd = vd[bt.long()].reshape(B, L, Hkv, D)
    p = torch.softmax(torch.einsum("bhgd,bnhd->bhgn", q.float().view(B, Hkv, Hq // Hkv, D), kd) * D ** -0.5, -1)
    ref = torch.einsum("bhgn,bnhd->bhgd", p, vd).reshape(B, Hq, D)
    del kd, vd, p
    rows = []
    for vname, kw in (VARIANTS.items() if fp8 else [("bf16", {})]):
        def call(kw=kw):
            return paged_decode(q, k, v, seq, block_table=bt, scale=D ** -0.5, k_scale=ks, v_scale=vs,
                                out=out, lse=lse, num_splits=splits, **kw)
        try:
            call()
            err = (out.float().reshape(B, Hq, D) - ref).norm().item() / ref.norm().item()
            ms, _ = common.time_graph_ms(call, warmup=10, rep=50)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            rows.append({"shape": name, "variant": vname, "error": repr(e)[:80]})
            continue
        rows.append({"shape": name, "variant": vname, "splits": splits, "us": ms * 1e3,
                     "speedup_vs_bf16": (bf16_ms or ms) / ms, "rel_err": err})
        print(rows[-1], flush=True)
    return rows


def variants(out_dir: str) -> None:
    from fmha_ops.kernels.decode_splits import choose_num_splits
    from fmha_ops.kernels.triton.decode import programs_per_split

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, shape in SHAPES.items():
        B, Hq, Hkv, L = shape[:4]
        splits = choose_num_splits(programs_per_split(B, Hkv, Hq // Hkv), L, sm)
        bf16 = _variant_rows(name, shape, splits, False, None)
        torch.cuda.empty_cache()
        rows += bf16 + _variant_rows(name, shape, splits, True, bf16[0].get("us", 0) / 1e3 or None)
        torch.cuda.empty_cache()
    common.print_table(rows, ("shape", "variant", "splits", "us", "speedup_vs_bf16", "rel_err", "error"))
    common.write_json(out_dir, "decode_variants", rows)


def ncu_driver() -> None:
    shape = LAYOUTS["B64_Hkv8_p64"]
    calls = [caller(shape, False, None)[0], caller(shape, True, None)[0]]
    for _ in range(2):
        for call in calls:
            call()
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", action="store_true")
    p.add_argument("--ncu", action="store_true")
    p.add_argument("--variants", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.ncu:
        ncu_driver()
    if args.variants:
        variants(common.out_dir(args.out))
    if args.layouts:
        layouts(common.out_dir(args.out))


if __name__ == "__main__":
    main()
