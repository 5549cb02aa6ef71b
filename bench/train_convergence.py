"""Training convergence with quantized attention: a byte-level GPT on the Python standard library source.

The same decoder-only transformer (same seed, same init, same data order) is trained once per attention
variant, sequentially in one process (memory freed between variants):

  sdpa   torch SDPA bf16, causal; on CUDA the faster of the cuDNN and flash backends (probed first)
  fp8    fmha_ops.fp8_attention(q, k, v, causal=True): fp8 forward, then the backward op the selector picks
         (fa4B where flash-attn-4 is installed, else triton_attnB) at the dequantized bf16 q/k/v
  i8fp8  fmha_ops.i8fp8_attention(q, k, v, causal=True): int8 q/k + fp8 v forward, same backward
  noattn the attention replaced by its value input (no attention work at all): the step time no attention
         kernel can beat, so sdpa's step / noattn's is the ceiling of any attention speedup at this shape

Corpus: every *.py file under ``sysconfig.get_paths()['stdlib']`` (site-packages excluded), sorted by
relative path, byte tokens (vocab 256); a file is held out for validation when crc32(relative path) % 10 == 0.
Model: pre-LayerNorm blocks, learned positions, GELU MLP (4x), tied embedding/head; q/k/v come out of one
fused projection as (batch, seq, heads, head_dim) views (BMHK). fp32 master weights, bf16 autocast (attention
called on the bf16 q/k/v with autocast off), AdamW (betas 0.9/0.95, weight decay on matrices), linear warmup
then cosine decay to ``--min-lr-ratio``, gradient clipping. NaN/Inf in the loss or gradient norm stops a
variant (checked one step late, so the host stays a step ahead of the GPU). Step time: CUDA events around
each optimizer step (perf_counter on CPU), median after warm-up; evaluation excluded. ``--cuda-graph`` (CUDA):
after 3 eager steps on a side stream, one whole step (forward, backward, clipping, capturable fused AdamW with
a tensor LR) is captured and replayed with each batch copied into static inputs, for every variant alike: the
step time without Python/launch overhead.

The table's ``target`` column (JSON and stdout) checks fp8 validation loss within 1% of sdpa's, no NaN/Inf and a
step at least ``SPEEDUP_TARGET`` times faster than sdpa's.

    PYTHONPATH=$PWD python bench/train_convergence.py --out $OUT     # H200: all three variants (under 2 min)
    PYTHONPATH=$PWD python bench/train_convergence.py --cuda-graph --out $OUT   # steps replayed from a CUDA graph
    python bench/train_convergence.py --tiny --steps 5                # CPU smoke run (reference op)

Writes train_convergence.json / .png / .md to --out; on CUDA (not --tiny, --quick or --no-record) also the record
bench/results/train_convergence.md (train_convergence_graph.md with --cuda-graph).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import statistics
import sys
import sysconfig
import time
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import common  # noqa: E402

NAME = "train_convergence"
VARIANTS = ("sdpa", "fp8", "i8fp8", "noattn")
VOCAB = 256
VAL_TOLERANCE = 0.01  # fp8 val loss within 1% of sdpa's
SPEEDUP_TARGET = 1.10  # fp8 step time: sdpa's / fp8's
GRAPH_WARMUP = 3  # --cuda-graph: eager steps (side stream) before the step is captured
TINY = {"layers": 2, "d_model": 64, "heads": 2, "context": 64, "batch": 8, "steps": 20, "minutes": 0.0, "warmup": 2,
        "lr": 3e-3, "eval_every": 10, "val_batches": 2}


# ---- data ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=2)
def load_corpus(root: str, val_mod: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, val bytes, info): *.py under ``root`` (no site-/dist-packages) in sorted relative-path
    order, each followed by a newline; a file goes to validation when crc32(relative path) % val_mod == 0."""
    base = Path(root)
    files = sorted((p.relative_to(base).as_posix(), p) for p in base.rglob("*.py")
                   if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(base).parts))
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for rel, path in files:
        try:
            text = path.read_bytes()
        except OSError:
            continue
        parts[zlib.crc32(rel.encode()) % val_mod == 0].append(text + b"\n")
    train, val = (b"".join(parts[k]) for k in (False, True))
    info = {"root": str(base), "files": len(parts[False]) + len(parts[True]), "val_files": len(parts[True]),
            "train_bytes": len(train), "val_bytes": len(val), "crc32_train": zlib.crc32(train),
            "crc32_val": zlib.crc32(val)}
    if len(train) < 1 << 20 or len(val) < 1 << 16:
        raise RuntimeError(f"corpus under {root} too small ({info}); pass --corpus DIR with Python sources")
    return (torch.frombuffer(bytearray(train), dtype=torch.uint8),
            torch.frombuffer(bytearray(val), dtype=torch.uint8), info)


