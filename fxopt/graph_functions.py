"""Functions that fxopt passes emit into graphs, kept as one call each when a graph is traced again.

A GraphModule is traced again when `torch.load` rebuilds it from its generated code, and when
`fxopt.optimize` is given a model fxopt already optimized. Tracing must not step into fxopt's
own helpers (`folded_conv_bn_params`, `relu_mask`, the no-grad wrappers, ...): inside they do
Python work on shapes and call autograd Functions. Each such helper is declared with
`@graph_function`; `RetraceTracer` and fxopt's capture tracers keep them as leaf calls.
"""
from __future__ import annotations

import importlib

import torch.fx as fx

_GRAPH_FUNCTIONS: list = []


def graph_function(fn):
    """Declare `fn` as emitted into graphs by a pass (see module docstring)."""
    _GRAPH_FUNCTIONS.append(fn)
    return fn


def graph_functions() -> tuple:
    """Every declared helper; importing the passes first makes sure all of them are declared."""
    importlib.import_module("fxopt.passes")
    return tuple(_GRAPH_FUNCTIONS)


class RetraceTracer(fx.Tracer):
    """The tracer `torch.load` uses to rebuild an fxopt GraphModule (constructed without arguments)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("autowrap_functions", graph_functions())
        super().__init__(*args, **kwargs)
