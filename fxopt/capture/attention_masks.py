"""Drop the constant attention masks that compiling made and eager does not.

Hugging Face models skip their attention mask in eager when no token is masked (SDPA then runs
without one), but build it under TorchDynamo (`masking_utils` checks `is_torchdynamo_compiling()`:
a traced graph must not branch on a mask's contents). ViT, BERT and the like, called without an
`attention_mask`, so get a graph that builds an all-True boolean mask at every call (`arange`,
`ge`, `expand`) and sends SDPA down its masked path: slower than eager, and not eager's arithmetic.

Causal models (GPT-2, Llama) likewise call SDPA with `is_causal=True` and no mask in eager, but
build the lower-triangular mask under Dynamo, and SDPA's masked path is slower than its causal one.

`drop_constant_masks` finds each `scaled_dot_product_attention` whose boolean `attn_mask` is
computed from constants alone (deterministic ATen ops on no input, parameter, buffer or size).
Such a mask has the same value at every call; it is evaluated once and, where it is all True, it
masks nothing: the call drops it (SDPA without a mask computes the same). Where it is the causal
mask (`ones(L, S).tril()` over its last two dimensions, broadcast over the others: exactly what
`is_causal=True` applies) of a call that is not causal already, the call drops it and becomes
causal. The ops that only built the mask are erased. Any other mask, and a mask read from
anything else (an `attention_mask` argument, the sequence length), is kept.
In a graph Dynamo made dynamic (a new padded length each batch) the mask is built from a symbolic
size, so it is no constant and is kept: that graph computes what the compiled model computes (in
float32, a rounding apart from eager on grouped-query models).

Models whose attention adds a float bias (BEiT's relative positions) add the boolean mask to it,
True as 1: under Dynamo every logit of a row is shifted by 1, which softmax ignores, and eager has the
bias alone. Where the mask is a constant all True, the call gets the bias alone, as eager's.

Models with grouped-query attention (Llama, Mistral, Qwen2) also choose their key and value by the
mask: without one, eager passes SDPA the key and value heads as they are with `enable_gqa=True`
(transformers' `use_gqa_in_sdpa`); with the mask Dynamo's trace built, they are first copied once per query
head (`repeat_kv`: unsqueeze, expand, reshape). Where a call loses its mask, such copies are undone and
the call takes `enable_gqa=True`, as eager's does: the same gradients bit for bit (SDPA's backward sums
a shared head's gradients itself, the copies' backward summed them in another order: 1e-10 apart on a
float32 Llama), and no copies of the keys and values saved for backward. (A transformers release
before `use_gqa_in_sdpa` copied the heads in eager too; its gradients then differ from fxopt's by
such rounding.)
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
        bias = _bias_plus_all_true(mask)
        if bias is not None:
            _set_argument(node, arguments, "attn_mask", bias)
            _erase_unused(mask)
            changed += 1
            continue
        kind = _constant_mask_kind(mask)
        if kind is None:
            continue
        _set_argument(node, arguments, "attn_mask", None)
        if kind == "causal":
            _set_argument(node, arguments, "is_causal", True)
        _erase_unused(mask)
        _share_key_value_heads(node, call_arguments(node))
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _bias_plus_all_true(mask: fx.Node) -> fx.Node | None:
    """`bias` where `mask` is `bias + m`, read by its SDPA call alone, with `bias` floating point and `m` a constant
    all-True boolean mask (module docstring); else None."""
    if mask.target is not _aten.add.Tensor or len(mask.users) != 1 or len(mask.args) != 2 or mask.kwargs:
        return None
    for bias, other in (mask.args, mask.args[::-1]):
        value = bias.meta.get("val") if isinstance(bias, fx.Node) else None
        if (isinstance(value, torch.Tensor) and value.is_floating_point() and isinstance(other, fx.Node)
                and _constant_mask_kind(other) == "all_true"):
            return bias
    return None


def _share_key_value_heads(sdpa: fx.Node, arguments: dict) -> None:
    """Undo the per-query-head copies of `sdpa`'s key and value, and call it with `enable_gqa=True` (module
    docstring); nothing where either is no such copy, or their groups differ."""
    if arguments.get("enable_gqa") is not False:  # not in this torch's schema, or set already
        return
    key, value = _repeated_heads(arguments["key"]), _repeated_heads(arguments["value"])
    if key is None or value is None or key[1] != value[1]:
        return
    for name, (shared, _) in (("key", key), ("value", value)):
        copy = arguments[name]
        _set_argument(sdpa, arguments, name, shared)
        _erase_unused(copy)
    _set_argument(sdpa, arguments, "enable_gqa", True)


def _repeated_heads(node) -> tuple[fx.Node, int] | None:
    """(heads, groups) where `node` is `reshape(expand(unsqueeze(heads, 2), [b, h, groups, s, d]), [b, h * groups,
    s, d])` read by nothing else: transformers' `repeat_kv` of 4-D `heads` as traced, static shapes; else None."""
    chain = []
    for target in (_aten.reshape.default, _aten.expand.default, _aten.unsqueeze.default):
        if not (isinstance(node, fx.Node) and node.target is target and len(node.users) == 1):
            return None
        chain.append(node)
        node = node.args[0]
    reshape, expand, unsqueeze = chain
    shapes = [n.meta.get("val") for n in (node, expand, reshape)]
    if unsqueeze.args[1] != 2 or not all(isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape)
                                         for v in shapes):
        return None
    (b, h, s, d), expanded, repeated = (tuple(v.shape) for v in shapes)
    groups = expanded[2] if len(expanded) == 5 else 0
    if expanded != (b, h, groups, s, d) or repeated != (b, h * groups, s, d):
        return None
    return node, groups


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
