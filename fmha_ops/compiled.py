"""``torch.compile`` support: the selector runs at trace time and the graph calls the chosen op.

Under ``torch.compile`` (``torch.compiler.is_compiling()``) the call path of the public functions comes
here instead of the eager memo: ``call.forward_plan`` returns the traced plan (``traced_plan``), which does its
work where the trace runs (or checks) it. The call is validated and its ``Problem`` fields computed in traced code
(shapes, dtypes, strides and the mask's host values are constants of the trace); ``_plan``, which Dynamo
runs once at trace time on those constants (``torch.compiler.assume_constant_result``), selects the forward
op, and the backward op when gradients are needed, and returns them as a ``CallSpec`` string. Ops whose
``apply`` is plain torch (``AttentionOp.TRACEABLE``: the SDPA ops) are traced into the graph; every other op
runs behind the custom op ``fmha_ops::attention_forward`` (a fake implementation gives the output shapes;
autograd goes through ``fmha_ops::attention_backward``, the sinks' gradient included). ``fp8_attention`` /
``i8fp8_attention`` and ``flash_attn_varlen_func`` have custom ops of their own next to them
(``fmha_ops.quantized``, ``fmha_ops.flash_attn_interface``), built from this module's helpers.

What a trace fixes: the selected ops, and with them ``use_ops``, ``set_fp8_dequantized_backward``, the
``FMHA_OPS_*`` environment and ``torch.use_deterministic_algorithms`` as they were when the function was
compiled. A custom-op call costs host time, so eager calls never come here.

Example
-------
>>> block = torch.compile(lambda q, k, v: fmha_ops.memory_efficient_attention(q, k, v, LowerTriangularMask()),
...                       fullgraph=True)
"""
from __future__ import annotations

import ast
import dataclasses
import operator
from typing import Any, NamedTuple, Optional

import torch

from registry import current_arch

from . import attn_bias as ab
from .dispatch import REGISTRY, SELECTOR
from .dtypes import FLOAT_DTYPES
from .fp8_backward import fp8_dequantized_backward_enabled
from .inputs import Inputs
from .plan import Plan
from .plans import PLANS, plan_finder
from .problem import Problem
from .validation import problem_fields, tma_misaligned, validate

_F32 = torch.float32


class CallSpec(NamedTuple):
    """Everything but the tensors that an op needs to run a call, chosen at trace time.

    ``fields`` holds every ``Inputs`` field but query / key / value / layout as ``(name, flatten(value))``; the
    tensors it references by index (descales, the mask's tensors) are items of the custom op's ``tensors``."""

    fw: str  # forward op NAME
    bw: str  # backward op NAME ("" when no gradient is needed or the forward differentiates itself)
    fields: tuple
    needs_lse: bool

    def encode(self) -> str:
        return repr(tuple(self))

    def inputs(self, query, key, value, tensors) -> Inputs:
        """The eager ``Inputs`` of the call, rebuilt around the real tensors."""
        return Inputs(query, key, value, **{name: unflatten(x, tensors) for name, x in self.fields})


def decode_spec(text: str) -> CallSpec:
    """The ``CallSpec`` a spec string encodes: parsed on the custom op's first call with it, then kept in the plan
    cache (``fmha_ops.plans``, under the key its one key builder makes of ``text``) as the plan of that custom op
    call (``Plan.run`` rebuilds the ``Inputs``; its ``ops`` are the forward and backward ops the spec names). The
    kept spec holds its host seqinfos built (``_host_parts_built``): every call of it shares them."""
    plan, key = _FIND_SPEC(text)
    if plan is None:
        spec = CallSpec(*ast.literal_eval(text))
        spec = spec._replace(fields=tuple((name, _host_parts_built(x)) for name, x in spec.fields))
        ops = tuple(REGISTRY.get(name) for name in (spec.fw, spec.bw) if name)
        plan = PLANS.put(key, Plan(spec.inputs, ops, ("parsing", "host seqinfo"), spec))
    return plan.bound


_FIND_SPEC = plan_finder(decode_spec)


# ---- call fields as constants + tensors ----------------------------------------------------------

