"""pointwise_before_expand: in a joint forward-backward graph, a pointwise op of an expanded tensor moved before the expand.

What it rewrites: each pointwise op of one expanded tensor and scalars (`expand(g, shape) / n`, a mean's gradient)
becomes `expand(g / n, shape)`: the same value in each element, without a full-size tensor. Why: op by op
(aot_eager) the full-size result lives until its readers have run; in a CNN that is the widest activation's size,
at the widest block's backward, where the step peaks.

Why it is safe: the op computes the same value per element either way; it is rewritten only where every reader is a
pointwise op that also reads a full-size contiguous tensor of that shape, so what the readers return, strides
included, does not change. Random ops are never moved. It runs only on the joint graphs of `memory_budget` under
torch.compile (fxopt.pipeline.compile_budget), never on a model's graph.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private
from ..analysis.ops import draws_random_numbers
from .base import TRAINING, Pass, PassContext, PassResult


class PointwiseBeforeExpand(Pass):
    name = "pointwise_before_expand"
    summary = "In a joint graph, compute a pointwise op of an expanded tensor before the expand."
    modes = (TRAINING,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op != "call_function" or not _torch_private.op_is_pointwise(node.target) or \
                    draws_random_numbers(node):
                continue
            tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
            if len(tensors) != 1 or tensors[0].target is not torch.ops.aten.expand.default or \
                    any(isinstance(a, (list, tuple)) for a in (*node.args, *node.kwargs.values())):
                continue
            expand, shape = tensors[0], tuple(node.meta["val"].shape)
            small = expand.args[0]
            if not node.users or not all(_torch_private.op_is_pointwise(user.target) and any(
                    isinstance(a, fx.Node) and a is not node and isinstance(a.meta.get("val"), torch.Tensor) and
                    tuple(a.meta["val"].shape) == shape and a.meta["val"].is_contiguous()
                    for a in user.all_input_nodes) for user in node.users):
                continue
            with graph.inserting_after(node):
                computed = graph.call_function(node.target, tuple(small if a is expand else a for a in node.args),
                                               dict(node.kwargs))
            with graph.inserting_after(computed):
                expanded = graph.call_function(torch.ops.aten.expand.default, (computed, list(expand.args[1])))
            for new in (computed, expanded):
                new.meta = {key: value for key, value in node.meta.items() if key != "val"}
            computed.meta["val"] = torch.empty_like(small.meta["val"], dtype=node.meta["val"].dtype)
            expanded.meta["val"] = computed.meta["val"].expand(expand.meta["val"].shape)
            node.replace_all_uses_with(expanded)
            result.record("computed_before_expand", node)
            graph.erase_node(node)
        return result
