"""drop_eval_dropout: remove dropouts that return their input unchanged.

What it rewrites::

    z = aten.dropout(y, 0.5, False)     ->  (removed: users of z read y)
    z = F.dropout(y, 0.5, training=False)
    z = aten.dropout(y, 0.0, True)

A dropout whose `train` / `training` flag is False, or whose probability is the constant 0 (ViT's
and many language models' default configurations, in training too), returns its input itself:
ATen's dropout returns before it draws, so it draws no random numbers, makes no autograd node,
keeps nothing for backward and computes nothing. Removing it therefore changes no value, no
gradient, no aliasing and no RNG stream. Removing it also lets a following pass see the real
producer of the tensor (inplace_relu can then run a ReLU before it in place) and spares
checkpoint_activations a step it would take for a random one.

What it leaves alone: every dropout that may draw a mask (a `train` flag that is True or
computed in the graph, with a probability that is not 0 or is computed in the graph).
TorchDynamo bakes each dropout's flag and probability into the graph and guards the module's mode
and its settings (`Dropout.p`), so a graph never holds a stale flag or probability.
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.saved_tensors import dropout_returns_input
from ..op_names import op_name
from .base import Pass, PassContext, PassResult, site_name


class DropEvalDropout(Pass):
    name = "drop_eval_dropout"
    summary = "Remove dropouts that return their input unchanged: in eval mode, or with probability 0."

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        for node in list(gm.graph.nodes):
            if op_name(node) != "dropout" or not node.args or not dropout_returns_input(node):
                continue
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            result.record("dropped", site_name(node), detail="the dropout returns its input (eval mode or p=0)")
        return result
