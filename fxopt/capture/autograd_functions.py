"""Custom autograd Functions in a captured graph, as one op that runs the Function itself.

Non-strict torch.export traces `Fn.apply(x)` into the ATen ops of `Fn.forward` and drops `Fn.backward`:
autograd would differentiate the forward instead (a straight-through estimator's gradient of `round` becomes
0, BLOOM's training GELU loses its own formula). While a module is exported (fxopt.capture.autograd_extensions),
such a call is recorded instead as one node,

    torch.ops.fxopt.autograd_function([x, ...], spec)

whose kernel is registered below autograd (CompositeImplicitAutograd) and is `Fn.apply` itself: each call of
the graph runs the Function's forward, and autograd records the Function's own node, whose backward is
`Fn.backward`, as in eager. `spec` names the Function, where its tensors go and its other arguments as
text (`repr`), so graphs copy and pickle like any other.

Recorded only when that is exact (`why_not_recorded` before the call, `recorded_apply` after it), else the
module calling it is refused as before and runs as written:
  the Function is importable by its name (not defined inside a function) and not torch's own (a collective);
  it takes no keyword arguments, at least one tensor, and otherwise only constants `repr` writes back exactly
  (None, bool, int, float, str, and tuples, lists and dicts of them);
  it returns a tensor or a tuple of tensors, none sharing memory with an argument (a view such as a gradient
  reversal's `x.view_as(x)`: analyses take an op's outputs to be new tensors);
  it writes into no argument (`ctx.mark_dirty`);
  and the exported graph holds the op once per recorded call (`recorded_calls`, checked by
  fxopt.capture.exporting): an export that traced into the op would have dropped the Function's backward.
To every analysis the op is opaque (declared so, fxopt.graph_functions): never removed, moved, recomputed or
put in a checkpoint region; what it keeps for backward and allocates in it is measured
(fxopt.analysis.opaque_memory).
"""
from __future__ import annotations

import ast
import contextlib
import threading

import torch

from .. import _torch_private
from ..graph_functions import graph_function, import_by_name, importable_name

_LIBRARY = torch.library.Library("fxopt", "DEF")
_LIBRARY.define("autograd_function(Tensor[] tensors, str spec) -> Tensor[]")
_PLAIN_APPLY = torch.autograd.Function.__dict__["apply"].__func__  # before fxopt.capture patches it while exporting
_state = threading.local()  # depth: recorded Functions running now; single: whether the last returned one tensor;
# calls: the Functions the op ran for within `recorded_calls()`


class NotRecordable(Exception):
    """A Function call the op cannot stand for exactly (module docstring); the message says why."""


def _run(tensors: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """The op's kernel: `Fn.apply` on the arguments `spec` and `tensors` make (module docstring)."""
    name, places, args = ast.literal_eval(spec)
    args = list(args)
    for place, tensor in zip(places, tensors, strict=True):
        args[place] = tensor
    if not inside_recorded_function() and hasattr(_state, "calls"):
        _state.calls.append(name.rsplit(".", 1)[-1])
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        out = _PLAIN_APPLY(import_by_name(name), *args)
    finally:
        _state.depth -= 1
    _state.single = isinstance(out, torch.Tensor)
    outputs = [out] if _state.single else list(out) if isinstance(out, tuple) else None
    if outputs is None or not all(isinstance(o, torch.Tensor) for o in outputs):
        raise NotRecordable(f"it returns {type(out).__name__}{'' if outputs is None else ' holding non-tensors'}, "
                            f"not a tensor or a tuple of tensors")
    return outputs


_LIBRARY.impl("autograd_function", _run, "CompositeImplicitAutograd")
OP = graph_function(opaque=True)(torch.ops.fxopt.autograd_function.default)


def inside_recorded_function() -> bool:
    """Whether a recorded Function's forward is running now (a Function it calls is part of it, not recorded)."""
    return getattr(_state, "depth", 0) > 0


def _is_constant(value) -> bool:
    """A value `repr` writes and `ast.literal_eval` reads back as the same (module docstring)."""
    try:
        back = ast.literal_eval(repr(value))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return type(back) is type(value) and back == value


def why_not_recorded(function: type, args: tuple, kwargs: dict) -> str:
    """Why `function.apply(*args, **kwargs)` cannot be recorded as the op before it runs, or ""."""
    if function.__module__.startswith("torch."):
        return "it is torch's own"
    if importable_name(function) is None:
        return "it cannot be imported by its name (defined inside a function?)"
    if kwargs:
        return "it is given keyword arguments"
    if not any(isinstance(a, torch.Tensor) for a in args):
        return "it is given no tensor"
    odd = [i for i, a in enumerate(args) if not isinstance(a, torch.Tensor) and not _is_constant(a)]
    if odd:
        return f"its argument {odd[0]} ({type(args[odd[0]]).__name__}) is neither a tensor nor a plain constant"
    return ""


def recorded_apply(function: type, args: tuple):
    """`function.apply(*args)` as the op (checked by why_not_recorded first), returned as the Function returned
    it; NotRecordable if its outputs rule the op out (module docstring)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    places = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    spec = repr((importable_name(function), places, tuple(None if i in places else a for i, a in enumerate(args))))
    versions = [t._version for t in tensors]
    outputs = OP(tensors, spec)
    if [t._version for t in tensors] != versions:
        raise NotRecordable("it writes into an argument")
    storages = {_torch_private.untyped_storage_key(t) for t in tensors}
    if any(_torch_private.untyped_storage_key(o) in storages for o in outputs):
        raise NotRecordable("it returns a view of an argument")
    return outputs[0] if _state.single else tuple(outputs)


@contextlib.contextmanager
def recorded_calls():
    """Within: the names of the Functions the op runs for (recorded calls, and the op called as it is by a graph
    being exported again), in a list this yields. An exporter checks that its graph holds the op that many times (a
    torch whose export traced into the op would have dropped the Function's backward: fxopt.capture.exporting)."""
    _state.calls = calls = []
    try:
        yield calls
    finally:
        del _state.calls


def function_of(node) -> str:
    """The import path of the Function a node of the op runs."""
    return ast.literal_eval(node.args[1])[0]


def ops_in(gm) -> int:
    """How many calls of the op `gm`'s graph holds."""
    return len(gm.graph.find_nodes(op="call_function", target=OP))
