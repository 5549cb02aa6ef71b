"""The plan cache: one ``Plan`` per call signature of every public entry point.

A public function turns its arguments into one key and looks it up (its ``plan_finder``: the key as ``key_function``
builds it, then one dict lookup in ``PLANS``) and, on a hit, runs the plan it finds; on a miss its full path validates
the arguments (raising ValueError / TypeError / NotImplementedError naming them), selects the op(s), runs the call
and, where a repeated call may skip that work, stores a ``Plan`` under the key (``PLANS.put``).

The key is derived from the arguments themselves, never listed by hand: ``key_function(entry)`` (and
``plan_finder(entry)``) generates, from the entry point's signature, a function that takes every parameter
(``call_key(entry, args)`` builds the same items in a loop, for the call layer's inner calls; ``unkeyed`` parameters,
which the entry point checks on every call before its lookup, are left out), and keeps for each argument what any
check may read short of a tensor's values

- a tensor: its shape, dtype, device, strides and ``requires_grad`` (a subclass also its type; on CUDA the low bits
  of its address, which the 16-byte alignment rules read);
- a mask (``attn_bias.AttentionBias``): its ``signature()`` (type, window, sizes; its index tensors' metadata);
- a bool, int or float: the value with its type (``True``, ``1`` and ``1.0`` are equal keys, not equal arguments),
  in a generated key the bare value where its type is the parameter's declared one (``causal: bool``: ``True``; ``1``
  there is keyed with its type); a pair of plain ints (a window size) as it is;
- None, a str, torch.dtype, torch.device or a class: the value;
- a list or tuple: its type, then its items as above;

and the process state that validation and selection read: the grad mode, torch's deterministic switch, the ``use_ops``
scope, the fp8-backward switch, check mode (``fmha_ops.checks``: the ``check_inputs`` scope and the environment's
switch) and, with a CUDA tensor, whether a CUDA graph is being captured. Any other argument (an object of another
library, a mask class, an unhashable value) gives no key: the call takes the full path, which converts or names it. So
a check added to any entry point reads only what the key already holds, unless it reads a tensor's values: those
checks (host index tensors, host descales, everything in check mode) belong to the full path, whose calls store no
plan, or to the plan's own run.

The cache is one bounded LRU (``LIMIT`` plans, in its second-chance form: a hit marks the plan used; a store past
the limit drops the oldest plan unused since its last chance, moving used ones to the young end) cleared with the
selector's memo (``Selector.derived_memo``: ``refresh_env``, tuning-table reloads, ``SELECTOR.clear()``), so no plan
outlives the choice it was built from. A plan holds no tensor of the call that built it (buffers a plan allocates
for itself aside).

Example
-------
>>> key = call_key("my_entry", (q, k, v, None, 0.125))
>>> plan = PLANS.get(key)
>>> out = plan.run(q, k, v) if plan is not None else full_path(key, q, k, v)  # the full path calls PLANS.put
"""
from __future__ import annotations

import atexit

import inspect
from typing import Callable, Hashable

import torch

from . import attn_bias as ab
from . import checks, fp8_backward
from .dispatch import SELECTOR
from .plan import Plan

#: plans kept before the least recently used is dropped (varlen-like workloads make new layouts without end)
LIMIT = 1 << 12

_Tensor = torch.Tensor
_Bias = ab.AttentionBias
#: argument types keyed by value; numbers with their type (True, 1 and 1.0 are equal keys, not equal arguments)
_NUMBERS = frozenset({bool, int, float})
_VALUES = frozenset({str, torch.dtype, torch.device})
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch._C.is_grad_enabled
_deterministic = torch._C._get_deterministic_algorithms
_scope = SELECTOR.current_scope
_fp8_backward = fp8_backward.enabled_now
_checks_scoped, _checks_env = checks.scoped_now, checks.ENV  # check mode as ``checks_enabled`` reads it, no call
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
#: the low address bits a 16-byte alignment rule reads
_ALIGN_BITS = 15


