"""dropout_from_mask: in a joint forward-backward graph, each train-mode dropout's output read from its mask.

What it rewrites: each train-mode `native_dropout(x, p)` of the forward: its output becomes `x * mask * (1 / (1 - p))`,
two pointwise ops of the bool mask the dropout returns, which carry the dropout's Dynamo position. Why: a region the
partitioner recomputes (fxopt.checkpointing.partitioner) then recomputes those two from the saved mask (a quarter of a
float32 output) while the draw itself is never tagged, so the random numbers are drawn once, as eager draws them.

Why it is safe: that is ATen's own computation of the output, bitwise equal in float32 and float64. When it does
nothing: eval-mode dropouts, p not a float in (0, 1), an output nobody reads; and under Inductor, which decomposes
dropout before the partitioner (its random values come from a saved seed). It runs only on the joint graphs of
`memory_budget` under torch.compile (fxopt.pipeline.compile_budget), never on a model's graph.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .base import TRAINING, Pass, PassContext, PassResult


class DropoutFromMask(Pass):
    name = "dropout_from_mask"
    summary = "In a joint graph, read each train-mode dropout's output from its mask."
    modes = (TRAINING,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        graph = gm.graph
        for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.native_dropout.default)):
            x, p = node.args[0], node.args[1]
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
            outputs = {user.args[1]: user for user in node.users if user.target is operator.getitem}
            if train is False or not isinstance(p, float) or not 0 < p < 1 or 0 not in outputs:
                continue
            if 1 not in outputs:
                with graph.inserting_after(node):
                    outputs[1] = graph.call_function(operator.getitem, (node, 1))
                outputs[1].meta = {**node.meta, "val": node.meta["val"][1]}
            with graph.inserting_after(outputs[1]):
                kept = graph.call_function(torch.ops.aten.mul.Tensor, (x, outputs[1]))
            with graph.inserting_after(kept):
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (kept, 1.0 / (1.0 - p)))
            for new in (kept, scaled):
                new.meta = {key: value for key, value in outputs[0].meta.items() if key != "val"}
                new.meta["val"] = torch.empty_like(outputs[0].meta["val"])
            outputs[0].replace_all_uses_with(scaled)
            result.record("read_from_mask", node)
            graph.erase_node(outputs[0])
        return result
