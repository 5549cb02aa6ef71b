"""Run the fuzz and print its classification table: ``python -m tests.fuzz [--workers N] [--only PREFIX]``."""
from __future__ import annotations

import argparse
import sys

from .suite import all_cases
from .runner import run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", default="", help="run only the cases whose name starts with this")
    ap.add_argument("--show", type=int, default=80, help="list at most this many non-clear / wrong calls")
    args = ap.parse_args(argv)
    cases = [c for c in all_cases() if c.name.startswith(args.only)]
    results = run(cases, workers=args.workers)
    print(results.report(limit=args.show))
    return 0


if __name__ == "__main__":
    sys.exit(main())