def flatten(obj: Any, tensors: list) -> Any:
    """A value as nested tuples of constants, its tensors appended to ``tensors`` and named by index.

    Values are what ``Inputs`` holds: tensors, dtypes, numbers, strings, None and the ``attn_bias`` masks
    (dataclasses of those and of the seqinfo dataclasses; ``LowerTriangularMask`` and the like have no fields)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("tensor", len(tensors) - 1)
    if isinstance(obj, torch.dtype):
        return ("dtype", str(obj).replace("torch.", ""))
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return ("value", obj)
    if type(obj) is ab._SeqLenInfo and obj.seqstart.device.type == "cpu":
        # host starts (a decode call's packed queries): rebuilt from seqstart_py inside the op, so no CPU tensor
        # made in the trace becomes a custom-op input (a CUDA graph partition cannot take host storage)
        return ("host_seqinfo", tuple(obj.seqstart_py))
    if isinstance(obj, (list, tuple)):
        return ("list" if isinstance(obj, list) else "tuple", tuple(flatten(x, tensors) for x in obj))
    if dataclasses.is_dataclass(obj):
        return ("object", type(obj).__name__,
                tuple(flatten(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj) if f.init))
    if isinstance(obj, ab.AttentionBias):  # no fields, or only a tensor bias (TensorBias and the like)
        bias = obj.tensor_bias
        return ("object", type(obj).__name__, () if bias is None else (flatten(bias, tensors),))
    raise TypeError(f"cannot pass a {type(obj).__name__} through the compiled call: {obj!r}")


def unflatten(structure: Any, tensors: list) -> Any:
    """The inverse of ``flatten`` (an item ``decode_spec`` built, tagged "built": that object)."""
    tag = structure[0]
    if tag == "tensor":
        return tensors[structure[1]]
    if tag == "dtype":
        return getattr(torch, structure[1])
    if tag == "object":
        return getattr(ab, structure[1])(*(unflatten(s, tensors) for s in structure[2]))
    if tag == "host_seqinfo":
        return _host_seqinfo(structure[1])
    if tag == "list":
        return [unflatten(s, tensors) for s in structure[1]]
    if tag == "tuple":
        return tuple(unflatten(s, tensors) for s in structure[1])
    return structure[1]


def _host_seqinfo(starts: tuple[int, ...]) -> ab._SeqLenInfo:
    """The host ``_SeqLenInfo`` with these starts (``decode_spec`` builds it once per spec: every decode step's
    plan holds it)."""
    return ab._SeqLenInfo.from_seqlens([b - a for a, b in zip(starts, starts[1:])])


def _host_parts_built(structure: Any) -> Any:
    """``structure`` (``flatten``'s) with each host seqinfo built (tag "built": ``unflatten`` returns it as it is),
    so that a spec's plan holds them instead of rebuilding them per call (~23 us each on the CPU at batch 8)."""
    tag = structure[0]
    if tag == "host_seqinfo":
        return ("built", _host_seqinfo(structure[1]))
    if tag == "object":
        return (tag, structure[1], tuple(_host_parts_built(s) for s in structure[2]))
    if tag in ("list", "tuple"):
        return (tag, tuple(_host_parts_built(s) for s in structure[1]))
    return structure


_TENSOR_FIELDS = ("query", "key", "value", "layout")  # passed to the custom op as tensors / not needed by ops


def flatten_inputs(inp: Inputs) -> tuple[tuple, list]:
    """(the ``CallSpec.fields`` of ``inp``, the tensors they reference)."""
    tensors: list = []
    fields = tuple((f.name, flatten(getattr(inp, f.name), tensors)) for f in dataclasses.fields(inp)
                   if f.name not in _TENSOR_FIELDS)
    return fields, tensors


# ---- trace time ----------------------------------------------------------------------------------

@torch.compiler.assume_constant_result
def _plan(device: str, fields: tuple, op: Any, spec: tuple) -> tuple[str, str, bool]:
    """Select the ops for a traced call (real Python, at trace time): the ``CallSpec`` string, the forward op's NAME
    and whether it is traced into the graph."""
    problem = Problem(arch=current_arch(device), deterministic=torch.are_deterministic_algorithms_enabled(),
                      graph_capture=False, fp8_backward=fp8_dequantized_backward_enabled(), **dict(fields))
    key = ("compiled", device, fields, spec)
    fw = SELECTOR.select(key, lambda: problem, "fw", op)
    bw = ""
    if problem.needs_grad and not fw.TRACEABLE:  # autograd of a traced op is torch's own
        # as eager: a forced fw op alone raises unless it carries its own autograd (then any bw op serves)
        own_autograd = fw.AUTOGRAD and problem.q_dtype in FLOAT_DTYPES and not isinstance(op, tuple)
        bw = SELECTOR.select(key, lambda: problem, "bw", None if own_autograd else op).NAME
    return CallSpec(fw.NAME, bw, *spec).encode(), fw.NAME, fw.TRACEABLE


def traced_plan(op: Any, needs_lse: bool) -> Plan:
    """The traced twin of ``call.forward_plan`` (same ``op`` and ``needs_lse``), made before it has seen a call:
    ``check(call)`` validates the call and selects its op(s) at trace time (``_traced_choice``); ``run(call) -> (out,
    lse)`` does so and runs them, the forward op traced into the graph or the custom op ``fmha_ops::attention_forward``
    with the plan's spec (lse None unless ``needs_lse``). The checks and the choice are made where the trace runs
    them, as often as it does (they add nothing to the graph); ``ops`` is empty (the trace holds the op it calls).

    Example
    -------
    >>> plan = traced_plan(None, False)  # doctest: +SKIP
    >>> out, _ = plan.run(make_inputs(q, k, v))  # inside a torch.compile trace  # doctest: +SKIP
    """
    def check(call: Inputs) -> None:
        _traced_choice(call, op, needs_lse)

    def run(call: Inputs):
        text, fw_name, traceable, tensors = _traced_choice(call, op, needs_lse)
        if traceable:
            return REGISTRY.get(fw_name).apply(call, needs_lse)
        out, lse = torch.ops.fmha_ops.attention_forward(call.query, call.key, call.value, tensors, text)
        return out, (lse if needs_lse else None)
    return Plan(run, (), check=check)


def _traced_choice(inp: Inputs, op: Any, needs_lse: bool) -> tuple[str, str, bool, list]:
    """A traced call validated and its ``Problem`` fields computed in traced code, then its ops selected at trace time
    (``_plan``): (the ``CallSpec`` string, the forward op's NAME, whether it is traced into the graph, the tensors
    the spec references by index)."""
    validate(inp)
    problem = problem_fields(inp, needs_lse)
    # sizes become constants: a dynamic-shape trace specializes (guards on) the sizes the selection reads
    problem = {name: operator.index(x) if isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool) else x
               for name, x in problem.items()}
    fields, tensors = flatten_inputs(inp)
    text, fw_name, traceable = _plan(str(inp.query.device), tuple(problem.items()), op,
                                     (fields, needs_lse or inp.is_partial))
    return text, fw_name, traceable, tensors


