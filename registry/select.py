"""Pick the fastest available op that supports a problem; explain the choice.

The problem object is the domain's: the selector needs only ``problem.arch``
(an :class:`~registry.arch.Arch`) and ``problem.bucket()`` (a tuning-table key), and
hands the problem to each op's ``not_supported_reasons`` and ``estimate``.

Ranking: measured time from the tuning table for this device and bucket; for a problem between the measured buckets,
the op's cost model scaled by measured / model at the nearest measured buckets of its kind (``nearest_ratio``); else
the op's cost model (scaled by the table's calibration of that op), else declared PRIORITY (ops with an estimate rank
first). On a GPU the estimate is at least the op's host time per call (``host_estimate``: the table's host rows at the
nearest measured buckets of the call's kind (``nearest_host``), else the op's one measured host time, else
``Op.host_time``): a small problem runs at the pace its launch path is issued, so the op that is fastest for the whole
call wins (source "... , host-bound"). Estimates within ``TIE_MARGIN`` of the fastest are a tie, broken on the device
estimate, then PRIORITY, then NAME, so the choice is deterministic and a host-bound ranking does not flip on host-time
noise. ``select`` is memoized on the caller's hashable signature plus the active overrides, so a repeated call is one
dict lookup.

Autotune (``with selector.autotune():`` or ``FMHA_OPS_AUTOTUNE=1``, the convention of
``torch.backends.cudnn.benchmark``): on a memo miss, when the caller passes ``measure`` (ops -> {name: seconds} on the
call's own inputs) and nothing forces an op, every op that supports the problem and has no measurement for it yet is
timed, the seconds are kept per (device, problem) in ``measured`` (in memory and in ``FMHA_OPS_CACHE_DIR``, see
``registry.measured``), and measured ops rank by those seconds (source "measured here") ahead of any model.
Callers skip ``measure`` where a measurement cannot run (a CUDA-graph capture, a torch.compile trace): the table
decides there.

Overrides, strongest first:
- ``op=`` argument: an op class, a name or alias, or an xformers-style ``(FwOp, BwOp)`` tuple (other
  libraries' op values too, through the translation given to ``set_foreign_ops``);
- ``use_ops(...)`` context manager: restrict (one op: force) / exclude ops for a block;
- environment, read at import and by ``refresh_env()``:
  ``FMHA_OPS_FORCE=name[,name]`` (force per kind), ``FMHA_OPS_DISABLE=name[,name]``,
  ``FMHA_OPS_LOG=1`` (print each new dispatch decision to stderr).
A forced op that cannot run raises ``ValueError`` with its reasons; it never falls back.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Hashable, Iterable, Iterator

from .measured import MeasuredTimes
from .op import Op
from .registry import Registry
from .tuning import TuningTables

OpLike = Any  # type[Op] | str | tuple[type[Op] | None, type[Op] | None] | None


MEMO_LIMIT = 1 << 16  # memoized signatures before the memo is cleared
#: estimates within this fraction of the fastest one are a tie, won by the least device estimate. Device times
#: repeat within 1% between H200 runs, host times of one ~100 us call moved up to 2x between runs: where the
#: ranking is decided by host time, an op predicted up to 5% slower costs at most 5% (half the 10% worst-regret
#: target), and the tie goes to the op that is also faster wherever the host runs ahead (other layers' kernels
#: in the queue, CUDA graphs), instead of to whichever host time came out lower this run.
TIE_MARGIN = 0.05
#: autotune times the ops estimated within this factor of the fastest estimate (and those without one): the worst
#: miss of the estimates off the H200's tuning grid was 1.5x, so an op predicted 3x slower is not a contender, and
#: timing it (a float32 reference at 16K tokens, say) could cost seconds and memory the call does not have
AUTOTUNE_SPAN = 3.0


class NoSupportedOpError(ValueError):
    """No op can run a call; the message lists every op with its reasons."""


@dataclass(frozen=True)
class Verdict:
    op: type[Op]
    unavailable: str | None  # None when the op can run in this process
    reasons: tuple[str, ...]  # why it does not support the problem (empty: supported)
    estimate: float | None  # seconds
    source: str  # "table" | "model x R from N measured buckets" | "calibrated model" | "model" | "priority"; ", host-bound" appended where the host time ruled
    device_estimate: float | None = None  # seconds on the device alone (equals estimate unless host-bound)

    @property
    def ok(self) -> bool:
        return self.unavailable is None and not self.reasons

    def why_not(self) -> str:
        if self.unavailable:
            return f"unavailable: {self.unavailable}"
        return "; ".join(self.reasons)


@dataclass
class Report:
    """What ``explain`` returns: one verdict per op (ranked), and the winner."""

    problem: Any
    kind: str
    verdicts: list[Verdict]
    selected: type[Op] | None
    note: str = ""

    def __str__(self) -> str:
        lines = [f"problem: {self.problem}", f"kind: {self.kind}"]
        if self.note:
            lines.append(self.note)
        width = max((len(v.op.NAME) for v in self.verdicts), default=4)
        for v in self.verdicts:
            mark = "*" if v.op is self.selected else " "
            if v.ok:
                est = "-" if v.estimate is None else f"{v.estimate * 1e6:.1f} us"
                lines.append(f"{mark} {v.op.NAME:<{width}}  supported  estimate {est} ({v.source})")
            else:
                lines.append(f"{mark} {v.op.NAME:<{width}}  no: {v.why_not()}")
        lines.append(f"selected: {self.selected.NAME if self.selected else None}")
        return "\n".join(lines)


class Selector:
    def __init__(self, registry: Registry, tables: TuningTables, env_prefix: str = "FMHA_OPS") -> None:
        self.registry = registry
        #: maps ``op=`` values the registry does not know (other libraries' op names / classes) to a
        #: registered op of the kind asked for, or None (see ``set_foreign_ops``)
        self._foreign: Callable[[Any, str], type[Op] | None] | None = None
        self.tables = tables
        self._env_prefix = env_prefix
        self._memo: dict[Hashable, type[Op]] = {}
        #: callers' own memos of what follows from a selection, cleared with the selector's (``derived_memo``)
        self._derived: list[dict] = []
        #: (device, op NAME, bucket) -> the op's measured points of that bucket's kind (``measured_points``)
        self._measured = self.derived_memo()
        #: (device, op NAME, bucket) -> the op's host rows of that bucket's kind (``host_points``)
        self._host_points = self.derived_memo()
        #: (allowed op NAMEs or None for all, excluded names, autotune on / off / None: as the environment says) set
        #: by use_ops / autotune for the current context
        self._scope: contextvars.ContextVar[tuple[frozenset | None, frozenset, bool | None]] = contextvars.ContextVar(
            f"{env_prefix}_scope", default=(None, frozenset(), None))
        #: the ``use_ops`` restriction and autotune switch of the current context, hashable: part of any key a caller
        #: memoizes a selection under
        self.current_scope = self._scope.get
        #: seconds measured per op at callers' exact problems (autotune); its folder is set by ``refresh_env``
        self.measured = MeasuredTimes(None)
        self.refresh_env()

    # ---- overrides -------------------------------------------------------------------
    def refresh_env(self) -> None:
        """Re-read FORCE / DISABLE / LOG / AUTOTUNE / CACHE_DIR from the environment and drop the memo."""
        p = self._env_prefix
        self._env_autotune = os.environ.get(f"{p}_AUTOTUNE", "") not in ("", "0")
        folder = os.environ.get(f"{p}_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), p.lower())
        if folder != self.measured.folder:
            self.measured = MeasuredTimes(folder)
        self._env_force = tuple(n.strip() for n in os.environ.get(f"{p}_FORCE", "").split(",") if n.strip())
        self._env_disable = frozenset(n.strip() for n in os.environ.get(f"{p}_DISABLE", "").split(",") if n.strip())
        self._log = os.environ.get(f"{p}_LOG", "") not in ("", "0")
        self.clear()

    def clear(self) -> None:
        self._memo.clear()
        for memo in self._derived:
            memo.clear()

    def derived_memo(self) -> dict:
        """A new dict for a caller's memo of what follows from selections (launch plans per call layout); the
        selector clears it whenever it clears its own memo (environment re-read, tuning tables reloaded, new
        foreign-op translation), so no entry outlives the choice it was built from."""
        memo: dict = {}
        self._derived.append(memo)
        return memo

    def resolve(self, op: OpLike, kind: str) -> type[Op] | None:
        """An ``op=`` value -> the op class of ``kind`` it names (None: let the selector choose)."""
        if op is None:
            return None
        if isinstance(op, tuple):
            if len(op) != 2:
                raise ValueError(f"op={op!r}: a tuple must be (FwOp, BwOp)")
            return self.resolve(op[0] if kind == "fw" else op[1], kind)
        if self._foreign is not None and not (isinstance(op, type) and issubclass(op, Op)) and not (
                isinstance(op, str) and op in self.registry.names()):
            op = self._foreign(op, kind)
            if op is None:
                return None
        if isinstance(op, str):
            op = self.registry.get(op)
        if not (isinstance(op, type) and issubclass(op, Op)):
            raise ValueError(f"op={op!r} is not an op class, op name or (FwOp, BwOp) tuple")
        if op.KIND != kind:
            hint = " (a call that needs gradients takes op=(FwOp, BwOp))" if kind == "bw" else ""
            raise ValueError(f"op={op.NAME!r} is a {op.KIND} op; a {kind} op is needed here{hint}")
        return op

    def set_foreign_ops(self, translate: Callable[[Any, str], type[Op] | None]) -> None:
        """Accept other libraries' ops as ``op=``: ``translate(op, kind)`` returns our op class of
        ``kind`` for a value the registry does not know, None for the selector's choice, or raises."""
        self._foreign = translate
        self.clear()

    def use_ops(self, *ops: type[Op] | str, exclude: Iterable[type[Op] | str] = ()) -> ContextManager[None]:
        """Restrict selection to ``ops`` (any kind; one op per kind forces it) and/or exclude some, for a ``with``
        block. Nested blocks narrow the enclosing one: allowed sets intersect, exclusions add up. The ops are
        resolved here, so ``use_ops(3)`` or an unknown name raises at the call, before any block.

        Example: ``with SELECTOR.use_ops("sdpa_flashF", exclude=["torch_referenceF"]): ...``
        """
        return self._scoped_ops(frozenset(self._name(o) for o in ops) or None,
                                frozenset(self._name(o) for o in exclude))

    @contextlib.contextmanager
    def _scoped_ops(self, include: frozenset | None, exclude: frozenset) -> Iterator[None]:
        outer_include, outer_exclude, tuning = self._scope.get()
        if outer_include is not None:
            include = outer_include if include is None else include & outer_include
        token = self._scope.set((include, outer_exclude | exclude, tuning))
        try:
            yield
        finally:
            self._scope.reset(token)

    @contextlib.contextmanager
    def autotune(self, enabled: bool = True) -> Iterator[None]:
        """Within the block (context-local), measure the ops of each new call problem and pick the fastest measured
        one (see the module docstring); ``enabled=False`` turns it off inside an enclosing block or under
        ``FMHA_OPS_AUTOTUNE=1``.

        Example
        -------
        >>> with SELECTOR.autotune():  # doctest: +SKIP
        ...     out = memory_efficient_attention(q, k, v)  # first call of this problem: every op timed once
        """
        include, exclude, _ = self._scope.get()
        token = self._scope.set((include, exclude, enabled))
        try:
            yield
        finally:
            self._scope.reset(token)

    def autotuning(self) -> bool:
        """Whether autotune is on in the current context (its ``autotune`` block, else ``FMHA_OPS_AUTOTUNE``)."""
        tuning = self._scope.get()[2]
        return self._env_autotune if tuning is None else tuning

    def _name(self, op: type[Op] | str) -> str:
        if isinstance(op, str):
            return self.registry.get(op).NAME
        if isinstance(op, type) and issubclass(op, Op):
            return op.NAME
        raise TypeError(f"use_ops takes op classes or op names (str), got {type(op).__name__} {op!r}")

    # ---- ranking ------------------------------------------------------------------------
    def verdict(self, op: type[Op], problem: Any) -> Verdict:
        unavailable = op.available()
        reasons: list[str] = []
        if unavailable is None:
            if not op.supports_arch(problem.arch):
                reasons.append(f"runs on {', '.join(map(str, op.arch_specs()))}; the inputs are on {problem.arch}")
            reasons.extend(op.not_supported_reasons(problem))
        estimate, source, device = None, "priority", None
        if unavailable is None and not reasons:
            estimate, source, device = self.estimate(op, problem)
        return Verdict(op, unavailable, tuple(reasons), estimate, source, device)

    def estimate(self, op: type[Op], problem: Any) -> tuple[float | None, str, float | None]:
        """(seconds the op is ranked by, its source, seconds on the device alone) for a problem the op supports:
        the tuning table's time or its fit (``_measured_estimate``), else the op's model scaled by the table's
        calibration, at least the op's host time on a GPU; (None, "priority", None) without an estimate. Needs
        neither the op's package nor its device (offline regret from a table calls it directly).

        Example
        -------
        >>> SELECTOR.estimate(get_op("fa4F"), problem)  # doctest: +SKIP
        (0.000372, 'model x 1.17 from 2 measured buckets', 0.000372)
        """
        if self.autotuning():
            here = self.measured.times(problem.arch.name, f"{op.KIND} {problem}").get(op.NAME)
            if here is not None:
                return here, "measured here", here
        estimate, source = self._measured_estimate(op, problem)
        if estimate is None:
            estimate, source = op.estimate(problem), "model"
            factor = self._calibration(op, problem.arch.name)
            if estimate is None or not math.isfinite(estimate):
                return None, "priority", None
            if factor is not None:
                estimate, source = estimate * factor, "calibrated model"
        device = estimate
        if problem.arch.kind != "cpu":
            host = self.host_estimate(op, problem)
            if host > estimate:
                estimate, source = host, f"{source}, host-bound"
        return estimate, source, device

    def _calibration(self, op: type[Op], device: str) -> float | None:
        """The table's measured / model factor for ``op``'s model: its own, else that of the op it is
        ``CALIBRATED_AS``, else (forward ops) the device-wide median; the tables time forward ops, so a backward
        model without its own factor stands as measured."""
        own = self.tables.calibration(device, op.NAME, median_fallback=False)
        if own is not None:
            return own
        if op.CALIBRATED_AS is not None:
            stand_in = self.tables.calibration(device, op.CALIBRATED_AS, median_fallback=False)
            if stand_in is not None:
                return stand_in
        return self.tables.calibration(device, op.NAME, median_fallback=op.KIND == "fw")

    def host_estimate(self, op: type[Op], problem: Any) -> float:
        """Host seconds per eager call of ``op`` on ``problem``: 0 where the op declares none (a CUDA graph
        capture); else from the table's host rows of the problem's kind nearest in ``size_point()``
        (``nearest_host``; the row of its own bucket for problems without ``at_bucket``), else the op's one measured
        host time, else the declared ``Op.host_time``."""
        declared = op.host_time(problem)
        if declared <= 0:
            return declared
        rows = self.tables.host_rows(problem.arch.name, op.NAME)
        measured = None
        if rows and not hasattr(problem, "at_bucket"):
            measured = rows.get(problem.bucket())
        elif rows:
            key = (problem.arch.name, op.NAME, problem.bucket())
            if key not in self._host_points:
                self._host_points[key] = host_points(problem, rows)
            measured = nearest_host(problem, self._host_points[key])
        return measured or self.tables.host_time(problem.arch.name, op.NAME) or declared

    def _measured_estimate(self, op: type[Op], problem: Any) -> tuple[float | None, str]:
        """The op's time from its tuning-table rows: the row of the problem's own bucket when the problem sits
        exactly on it (source "table"); else, for problems exposing ``at_bucket`` and ``size_point``, the op's
        model scaled by measured / model at the nearest measured buckets of the same kind (see
        ``nearest_ratio``; source "model x R from N measured buckets"); else the own bucket's row as it
        stands; (None, "") where nothing was measured."""
        rows = self.tables.rows(problem.arch.name, op.NAME)
        if not rows:
            return None, ""
        bucket = problem.bucket()
        if not hasattr(problem, "at_bucket"):
            return rows.get(bucket), "table"
        if bucket in rows and problem.at_bucket(bucket).size_point() == problem.size_point():
            return rows[bucket], "table"
        model = op.estimate(problem)
        if model is None or not math.isfinite(model):
            return rows.get(bucket), "table"
        factor = self.tables.calibration(problem.arch.name, op.NAME, median_fallback=False)
        key = (problem.arch.name, op.NAME, bucket)
        if key not in self._measured:
            self._measured[key] = measured_points(op, problem, rows)
        fitted = nearest_ratio(op, problem, rows, factor, self._measured[key])
        if fitted is None:
            return None, ""
        ratio, used = fitted
        return model * ratio, f"model x {ratio:.2f} from {used} measured bucket{'s' * (used > 1)}"

    @staticmethod
    def _rank(v: Verdict) -> tuple:
        return (not v.ok, v.estimate is None, v.estimate or 0.0, v.device_estimate or 0.0, -v.op.PRIORITY, v.op.NAME)

    def _candidates(self, kind: str) -> tuple[list[type[Op]], str]:
        """Ops of ``kind`` allowed by the context and the environment, and a note on the restriction."""
        include, exclude, _ = self._scope.get()
        ops = self.registry.ops(kind)
        note = []
        forced_env = [self.registry.get(n) for n in self._env_force]
        forced_env = [o for o in forced_env if o.KIND == kind]
        if forced_env:
            ops = forced_env
            note.append(f"forced by {self._env_prefix}_FORCE")
        if include is not None:
            ops = [o for o in ops if o.NAME in include]
            note.append(f"restricted by use_ops to {sorted(include)}")
        blocked = exclude | self._env_disable
        if blocked:
            ops = [o for o in ops if not ({o.NAME, *self.registry.aliases(o)} & blocked)]
            note.append(f"excluded: {sorted(blocked)}")
        return ops, "; ".join(note)

    def explain(self, problem: Any, kind: str = "fw", op: OpLike = None) -> Report:
        forced = self.resolve(op, kind)
        if forced is not None:
            v = self.verdict(forced, problem)
            return Report(problem, kind, [v], forced if v.ok else None, f"forced by op={forced.NAME!r}")
        ops, note = self._candidates(kind)
        verdicts = [self.verdict(o, problem) for o in ops]
        if kind == "fw" and getattr(problem, "needs_grad", False):
            verdicts = self._with_backward(verdicts, problem)
        verdicts = self._ranked(verdicts)
        selected = verdicts[0].op if verdicts and verdicts[0].ok else None
        return Report(problem, kind, verdicts, selected, note)

    def _ranked(self, verdicts: list[Verdict]) -> list[Verdict]:
        """``verdicts`` by ``_rank``, then the tie at the top settled: of the estimates within ``TIE_MARGIN`` of
        the fastest, the least device estimate (then PRIORITY, NAME) goes first, its source saying so."""
        ranked = sorted(verdicts, key=self._rank)
        if not ranked or not ranked[0].ok or ranked[0].estimate is None:
            return ranked
        limit = ranked[0].estimate * (1 + TIE_MARGIN)
        tied = [v for v in ranked if v.ok and v.estimate is not None and v.estimate <= limit]
        first = min(tied, key=lambda v: (v.device_estimate if v.device_estimate is not None else v.estimate,
                                         -v.op.PRIORITY, v.op.NAME))
        if first is ranked[0]:
            return ranked
        rest = [v for v in ranked if v is not first]
        note = f"; tie within {TIE_MARGIN:.0%} of {ranked[0].op.NAME}'s estimate: less device time"
        return [dataclasses.replace(first, source=first.source + note)] + rest

    def _with_backward(self, verdicts: list[Verdict], problem: Any) -> list[Verdict]:
        """Forward verdicts of a call that needs gradients, their estimates plus the backward that follows:
        the op's own (``backward_estimate``) or the best ``bw`` op's. A fast forward whose backward is slow
        loses to a slightly slower forward paired with a faster backward."""
        best_bw: list[Verdict | None] = []

        def paired() -> Verdict | None:
            if not best_bw:
                ranked = sorted((self.verdict(o, problem) for o in self._candidates("bw")[0]), key=self._rank)
                best_bw.append(ranked[0] if ranked and ranked[0].ok and ranked[0].estimate is not None else None)
            return best_bw[0]

        out = []
        for v in verdicts:
            if v.ok and v.estimate is not None:
                own = v.op.backward_estimate(problem)
                bw = None if own is not None else paired()
                extra = own if own is not None else (bw.estimate if bw is not None else None)
                if extra is not None:
                    who = "its own" if own is not None else bw.op.NAME
                    v = dataclasses.replace(v, estimate=v.estimate + extra,
                                            device_estimate=(v.device_estimate or 0.0) + extra,
                                            source=f"{v.source}; + backward ({who}) {extra * 1e6:.1f} us")
            out.append(v)
        return out

    def _measure(self, problem: Any, kind: str, measure: Callable[[list[type[Op]]], dict[str, float]]) -> None:
        """Time, with ``measure``, each contender for ``problem`` (an op that supports it, estimated within
        ``AUTOTUNE_SPAN`` of the fastest estimate) that has no measurement for it yet, and keep the seconds in
        ``measured``; nothing when the context leaves fewer than two ops to choose from."""
        verdicts = [v for v in (self.verdict(o, problem) for o in self._candidates(kind)[0]) if v.ok]
        if len(verdicts) < 2:
            return
        fastest = min((v.estimate for v in verdicts if v.estimate is not None), default=None)
        ops = [v.op for v in verdicts if v.estimate is None or fastest is None or v.estimate <= AUTOTUNE_SPAN * fastest]
        name = f"{kind} {problem}"
        have = self.measured.times(problem.arch.name, name)
        missing = [o for o in ops if o.NAME not in have]
        times = {name: t for name, t in (measure(missing) if missing else {}).items() if math.isfinite(t) and t > 0}
        if times:
            self.measured.record(problem.arch.name, name, times)

    # ---- the hot path ----------------------------------------------------------------------
    def select(self, key: Hashable, make_problem: Callable[[], Any], kind: str = "fw", op: OpLike = None,
               measure: Callable[[list[type[Op]]], dict[str, float]] | None = None) -> type[Op]:
        """The op for a call whose signature is ``key``; ``make_problem()`` runs only on a memo miss. ``measure(ops)``:
        {op name: seconds per call on the call's own inputs} for the ops it could time, used under autotune."""
        memo_key = (kind, op, self._scope.get(), key)
        try:
            return self._memo[memo_key]
        except KeyError:
            pass
        except TypeError:  # an unhashable argument: the problem's validation or resolve() names it
            make_problem()
            self.resolve(op, kind)
            raise
        problem = make_problem()
        if measure is not None and op is None and self.autotuning():
            self._measure(problem, kind, measure)
        report = self.explain(problem, kind, op)
        if report.selected is None:
            raise _no_op_error(report, op is not None)
        if self._log:
            sys.stderr.write(f"[fmha_ops] {kind} {problem} -> {report.selected.NAME}\n")
        if len(self._memo) >= MEMO_LIMIT:  # varlen workloads make new signatures without end
            self._memo.clear()
        self._memo[memo_key] = report.selected
        return report.selected


