"""Fuzz of the public API with invalid and valid calls, each run isolated in a forked worker.

``cases_*`` build the calls (fixed seeds), ``reference`` holds the float64 attention the valid and the
leniently accepted calls are checked against, ``runner`` executes the calls in forked workers and
classifies each outcome, ``__main__`` prints the classification table (``python -m tests.fuzz``).
"""
