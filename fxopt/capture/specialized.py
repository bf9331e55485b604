"""A captured module whose graph is valid only for calls like the one it was exported from.

`torch.export` specializes a graph to its example call (see `call_spec.py`) and bakes in the
train/eval flag of every module (`batch_norm(training=...)`, `dropout(train=...)`).
`SpecializedCall` stands where the module was: it runs the graph when a call matches and the
module's flags are those of the export, and otherwise runs the original module — warning once
per reason, never an export guard's `AssertionError`, never a stale graph.

It exposes the graph's parameters, buffers and submodules as its own (the same dicts), so
`state_dict()` keys behave exactly like the module it stands in for; `.to()`, `.half()`,
`.double()` reach the original too, since a call may run it. Attributes it does not have
(`code`, `graph`) are read from the graph module.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.fx as fx

from .call_spec import CallSpec


@dataclasses.dataclass
class Specialization:
    """A captured graph that runs only for calls like the example (the report lists these)."""

    path: str  # where the graph sits in the model ("" is the model itself)
    assumes: str  # SpecializedCall.describe()


def describe_assumptions(call: CallSpec, training_flags: dict[str, bool]) -> str:
    """What a graph assumes, e.g. `x: (s0, 3, 32, 32) float32; s0 >= 2; eval mode`."""
    return f"{call.describe()}; {'training' if training_flags.get('') else 'eval'} mode"


class SpecializedCall(torch.nn.Module):
    """Run `graph_module` if the call and flags match its export, else `original` (see module docstring)."""

    def __init__(self, graph_module: fx.GraphModule, original: torch.nn.Module, call: CallSpec,
                 training_flags: dict[str, bool]):
        super().__init__()
        # Share (not copy) the graph's state so keys and devices stay those of the original module.
        self.__dict__.update(_parameters=graph_module._parameters, _buffers=graph_module._buffers,
                             _modules=graph_module._modules,
                             _non_persistent_buffers_set=graph_module._non_persistent_buffers_set)
        # Held outside the module tree so state_dict() does not list anything twice.
        self.__dict__["graph_module"] = graph_module
        self.__dict__["original"] = original
        self.call = call
        self.training_flags = training_flags  # module path -> flag the graph computes with
        self.warned: set[str] = set()
        self.training = training_flags.get("", original.training)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or "graph_module" not in self.__dict__:  # copy/pickle protocols; unpickling
                raise
            return getattr(self.__dict__["graph_module"], name)

    def mismatch(self, args: tuple, kwargs: dict) -> str | None:
        """None if the graph may answer this call now, else which assumption fails."""
        for path, flag in self.training_flags.items():
            module = _submodule_or_none(self, path)
            if module is not None and module.training != flag:  # a pass may have removed the module (folded BN)
                return f"{path or 'the model'} is in {'training' if module.training else 'eval'} mode, " \
                       f"the graph was exported in {'training' if flag else 'eval'} mode"
        return self.call.mismatch(args, kwargs)

    def describe(self) -> str:
        return describe_assumptions(self.call, self.training_flags)

    def with_graph(self, graph_module: torch.nn.Module) -> SpecializedCall:
        """The same assumptions around another graph (the same graph, optimized again)."""
        return SpecializedCall(graph_module, self.original, self.call, self.training_flags)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.original._apply(fn, recurse)  # parameters are shared: converting twice is a no-op
        return self

    def forward(self, *args, **kwargs):
        reason = self.mismatch(args, kwargs)
        if reason is None:
            return self.graph_module(*args, **kwargs)
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(f"fxopt: running the original {type(self.original).__name__} (not optimized): {reason}",
                          stacklevel=2)
        _copy_flags(self, self.original)
        return self.original(*args, **kwargs)


def _submodule_or_none(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _copy_flags(stand_in: torch.nn.Module, original: torch.nn.Module) -> None:
    """Give `original` the train/eval flags the caller set on the stand-in (where the stand-in has the module)."""
    for path, module in original.named_modules():
        counterpart = _submodule_or_none(stand_in, path)  # a module without state has none in the graph
        module.training = (counterpart or stand_in).training