#: measured buckets (at most) whose measured / model ratios set an unmeasured problem's estimate
NEIGHBOURS = 2
#: the log2-size distance at which the op's device-wide factor weighs as much as a measured bucket. An op's measured
#: / model ratio follows the call's sizes (H200 table: 1.08 / 0.98 / 0.97 medians at 512 / 2048 / 8192 tokens, an
#: op's own spread 1.31x), so its one median factor stands in for far buckets only: leaving each H200 grid point out
#: in turn, the 8192-token points' worst regret is 3.7% with the factor at 4 against 10.7% at 2 (where it pulled the
#: long calls' ratio toward the op's median and ranked fa3F over fa4F at D256); the 2048-token points' 7.9% / 8.9%
PRIOR_DISTANCE = 4.0
#: host rows (at most) whose times set a problem's host estimate. Host rows of one op and kind measured in one run
#: differ up to 1.8x at the same sizes (sdpa_cudnnF bf16 D128 at 512 tokens: 50 and 89 us at GQA 4 and 1), and an
#: op's host work grows with the sizes where its launches do (fa3F decode: 39 us at 1K keys, 120 us at 128K): the
#: weighted mean of the 3 nearest rows follows the sizes and evens out one row's noise (leaving each H200 grid point
#: out in turn, the 512-token points' worst regret 36% against 48% from the nearest row alone)
HOST_NEIGHBOURS = 3


