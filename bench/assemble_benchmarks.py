"""Build BENCHMARKS.md from bench/findings.md (hand-written header and findings) and the records that the
benchmarks write into bench/results/.

Every record carries an ``Environment: ...`` line; the most common one becomes the page's single environment line
(the ``{environment}`` placeholder of findings.md) and is dropped from the records that share it.

    python bench/assemble_benchmarks.py
"""
from __future__ import annotations

import collections
import os

BENCH = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(BENCH, "results")
HEADER = os.path.join(BENCH, "findings.md")
PAGE = os.path.join(BENCH, "..", "BENCHMARKS.md")
ORDER = ("attention_fwd", "attention_window", "attention_bwd", "backends", "decode", "host_time", "host_time_cpu",
         "train_convergence_graph", "train_convergence", "context_parallel", "selector", "accuracy", "quantize",
         "model_features", "models")
ENV_PREFIX = "Environment: "


def _environment(text: str) -> str | None:
    return next((ln for ln in text.splitlines() if ln.startswith(ENV_PREFIX)), None)


def assemble() -> str:
    """The page's text: the header with the common environment line, then each record in ``ORDER``."""
    names = sorted(n[:-3] for n in os.listdir(RESULTS) if n.endswith(".md"))
    unknown = [n for n in names if n not in ORDER]
    if unknown:
        raise SystemExit(f"bench/results/{unknown[0]}.md is not in ORDER: add it to bench/assemble_benchmarks.py")
    records = []
    for name in ORDER:
        path = os.path.join(RESULTS, f"{name}.md")
        if os.path.exists(path):
            with open(path) as f:
                records.append(f.read().strip())
    envs = collections.Counter(e for e in map(_environment, records) if e)
    common = envs.most_common(1)[0][0] if envs else ENV_PREFIX + "not recorded."
    parts = []
    for text in records:
        lines = text.splitlines()
        if common in lines:  # the line and the blank line after it
            i = lines.index(common)
            del lines[i:i + 2]
        parts.append("\n".join(lines))
    with open(HEADER) as f:
        header = f.read().strip().replace("{environment}", common[len(ENV_PREFIX):].rstrip("."))
    return "\n\n".join([header, *parts]) + "\n"


def main() -> None:
    text = assemble()
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"BENCHMARKS.md: {text.count(chr(10))} lines")


if __name__ == "__main__":
    main()
