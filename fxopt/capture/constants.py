"""Tensors created while tracing must stay fresh on every call.

torch.fx runs a factory call whose arguments are all constants (`torch.zeros(6, 8)` in a
forward) once, at trace time, and stores the result on the GraphModule as `_tensor_constant<N>`.
Eager PyTorch makes a new tensor on every call. The two agree until something writes into that
tensor (`acc = torch.zeros(...); acc.add_(y)`): then the traced module would accumulate into
one stored tensor across calls. `protect_traced_constants` gives each such constant that may be
written (an in-place op, or code fxopt cannot see, downstream of it) one `clone()` per call.
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.side_effects import MUTATION, OPAQUE, effects

_TRACER_CONSTANT_PREFIX = "_tensor_constant"


def _may_be_written(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether a node reading `node`, directly or through what it computes, may write or escape our view."""
    seen, stack = set(), list(node.users)
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if effects(user, gm) & {MUTATION, OPAQUE}:
            return True
        stack.extend(user.users)
    return False


def protect_traced_constants(gm: fx.GraphModule) -> None:
    """Read each written trace-time constant through one fresh clone per call (see module docstring)."""
    by_target: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target.startswith(_TRACER_CONSTANT_PREFIX):
            by_target.setdefault(node.target, []).append(node)
    changed = False
    for nodes in by_target.values():
        if not any(_may_be_written(n, gm) for n in nodes):
            continue
        first, *rest = nodes
        with gm.graph.inserting_after(first):
            fresh = gm.graph.call_method("clone", (first,))
        for n in nodes:
            n.replace_all_uses_with(fresh, delete_user_cb=lambda user: user is not fresh)
        for n in rest:
            gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.recompile()
