"""A checkpointed region of a graph: its nodes moved into a GraphModule run under torch.utils.checkpoint.

`extract_region(gm, nodes, name, save_counted)` moves a contiguous run of call nodes into
`CheckpointedRegion(body)`, registered on `gm` as submodule `name`, and calls it in their
place. The region runs under non-reentrant `torch.utils.checkpoint.checkpoint`, which keeps
only the region's inputs (and restores the RNG state before recomputing, so dropout draws the
same mask). With `save_counted`, a selective checkpoint policy also keeps the outputs of the
ops FlopCounterMode counts (matmuls, convolutions, attention) and recomputes only the rest.

The body's modules and tensors are the parent graph's own (not registered a second time), so
`state_dict()` keeps the original keys. Before / after::

    h = self.fc1(x);  n = self.norm(h);  g = self.act(n);  y = self.fc2(g)
  becomes
    h = self.fc1(x);  checkpointed_norm_to_act = self.checkpointed_norm_to_act(h);  y = self.fc2(checkpointed_norm_to_act)
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..analysis.flops import is_counted_op


def _save_counted_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_counted_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedRegion(torch.nn.Module):
    """Runs `body` under non-reentrant checkpoint; selective (matmul/conv/attention outputs kept) if `save_counted`."""

    def __init__(self, body: fx.GraphModule, save_counted: bool):
        super().__init__()
        # Held outside the module tree: its modules and tensors are the parent graph's own, so
        # state_dict() and parameters() list nothing twice.
        self.__dict__["body"] = body
        self.save_counted = save_counted

    def forward(self, *args):
        if not self.save_counted:
            return checkpoint(self.body, *args, use_reentrant=False)
        context_fn = functools.partial(create_selective_checkpoint_contexts, _save_counted_ops)
        return checkpoint(self.body, *args, use_reentrant=False, context_fn=context_fn)

    def extra_repr(self) -> str:
        kind = "selective: matmul/conv/attention outputs saved" if self.save_counted else "recomputes everything"
        return f"{kind}\n{self.body.code.strip()}"


def extract_region(gm: fx.GraphModule, nodes: list[fx.Node], name: str, save_counted: bool) -> fx.Node:
    """Replace `nodes` (contiguous in graph order) with one call of a CheckpointedRegion; return that call."""
    members = set(nodes)
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in members or arg in env:
                continue
            if arg.op == "get_attr":
                env[arg] = body.get_attr(arg.target)
            else:
                inputs.append(arg)
                env[arg] = body.placeholder(arg.name)
            env[arg].meta.update(arg.meta)
        env[node] = body.node_copy(node, lambda a: env[a])
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    body.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[n] for n in outputs))
    gm.add_submodule(name, CheckpointedRegion(fx.GraphModule(gm, body, "Region"), save_counted))
    with gm.graph.inserting_before(nodes[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        if len(outputs) == 1:
            outputs[0].replace_all_uses_with(call)
        else:
            for i, out in enumerate(outputs):
                item = gm.graph.call_function(operator.getitem, (call, i))
                item.meta.update(out.meta)
                out.replace_all_uses_with(item)
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    return call
