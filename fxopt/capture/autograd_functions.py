"""Custom autograd Functions in a Dynamo graph, kept as one op that runs the Function's own forward and backward.

TorchDynamo captures `Fn.apply(x)` as the higher-order op `autograd_function_apply(fwd_body, bwd_body, x, ...)`,
whose two bodies are the Function's forward and backward. Traced to ATen ops, that op would be flattened into
its forward alone, and autograd would differentiate the forward instead of running `Fn.backward` (a
straight-through estimator's gradient of `round` becomes 0; HF BLOOM's training GELU loses its formula).
While a Dynamo graph is traced (`fxopt._torch_private.aten_graph_of_dynamo_graph`), each such call becomes

    torch.ops.fxopt.autograd_function([x, ...], key)

whose kernel sits below autograd (CompositeImplicitAutograd) and runs the higher-order op itself on the
bodies `key` names: every call of the graph runs the Function's forward, and autograd records the
Function's own backward, as in eager. The bodies stay in a registry for the life of the process (a graph
holds only their number, so graphs copy and print like any other). To every analysis the op is opaque
(declared so, fxopt.graph_functions): never removed, moved, recomputed or put in a checkpoint region; what it
keeps for backward and allocates in it is measured (fxopt.analysis.opaque_memory).
"""
from __future__ import annotations

import threading

import torch

from ..graph_functions import graph_function

_LIBRARY = torch.library.Library("fxopt", "DEF")
_LIBRARY.define("autograd_function(Tensor[] tensors, int key) -> Tensor[]")
_BODIES: list[tuple] = []  # key -> (apply, fwd_body, bwd_body, where each tensor goes among the args, the other args, kwargs)
_LOCK = threading.Lock()


def _run(tensors: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """The op's kernel: the higher-order op on the bodies and arguments `key` names (module docstring)."""
    apply, fwd, bwd, places, args, kwargs = _BODIES[key]
    args = list(args)
    for place, tensor in zip(places, tensors, strict=True):
        args[place] = tensor
    out = apply(fwd, bwd, *args, **kwargs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


_LIBRARY.impl("autograd_function", _run, "CompositeImplicitAutograd")
OP = graph_function(opaque=True)(torch.ops.fxopt.autograd_function.default)


def is_autograd_function_call(target) -> bool:
    """Whether a Dynamo graph node's target is a custom autograd Function's call (`autograd_function_apply`)."""
    return getattr(target, "__name__", None) == "autograd_function_apply"


def as_one_op(apply, fwd, bwd, args: tuple, kwargs: dict):
    """The call `apply(fwd, bwd, *args, **kwargs)` as the op (module docstring), returned as the call returns."""
    places = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    others = tuple(None if i in places else a for i, a in enumerate(args))
    with _LOCK:
        _BODIES.append((apply, fwd, bwd, places, others, dict(kwargs)))
        key = len(_BODIES) - 1
    return tuple(OP([args[i] for i in places], key))