# ---- the custom ops ------------------------------------------------------------------------------

@torch.library.custom_op("fmha_ops::attention_forward", mutates_args=())
def attention_forward_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         tensors: list[Optional[torch.Tensor]], spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward op ``spec`` names on BMHK query / key / value; returns out (B, Mq, Hq, Kv) contiguous and
    lse float32 (B, Hq, Mq) (empty when neither the LSE nor a gradient is needed)."""
    call = decode_spec(spec)
    fw = REGISTRY.get(call.fw)
    misaligned = tma_misaligned(query, key, value) if fw.ALIGNMENT else ()  # the trace could not see the data pointers
    if misaligned:
        query, key, value = (t.clone(memory_format=torch.contiguous_format) if name in misaligned else t
                             for name, t in zip(("query", "key", "value"), (query, key, value)))
    needs_lse = call.needs_lse or bool(call.bw)
    out, lse = fw.apply(call.inputs(query, key, value, tensors), needs_lse)
    lse = lse.contiguous() if needs_lse else query.new_empty((0,), dtype=_F32)
    return out.contiguous(), lse


@attention_forward_op.register_fake
def _attention_forward_fake(query, key, value, tensors, spec):
    call = decode_spec(spec)
    b, mq, hq, _ = query.shape
    out_dtype = call.inputs(query, key, value, tensors).out_dtype
    out = query.new_empty((b, mq, hq, value.shape[-1]), dtype=out_dtype)
    lse = query.new_empty((b, hq, mq) if call.needs_lse or call.bw else (0,), dtype=_F32)
    return out, lse


@torch.library.custom_op("fmha_ops::attention_backward", mutates_args=())
def attention_backward_op(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, tensors: list[Optional[torch.Tensor]],
                          spec: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv), contiguous, in query / key / value's dtypes, and dsinks, from the backward op ``spec``
    names: float32 (Hq,) when the call has sinks (``AttentionBwOp.apply_bw_sinks``), else empty."""
    call = decode_spec(spec)
    inp = call.inputs(query, key, value, tensors)
    bw = REGISTRY.get(call.bw)
    with autograd_dispatch():  # the reference backward differentiates with torch.autograd
        if inp.sinks is None:
            grads, dsinks = bw.apply_bw(inp, out, lse, grad_out.contiguous()), lse.new_empty((0,))
        else:
            *grads, dsinks = bw.apply_bw_sinks(inp, out, lse, grad_out.contiguous())
    return (*(g.to(t.dtype).contiguous() for g, t in zip(grads, (query, key, value))), dsinks)


def autograd_dispatch():
    """Autograd dispatch back on: a custom op's implementation runs below torch's autograd keys."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
        excluded = excluded.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, query, key, value, out, lse, tensors, spec):
    dsinks = lse.new_empty((0,) if _sinks_index(spec) is None else (query.shape[2],))
    return (*(t.new_empty(t.shape) for t in (query, key, value)), dsinks)


def _sinks_index(spec: str) -> int | None:
    """The index in the custom op's ``tensors`` of the call's sinks, or None."""
    sinks = dict(decode_spec(spec).fields).get("sinks")
    return sinks[1] if sinks is not None and sinks[0] == "tensor" else None


def _forward_setup(ctx, inputs, output):
    query, key, value, tensors, spec = inputs
    ctx.spec, ctx.n_tensors, ctx.sinks_index = spec, len(tensors), _sinks_index(spec)
    ctx.save_for_backward(query, key, value, *output, *tensors)


def _forward_backward(ctx, grad_out, _grad_lse):
    query, key, value, out, lse, *tensors = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.fmha_ops.attention_backward(grad_out, query, key, value, out, lse, tensors,
                                                               ctx.spec)
    grads = [None] * ctx.n_tensors
    if ctx.sinks_index is not None:
        grads[ctx.sinks_index] = dsinks
    return dq, dk, dv, grads, None


attention_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup)
