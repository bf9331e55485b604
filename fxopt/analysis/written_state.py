"""Which parameters, buffers and graph inputs the graph itself may write into.

A pass that reads a weight or statistic once, ahead of time (a fold), is exact only if nothing
in the graph writes it: a train-mode BatchNorm updating shared running statistics, an in-place
op on a view of a buffer, an opaque module that may touch its own state. Eager autograd would
also read such a buffer at backward time, after the write. `written_state` collects everything
a node with a MUTATION, STATS or OPAQUE effect may reach through aliases: from the arguments an
in-place op writes (its schema's, or an fxopt in-place helper's first), from every input of the rest.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private
from ..graph_functions import declared
from ..op_names import is_inplace_op
from .aliasing import AliasInfo
from .ops import resolve
from .side_effects import MUTATION, OPAQUE, STATS, effects


def state_key(ref: fx.Node | str, gm: fx.GraphModule):
    """What identifies the tensor behind a reference: the tensor itself, or the placeholder's name."""
    value = resolve(ref, gm)
    return id(value) if value is not None else ref.name


def written_state(gm: fx.GraphModule) -> set:
    """Keys (see `state_key`) of every parameter, buffer and input that some node may write into."""
    aliases = AliasInfo(gm)
    written = set()
    for node in gm.graph.nodes:
        if not effects(node, gm) & {MUTATION, STATS, OPAQUE}:
            continue
        owners = [gm.get_submodule(node.target)] if node.op == "call_module" else []
        for alias in (a for arg in _inputs_written(node, gm) for a in aliases.aliases(arg)):
            value = resolve(alias, gm) if alias.op == "get_attr" else None
            if isinstance(value, torch.nn.Module):
                owners.append(value)
            elif alias.op in ("get_attr", "placeholder"):
                written.add(state_key(alias, gm))
        written |= {id(t) for owner in owners for t in (*owner.parameters(), *owner.buffers())}
    return written


def _inputs_written(node: fx.Node, gm: fx.GraphModule) -> list[fx.Node]:
    """The inputs a node with effects may write into: an in-place op whose only effect is that write (an ATen op's
    written arguments, by its schema; fxopt's in-place helpers, their first) writes those alone; anything else (a
    statistics update, an opaque call, a write Python makes) may write every input."""
    if node.op != "call_function" or effects(node, gm) != {MUTATION}:
        return node.all_input_nodes
    names = _torch_private.written_arguments(node.target)
    if names:
        bound = _torch_private.bind_aten_arguments(node.target, node.args, node.kwargs)
        values = [bound.get(name) for name in names]
        return [n for v in values for n in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(n, fx.Node)]
    helper = declared(node.target)
    if helper is not None and helper.mutates and is_inplace_op(helper.name) and isinstance(node.args[0], fx.Node):
        return [node.args[0]]
    return node.all_input_nodes
