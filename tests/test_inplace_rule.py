"""One in-place rule: aliasing and side effects agree on which calls write into their first input.

Hand-written graphs in the torch-function form (TorchDynamo's, what the torch.compile backend gets),
so every way of writing an op in place is spelled out.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from fxopt.analysis.aliasing import aliased_inputs
from fxopt.analysis.side_effects import MUTATION, effects
from fxopt.op_names import is_inplace_op, op_name

CALLS = {  # name -> (op, target, args after x, kwargs, written in place)
    "x += y": ("call_function", operator.iadd, ("y",), {}, True),
    "x |= y": ("call_function", operator.ior, ("y",), {}, True),
    "x.__iadd__(y)": ("call_method", "__iadd__", ("y",), {}, True),
    "x.add_(y)": ("call_method", "add_", ("y",), {}, True),
    "torch.relu_(x)": ("call_function", torch.relu_, (), {}, True),
    "F.relu(x, inplace=True)": ("call_function", F.relu, (), {"inplace": True}, True),
    "F.relu(x, True)": ("call_function", F.relu, (True,), {}, True),
    "F.dropout(x, inplace=True)": ("call_function", F.dropout, (0.5, False), {"inplace": True}, True),
    "F.mish(x, inplace=True)": ("call_function", F.mish, (), {"inplace": True}, True),
    "x + y": ("call_function", operator.add, ("y",), {}, False),
    "F.relu(x)": ("call_function", F.relu, (), {}, False),
    "x.__invert__()": ("call_method", "__invert__", (), {}, False),
    "x.relu()": ("call_method", "relu", (), {}, False),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_aliasing_and_effects_agree_on_in_place(case):
    """A call written in place aliases its first input AND has a MUTATION effect; any other call neither."""
    op, target, rest, kwargs, in_place = CALLS[case]
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    node = graph.create_node(op, target, (x, *(y if a == "y" else a for a in rest)), kwargs)
    graph.output(node)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert is_inplace_op(op_name(node)) is in_place
    assert (aliased_inputs(node) == [x]) is in_place
    assert (MUTATION in effects(node, gm)) is in_place
