"""Drop the constant attention masks that exporting made and eager does not.

Hugging Face models skip their attention mask in eager when no token is masked (SDPA then runs
without one), but build it under `torch.export` (`masking_utils` checks
`torch.compiler.is_exporting()`: a traced graph must not branch on a mask's contents). ViT, BERT
and the like, called without an `attention_mask`, so get a graph that builds an all-True boolean
mask at every call (`arange`, `ge`, `expand`) and sends SDPA down its masked path: slower than eager.

Causal models (GPT-2) likewise call SDPA with `is_causal=True` and no mask in eager, but build
the lower-triangular mask under export, and SDPA's masked path is slower than its causal one.

`drop_constant_masks` finds each `scaled_dot_product_attention` whose boolean `attn_mask` is
computed from constants alone (deterministic ATen ops on no input, parameter, buffer or size).
Such a mask has the same value at every call; it is evaluated once and, where it is all True, it
masks nothing: the call drops it (SDPA without a mask computes the same). Where it is the causal
mask (`ones(L, S).tril()` over its last two dimensions, broadcast over the others: exactly what
`is_causal=True` applies) of a call that is not causal already, the call drops it and becomes
causal. The ops that only built the mask are erased. Any other mask, and a mask read from
anything else (an `attention_mask` argument, the sequence length), is kept.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private
from ..op_names import call_arguments

_aten = torch.ops.aten


def drop_constant_masks(gm: fx.GraphModule) -> int:
    """Drop every all-True or causal constant attention mask of `gm` (see module docstring); how many calls changed."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _aten.scaled_dot_product_attention.default:
            continue
        arguments = call_arguments(node)
        mask = arguments.get("attn_mask")
        if not isinstance(mask, fx.Node) or arguments.get("is_causal") is not False:
            continue
        kind = _constant_mask_kind(mask)
        if kind is None:
            continue
        _set_argument(node, arguments, "attn_mask", None)
        if kind == "causal":
            _set_argument(node, arguments, "is_causal", True)
        _erase_unused(mask)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _set_argument(node: fx.Node, arguments: dict, name: str, value) -> None:
    """Set argument `name` of `node` where the call passes it (by position or keyword), else by keyword;
    `arguments` are all of the call's, in the schema's order (`call_arguments`)."""
    index = list(arguments).index(name)
    if index < len(node.args):
        node.args = (*node.args[:index], value, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}


def _constant_mask_kind(mask: fx.Node) -> str | None:
    """"all_true" or "causal" for a constant boolean mask of that value (see module docstring), else None."""
    value = _evaluate_constant(mask)
    if value is None or value.dtype != torch.bool or value.dim() < 2:
        return None
    if bool(value.all()):
        return "all_true"
    causal = torch.ones(value.shape[-2:], dtype=torch.bool, device=value.device).tril()
    return "causal" if torch.equal(value, causal.expand_as(value)) else None


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
    """Erase `node` if nothing reads it, then the inputs only it read. Export's checks of a value's dtype and
    device (`_assert_tensor_metadata`) do not keep it: they go with it."""
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        if n in erased:  # an input of two erased nodes is reached twice
            continue
        if n.op != "call_function" or any(u.target is not _aten._assert_tensor_metadata.default for u in n.users):
            continue
        for check in list(n.users):
            n.graph.erase_node(check)
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)
