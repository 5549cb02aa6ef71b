"""fp8-KV speedup of the Gluon decoder over the bf16 decoder per (key splits, cp.async stages) at one shape.

Both kernels run as the selected ops launch them (``decode_launcher``) on the same paged cache (bf16 pages, and
``kv_cache.build_fp8_paged_cache``'s fp8 pages with keys-contiguous scales), CUDA-graph replays timed by do_bench
(median; its L2 flush leaves dirty lines) and after a read-only L2 eviction (``clean``). The stage count is forced
by replacing ``kernels.gluon.decode.tile_config`` for the variant; the split count by the launch argument.

    PYTHONPATH=$PWD python bench/diagnostics/gluon_decode_sweep.py [--B 128] [--L 1024] [--page 64]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from bench import common  # noqa: E402

VARIANTS = [(None, None), (1, 3), (1, 4), (2, 2)]  # (splits, stages); None: the op's choice


def main() -> None:
    from fmha_ops.kernels.gluon import decode as gd
    from fmha_ops.kernels.softmax import LOG2E
    from fmha_ops.kernels.triton.decode import paged_decode, programmatic_launch, reduce_splits, split_buffers
    from fmha_ops.kv_cache import build_fp8_paged_cache
    from fmha_ops.ops.gluon_decode import GluonFp8DecodeFwOp
    from fmha_ops.ops.triton_decode import TritonDecoderFwOp
    from registry import current_arch

    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=128)
    p.add_argument("--L", type=int, default=1024)
    p.add_argument("--page", type=int, default=64)
    args = p.parse_args()
    B, L, ps, Hq, Hkv, D = args.B, args.L, args.page, 32, 8, 128
    torch.manual_seed(0)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    seq = torch.full((B,), L, device="cuda", dtype=torch.int32)
    k8, v8, ks, vs, bt = build_fp8_paged_cache(k, v, ps)
    order = bt.flatten().argsort()
    kp, vp = (t.view(-1, ps, Hkv, D)[order] for t in (k, v))
    del k, v
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, 1, device="cuda")
    arch = current_arch(q.device)
    scale = D ** -0.5

    bf16_splits = TritonDecoderFwOp.num_splits(B, Hkv, L, Hq // Hkv, D, False, arch)
    bf16 = (lambda: paged_decode(q, kp, vp, seq, block_table=bt, scale=scale, num_splits=bf16_splits, out=out,
                                 lse=lse))
    bf16_ms, g = common.time_graph_ms(bf16, warmup=10, rep=60)
    bf16_clean = common.time_clean_l2_ms(g.replay)
    print(f"B{B} L{L} p{ps}: bf16 {bf16_ms * 1e3:.1f} us (clean {bf16_clean * 1e3:.1f})", flush=True)

    chosen = GluonFp8DecodeFwOp.num_splits(B, Hkv, L, Hq // Hkv, D, ps, arch)
    default_tiles = gd.tile_config
    for splits, stages in VARIANTS:
        splits = splits or chosen
        if stages is not None:
            gd.tile_config = lambda *a, stages=stages, **kw: gd.TileConfig(32, stages)
        o_buf, l_buf, o_strides, l_strides = split_buffers(q, splits, out, lse)
        pdl = splits > 1 and programmatic_launch(q.device)

        def fp8(splits=splits, o_buf=o_buf, l_buf=l_buf, o_strides=o_strides, l_strides=l_strides, pdl=pdl):
            gd.launch(q, k8, v8, ks, vs, seq, bt, o_buf, l_buf, o_strides, l_strides, scale * LOG2E.value, splits,
                      ps, pdl)
            if splits > 1:
                reduce_splits(o_buf, l_buf, out, lse, pdl)
        try:
            ms, g = common.time_graph_ms(fp8, warmup=10, rep=60)
            clean = common.time_clean_l2_ms(g.replay)
            print(f"  fp8 splits {splits} stages {stages or 'default'}: {ms * 1e3:.1f} us, speedup "
                  f"{bf16_ms / ms:.3f} (clean {bf16_clean / clean:.3f})", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  fp8 splits {splits} stages {stages}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
        finally:
            gd.tile_config = default_tiles


if __name__ == "__main__":
    main()
