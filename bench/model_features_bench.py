"""What attention sinks and a value head dim of their own cost on the H200, through the public calls.

* Sinks (GPT-OSS heads: 64 query / 8 KV heads of dim 64, causal, full or a 128-token window): the same call with
  and without ``sinks=`` (``sinks / none`` is the time ratio; the target is <= 1.03): the bf16 and fp8 Triton
  forwards, the bf16 forward + backward (the sinks' gradient included), and paged decode (bf16 and fp8 KV,
  single pass and split-K).
* Value head dim (DeepSeek-V3 heads: K=192, Kv=128, 128 heads): ``memory_efficient_attention`` with Kv=128 against
  the call transformers makes today for FlashAttention, V zero-padded to 192 and the output sliced back
  (``padded / ours`` is the speedup; target >= 1.25), forward and forward + backward; FA3's 192 -> 128 kernel
  (``flash_attn_interface``, where installed) and FA4 with Kv=128 beside it.

CUDA-event medians of whole public calls (``bench.common.time_ms``). Writes ``bench/results/model_features.md``
and ``<out>/model_features.json``.

    python bench/model_features_bench.py [--quick] [--out DIR] [--no-record]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Record, base_parser, environment, or_none, out_dir, print_table, time_ms, write_json  # noqa
import fmha_ops  # noqa: E402
from fmha_ops import LowerTriangularFromBottomRightMask, memory_efficient_attention  # noqa: E402
from fmha_ops.quant import quantize_qkv_fp8  # noqa: E402

CAUSAL = LowerTriangularFromBottomRightMask()
GPT_OSS = dict(hq=64, hkv=8, d=64)
DEEPSEEK = dict(hq=128, d=192, dv=128)
WINDOW = 128


def _randn(*shape, grad=False):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)


def sinks_rows(quick: bool) -> list[dict]:
    rows = []
    hq, hkv, d = GPT_OSS["hq"], GPT_OSS["hkv"], GPT_OSS["d"]
    sinks = torch.randn(hq, device="cuda")
    for b, n in ([(1, 8192)] if quick else [(1, 8192), (8, 4096), (1, 32768)]):
        q, k, v = _randn(b, n, hq, d), _randn(b, n, hkv, d), _randn(b, n, hkv, d)
        q8, k8, v8, qd, kd, vd = quantize_qkv_fp8(q, k, v)
        for window in (None, WINDOW):
            mask = CAUSAL if window is None else CAUSAL.make_local_attention(window)
            label = f"{b}x{n} {'full' if window is None else f'window {window}'}"
            for kind, call in (
                ("bf16 fwd", lambda s: memory_efficient_attention(q, k, v, mask, sinks=s)),
                ("fp8 fwd", lambda s: memory_efficient_attention(q8, k8, v8, mask, q_descale=qd, k_descale=kd,
                                                                 v_descale=vd, sinks=s)),
            ):
                none = or_none(lambda: time_ms(lambda: call(None)))
                with_sinks = or_none(lambda: time_ms(lambda: call(sinks)))
                rows.append(_row(label, kind, none, with_sinks))
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
            sg = sinks.clone().requires_grad_(True)
            grad = torch.randn_like(q)

            def train(s):
                out = memory_efficient_attention(qg, kg, vg, mask, sinks=s)
                torch.autograd.backward(out, grad)
            rows.append(_row(label, "bf16 fwd+bwd", or_none(lambda: time_ms(lambda: train(None))),
                             or_none(lambda: time_ms(lambda: train(sg)))))
    rows += decode_rows(quick, sinks)
    return rows


def decode_rows(quick: bool, sinks) -> list[dict]:
    from fmha_ops.kv_cache import build_fp8_paged_cache, paged_from_dense

    rows = []
    hq, hkv, d = GPT_OSS["hq"], GPT_OSS["hkv"], GPT_OSS["d"]
    for b, length in ([(32, 8192)] if quick else [(1, 32768), (32, 8192), (64, 2048)]):
        k, v = _randn(b, length, hkv, d), _randn(b, length, hkv, d)
        q = _randn(b, 1, hq, d)
        lengths = torch.full((b,), length, dtype=torch.int32, device="cuda")
        (kc, vc), table = paged_from_dense([k, v], 64)
        k8, v8, ks, vs, table8 = build_fp8_paged_cache(k, v, 64)
        for kv, args in (("bf16", (kc, vc, table, None, None)), ("fp8", (k8, v8, table8, ks, vs))):
            for op in ("triton_decoderF", "triton_splitKF"):
                def call(s, args=args, op=op):
                    with fmha_ops.use_ops(op):
                        return fmha_ops.flash_attn_with_kvcache(q, args[0], args[1], cache_seqlens=lengths,
                                                                page_table=args[2], k_descale=args[3],
                                                                v_descale=args[4], causal=True, sinks=s)
                rows.append(_row(f"decode B{b} L{length}", f"{kv} KV {op}", or_none(lambda: time_ms(lambda: call(None))),
                                 or_none(lambda: time_ms(lambda: call(sinks)))))
    return rows


def _row(shape: str, kind: str, none: float | None, with_sinks: float | None) -> dict:
    return {"shape": shape, "call": kind, "none_ms": none, "sinks_ms": with_sinks,
            "ratio": with_sinks / none if none and with_sinks else None}


def value_dim_rows(quick: bool) -> list[dict]:
    rows = []
    hq, d, dv = DEEPSEEK["hq"], DEEPSEEK["d"], DEEPSEEK["dv"]
    for b, n in ([(1, 4096)] if quick else [(1, 4096), (1, 16384), (4, 4096)]):
        q, k, v = _randn(b, n, hq, d), _randn(b, n, hq, d), _randn(b, n, hq, dv)
        grad = torch.randn(b, n, hq, dv, device="cuda", dtype=torch.bfloat16)

        def ours():
            return memory_efficient_attention(q, k, v, CAUSAL)

        def padded():  # what transformers does for FlashAttention: V zero-padded to K, the output sliced back
            vp = torch.nn.functional.pad(v, (0, d - dv))
            return memory_efficient_attention(q, k, vp, CAUSAL)[..., :dv]

        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

        def ours_train():
            torch.autograd.backward(memory_efficient_attention(qg, kg, vg, CAUSAL), grad)

        def padded_train():
            vp = torch.nn.functional.pad(vg, (0, d - dv))
            torch.autograd.backward(memory_efficient_attention(qg, kg, vp, CAUSAL)[..., :dv], grad)

        fa3 = or_none(lambda: _fa3(q, k, v))
        fa4 = or_none(lambda: time_ms(lambda: memory_efficient_attention(q, k, v, CAUSAL, op="fa4F")))
        for kind, mine, theirs in (("fwd", ours, padded), ("fwd+bwd", ours_train, padded_train)):
            t_ours = or_none(lambda: time_ms(mine))
            t_pad = or_none(lambda: time_ms(theirs))
            rows.append({"shape": f"{b}x{n}x{hq} K{d}/Kv{dv}", "call": kind, "ours_ms": t_ours, "padded_ms": t_pad,
                         "speedup": t_pad / t_ours if t_ours and t_pad else None,
                         "op": fmha_ops.explain(q, k, v, CAUSAL).selected.NAME,
                         "fa3_ms": fa3 if kind == "fwd" else None, "fa4_ms": fa4 if kind == "fwd" else None,
                         "ours/fa3": fa3 / t_ours if kind == "fwd" and fa3 and t_ours else None})
    return rows


def _fa3(q, k, v) -> float:
    """FA3's forward (``flash_attn_interface``, the hopper build) at K=192 / Kv=128, causal."""
    from flash_attn_interface import flash_attn_func

    return time_ms(lambda: flash_attn_func(q, k, v, causal=True))


