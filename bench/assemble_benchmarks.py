"""Rebuild BENCHMARKS.md from bench/results: the summary first, then each benchmark's own record.

    python bench/assemble_benchmarks.py
"""
from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ORDER = ("summary", "attention_fwd", "i8fp8_accuracy", "attention_bwd", "train_convergence", "quantize", "decode",
         "decode_fp8_analysis", "selector", "dispatch_overhead", "launch_overhead", "flydsl")


def main() -> None:
    names = [n[:-3] for n in sorted(os.listdir(RESULTS)) if n.endswith(".md")]
    missing = [n for n in names if n not in ORDER]
    if missing:
        raise SystemExit(f"bench/results/{missing[0]}.md is not in ORDER: add it to bench/assemble_benchmarks.py")
    parts = []
    for name in ORDER:
        with open(os.path.join(RESULTS, f"{name}.md")) as f:
            parts.append(f.read().strip() + "\n")
    with open(os.path.join(os.path.dirname(RESULTS), "..", "BENCHMARKS.md"), "w") as f:
        f.write("\n\n".join(parts))


if __name__ == "__main__":
    main()