class Batches:
    """``steps`` batches of random (batch, context) windows from ``data``, in an order fixed by ``seed``
    (window starts drawn up front on the CPU, so the order is the same on every device and the loop never
    copies from the host)."""

    def __init__(self, data: torch.Tensor, batch: int, context: int, seed: int, steps: int,
                 device: torch.device) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, data.numel() - context - 1, (steps, batch), generator=gen).to(device)
        self.data, self.span = data.to(device), torch.arange(context + 1, device=device)

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.data[self.starts[step, :, None] + self.span].long()
        return w[:, :-1], w[:, 1:]


def val_batches(data: torch.Tensor, batch: int, context: int, n: int, device: torch.device) -> list:
    """``n`` fixed batches of evenly spaced validation windows."""
    starts = torch.linspace(0, data.numel() - context - 1, n * batch).long()
    w = data[starts[:, None] + torch.arange(context + 1)].long().to(device)
    return [(w[i:i + batch, :-1], w[i:i + batch, 1:]) for i in range(0, n * batch, batch)]


# ---- model -----------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).unbind(2)  # BMHK views
        with torch.autocast(x.device.type, enabled=False):  # q/k/v are bf16 already
            a = attend(q, k, v)
        x = x + self.proj(a.reshape(B, T, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(context, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, attend) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x, attend)
        return F.linear(self.ln(x), self.tok.weight)


def train_flops_per_token(layers: int, d: int, context: int) -> float:
    """6 * parameters in matmuls (blocks + tied head) + causal attention 6 * layers * context * d."""
    return 6 * (12 * layers * d * d + VOCAB * d) + 6 * layers * context * d


# ---- attention variants ----------------------------------------------------------------------

def sdpa_context(backend: str):
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend])


def attention_fn(variant: str):
    """``attend(q, k, v)`` on BMHK bf16 tensors -> BMHK (causal)."""
    if variant == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    if variant == "noattn":
        return lambda q, k, v: v
    import fmha_ops

    fn = {"fp8": fmha_ops.fp8_attention, "i8fp8": fmha_ops.i8fp8_attention}[variant]
    return lambda q, k, v: fn(q, k, v, causal=True)


