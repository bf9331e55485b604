"""From a model, or a graph Dynamo hands over, to optimized graphs and their report: the one way through.

    captured = from_model(model, args, kwargs)                          # a model's graphs, as Dynamo captures them
    captured = from_dynamo_graph(aten, example_inputs, name, constants)  # one graph inside the backend
    report = run_pipeline(captured, pipeline, ctx, instruments=..., verifier=...)

Either way each graph is an ATen trace of a Dynamo graph (fxopt.capture) and gets its shapes
(`node.meta["val"]`) once, here, by one fake-tensor propagation from the example inputs: the sizes of
the call being compiled, also where the graph's sizes are symbolic. `run_pipeline` then checks capture
alone (with a verifier) and runs the passes with the `PassManager`, which keeps the shapes up to date as
passes change the graphs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from ..analysis.shapes import propagate_shapes
from ..capture import Capture, CapturedGraph, capture
from ..passes.base import Pass, PassContext
from .instruments import Instrument
from .manager import PassManager
from .report import Report
from .verify import Verifier


def from_model(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> Capture:
    """`model`'s graphs as Dynamo captures them called with (args, kwargs), each with its shapes."""
    captured = capture(model, args, kwargs)
    for graph in captured.graphs:
        _give_shapes(graph)
    return captured


def from_dynamo_graph(gm: fx.GraphModule, example_inputs: Sequence, name: str,
                      constant_inputs: frozenset[str] = frozenset()) -> Capture:
    """One ATen trace of a Dynamo graph as a capture of itself, with its shapes for `example_inputs`."""
    graph = CapturedGraph(name, gm, tuple(example_inputs), constant_inputs)
    _give_shapes(graph)
    return Capture(gm, [graph])


def _give_shapes(graph: CapturedGraph) -> None:
    """Shapes by propagation from the example inputs; an input needs grad as its example does (propagation detaches)."""
    propagate_shapes(graph.gm, graph.example_inputs)
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, graph.example_inputs):
        if isinstance(value, torch.Tensor) and isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["val"].requires_grad_(value.requires_grad and node.meta["val"].dtype.is_floating_point)


def run_pipeline(captured: Capture, pipeline: Sequence[Pass], ctx: PassContext, *,
                 instruments: Sequence[Instrument] = (), verifier: Verifier | None = None) -> Report:
    """Run `pipeline` over every graph of `captured` (rewritten in place)."""
    if verifier is not None:  # capture alone must compute what the model does: a difference there is capture's
        verifier.check(captured.module, "capture")
    return PassManager(pipeline, instruments, verifier).run(captured.module, captured.graphs, ctx)
