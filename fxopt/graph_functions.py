"""Functions kept as one call each when fxopt traces: its own graph helpers, and user checkpointing.

A GraphModule is traced again when `torch.load` rebuilds it from its generated code, and when
`fxopt.optimize` is given a model fxopt already optimized. Tracing must not step into fxopt's
own helpers (`folded_conv_bn_params`, `relu_mask`, the no-grad wrappers, ...): inside they do
Python work on shapes and call autograd Functions. Each such helper is declared with
`@graph_function`; `RetraceTracer` and fxopt's capture tracers keep them as leaf calls. The
declaration also says what the helper does besides computing its result (`mutates`,
`updates_stats`), which is what `fxopt.analysis.side_effects` reports for its calls.

`torch.utils.checkpoint.checkpoint` is kept as a call too: tracing through it would inline the
block and silently drop the activation checkpointing the user asked for. (A checkpoint of a
lambda cannot be a graph call; the module calling it then stays opaque and runs as written.)
"""
from __future__ import annotations

import dataclasses
import importlib

import torch.fx as fx
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass(frozen=True)
class Declared:
    """What a graph helper does besides computing its result."""

    mutates: bool = False  # writes into a tensor it is given
    updates_stats: bool = False  # updates BatchNorm running statistics


_GRAPH_FUNCTIONS: dict = {}  # function -> Declared


def graph_function(fn=None, *, mutates: bool = False, updates_stats: bool = False):
    """Declare `fn` as emitted into graphs by a pass (see module docstring); bare, or with its effects."""
    def declare(f):
        _GRAPH_FUNCTIONS[f] = Declared(mutates, updates_stats)
        return f

    return declare(fn) if fn is not None else declare


def declared(fn) -> Declared | None:
    """What `fn` was declared to do, or None if it is not an fxopt graph helper."""
    try:
        return _GRAPH_FUNCTIONS.get(fn)
    except TypeError:  # an unhashable callable
        return None


def graph_functions() -> tuple:
    """Every declared helper, and `checkpoint`; importing the passes first declares all helpers."""
    importlib.import_module("fxopt.passes")
    return (*_GRAPH_FUNCTIONS, checkpoint)


def forget_wrapped_calls(graph: fx.Graph) -> fx.Graph:
    """Drop fx's marks on auto-wrapped calls before the graph is compiled.

    fx emits `torch.fx._symbolic_trace.wrap("<name>")` into the generated code of a marked call,
    which registers the name process-wide on first run; for a qualified name such as
    `torch.utils.checkpoint.checkpoint` that breaks every later trace in the process.
    """
    for node in graph.nodes:
        node.meta.pop("is_wrapped", None)
    return graph


class RetraceTracer(fx.Tracer):
    """The tracer `torch.load` uses to rebuild an fxopt GraphModule (constructed without arguments)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("autowrap_functions", graph_functions())
        super().__init__(*args, **kwargs)

    def trace(self, root, concrete_args=None):
        return forget_wrapped_calls(super().trace(root, concrete_args))