def selected_ops(variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """The forward/backward ops ``fmha_ops.explain`` picks for this variant's calls (quantized exactly as
    ``fmha_ops.quantized`` does), with the forward problem line."""
    import fmha_ops
    from fmha_ops.quantized import quantize_smooth
    from registry import current_arch, fp8_dtype

    qk_dtype = fp8_dtype(current_arch(q.device)) if variant == "fp8" else torch.int8
    (q8, k8, v8), descales, _ = quantize_smooth(q, k, v, q.shape[-1] ** -0.5, qk_dtype)
    bias = fmha_ops.LowerTriangularFromBottomRightMask()
    fw = fmha_ops.explain(q8, k8, v8, bias, scale=1.0, output_dtype=q.dtype, partial=True, **descales)
    bw = fmha_ops.explain(*(t.detach().requires_grad_() for t in (q, k, v)), bias, partial=True, kind="bw")
    if fw.selected is None or bw.selected is None:
        raise RuntimeError(f"no op for the {variant} path:\n{fw}\n{bw}")
    return {"fw": fw.selected.NAME, "bw": bw.selected.NAME, "fw_problem": str(fw.problem)}


def probe_attention(attend, shape: tuple[int, int, int, int], device: torch.device) -> dict:
    """Forward and gradient error against float32 SDPA on random q/k/v in the training layout (views of
    one (B, T, 3, H, D) tensor), and (CUDA) the time of one attention forward and forward+backward."""
    g = torch.Generator().manual_seed(1234)
    B, T, H, D = shape
    qkv = torch.randn(B, T, 3, H, D, generator=g).to(device, torch.bfloat16).requires_grad_()
    do = torch.randn(shape, generator=g).to(device, torch.bfloat16)
    ref_in = qkv.detach().float().requires_grad_()
    with sdpa_context("math"):  # float32 math, whatever backend the caller restricted SDPA to
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref_in.unbind(2)), is_causal=True)
        ref_grad, = torch.autograd.grad(ref, ref_in, do.float().transpose(1, 2))
    out = attend(*qkv.unbind(2))
    grad, = torch.autograd.grad(out, qkv, do)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach().float() - b).norm() / b.norm())

    res = {"fwd_rel_err": rel(out, ref.detach().transpose(1, 2))}
    res.update({f"d{n}_rel_err": rel(grad[:, :, i], ref_grad[:, :, i]) for i, n in enumerate("qkv")})
    errors = {}
    if device.type == "cuda":
        res["fwd_ms"] = common.time_ms(lambda: attend(*qkv.unbind(2)), warmup=5, rep=30)
        res["fwdbwd_ms"] = common.time_ms(lambda: torch.autograd.grad(attend(*qkv.unbind(2)), qkv, do),
                                          warmup=5, rep=30)
        # SDPA cuDNN's first capture of this call in a process fails on the H200 (torch 2.11: "operation failed due to
        # a previous error during capture") while a whole training step with it captures: a failure here drops only
        # the graph time, replaced by the sum of kernel times
        try:
            res["graph_fwdbwd_ms"] = common.time_graph_ms(
                lambda: torch.autograd.grad(attend(*qkv.unbind(2)), qkv, do), warmup=5, rep=30)[0]
        except RuntimeError as e:
            errors["graph_error"] = str(e).splitlines()[0][:120]
            torch.cuda.synchronize()
            res["kernel_fwdbwd_ms"] = kernel_ms(lambda: torch.autograd.grad(attend(*qkv.unbind(2)), qkv, do))
    return {**{k: float(f"{x:.4g}") for k, x in res.items()}, **errors}