class PlanCache:
    """The bounded LRU of plans by ``call_key`` (``PLANS`` is the one instance)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._plans: dict = SELECTOR.derived_memo()  # cleared with the selector's memo

    def get(self, key: Hashable | None) -> Plan | None:
        """The plan stored under ``key`` (None: no key, or none stored); a hit marks the plan used. Without a key
        (a trace) the cache is not read: compiled graphs hold no guard on it."""
        if key is None:
            return None
        try:
            plan = self._plans.get(key)
        except TypeError:  # an unhashable item (a mask's signature of another library's values): no plan
            return None
        if plan is not None:
            plan.used = True
        return plan

    def put(self, key: Hashable | None, plan: Plan) -> Plan:
        """Store ``plan`` under ``key`` (nothing without a key); past ``limit`` the least recently used plan goes."""
        if key is not None and _hashable(key):
            plans = self._plans
            while len(plans) >= self.limit and key not in plans:
                self._evict_one(plans)
            plans[key] = plan
        return plan

    @staticmethod
    def _evict_one(plans: dict) -> None:
        """Drop the oldest plan not used since it was last looked at here; a used one moves to the young end with
        its mark cleared (the second-chance form of LRU: a hit costs one lookup and a flag, not a reordering)."""
        while True:
            oldest = next(iter(plans))
            plan = plans.pop(oldest)
            if not plan.used:
                return
            plan.used = False
            plans[oldest] = plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key) -> bool:
        return key in self._plans

    def plans(self, entry: Hashable | None = None) -> list[Plan]:
        """The stored plans (of calls of ``entry``, the first item of their keys, when given), least recently used
        first."""
        return [plan for key, plan in self._plans.items() if entry is None or key[0] is entry]


PLANS = PlanCache(LIMIT)
#: plans can hold extension objects (cuDNN-frontend graphs bound into a launcher) whose bindings report every object
#: still alive when they unload after the exit handlers ("nanobind: leaked N instances"): the plans go first
atexit.register(PLANS.clear)


def _hashable(key) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def call_key(entry: Hashable, args: tuple) -> tuple | None:
    """The key of one call of ``entry`` (the public function) with ``args`` (every argument it was given, in its
    own order, the main tensor first), or None where the call cannot have a plan: inside a torch.compile trace
    (``PLANS`` is never read there, so compiled graphs hold no guard on it) or an argument the key cannot hold (see
    the module docstring). Where the first argument is a CUDA tensor, each tensor's item holds its address bits
    below 16 bytes and the key whether a CUDA graph is being captured.

    Example: ``call_key(flash_attn_func, (q, k, v, None, True))`` equals the key of any later call with tensors of
    the same metadata, the same scalars and the same process state.
    """
    if _is_compiling():
        return None
    first = args[0]
    cuda = type(first) is _Tensor and first.is_cuda
    items = []
    item = items.append
    try:
        for a in args:  # the hot path of every repeated call: the commonest kinds first, no call per argument
            if a is None:
                item(None)
            elif (kind := type(a)) is _Tensor:
                if cuda:
                    item((a.shape, a.dtype, a.device, a.stride(), a.requires_grad, a.data_ptr() & _ALIGN_BITS))
                else:
                    item((a.shape, a.dtype, a.device, a.stride(), a.requires_grad))
            elif kind in _NUMBERS:
                item((kind, a))
            elif kind in _VALUES:
                item(a)
            else:
                item(_other(a, cuda))
    except _NoKey:
        return None
    if cuda:
        item(_capturing())
    return (entry, _grad_enabled(), _deterministic(), _scope(), _fp8_backward(), _checks_scoped(), _checks_env[0],
            *items)


def key_function(entry: Callable, unkeyed: tuple[str, ...] = ()) -> Callable[..., tuple | None]:
    """``call_key`` for ``entry``, specialized to its parameters: ``key(*args)`` takes every parameter of ``entry``
    but those named in ``unkeyed`` (positionally, in its order; leaving one out is a TypeError) and returns a key as
    ``call_key`` builds it, as one expression instead of a loop. The parameters annotated ``torch.Tensor`` give their
    metadata as items of the key's argument tuples when they are plain tensors (no tuple per tensor); any other
    call takes ``call_key``. ``unkeyed``: parameters ``entry`` checks on every call before its lookup, by a check
    that reads nothing else (FA3 features it rejects unless left at their defaults): no key needs them.

    Example
    -------
    >>> _KEY = key_function(flash_attn_func)  # once, after the function
    >>> key = _KEY(q, k, v, softmax_scale, causal, ...)  # every parameter of flash_attn_func
    """
    return _generated(entry, "key", unkeyed)


def plan_finder(entry: Callable, unkeyed: tuple[str, ...] = ()) -> Callable[..., tuple]:
    """The hot path of every repeated call: ``find(*args)`` takes what ``key_function(entry, unkeyed)`` takes and
    returns ``(plan, key)``: the plan ``PLANS`` holds under the call's key (marked used, as ``PlanCache.get`` marks
    it) or None, and the key, for the full path to store its plan under (None where the call can have none). One
    frame: the key built as ``key_function``'s, then one dict lookup.

    Example
    -------
    >>> _FIND = plan_finder(flash_attn_func)  # once, after the function
    >>> plan, key = _FIND(q, k, v, softmax_scale, causal, ...)  # every parameter of flash_attn_func
    """
    return _generated(entry, "find", unkeyed)


def _generated(entry: Callable, kind: str, unkeyed: tuple[str, ...] = ()) -> Callable:
    """``key_function``'s (``kind`` "key") or ``plan_finder``'s ("find") function for ``entry``: source generated
    from its signature (less the ``unkeyed`` parameters), compiled once."""
    params = list(inspect.signature(entry).parameters.values())
    missing = set(unkeyed) - {p.name for p in params}
    if missing:
        raise ValueError(f"unkeyed names {sorted(missing)}, which are not parameters of {entry.__qualname__}")
    params = [p for p in params if p.name not in unkeyed]
    local = [f"_a{i}" for i in range(len(params))]  # the arguments' names here, whatever the entry calls them
    tensors = [x for x, p in zip(local, params) if p.annotation in ("torch.Tensor", torch.Tensor)]
    items, cuda_items = [], []
    for x, param in zip(local, params):
        meta = [f"{x}.shape", f"{x}.dtype", f"{x}.device", f"{x}.stride()", f"{x}.requires_grad"]
        cuda_meta = [*meta, f"{x}.data_ptr() & {_ALIGN_BITS}"]
        if x in tensors:
            items += meta
            cuda_items += cuda_meta
        else:  # None, a number with its type, a value, a mask's signature, or what ``_item`` makes of it
            item = (f"(None if {x} is None else (type({x}), {x}) if type({x}) in _NUMBERS else {x} "
                    f"if type({x}) in _VALUES else {x}.signature() if isinstance({x}, _Bias) "
                    f"else (_INT_PAIR, {x}) if {_int_pair(x)} else _item({x}, {{cuda}}))")
            number = _ANNOTATED_NUMBERS.get(str(param.annotation))
            if number is not None:  # the declared number type keyed by its value alone: no (type, value) pair
                item = f"({x} if type({x}) is {number} else {item})"
            elif str(param.annotation) in _ANNOTATED_INT_PAIRS:  # the same item, its declared kind tested first
                item = f"((_INT_PAIR, {x}) if {_int_pair(x)} else {item})"
            if "Tensor" in str(param.annotation):  # an optional tensor: a plain one's item inline, as ``_item``'s
                item = (f"(None if {x} is None else ({{meta}}) if type({x}) is _Tensor else "
                        f"{item.replace('_item(', '_other(')})")
            items.append(item.format(cuda=False, meta=", ".join(meta)))
            cuda_items.append(item.format(cuda=True, meta=", ".join(cuda_meta)))
    plain = " and ".join(f"type({x}) is _Tensor" for x in tensors) or "True"
    first = tensors[0] if tensors else None
    state = "_grad_enabled(), _deterministic(), _scope(), _fp8_backward(), _checks_scoped(), _checks_env[0]"
    no_key = "None" if kind == "key" else "_MISS"
    source = (f"def {kind}({', '.join(local)}):\n"
              f"    if _is_compiling():\n"
              f"        return {no_key}\n"
              f"    try:\n"
              f"        if {plain}:\n"
              f"            if {first} is None or not {first or '_a0'}.is_cuda:\n"
              f"                key = (_entry, _FLAT, {state}, {_displays(items)})\n"
              f"            else:\n"
              f"                key = (_entry, _FLAT, {state}, {_displays(cuda_items)}, _capturing())\n"
              f"        else:\n"
              f"            key = call_key(_entry, ({', '.join(local)},))\n"
              f"    except _NoKey:\n"
              f"        return {no_key}\n")
    if kind == "key":
        source += "    return key\n"
    else:  # PlanCache.get inlined: one dict lookup, a hit marked used; an unhashable key finds nothing
        source += ("    try:\n"
                   "        plan = _lookup(key)\n"
                   "    except TypeError:\n"
                   "        return None, key\n"
                   "    if plan is None:\n"
                   "        return None, key\n"
                   "    plan.used = True\n"
                   "    return plan, key\n")
    scope = dict(_ENV, _entry=entry, _lookup=PLANS._plans.get)
    exec(compile(source, f"<{kind} of {entry.__qualname__}>", "exec"), scope)  # noqa: S102 - our own generated code
    fn = scope[kind]
    maker = "key_function" if kind == "key" else "plan_finder"
    fn.__doc__ = (f"The plan {'key' if kind == 'key' else '(plan, key)'} of a call of {entry.__qualname__}"
                  f"({', '.join(p.name for p in params)}) (``plans.{maker}``).")
    return fn


#: parameter annotations (as ``from __future__ import annotations`` leaves them) whose number type a generated key
#: holds as the bare value: the type is the parameter's own, so a value of another type (``1`` for a float, ``True``
#: for an int), keyed as (type, value), never equals it
_ANNOTATED_NUMBERS = {"float": "float", "float | None": "float", "bool": "bool", "int": "int", "int | None": "int"}
#: parameter annotations of a pair of ints (a window size): a generated key tests that kind first (the item is the
#: one the generic test order makes; the three tests it skips cost ~0.1 us per call on the CPU)
_ANNOTATED_INT_PAIRS = frozenset({"tuple[int, int]"})
#: the most items of one tuple display (or call) in generated code: CPython compiles a longer one as a list built
#: item by item and converted (on 3.11 ~190 ns more for a key of 51 items, ~300 ns more for a call of 31 arguments,
#: on the CPU), so a generated key holds its argument items in tuples of at most this many
_DISPLAY_ITEMS = 30
#: marks the keys ``key_function`` lays out flat (tensor metadata as items of its argument tuples), apart from
#: ``call_key``'s
_FLAT = object()
#: marks a tuple of two plain ints (a window size) kept as it is: without the per-item types ``_other`` adds
_INT_PAIR = object()


def _displays(items: list[str]) -> str:
    """Generated code: ``items`` as tuple displays of at most ``_DISPLAY_ITEMS`` items each, comma-separated."""
    return ", ".join(f"({', '.join(items[i:i + _DISPLAY_ITEMS])},)" for i in range(0, len(items), _DISPLAY_ITEMS))


def _int_pair(x: str) -> str:
    """Generated code: whether the argument named ``x`` is a tuple of two plain ints."""
    return f"type({x}) is tuple and len({x}) == 2 and type({x}[0]) is int and type({x}[1]) is int"


def _item(a, cuda: bool):
    """``key_function``'s item for an argument that is not None, a number or a value."""
    if type(a) is _Tensor:
        return _tensor(a, cuda)
    return _other(a, cuda)


