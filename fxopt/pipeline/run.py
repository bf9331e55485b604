"""From a model, or a graph Dynamo hands over, to optimized graphs and their report: the one way through.

    captured = from_model(model, args, kwargs)                  # fxopt.optimize: torch.export
    captured = from_dynamo_graph(gm, example_inputs, name)      # the torch.compile backend
    report = run_pipeline(captured, pipeline, ctx, instruments=..., verifier=...)

Either way each graph gets its shapes (`node.meta["val"]`) once, here: an exported graph from the
fake tensors export computed where they are concrete (a static export: the example's sizes), else by
one fake-tensor propagation from the example inputs; a Dynamo graph from the fake tensors Dynamo
already computed. `run_pipeline` then checks capture alone (with a verifier) and runs the passes
with the `PassManager`, which keeps the shapes up to date as passes change the graphs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from ..analysis.shapes import adopt_concrete_shapes, propagate_shapes, remember_shape_sources
from ..capture import Capture, CapturedGraph, capture
from ..passes.base import Pass, PassContext
from .instruments import Instrument
from .manager import PassManager
from .report import Report
from .verify import Verifier


def from_model(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
               dynamic_batch: bool = False, propagate: bool = False) -> Capture:
    """`model` captured with torch.export as called with (args, kwargs), every graph with its shapes
    (with `dynamic_batch`, the whole model exported for any batch size: see `capture`).

    A static export's own fake values serve as the shapes (where eager hands an input back, they are
    made to share its storage: `adopt_concrete_shapes`), unless `propagate`: then one propagation
    from the example inputs gives them.
    """
    captured = capture(model, args, kwargs, dynamic_batch=dynamic_batch)
    for g in captured.graphs:
        if propagate or not adopt_concrete_shapes(g.gm):
            propagate_shapes(g.gm, g.example_inputs)
    return captured


def from_dynamo_graph(gm: fx.GraphModule, example_inputs: Sequence, name: str) -> Capture:
    """One Dynamo graph as a capture of itself, its shapes taken from what Dynamo computed.

    Dynamo leaves a fake tensor in `node.meta["example_value"]`; it becomes `meta["val"]`, and the
    fake placeholder values are the inputs shapes are re-propagated from after a pass (not the real
    parameters, which would have to be converted to fake tensors each time). A graph without them
    gets one propagation from the example inputs.
    """
    if not all("example_value" in n.meta for n in gm.graph.nodes if n.op not in ("output", "get_attr")):
        propagate_shapes(gm, tuple(example_inputs))
        fake_inputs = tuple(example_inputs)
    else:
        for node in gm.graph.nodes:
            if "example_value" in node.meta:
                node.meta.setdefault("val", node.meta["example_value"])
        remember_shape_sources(gm)
        fake_inputs = tuple(n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder")
    return Capture(gm, [CapturedGraph(name, gm, fake_inputs)], opaque=[], specialized=[])


def run_pipeline(captured: Capture, pipeline: Sequence[Pass], ctx: PassContext, *,
                 instruments: Sequence[Instrument] = (), verifier: Verifier | None = None) -> Report:
    """Run `pipeline` over every graph of `captured` (rewritten in place); the report also lists what stayed opaque."""
    if verifier is not None:  # capture alone must compute what the model does: a difference there is capture's
        verifier.check(captured.module, "capture")
    report = PassManager(pipeline, instruments, verifier).run(captured.module, captured.graphs, ctx)
    report.opaque = captured.opaque
    report.specialized = captured.specialized
    return report
