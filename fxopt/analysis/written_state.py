"""Which parameters, buffers and graph inputs the graph itself may write into.

A pass that reads a weight or statistic once, ahead of time (a fold), is exact only if nothing
in the graph writes it: a train-mode BatchNorm updating shared running statistics, an in-place
op on a view of a buffer, an opaque module that may touch its own state. Eager autograd would
also read such a buffer at backward time, after the write. `written_state` collects everything
a node with a MUTATION, STATS or OPAQUE effect may reach through aliases.
"""
from __future__ import annotations

import torch
import torch.fx as fx

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
        for alias in (a for arg in node.all_input_nodes for a in aliases.aliases(arg)):
            value = resolve(alias, gm) if alias.op == "get_attr" else None
            if isinstance(value, torch.nn.Module):
                owners.append(value)
            elif alias.op in ("get_attr", "placeholder"):
                written.add(state_key(alias, gm))
        written |= {id(t) for owner in owners for t in (*owner.parameters(), *owner.buffers())}
    return written
