"""A captured child module that was traced with some non-tensor arguments fixed.

Hugging Face blocks are called with flags (`output_hidden_states=False`, `return_dict=True`,
`attention_mask=None`). Tracing fixes those values; `SpecializedCall` runs the graph only when a
call passes the same values and otherwise falls back to the original module, so a later call
with other flags is still correct rather than an assertion error or a wrong result.

It exposes the graph's parameters, buffers and submodules as its own (the same dicts), so
`state_dict()` keys and `.to()` behave exactly like the module it stands in for.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx


def is_specializable(value: Any) -> bool:
    """A value we can fix at trace time and compare cheaply at call time."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (tuple, list)):
        return all(is_specializable(v) for v in value)
    return False


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


class SpecializedCall(torch.nn.Module):
    """Run `graph_module` if the fixed arguments match, else `original` (see module docstring)."""

    def __init__(self, graph_module: fx.GraphModule, original: torch.nn.Module, specialized: dict[str, Any]):
        super().__init__()
        # Share (not copy) the graph's state so keys and devices stay those of the original module.
        self.__dict__.update(_parameters=graph_module._parameters, _buffers=graph_module._buffers,
                             _modules=graph_module._modules)
        # Held outside the module tree so state_dict() does not list anything twice.
        self.__dict__["graph_module"] = graph_module
        self.__dict__["original"] = original
        self.__dict__["_signature"] = inspect.signature(original.forward)
        self.specialized = specialized

    def forward(self, *args, **kwargs):
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if all(_same(bound.arguments[name], value) for name, value in self.specialized.items()):
            return self.graph_module(*bound.args, **bound.kwargs)
        return self.original(*args, **kwargs)
