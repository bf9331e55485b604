"""A captured module whose graph is valid only for calls like the one it was traced from.

Hugging Face blocks are called with flags (`output_hidden_states=False`, `return_dict=True`,
`attention_mask=None`), and shape-specialized tracing (see `tracer.py`) bakes the example's
shapes and dtypes into the graph. `SpecializedCall` runs the graph only when a call passes the
same flag values and tensors of the same shapes and dtypes — and, when tracing baked in a
`self.training` check, in the same train/eval mode — and otherwise runs the original module,
so a later call with other flags, shapes or mode is still correct (just not optimized) rather
than an assertion error or a wrong result.

It exposes the graph's parameters, buffers and submodules as its own (the same dicts), so
`state_dict()` keys and `.to()` behave exactly like the module it stands in for.
"""
from __future__ import annotations

import inspect
import dataclasses
from typing import Any

import torch
import torch.fx as fx


@dataclasses.dataclass
class Specialization:
    """A captured graph that runs only for calls like the example (the report lists these)."""

    path: str  # where the graph sits in the model ("" is the model itself)
    assumes: str  # SpecializedCall.describe()


def is_specializable(value: Any) -> bool:
    """A value we can fix at trace time and compare cheaply at call time."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (tuple, list)):
        return all(is_specializable(v) for v in value)
    return False


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def tensor_spec(value: torch.Tensor) -> tuple:
    """What a shape-specialized graph assumes about one tensor argument."""
    return tuple(value.shape), value.dtype


class SpecializedCall(torch.nn.Module):
    """Run `graph_module` if the call matches what it was traced for, else `original` (see module docstring)."""

    def __init__(self, graph_module: fx.GraphModule, original: torch.nn.Module, specialized: dict[str, Any],
                 tensor_specs: dict[str, tuple] | None = None, traced_training: bool | None = None):
        super().__init__()
        # Share (not copy) the graph's state so keys and devices stay those of the original module.
        self.__dict__.update(_parameters=graph_module._parameters, _buffers=graph_module._buffers,
                             _modules=graph_module._modules,
                             _non_persistent_buffers_set=graph_module._non_persistent_buffers_set)
        # Held outside the module tree so state_dict() does not list anything twice.
        self.__dict__["graph_module"] = graph_module
        self.__dict__["original"] = original
        self.__dict__["_signature"] = inspect.signature(original.forward)
        self.specialized = specialized
        self.tensor_specs = tensor_specs or {}
        self.traced_training = traced_training  # the mode baked into the graph, None if it has none
        self.training = original.training

    def matches(self, arguments: dict[str, Any]) -> bool:
        """Whether a call with these bound arguments, in the current mode, is one the graph was traced for."""
        if self.traced_training is not None and self.training != self.traced_training:
            return False
        if not all(_same(arguments[name], value) for name, value in self.specialized.items()):
            return False
        return all(isinstance(arguments[name], torch.Tensor) and tensor_spec(arguments[name]) == spec
                   for name, spec in self.tensor_specs.items())

    def describe(self) -> str:
        """What the graph assumes about a call, e.g. `x: (2, 3, 32, 32) float32; return_dict=None; eval mode`."""
        parts = [f"{name}: {shape} {str(dtype).removeprefix('torch.')}" for name, (shape, dtype) in self.tensor_specs.items()]
        parts += [f"{name}={value!r}" for name, value in self.specialized.items()]
        if self.traced_training is not None:
            parts.append("training mode" if self.traced_training else "eval mode")
        return "; ".join(parts)

    def graph_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
        """(args, kwargs) for the graph from a call of the original's signature, and whether the graph may take it."""
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.args, bound.kwargs, self.matches(bound.arguments)

    def with_graph(self, graph_module: torch.nn.Module) -> SpecializedCall:
        """The same guards around another graph (the same graph, optimized again)."""
        return SpecializedCall(graph_module, self.original, self.specialized, self.tensor_specs, self.traced_training)

    def forward(self, *args, **kwargs):
        graph_args, graph_kwargs, matches = self.graph_arguments(args, kwargs)
        if matches:
            return self.graph_module(*graph_args, **graph_kwargs)
        if self.original.training != self.training:  # the caller switched the result's mode: do what
            self.original.train(self.training)       # the same switch would have done to the original
        return self.original(*args, **kwargs)
