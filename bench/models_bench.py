"""Whole models through Hugging Face transformers on the H200: prefill and decode tokens/s by attn_implementation.

Two models built from configs with random bf16 weights (no download), layers reduced to fit: a Llama-3-8B-shaped
one (hidden 4096, 32 query / 8 KV heads of dim 128, MLP 14336) and a GPT-OSS-20B-shaped one (hidden 2880, 64 / 8
heads of dim 64 with sinks, alternating 128-token sliding-window and full layers, 32 experts top-4). Each
(model, batch, context) runs every implementation in the same process on the same weights:

* prefill: one forward over batch x context tokens (``logits_to_keep=1``, filling a dynamic cache);
  tokens/s = batch x context / median time;
* decode: one-token steps against that cache (greedy inputs, the cache growing by ``--steps`` tokens);
  tokens/s = batch / median step time;
* attention: the time inside the implementation's attention function (CUDA events around each call, summed per
  forward), in a separate pass so that the whole-step times carry no event overhead; ``attn %`` is its share.

Implementations: ``fmha_ops`` and ``fmha_ops_fp8`` (``fmha_ops.integrations.transformers``), ``sdpa``,
``flex_attention``, and ``flash_attention_4`` where flash-attn-4 is installed; one that cannot run a model
(GPT-OSS takes no ``sdpa`` in transformers) gives empty cells. Writes ``bench/results/models.md`` (+ ``.png``: each
implementation's tokens/s relative to the fastest one of its cell) and ``<out>/models.json`` / ``models.png``.

    python bench/models_bench.py [--quick] [--model llama3-8b gpt-oss-20b] [--batch 1 32] [--context 2048 16384]
                                 [--impl fmha_ops sdpa ...] [--layers N] [--budget SECONDS] [--merge] [--out DIR]
                                 [--no-record] [--device cpu]

``--merge`` keeps the rows of ``<out>/models.json`` that this run does not measure again, so the grid can be run in
parts (one model or batch per command) into one record. ``--budget``: cells that would start after that many
seconds are left out (listed at the end and in the record, for a ``--merge`` run). ``--device cpu``: a smoke run,
the same code on models a few hundred parameters wide (``TINY``, ``TINY_GRID``), wall-clock timings, no record.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (Record, StepTimer, bar_plot, base_parser, environment, or_none, out_dir,  # noqa: E402
                          print_table, write_json)

IMPLEMENTATIONS = ["fmha_ops", "fmha_ops_fp8", "sdpa", "flex_attention", "flash_attention_4"]
#: layers kept per model (the attention's share of a step does not depend on the depth); vocabulary cut to 32k
#: (the LM head runs on the last token only: ``logits_to_keep=1``)
LAYERS = {"llama3-8b": 4, "gpt-oss-20b": 4}
VOCAB = 32000
PREFILL_REPS = 3
WARMUP_STEPS = 3
PHASES = ("prefill", "decode")
#: ``--device cpu`` (smoke runs): the same architectures a few hundred parameters wide, GQA and sinks kept, an
#: 8-token window so that the smoke contexts pass it
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
TINY_WINDOW = 8
TINY_GRID = dict(batch=[1, 2], context=[24], steps=2, layers=2)


def make_config(name: str, layers: int, tiny: bool = False):
    """The transformers config of a model shape, ``layers`` deep (``tiny``: the TINY widths)."""
    from transformers import GptOssConfig, LlamaConfig

    if name == "llama3-8b":
        shape = dict(vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128)
        return LlamaConfig(**(TINY if tiny else shape), num_hidden_layers=layers, max_position_embeddings=32768,
                           rope_theta=500000.0)
    if name == "gpt-oss-20b":
        shape = dict(vocab_size=VOCAB, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                     num_key_value_heads=8, head_dim=64)
        experts = dict(num_local_experts=4, num_experts_per_tok=2) if tiny else dict(num_local_experts=32,
                                                                                     num_experts_per_tok=4)
        return GptOssConfig(**(TINY if tiny else shape), **experts, num_hidden_layers=layers,
                            sliding_window=TINY_WINDOW if tiny else 128,
                            layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                            + ["sliding_attention"] * (layers % 2))
    raise ValueError(f"unknown model {name!r}; choose from {sorted(LAYERS)}")


@contextlib.contextmanager
def attention_timer(implementation: str, clock: StepTimer):
    """Within the block, every call of ``implementation``'s attention function is timed (``clock`` marks around
    it); yields a function returning the summed milliseconds (waiting for the marks) and resetting them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    inner = mapping[implementation]
    marks: list = []

    def timed(*args, **kwargs):
        start = clock.mark()
        result = inner(*args, **kwargs)
        marks.append((start, clock.mark()))
        return result

    def total_ms() -> float:
        ms = sum(clock.ms(a, b) for a, b in marks)
        marks.clear()
        return ms

    mapping[implementation] = timed
    try:
        yield total_ms
    finally:
        mapping[implementation] = inner


