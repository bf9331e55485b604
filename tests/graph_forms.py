"""The two graph forms fxopt's passes see, built for tests that run an analysis or a pass alone.

`exported_graph`: the ATen graph `fxopt.optimize` captures (TorchDynamo's graph traced to ATen ops,
fxopt.capture), with the caller's parameters and buffers read as attributes (`get_attr`) rather than
passed in, so that a test calls it as `gm(x)`. `function_form`: torch
functions and methods (`F.conv2d`, `x.relu()`), the form TorchDynamo hands the torch.compile
backend, traced with torch.fx through every module so that no `call_module` remains.
Both come with `node.meta["val"]` for the example inputs.
"""
from __future__ import annotations

import warnings

import torch.fx as fx
import torch.nn as nn

from fxopt.analysis.shapes import propagate_shapes
from fxopt.pipeline.run import from_model


def exported_graph(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    """`model`'s whole-model graph as fxopt.optimize captures it, with shapes of `inputs` (not symbolic),
    its parameter and buffer inputs turned into reads of `model`'s own tensors."""
    (captured,) = from_model(model, inputs).graphs
    graph = captured.gm.graph
    for node in list(graph.find_nodes(op="placeholder")):
        if node.name in captured.constant_inputs:
            with graph.inserting_before(node), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its owner lacks `model`'s tensors: the module made below holds them
                read = graph.get_attr(node.meta["state_name"])
            read.meta = dict(node.meta)
            node.replace_all_uses_with(read)
            graph.erase_node(node)
    # the model's tensors, and the constants capture made (a key/value cache's empty tensor: `_tensor_constant0`)
    return fx.GraphModule({n.target: _attribute(model, n.target) if _has(model, n.target) else
                           _attribute(captured.gm, n.target) for n in graph.find_nodes(op="get_attr")}, graph)


def _has(root, target: str) -> bool:
    try:
        _attribute(root, target)
    except AttributeError:
        return False
    return True


def _attribute(root, target: str):
    for part in target.split("."):
        root = getattr(root, part)
    return root


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