def measured_points(op: type[Op], problem: Any, rows: dict[str, float]) -> list[tuple[tuple, float]]:
    """(``size_point()``, log(measured / ``op.estimate``)) at each of the op's measured ``rows`` whose bucket is
    of the problem's kind (``problem.at_bucket(bucket)`` gives a problem: same dtypes, masks, head dims...)."""
    points = []
    for bucket, seconds in rows.items():
        at = problem.at_bucket(bucket)
        model = op.estimate(at) if at is not None else None
        if model and math.isfinite(model) and seconds > 0:
            points.append((at.size_point(), math.log(seconds / model)))
    return points


def _weighted_log_mean(here: tuple, points: list[tuple[tuple, float]], count: int,
                       prior: float | None = None) -> float | None:
    """exp of the mean of the logs at the ``count`` ``points`` ((size point, log value)) nearest to ``here``,
    weighted by 1 / (distance + 1/2)^2, with ``prior`` (a log value) weighted as a point at ``PRIOR_DISTANCE``;
    None without points."""
    near = sorted((math.dist(here, at), value) for at, value in points)[:count]
    if not near:
        return None
    if prior is not None:
        near.append((PRIOR_DISTANCE, prior))
    weights = [1.0 / (d + 0.5) ** 2 for d, _ in near]
    return math.exp(sum(w * v for w, (_, v) in zip(weights, near)) / sum(weights))


