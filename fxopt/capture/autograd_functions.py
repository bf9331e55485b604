"""Custom autograd Functions in a Dynamo graph, kept as one op that runs the Function's own forward and backward.

TorchDynamo captures `Fn.apply(x)` as the higher-order op `autograd_function_apply(fwd_body, bwd_body, x, ...)`,
whose two bodies are the Function's forward and backward. Traced to ATen ops, that op would be flattened into
its forward alone, and autograd would differentiate the forward instead of running `Fn.backward` (a
straight-through estimator's gradient of `round` becomes 0; HF BLOOM's training GELU loses its formula).
While a Dynamo graph is traced (`fxopt._torch_private.aten_graph_of_dynamo_graph`), each such call becomes

    torch.ops.fxopt.autograd_function([x, ...], key)

whose kernel sits below autograd (CompositeImplicitAutograd) and runs the bodies `key` names as an autograd
Function (`_FromBodies`): every call of the graph runs the Function's forward, and autograd records the
Function's own backward, as in eager. What the forward saved with `ctx.save_for_backward` is saved the same
way, so saved-tensor hooks (offloading, fxopt's memory measurements) and autograd's version checks see it
(the higher-order op's own eager kernel keeps it in a closure, out of their sight). The bodies stay in a registry for the life of the process (a graph
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
_BODIES: list[tuple] = []  # key -> (fwd_body, bwd_body, where each tensor goes among the args, the other args, options)
_LOCK = threading.Lock()


class _FromBodies(torch.autograd.Function):
    """A custom autograd Function rebuilt from the forward and backward bodies Dynamo captured of it."""

    @staticmethod
    def forward(ctx, fwd, bwd, options: dict, *args):
        output, saved = torch.fx.Interpreter(fwd).run(*args)
        outputs = list(output) if isinstance(output, (tuple, list)) else [output]
        by_save = set(options.get("saved_for_backward_idx", ()))
        kept = [i for i, v in enumerate(saved) if i in by_save and isinstance(v, torch.Tensor)]
        ctx.save_for_backward(*(saved[i] for i in kept))
        ctx.kept, ctx.others, ctx.bwd = kept, [None if i in kept else v for i, v in enumerate(saved)], bwd
        if options.get("dirty_idx"):
            ctx.mark_dirty(*(outputs[i] for i in options["dirty_idx"]))
        if options.get("non_differentiable_idx"):
            ctx.mark_non_differentiable(*(outputs[i] for i in options["non_differentiable_idx"]))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        saved = list(ctx.others)
        for i, tensor in zip(ctx.kept, ctx.saved_tensors):
            saved[i] = tensor
        out = torch.fx.Interpreter(ctx.bwd).run(*grads, *saved)
        return (None, None, None, *(out if isinstance(out, (tuple, list)) else (out,)))


def _run(tensors: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """The op's kernel: the Function rebuilt from the bodies `key` names, on its arguments (module docstring)."""
    fwd, bwd, places, args, options = _BODIES[key]
    args = list(args)
    for place, tensor in zip(places, tensors, strict=True):
        args[place] = tensor
    return list(_FromBodies.apply(fwd, bwd, options, *args))


_LIBRARY.impl("autograd_function", _run, "CompositeImplicitAutograd")
OP = graph_function(opaque=True)(torch.ops.fxopt.autograd_function.default)


def is_autograd_function_call(target) -> bool:
    """Whether a Dynamo graph node's target is a custom autograd Function's call (`autograd_function_apply`)."""
    return getattr(target, "__name__", None) == "autograd_function_apply"


def as_one_op(fwd, bwd, args: tuple, options: dict):
    """The call `autograd_function_apply(fwd, bwd, *args, **options)` as the op (module docstring), returned as the
    call returns."""
    places = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    others = tuple(None if i in places else a for i, a in enumerate(args))
    with _LOCK:
        _BODIES.append((fwd, bwd, places, others, dict(options)))
        key = len(_BODIES) - 1
    return tuple(OP([args[i] for i in places], key))