def kernel_ms(fn, reps: int = 20) -> float:
    """GPU time of one ``fn()`` in ms: the sum of its kernels' durations (torch.profiler, host time excluded),
    for calls that cannot be captured alone."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.device_time_total for e in prof.key_averages() if e.device_type == cuda) / reps / 1e3


def pick_sdpa_backend(requested: str, shape, device: torch.device, graph: bool) -> tuple[str, dict]:
    """``best``: on CUDA the faster (forward + backward) of cuDNN and flash at the training shape: timed eagerly,
    or for graph steps (``graph``) as CUDA-graph replays (host overhead does not count), or where the call alone
    does not capture, by the sum of its kernel times (cuDNN: it does capture inside the whole step)."""
    if requested != "best":
        return requested, {}
    if device.type != "cuda":
        return "auto", {}
    times = {}
    for backend in ("cudnn", "flash"):
        try:
            with sdpa_context(backend):
                probe = probe_attention(attention_fn("sdpa"), shape, device)
            times[backend] = probe.get("graph_fwdbwd_ms", probe.get("kernel_fwdbwd_ms")) if graph \
                else probe["fwdbwd_ms"]
        except RuntimeError as e:  # backend unavailable for this shape/build
            times[backend] = f"failed: {str(e).splitlines()[0][:120]}"
    ok = {b: t for b, t in times.items() if isinstance(t, float)}
    return (min(ok, key=ok.get) if ok else "auto"), times


# ---- training --------------------------------------------------------------------------------

def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


@torch.no_grad()
def evaluate(model: GPT, batches: list, attend, device: torch.device) -> float:
    total = 0.0
    for x, y in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x, attend)
        total += float(F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1)))
    return total / len(batches)


def train_variant(variant: str, args, train: torch.Tensor, val: list, device: torch.device) -> dict:
    shape = (args.batch, args.context, args.heads, args.d_model // args.heads)
    res: dict = {"variant": variant}
    if variant == "noattn":
        backend = "auto"
        res["ops"] = {"fw": "none", "bw": "none"}
    elif variant == "sdpa":
        backend, res["sdpa_backend_probe_ms"] = pick_sdpa_backend(args.sdpa_backend, shape, device, args.cuda_graph)
        res["ops"] = {"fw": f"sdpa[{backend}]", "bw": f"sdpa[{backend}]"}
    else:
        backend = "auto"
        q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(3))
        res["ops"] = selected_ops(variant, q, k, v)
        del q, k, v
    print(f"[{variant}] attention ops: {res['ops']}", flush=True)
    if device.type == "cuda" and variant in ("fp8", "i8fp8") and not res["ops"]["fw"].startswith("triton"):
        print(f"[{variant}] WARNING: forward op {res['ops']['fw']} is not a Triton kernel; step time is not "
              f"representative", flush=True)
    attend = attention_fn(variant)
    with sdpa_context(backend):
        res["probe"] = probe_attention(attend, shape, device)
        print(f"[{variant}] attention probe: {res['probe']}", flush=True)
        res.update(_train_loop(variant, args, train, val, attend, device))
        if variant in ("fp8", "i8fp8"):
            with sdpa_context("auto" if device.type == "cpu" else "flash"):
                res["final_val_loss_sdpa_attn"] = evaluate(res.pop("_model"), val, attention_fn("sdpa"), device)
        else:
            res.pop("_model")
    return res


def _train_loop(variant: str, args, train: torch.Tensor, val: list, attend, device: torch.device) -> dict:
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.d_model, args.heads, args.context).to(device)
    params = [p for p in model.parameters()]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    graphed = args.cuda_graph and device.type == "cuda"
    lr0 = torch.tensor(args.lr, device=device) if graphed else args.lr  # a tensor LR is read at replay
    opt = torch.optim.AdamW(groups, lr=lr0, betas=(0.9, 0.95), fused=device.type == "cuda", capturable=graphed)
    batches = Batches(train, args.batch, args.context, args.seed, args.steps, device)
    timer = common.StepTimer(device)
    tokens = args.batch * args.context
    log, evals, pending = [], [], []
    stopped, nan_step = None, None
    cap_s = args.minutes * 60 if args.minutes else math.inf
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_begin, eval_s, done = time.perf_counter(), 0.0, 0

    def train_step(x, y, cache: bool = True):
        with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache):
            logits = model(x, attend)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        return loss.detach(), gnorm.detach()

    graph, static = None, None
    if graphed:  # steps 0..GRAPH_WARMUP-1 run eagerly on a side stream, then one step is captured and replayed
        static = [t.clone() for t in batches[0]]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())

    def finish(entry) -> bool:
        step, loss, gnorm, lr, t0, t1 = entry
        rec = {"step": step, "train_loss": float(loss), "grad_norm": float(gnorm), "lr": lr,
               "step_ms": timer.ms(t0, t1)}
        rec["tokens_per_s"] = tokens / rec["step_ms"] * 1e3
        log.append(rec)
        return math.isfinite(rec["train_loss"]) and math.isfinite(rec["grad_norm"])

    def run_eval(step: int) -> None:
        nonlocal eval_s
        t = time.perf_counter()
        evals.append({"step": step, "val_loss": evaluate(model, val, attend, device)})
        eval_s += time.perf_counter() - t
        print(f"[{variant}] step {step:5d}  val {evals[-1]['val_loss']:.4f}  "
              f"train {log[-1]['train_loss'] if log else float('nan'):.4f}", flush=True)

    for step in range(args.steps):
        if step % args.eval_every == 0:
            run_eval(step)
        lr = lr_at(step, args)
        for g in opt.param_groups:
            if graphed:
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        x, y = batches[step]
        t0 = timer.mark()
        if graphed and step >= GRAPH_WARMUP:
            if graph is None:
                torch.cuda.current_stream().wait_stream(side)
                opt.zero_grad(set_to_none=True)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = train_step(*static, cache=False)
                t0 = timer.mark()
            static[0].copy_(x)
            static[1].copy_(y)
            graph.replay()
            loss, gnorm = (t.clone() for t in static_out)
        elif graphed:
            with torch.cuda.stream(side):
                opt.zero_grad(set_to_none=True)
                loss, gnorm = train_step(x, y)
            torch.cuda.current_stream().wait_stream(side)
        else:
            opt.zero_grad(set_to_none=True)
            loss, gnorm = train_step(x, y)
        pending.append((step, loss, gnorm, lr, t0, timer.mark()))
        done = step + 1
        if len(pending) > 1 and not finish(pending.pop(0)):
            nan_step = log[-1]["step"]
            break
        if time.perf_counter() - t_begin - eval_s > cap_s:
            stopped = f"time cap {args.minutes} min after {done} steps"
            break
    while pending and nan_step is None:
        if not finish(pending.pop(0)):
            nan_step = log[-1]["step"]
    if nan_step is not None:
        stopped = f"non-finite loss/grad norm at step {nan_step}"
        print(f"[{variant}] STOPPED: {stopped}", flush=True)
    else:
        run_eval(done)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t_begin
    skip = GRAPH_WARMUP + 1 if graphed else 5  # graph mode: eager warm-up steps and the capture step
    steady = [r["step_ms"] for r in log[min(skip, len(log) - 1):]] if log else [math.nan]
    step_ms = statistics.median(steady)
    return {"_model": model, "log": log, "evals": evals, "steps_done": done, "stopped": stopped, "cuda_graph": graphed,
            "nan_step": nan_step, "step_ms": step_ms, "tokens_per_s": tokens / step_ms * 1e3,
            "train_wall_s": wall - eval_s, "eval_wall_s": eval_s,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}


# ---- summary ---------------------------------------------------------------------------------

def summarize(results: list[dict], args) -> tuple[list[dict], int | None]:
    """One row per variant, compared with sdpa at the last step every variant evaluated."""
    common_steps = set.intersection(*({e["step"] for e in r["evals"]} for r in results)) if results else set()
    cmp_step = max(common_steps) if common_steps else None
    val_at = {r["variant"]: next((e["val_loss"] for e in r["evals"] if e["step"] == cmp_step), None)
              for r in results}
    base = next((r for r in results if r["variant"] == "sdpa"), None)
    flops = train_flops_per_token(args.layers, args.d_model, args.context)
    rows = []
    for r in results:
        v = val_at[r["variant"]]
        row = {"variant": r["variant"], "steps": r["steps_done"], "val_loss": v,
               "val_loss_sdpa_attn": r.get("final_val_loss_sdpa_attn"),
               "tokens_per_s": r["tokens_per_s"], "step_ms": r["step_ms"],
               "tflops": flops * r["tokens_per_s"] / 1e12, "attn_fwdbwd_ms": r["probe"].get("fwdbwd_ms"),
               "attn_graph_ms": r["probe"].get("graph_fwdbwd_ms"),
               "fw_op": r["ops"]["fw"], "bw_op": r["ops"]["bw"], "nan": r["nan_step"] is not None}
        if base is not None and val_at["sdpa"] and v is not None:
            row["val_ratio"] = v / val_at["sdpa"]
            row["speedup"] = base["step_ms"] / r["step_ms"]
        if r["variant"] == "noattn":
            row["target"] = "ceiling: no attention work"
        elif base is not None and r is not base:
            why = []
            if row["nan"]:
                why.append("NaN/Inf")
            if row.get("val_ratio") is None or row["val_ratio"] > 1 + VAL_TOLERANCE:
                why.append("val loss > 1.01x sdpa")
            if row.get("speedup") is None or row["speedup"] < SPEEDUP_TARGET:
                why.append(f"step speedup < {SPEEDUP_TARGET}")
            row["target"] = "met" if not why else "missed: " + ", ".join(why)
        rows.append(row)
    return rows, cmp_step


COLUMNS = ("variant", "steps", "val_loss", "val_ratio", "val_loss_sdpa_attn", "tokens_per_s", "step_ms", "speedup",
           "tflops", "attn_fwdbwd_ms", "attn_graph_ms", "fw_op", "bw_op", "nan", "target")


def plot(out: str, results: list[dict]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax, axr) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = {e["step"]: e["val_loss"] for r in results if r["variant"] == "sdpa" for e in r["evals"]}
    for i, r in enumerate(results):
        color = f"C{i}"
        steps = [x["step"] for x in r["log"]]
        ema, smooth = None, []
        for x in r["log"]:
            ema = x["train_loss"] if ema is None else 0.95 * ema + 0.05 * x["train_loss"]
            smooth.append(ema)
        ax.plot(steps, smooth, color=color, alpha=0.5, lw=1, label=f"{r['variant']} train (EMA)")
        ax.plot([e["step"] for e in r["evals"]], [e["val_loss"] for e in r["evals"]], "o-", color=color, ms=3,
                label=f"{r['variant']} val")
        if base and r["variant"] != "sdpa":
            pts = [(e["step"], e["val_loss"] / base[e["step"]]) for e in r["evals"] if e["step"] in base]
            axr.plot(*zip(*pts), "o-", color=color, ms=3, label=r["variant"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.legend(fontsize=7)
    ax.set_title("byte-level GPT on the Python stdlib")
    axr.axhline(1.0, color="k", lw=0.5)
    axr.axhline(1 + VAL_TOLERANCE, color="r", lw=0.5, ls="--", label="target 1.01")
    axr.set_xlabel("step")
    axr.set_ylabel("val loss / sdpa val loss")
    axr.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, f"{NAME}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


RECORD_COLUMNS = ("variant", "val_loss", "val_ratio", "step_ms", "speedup", "attn_fwdbwd_ms", "attn_graph_ms", "fw_op",
                  "bw_op", "nan")
RECORD_LABELS = ("variant", "val loss", "val loss / sdpa", "step (ms)", "step speedup", "attention fwd+bwd (ms)",
                 "attention, graph (ms)", "forward op", "backward op", "NaN/Inf")


def record_name(args) -> str:
    """``train_convergence`` for eager steps, ``train_convergence_graph`` for ``--cuda-graph``."""
    return NAME + ("_graph" if args.cuda_graph else "")


def record_command(args) -> str:
    return f"PYTHONPATH=$PWD python bench/train_convergence.py{' --cuda-graph' if args.cuda_graph else ''}"


def record(rows: list[dict], cmp_step, args, env: dict, corpus: dict, results_dir: str = common.RESULTS,
           png: str | None = None) -> str:
    """Write ``<results_dir>/<record_name(args)>.md``: the variants' table and what it measured."""
    columns = {c: label for c, label in zip(RECORD_COLUMNS, RECORD_LABELS) if any(r.get(c) is not None for r in rows)}
    title = (f"Training: {args.layers}L d{args.d_model} {args.heads}h ctx{args.context}, batch {args.batch}, "
             f"{args.steps} steps, " + ("CUDA-graph steps" if args.cuda_graph else "eager steps"))
    notes = (f"Byte-level GPT on {corpus['files']} stdlib .py files ({corpus['train_bytes'] / 1e6:.1f} MB train, "
             f"{corpus['val_bytes'] / 1e6:.1f} MB validation by file); validation loss in nats/byte after "
             f"{cmp_step} steps. Same seed, init and data order for every variant; sdpa: torch SDPA bf16 (the faster "
             "backend at the training shape); fp8 / i8fp8: `fmha_ops.fp8_attention` / `i8fp8_attention` (quantized "
             "forward, the selected bf16 backward op at the dequantized values); noattn: the attention replaced by its "
             "value input, so its step speedup is the most any attention kernel can give at this shape. Attention "
             "columns: one forward+backward at the training shape, eager / replayed from a CUDA graph.")
    spec = common.Record(record_name(args), title, record_command(args), columns, notes)
    return spec.write(rows, env, png, results_dir=results_dir)