COMMAND = "python bench/model_features_bench.py"
RECORD = Record(
    "model_features", "Attention sinks and a value head dim of its own", COMMAND,
    {"shape": "shape", "call": "call", "none_ms": "no sinks ms", "sinks_ms": "sinks ms", "ratio": "sinks / none",
     "ours_ms": "Kv=128 ms", "padded_ms": "V padded to 192 ms", "speedup": "padded / ours", "op": "op (Kv=128)",
     "fa3_ms": "FA3 192->128 ms", "fa4_ms": "FA4 Kv=128 ms", "ours/fa3": "FA3 / ours"},
    "Sinks: GPT-OSS attention heads (64 / 8 of dim 64, bf16), the same public call with and without "
    "sinks= (fp8: inputs quantized beforehand, per (batch, KV head) descales; decode: flash_attn_with_kvcache on "
    "64-token pages, the decoder forced by use_ops). Value head dim: DeepSeek-V3 heads (128 of K=192, Kv=128, bf16, "
    "causal) through the selector, against V zero-padded to 192 with the output sliced (transformers' FlashAttention "
    "path); FA3 / FA4: their own calls where installed. CUDA-event medians of whole calls.")


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    rows = sinks_rows(args.quick) + value_dim_rows(args.quick)
    print_table(rows, list(RECORD.columns))
    write_json(out_dir(args.out), "model_features", rows)
    if not args.no_record:
        RECORD.write(rows, environment())


if __name__ == "__main__":
    main()