def nearest_ratio(op: type[Op], problem: Any, rows: dict[str, float], prior: float | None = None,
                  points: list[tuple[tuple, float]] | None = None) -> tuple[float, int] | None:
    """(measured / model ratio, buckets used) for ``problem`` from the op's measured ``rows`` of the same kind.

    The ratio is the geometric mean of measured / ``op.estimate`` at the ``NEIGHBOURS`` buckets nearest in
    ``problem.size_point()`` (log2 sizes), weighted by 1 / (distance + 1/2)^2, and ``prior`` (the op's one
    device-wide factor, when given) weighted as a bucket at ``PRIOR_DISTANCE``; None when no row is of the same
    kind. ``points``: ``measured_points(op, problem, rows)`` computed beforehand.

    Example
    -------
    >>> nearest_ratio(op, problem, {"...|q1024|...": 2e-4})  # doctest: +SKIP
    (1.31, 1)
    """
    points = measured_points(op, problem, rows) if points is None else points
    ratio = _weighted_log_mean(problem.size_point(), points, NEIGHBOURS, math.log(prior) if prior else None)
    return None if ratio is None else (ratio, min(len(points), NEIGHBOURS))


def host_points(problem: Any, rows: dict[str, float]) -> list[tuple[tuple, float]]:
    """(``size_point()``, log host seconds) at each of an op's host ``rows`` (``{bucket: host seconds}``) whose
    bucket is of the problem's kind (``problem.at_bucket(bucket)`` is not None)."""
    return [(at.size_point(), math.log(seconds)) for bucket, seconds in rows.items()
            if seconds > 0 and (at := problem.at_bucket(bucket)) is not None]