def _ms(fn, clock: StepTimer) -> float:
    start = clock.mark()
    fn()
    return clock.ms(start, clock.mark())


def _empty_cache(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run_one(model, batch: int, context: int, steps: int, implementation: str) -> dict:
    """Prefill and decode timings of ``model`` (its attention set to ``implementation``) on the model's device."""
    from transformers import DynamicCache

    model.set_attn_implementation(implementation)
    device = str(model.device)
    clock = StepTimer(device)
    vocab = model.config.vocab_size
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(3, vocab, (batch, context), device=device, generator=g)
    step_ids = torch.randint(3, vocab, (batch, 1), device=device, generator=g)

    def prefill():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache

    with torch.no_grad():
        prefill()  # warm-up (compiles flex_attention, Triton kernels)
        prefill_ms = statistics.median(_ms(prefill, clock) for _ in range(PREFILL_REPS))
        with attention_timer(implementation, clock) as attn_ms:
            prefill()
            prefill_attn = attn_ms()
        cache = prefill()
        for _ in range(WARMUP_STEPS):
            model(input_ids=step_ids, past_key_values=cache, use_cache=True)
        step_ms = statistics.median(_ms(lambda: model(input_ids=step_ids, past_key_values=cache, use_cache=True),
                                        clock) for _ in range(steps))
        with attention_timer(implementation, clock) as attn_ms:
            for _ in range(steps):
                model(input_ids=step_ids, past_key_values=cache, use_cache=True)
            decode_attn = attn_ms() / steps
    del cache
    _empty_cache(device)
    return {"prefill_tok_s": batch * context / (prefill_ms * 1e-3), "prefill_ms": prefill_ms,
            "prefill_attn_ms": prefill_attn, "prefill_attn_pct": 100.0 * prefill_attn / prefill_ms,
            "decode_tok_s": batch / (step_ms * 1e-3), "decode_ms": step_ms, "decode_attn_ms": decode_attn,
            "decode_attn_pct": 100.0 * decode_attn / step_ms}


def relative_rows(rows: list[dict]) -> list[dict]:
    """For the plot: one row per (model, batch, context) cell and phase, each implementation's tokens/s divided by
    the fastest implementation's in that cell (1.0 = fastest; absent: not measured)."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["model"], r["batch"], r["context"]), []).append(r)
    out = []
    for (model, batch, context), group in cells.items():
        for phase in PHASES:
            speeds = {r["impl"]: r.get(f"{phase}_tok_s") for r in group if r.get(f"{phase}_tok_s")}
            best = max(speeds.values(), default=None)
            if best:
                out.append({"cell": f"{model} B{batch} {context // 1024 or context}{'k' if context >= 1024 else ''}"
                                    f" {phase}", **{impl: v / best for impl, v in speeds.items()}})
    return out


COMMAND = "python bench/models_bench.py"
#: what each measured cell prints (all of it is in models.json)
COLUMNS = ("model", "batch", "context", "impl", "prefill_tok_s", "prefill_attn_pct", "decode_tok_s", "decode_ms",
           "decode_attn_ms", "decode_attn_pct")
RECORD = Record(
    "models", "Models through transformers: prefill and decode tokens/s by attn_implementation", COMMAND,
    {"model": "model (layers)", "batch": "batch", "context": "context", **{impl: impl for impl in IMPLEMENTATIONS}},
    "Cells: prefill / decode tokens/s (the attention's share of the time: prefill of the forward, decode of a step). "
    "Random bf16 weights from configs, layers reduced (the attention's share does not depend on depth), vocabulary "
    "32k with logits for the last token only. Prefill: one forward over batch x context tokens into a dynamic "
    "cache, median of 3. Decode: one-token steps against that cache (eager, no CUDA graphs), median step. attn: "
    "CUDA-event time inside the attention function, measured in a separate pass. Same process, same weights for "
    "every implementation; empty cells: the implementation cannot run the model (GPT-OSS takes no sdpa) or is not "
    "installed.")


def record_rows(rows: list[dict]) -> list[dict]:
    """The record's table from the measured ``rows``: one row per (model, batch, context), one column per
    implementation holding "prefill tokens/s / decode tokens/s (attention % / attention %)" (absent: not measured,
    or the implementation cannot run the model).

    >>> record_rows([{"model": "m", "batch": 1, "context": 8, "impl": "sdpa", "prefill_tok_s": 1234.5,
    ...               "prefill_attn_pct": 40.2, "decode_tok_s": 50.0, "decode_attn_pct": 9.6}])[0]["sdpa"]
    '1,234 / 50 (40% / 10%)'
    """
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["model"], r["batch"], r["context"]), []).append(r)
    out = []
    for (model, batch, context), group in cells.items():
        row = {"model": model, "batch": batch, "context": context}
        for r in group:
            if r.get("prefill_tok_s"):  # run_one measures both phases or neither
                row[r["impl"]] = (f"{r['prefill_tok_s']:,.0f} / {r['decode_tok_s']:,.0f} "
                                  f"({r['prefill_attn_pct']:.0f}% / {r['decode_attn_pct']:.0f}%)")
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=list(LAYERS))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    p.add_argument("--context", nargs="+", type=int, default=[2048, 16384])
    p.add_argument("--impl", nargs="+", default=IMPLEMENTATIONS)
    p.add_argument("--layers", type=int, default=None, help="layers per model (default: LAYERS)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds; leave out cells that would start later (0: none)")
    p.add_argument("--merge", action="store_true", help="keep <out>/models.json's rows this run does not redo")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"),
                   help="cpu: a smoke run on tiny models (no record)")
    args = p.parse_args(argv)
    tiny = args.device == "cpu"
    if args.quick:
        args.batch, args.context, args.steps = [1], [2048], 8
    if tiny:
        args.batch, args.context, args.steps = TINY_GRID["batch"], TINY_GRID["context"], TINY_GRID["steps"]
        args.layers, args.no_record = args.layers or TINY_GRID["layers"], True
    import fmha_ops.integrations.transformers  # noqa: F401  (registers fmha_ops, fmha_ops_fp8)
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if tiny else torch.bfloat16
    began, left_out, rows = time.perf_counter(), [], []
    for name in args.model:
        layers = args.layers or LAYERS[name]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_config(name, layers, tiny), dtype=dtype,
                                                 attn_implementation="sdpa" if name == "llama3-8b" else "eager")
        model = model.to(args.device).eval()
        for batch in args.batch:
            for context in args.context:
                for impl in args.impl:
                    cell = f"--model {name} --batch {batch} --context {context} --impl {impl}"
                    if args.budget and time.perf_counter() - began > args.budget:
                        left_out.append(cell)
                        continue
                    print(f"{name} L{layers} B{batch} context {context}: {impl}", flush=True)
                    res = or_none(lambda: run_one(model, batch, context, args.steps, impl)) or {}
                    rows.append({"model": f"{name} ({layers})", "batch": batch, "context": context, "impl": impl,
                                 **res})
                    _empty_cache(args.device)
        del model
        _empty_cache(args.device)
    out = out_dir(args.out)
    if args.merge:
        rows = merged(os.path.join(out, "models.json"), rows)
    print_table(rows, COLUMNS)
    write_json(out, "models", rows, {"left_out": left_out})
    plot = relative_rows(rows)
    png = bar_plot(out, "models", plot, "cell", [i for i in IMPLEMENTATIONS if any(i in r for r in plot)],
                   "tokens/s relative to the fastest", "Models through transformers (1.0 = fastest in the cell)")
    if not args.no_record:
        notes = RECORD.notes + (f" Not measured (time budget): {'; '.join(left_out)}." if left_out else "")
        RECORD.write(record_rows(rows), environment(), png, notes)
    for cell in left_out:
        print(f"left out (budget): {cell}")
    print(f"{time.perf_counter() - began:.0f} s")


def merged(path: str, rows: list[dict]) -> list[dict]:
    """The rows of an earlier run's JSON at ``path`` that ``rows`` do not redo (same model, batch, context and
    implementation), then ``rows``."""
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        earlier = json.load(f)["rows"]
    keys = {(r["model"], r["batch"], r["context"], r["impl"]) for r in rows}
    return [r for r in earlier if (r["model"], r["batch"], r["context"], r["impl"]) not in keys] + rows


if __name__ == "__main__":
    main()
