"""drop_eval_dropout: remove dropouts that return their input unchanged.

What it rewrites::

    z = aten.dropout(y, 0.5, False)     ->  (removed: users of z read y)
    z = F.dropout(y, 0.5, training=False)

A dropout whose `train` / `training` flag is False returns its input itself: it draws no random
numbers, keeps nothing for backward and computes nothing, so removing it changes no value, no
gradient and no RNG stream. Removing it also lets a following pass see the real producer of the
tensor (inplace_relu can then run a ReLU before it in place).

What it leaves alone: every dropout that may draw a mask (a `train` flag that is True or
computed in the graph). torch.export bakes each dropout's flag into the graph and capture guards
the module's mode, so an exported graph never holds a stale flag; Dynamo guards it likewise.
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.saved_tensors import dropout_training
from ..op_names import op_name
from .base import Pass, PassContext, PassResult, site_name


class DropEvalDropout(Pass):
    name = "drop_eval_dropout"
    summary = "Remove dropouts in eval mode: they return their input unchanged."

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        for node in list(gm.graph.nodes):
            if op_name(node) != "dropout" or dropout_training(node) or not node.args:
                continue
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            result.record("dropped", site_name(node), detail="dropout in eval mode returns its input")
        return result
