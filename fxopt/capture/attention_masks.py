"""Drop the all-True attention masks that exporting made and eager does not.

Hugging Face models skip their attention mask in eager when no token is masked (SDPA then runs
without one), but build it under `torch.export` (`masking_utils` checks
`torch.compiler.is_exporting()`: a traced graph must not branch on a mask's contents). ViT, BERT
and the like, called without an `attention_mask`, so get a graph that builds an all-True boolean
mask at every call (`arange`, `ge`, `expand`) and sends SDPA down its masked path: slower than eager.

`drop_all_true_masks` finds each `scaled_dot_product_attention` whose boolean `attn_mask` is
computed from constants alone (deterministic ATen ops on no input, parameter, buffer or size),
broadcast to the call's shape by `expand` at most. Such a mask has the same value at every call;
it is evaluated once and, where it is all True, it masks nothing: the call drops it (SDPA without
a mask computes the same) and the ops that only built it are erased. A mask read from anything
else (an `attention_mask` argument, the sequence length) is kept.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private

_aten = torch.ops.aten


def drop_all_true_masks(gm: fx.GraphModule) -> int:
    """Drop every all-True constant attention mask of `gm` (see module docstring); how many calls changed."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _aten.scaled_dot_product_attention.default:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node) and _constant_all_true(mask):
            if len(node.args) > 3:
                node.args = (*node.args[:3], None, *node.args[4:])
            else:
                node.kwargs = {**node.kwargs, "attn_mask": None}
            _erase_unused(mask)
            dropped += 1
    if dropped:
        gm.graph.lint()
        gm.recompile()
    return dropped


def _constant_all_true(mask: fx.Node) -> bool:
    source = mask
    while source.op == "call_function" and source.target is _aten.expand.default:  # a broadcast keeps the values
        source = source.args[0]
    if not isinstance(source, fx.Node):
        return False
    value = _evaluate_constant(source)
    return value is not None and value.dtype == torch.bool and bool(value.all())


def _evaluate_constant(node: fx.Node) -> torch.Tensor | None:
    """`node`'s value if it is computed by deterministic, non-mutating ATen ops from literals alone, else None."""
    order, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if (n.op != "call_function" or _torch_private.aten_op_name(n.target) is None
                or _torch_private.op_is_mutable(n.target) or _torch_private.op_is_random(n.target)):
            return None
        order.append(n)
        stack.extend(n.all_input_nodes)
    values: dict[fx.Node, object] = {}
    for n in sorted(order, key=_position(node.graph)):
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), values.__getitem__)
        values[n] = n.target(*args, **kwargs)
    value = values[node]
    return value if isinstance(value, torch.Tensor) else None


def _position(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _erase_unused(node: fx.Node) -> None:
    """Erase `node` if nothing reads it, then the inputs only it read."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        stack.extend(inputs)
