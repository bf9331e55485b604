"""The two graph forms fxopt's passes see, built for tests that run an analysis or a pass alone.

`exported_graph`: the ATen graph `fxopt.optimize` captures (fxopt's own capture: torch.export,
non-strict), holding the caller's parameters and buffers as `get_attr`. `function_form`: torch
functions and methods (`F.conv2d`, `x.relu()`), the form TorchDynamo hands the torch.compile
backend, traced with torch.fx through every module so that no `call_module` remains.
Both come with `node.meta["val"]` for the example inputs.
"""
from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from fxopt.analysis.shapes import propagate_shapes
from fxopt.capture import capture


def exported_graph(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    """`model`'s whole-model graph as fxopt.optimize captures it, with shapes of `inputs` (not symbolic)."""
    (graph,) = capture(model, inputs).graphs
    propagate_shapes(graph.gm, inputs)
    return graph.gm


class _ThroughModules(fx.Tracer):
    """torch.fx's tracer recording what each module's forward calls, never the module itself."""

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return False


def function_form(model: nn.Module, inputs: tuple | None = None, autowrap_functions: tuple = ()) -> fx.GraphModule:
    """`model` as a graph of torch functions and methods (shapes filled when `inputs` are given),
    each of `autowrap_functions` (e.g. torch.utils.checkpoint.checkpoint) kept as one call."""
    graph = _ThroughModules(autowrap_functions=autowrap_functions).trace(model)
    for node in graph.nodes:  # else the code re-registers those functions as wrapped for every later trace
        node.meta.pop("is_wrapped", None)
    gm = fx.GraphModule(model, graph)
    if inputs is not None:
        propagate_shapes(gm, inputs)
    return gm
