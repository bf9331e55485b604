"""A checkpointed region of a graph: its nodes moved into a GraphModule run under torch.utils.checkpoint.

`extract_region(gm, nodes, name, save_counted)` moves a contiguous run of call nodes into
`CheckpointedRegion(body)`, registered on `gm` as submodule `name`, and calls it in their
place. The region runs under non-reentrant `torch.utils.checkpoint.checkpoint`, which keeps
only the region's inputs (and restores the RNG state before recomputing, so dropout draws the
same mask). A train-mode BatchNorm module inside runs as `batch_norm_once`: the module on the
first run, and on recomputation the same batch-statistics normalisation without updating the
running statistics, so they move once per step, as without checkpointing. With `save_counted`, a selective checkpoint policy also keeps the outputs of the
ops FlopCounterMode counts (matmuls, convolutions, attention) and recomputes only the rest.

The body's modules and tensors are the parent graph's own (not registered a second time), so
`state_dict()` keeps the original keys. Before / after::

    h = self.fc1(x);  n = self.norm(h);  g = self.act(n);  y = self.fc2(g)
  becomes
    h = self.fc1(x);  checkpointed_norm_to_act = self.checkpointed_norm_to_act(h);  y = self.fc2(checkpointed_norm_to_act)
"""
from __future__ import annotations

import functools
import itertools
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..analysis.flops import is_counted_op
from ..graph_functions import graph_function


def _save_counted_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_counted_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


TRAIN_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


@graph_function(updates_stats=True)
def batch_norm_once(x: torch.Tensor, bn: torch.nn.Module, first_run: bool) -> torch.Tensor:
    """A train-mode BatchNorm: the module itself on the region's first run; when the region is
    recomputed, the same normalisation by batch statistics without touching the running ones."""
    if first_run or bn.running_mean is None:
        return bn(x)
    # Throwaway copies take the update; autograd saves the same tensors as on the first run
    # (checkpoint checks that), and backward reads only the batch statistics.
    return F.batch_norm(x, bn.running_mean.clone(), bn.running_var.clone(), bn.weight, bn.bias, True,
                        bn.momentum or 0.0, bn.eps)


batch_norm_once.fxopt_op_name = "batch_norm"


class CheckpointedRegion(torch.nn.Module):
    """Runs `body` under non-reentrant checkpoint; selective (matmul/conv/attention outputs kept) if `save_counted`.

    A body that runs train-mode BatchNorm takes a first argument saying whether this is the
    first run (the forward) or a recomputation, so running statistics are updated once.
    """

    def __init__(self, body: fx.GraphModule, save_counted: bool, takes_first_run: bool):
        super().__init__()
        # Held outside the module tree: its modules and tensors are the parent graph's own, so
        # state_dict() and parameters() list nothing twice.
        self.__dict__["body"] = body
        self.save_counted = save_counted
        self.takes_first_run = takes_first_run

    def forward(self, *args):
        run = self.body
        if self.takes_first_run:
            runs = itertools.count()
            run = lambda *inputs: self.body(next(runs) == 0, *inputs)  # noqa: E731 - True on the first run only

        if not self.save_counted:
            return checkpoint(run, *args, use_reentrant=False)
        context_fn = functools.partial(create_selective_checkpoint_contexts, _save_counted_ops)
        return checkpoint(run, *args, use_reentrant=False, context_fn=context_fn)

    def extra_repr(self) -> str:
        kind = "selective: matmul/conv/attention outputs saved" if self.save_counted else "recomputes everything"
        return f"{kind}\n{self.body.code.strip()}"


def is_train_batch_norm_module(node: fx.Node, gm: fx.GraphModule) -> bool:
    """An nn.BatchNorm1d/2d/3d call (exactly those types) in train mode, called on one input."""
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return False
    module = gm.get_submodule(node.target)
    return type(module) in TRAIN_BATCH_NORMS and module.training


def extract_region(gm: fx.GraphModule, nodes: list[fx.Node], name: str, save_counted: bool) -> fx.Node:
    """Replace `nodes` (contiguous in graph order) with one call of a CheckpointedRegion; return that call."""
    members = set(nodes)
    body = fx.Graph()
    batch_norms = [n for n in nodes if is_train_batch_norm_module(n, gm)]
    first_run = body.placeholder("first_run") if batch_norms else None
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
        if node in batch_norms:
            env[node] = body.call_function(batch_norm_once, (env[node.args[0]], body.get_attr(node.target), first_run))
            env[node].meta.update(node.meta)
        else:
            env[node] = body.node_copy(node, lambda a: env[a])
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    body.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[n] for n in outputs))
    gm.add_submodule(name, CheckpointedRegion(fx.GraphModule(gm, body, "Region"), save_counted, bool(batch_norms)))
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
