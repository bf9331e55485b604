"""The op a graph node computes, by one name in every form a graph holds it in.

A call_function of ATen's `aten.relu.default` (the ATen graph fxopt's backend traces), of
`F.relu` or `torch.relu`, and a call_method `relu` (a torch.fx trace of Python code) are
all "relu"; in-place forms are "relu_". A `call_module` (an opaque module, a region fxopt made)
has no op name: its module could compute anything. Tables keyed by op name (saved-for-backward,
aliasing, the passes' patterns) read it from here.
"""
from __future__ import annotations

import builtins
import functools
import inspect
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from . import _torch_private
from .graph_functions import declared

_FUNCTION_NAMESPACES = (torch, F, operator, builtins, torch.Tensor)
# Python's augmented assignments on tensors (`x += y`): `operator.iadd`, or the method `__iadd__`.
_AUGMENTED = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                        "ilshift", "irshift", "imatmul"})


def is_inplace_op(name: str | None) -> bool:
    """`relu_`, `add_`, `iadd`, `__iadd__`: the op writes into its first input and returns it.

    This and `is_inplace_call` are fxopt's one in-place rule: `op_name` names a call that an
    argument or attribute makes in place (`F.relu(x, inplace=True)`) with a trailing underscore.
    """
    return name is not None and ((name.endswith("_") and not name.endswith("__"))
                                 or name.removeprefix("__").removesuffix("__") in _AUGMENTED)


@functools.lru_cache(maxsize=None)
def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a Python signature
        return None


def bound_argument(fn, args: tuple, kwargs: dict, name: str, default):
    """The value `fn(*args, **kwargs)` receives for parameter `name` (computed in the graph: None)."""
    try:
        signature = _signature(fn)
    except TypeError:  # an unhashable callable
        signature = None
    try:
        value = signature.bind(*args, **kwargs).arguments.get(name, default) if signature else kwargs.get(name, default)
    except TypeError:  # arguments the signature does not take: keywords only
        value = kwargs.get(name, default)
    return None if isinstance(value, fx.Node) else value


def call_arguments(node: fx.Node) -> dict | None:
    """Every argument of a call_function node by parameter name, in the order of its schema or signature
    (defaults filled in); None where the target has neither."""
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return None if normalized is None else normalized.kwargs


def is_inplace_call(target, args: tuple = (), kwargs: dict | None = None) -> bool:
    """A call that writes into its first input: its name says so (`is_inplace_op`), or its `inplace`
    argument is not False (computed in the graph counts as True).

    `target` is a function or a method name.
    """
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if is_inplace_op(name):
        return True
    return not isinstance(target, str) and bound_argument(target, args, kwargs or {}, "inplace", False) is not False


def op_name(node: fx.Node) -> str | None:
    """The op a node computes, the same name in every form ("relu", "conv2d", "relu_"), or None.

    In-place forms get a trailing underscore (`x.relu_()`, `F.relu(x, inplace=True)`:
    `is_inplace_call`). fxopt's own functions have the name they are declared with
    (`fxopt.graph_functions`).
    Calls of anything else outside torch / operator / builtins, and module calls, are None.
    """
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    helper = declared(node.target)
    own = helper.name if helper is not None else _torch_private.aten_op_name(node.target)
    if own is not None:
        return own
    name = getattr(node.target, "__name__", None)
    if name is None or not any(getattr(ns, name, None) is node.target for ns in _FUNCTION_NAMESPACES):
        return None
    return name + "_" if not is_inplace_op(name) and is_inplace_call(node.target, node.args, node.kwargs) else name