class _NoKey(Exception):
    """An argument ``call_key`` cannot hold."""


def _other(a, cuda: bool):
    """``call_key``'s item for an argument that is not None, a number, a value or a plain tensor: a mask's signature,
    a list / tuple item by item, a tensor subclass with its type, a class; raises ``_NoKey`` for anything else."""
    kind = type(a)
    if isinstance(a, _Bias):
        try:
            return a.signature()
        except Exception:  # a mask whose state its own checks reject: the full path names it
            raise _NoKey from None
    if kind is list or kind is tuple:  # merge_attentions' parts: ``_tensor``'s items inline, no call per part (a
        # loop, not a comprehension: one frame less per list)
        items = [kind]
        item = items.append
        if cuda:
            for x in a:
                item((x.shape, x.dtype, x.device, x.stride(), x.requires_grad, x.data_ptr() & _ALIGN_BITS)
                     if type(x) is _Tensor else _listed(x, cuda))
        else:
            for x in a:
                item((x.shape, x.dtype, x.device, x.stride(), x.requires_grad) if type(x) is _Tensor
                     else _listed(x, cuda))
        return tuple(items)
    if isinstance(a, _Tensor):  # a subclass (nn.Parameter): its type is part of the key
        return (kind, *_tensor(a, cuda))
    if isinstance(a, type):
        return a
    raise _NoKey


def _listed(x, cuda: bool):
    """``call_key``'s item for an item of a list or tuple argument that is not a plain tensor."""
    return None if x is None else (type(x), x) if type(x) in _NUMBERS else x if type(x) in _VALUES else _other(x, cuda)


def _tensor(t, cuda: bool) -> tuple:
    if cuda:
        return t.shape, t.dtype, t.device, t.stride(), t.requires_grad, t.data_ptr() & _ALIGN_BITS
    return t.shape, t.dtype, t.device, t.stride(), t.requires_grad


#: the names ``key_function``'s generated code reads
_ENV = {"_is_compiling": _is_compiling, "_Tensor": _Tensor, "_Bias": _Bias, "_NUMBERS": _NUMBERS, "_VALUES": _VALUES,
        "_item": _item, "_other": _other, "_FLAT": _FLAT, "_INT_PAIR": _INT_PAIR, "_NoKey": _NoKey,
        "_MISS": (None, None), "_capturing": _capturing,
        "call_key": call_key, "_grad_enabled": _grad_enabled, "_deterministic": _deterministic, "_scope": _scope,
        "_fp8_backward": _fp8_backward, "_checks_scoped": _checks_scoped, "_checks_env": _checks_env}
