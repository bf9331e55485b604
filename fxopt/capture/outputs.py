"""Where a model's outputs are among the outputs of the one graph Dynamo captures of its forward.

Dynamo hands a backend a graph whose outputs are the tensors the frame's return value is rebuilt from,
deduplicated, in an order of Dynamo's choosing. `output_places` compiles the model once with a backend
that keeps what the graph returned on the example call, and finds each tensor of the model's output
among them by identity: the graph's own tensors are what the model returns. None where Dynamo split the
forward into several graphs (a graph break: no one graph returns the model's outputs).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private
from ..output_selection import OutputPlaces, entries_of
from ..state_preservation import preserved_state
from ..tree import flatten_tensors


def output_places(model: torch.nn.Module, args: tuple, kwargs: dict) -> OutputPlaces | None:
    """Each of `model(*args, **kwargs)`'s outputs (index or key) with the positions of its tensors among
    its Dynamo graph's outputs; the model and inputs are left as they were (see module docstring)."""
    returned: list[list] = []

    def keep_outputs(gm: fx.GraphModule, example_inputs: list):
        def run(*inputs):
            out = gm(*inputs)
            returned.append(list(out) if isinstance(out, (tuple, list)) else [out])
            return out
        return run

    with preserved_state(model, (args, kwargs)), _torch_private.settings_applied():  # the graphs the result gets
        out = _torch_private.compile_on_its_own(model, keep_outputs, dynamic=False)(*args, **kwargs)
    if len(returned) != 1:
        return None
    (graph_outputs,) = returned
    positions = {id(t): i for i, t in enumerate(graph_outputs) if isinstance(t, torch.Tensor)}
    entries = tuple((key, tuple(positions[id(t)] for t in flatten_tensors(value) if id(t) in positions))
                    for key, value in entries_of(out).items())
    return OutputPlaces(entries, len(graph_outputs))