def nearest_host(problem: Any, points: list[tuple[tuple, float]]) -> float | None:
    """Host seconds at ``problem`` from ``points`` (``host_points``): the row at the problem's own sizes as
    measured, else the geometric mean of the ``HOST_NEIGHBOURS`` nearest to ``problem.size_point()``, weighted by
    1 / (distance + 1/2)^2 (a row at distance 0.5 weighs 4x one at distance 1.5); None without points. An op's
    host work follows the call's kind (masks, paging, a quantize step) and, where its launches do, its sizes (a
    decoder's split count follows the cache length): the nearest rows are those measured at sizes most like the
    problem's.

    Example
    -------
    >>> nearest_host(problem, host_points(problem, {"...|q512|...": 1.1e-4, "...|q2048|...": 1.3e-4}))  # doctest: +SKIP
    0.000113
    """
    here = problem.size_point()
    own = [math.exp(value) for at, value in points if at == here]
    return own[0] if own else _weighted_log_mean(here, points, HOST_NEIGHBOURS)


def _no_op_error(report: Report, forced: bool) -> NoSupportedOpError:
    if forced:
        v = report.verdicts[0]
        return NoSupportedOpError(f"op={v.op.NAME!r} cannot run this call: {v.why_not()}\n  problem: {report.problem}")
    lines = [f"no {report.kind} op supports this call: {report.problem}"]
    if report.note:
        lines.append(f"  ({report.note})")
    lines += [f"  {v.op.NAME}: {v.why_not()}" for v in report.verdicts]
    return NoSupportedOpError("\n".join(lines))