# ---- entry point -----------------------------------------------------------------------------

def parse_args(argv):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + "|".join(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="2 layers, d 64, 2 heads, context 64, 20 steps (CPU smoke)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps per variant (sets the LR schedule)")
    p.add_argument("--minutes", type=float, default=0.5, help="cap on each variant's training time (0: none)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sdpa-backend", default="best", choices=("best", "auto", "cudnn", "flash", "efficient", "math"),
                   help="best: the faster of cudnn/flash at the training shape (CUDA)")
    p.add_argument("--corpus", default=None, help="folder of .py files (default: the stdlib)")
    p.add_argument("--val-mod", type=int, default=10, help="a file is validation when crc32(path) %% N == 0")
    p.add_argument("--device", default=None)
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture one whole training step (forward, backward, clip, AdamW) in a CUDA graph and replay "
                        "it: step time without host overhead, for every variant")
    pre, _ = p.parse_known_args(argv)
    if pre.tiny:
        p.set_defaults(**TINY)
    args = p.parse_args(argv)
    if args.quick:
        args.steps = max(args.eval_every, args.steps // 10)
    args.warmup = max(1, min(args.warmup, args.steps // 2))
    bad = set(args.variants.split(",")) - set(VARIANTS)
    if bad or args.d_model % args.heads:
        p.error(f"unknown variants {sorted(bad)}" if bad else "--d-model must be a multiple of --heads")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = common.out_dir(args.out)
    env = common.environment()
    train, val_data, corpus = load_corpus(args.corpus or sysconfig.get_paths()["stdlib"], args.val_mod)
    val = val_batches(val_data, args.batch, args.context, args.val_batches, device)
    flops = train_flops_per_token(args.layers, args.d_model, args.context)
    print(f"device {device}; corpus {corpus}; {args.batch * args.context} tokens/step, "
          f"{flops / 1e6:.1f} MFLOP/token", flush=True)
    results = []
    for variant in args.variants.split(","):
        results.append(train_variant(variant, args, train, val, device))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows, cmp_step = summarize(results, args)
    json_path = common.write_json(out, NAME, rows, extra={"config": vars(args), "corpus": corpus,
                                                           "flops_per_token": flops, "compare_step": cmp_step,
                                                           "variants": results})
    png = plot(out, results)
    md_paths = [record(rows, cmp_step, args, env, corpus, out)]
    if device.type == "cuda" and not (args.tiny or args.quick or args.no_record):
        md_paths.append(record(rows, cmp_step, args, env, corpus, png=png))
    for r in results:
        print(f"{r['variant']}: ops {r['ops']}; attention probe {r['probe']}"
              + (f"; stopped: {r['stopped']}" if r["stopped"] else ""))
    print(f"wrote {json_path}, {png or 'no PNG (matplotlib missing)'}, {', '.join(md_paths)}")
    print(f"\nval loss at step {cmp_step}; target: val_ratio <= {1 + VAL_TOLERANCE}, no NaN/Inf")
    common.print_table(rows, [c for c in COLUMNS if any(r.get(c) is not None for r in rows)])
    return {"rows": rows, "results": results, "compare_step": cmp_step, "json": json_path, "png": png,
            "md": md_paths}


if __name__ == "__main__":
    main()
