"""Which values of a graph need gradients, as data (JAX's `dce_jaxpr(used_outputs) -> used_inputs`).

`analyze_grad_needs(gm, differentiated)` takes the output values the loss will differentiate and
answers, without running anything:

  requires_grad       values autograd records when the graph runs (reach a trainable parameter or an
                      input whose example requires grad), following dtypes: integer and bool results,
                      `detach` and calls already run without grad record nothing
  grad_live           nodes a differentiated output depends on, plus every node that runs opaque
                      code or writes into a tensor that may share storage (`aliasing.AliasInfo`)
                      with such a node or with a graph input (the write carries gradient into
                      it): these must stay recorded. A write inside an aux head (an in-place
                      ReLU on the head's own activations) does not keep the head recorded
  no_grad_nodes       recorded nodes outside `grad_live` that something reads: they feed only outputs
                      nobody differentiates, so they may run under `torch.no_grad()`
  params_needing_grad / params_losing_grad / inputs_needing_grad
                      trainable parameters a differentiated output depends on, trainable parameters it
                      does not (they get no gradient), and graph inputs that require grad (as their
                      example did) and that a differentiated output depends on

`really_saved(node, gm, requires_grad)` answers what one op keeps for backward by running it once
on fake tensors under `saved_tensors_hooks`, with exactly the `requires_grad` pattern the graph
gives it: the truth for that op in this torch build (eager `linear` with a frozen weight keeps no
input, `conv2d` keeps it anyway), where `saved_tensors.saved_for_backward` is a safe table.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection

import torch
import torch.fx as fx

from .. import _torch_private
from ..graph_functions import declared
from .aliasing import AliasInfo
from .ops import constant_placeholders
from .saved_tensors import SavedForBackward
from .side_effects import MUTATION, OPAQUE, effects

_CALLS = ("call_function", "call_method", "call_module")


@dataclasses.dataclass(frozen=True)
class GradNeeds:
    requires_grad: frozenset[fx.Node]
    grad_live: frozenset[fx.Node]
    no_grad_nodes: tuple[fx.Node, ...]
    params_needing_grad: tuple[str, ...]
    params_losing_grad: tuple[str, ...]
    inputs_needing_grad: tuple[str, ...]

    def recorded(self, node: fx.Node) -> bool:
        """Whether autograd will record `node` once `no_grad_nodes` run without grad."""
        return node in self.requires_grad and node not in self.no_grad_nodes


def _attribute(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _differentiable_value(node: fx.Node) -> bool:
    """Whether the node's result can carry a gradient (floating or complex tensors); unknown -> True."""
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None:
        return True
    values = _torch_private.tree_leaves(val)
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in values)


def _placeholder_requires_grad(node: fx.Node) -> bool:
    """Whether a graph input requires grad, as its example did (Dynamo's `example_value` first); unknown: True."""
    for key in ("example_value", "val"):
        val = node.meta.get(key)
        if isinstance(val, torch.Tensor):
            return val.requires_grad
    return not any(key in node.meta for key in ("example_value", "val"))


def _trainable_params(node: fx.Node, gm: fx.GraphModule, constant_inputs: frozenset[str]) -> list[str]:
    """Qualified names of the trainable parameters a node reads directly."""
    if node.op == "get_attr":
        value = _attribute(gm, node.target)
        return [node.target] if isinstance(value, torch.Tensor) and value.requires_grad else []
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return [f"{node.target}.{name}" for name, p in module.named_parameters() if p.requires_grad]
    if node.op == "placeholder" and node.name in constant_inputs:
        return [node.meta.get("state_name", node.name)] if _placeholder_requires_grad(node) else []
    return []


def _requires_grad(gm: fx.GraphModule, constant_inputs: frozenset[str], writers: list[fx.Node],
                   aliases: AliasInfo | None) -> set[fx.Node]:
    result: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            needs = _placeholder_requires_grad(node)
        elif node.op == "get_attr":
            needs = bool(_trainable_params(node, gm, constant_inputs))
        elif node.op in _CALLS:
            reads = any(n in result for n in node.all_input_nodes) or bool(_trainable_params(node, gm, constant_inputs))
            silent = node.target == "detach" or _runs_without_grad(node)
            needs = reads and not silent and _differentiable_value(node)
        else:
            needs = False
        if needs:
            result.add(node)
            if node in writers:  # writing a recorded value into a tensor makes it (and its views) recorded
                result.update(a for n in node.all_input_nodes for a in aliases.aliases(n) if _differentiable_value(a))
    return result


def _runs_without_grad(node: fx.Node) -> bool:
    """An fxopt helper declared to run its callable without grad."""
    helper = declared(node.target) if node.op == "call_function" else None
    return helper is not None and bool(helper.runs_without_grad)


def _add_with_inputs(live: set[fx.Node], roots) -> None:
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)


def _grad_live(differentiated: Collection[fx.Node], opaque: list[fx.Node], writers: list[fx.Node],
               aliases: AliasInfo | None) -> set[fx.Node]:
    """Nodes a differentiated output depends on, and everything that may write into one of them."""
    live: set[fx.Node] = set()
    _add_with_inputs(live, [*differentiated, *opaque])
    changed = True
    while changed:  # a write into anything that may share storage with a live value (or an input) is live
        changed = False
        for writer in writers:
            if writer in live:
                continue
            touched = [a for n in (writer, *writer.all_input_nodes) for a in aliases.aliases(n)]
            if any(a in live or a.op in ("placeholder", "get_attr") for a in touched):
                _add_with_inputs(live, [writer])
                changed = True
    return live


def analyze_grad_needs(gm: fx.GraphModule, differentiated: Collection[fx.Node],
                       constant_inputs: frozenset[str] = frozenset()) -> GradNeeds:
    """What needs a gradient when only `differentiated` output values are differentiated (module docstring);
    `constant_inputs` adds to the placeholders capture marked as parameters or buffers."""
    constant_inputs = frozenset(constant_inputs) | constant_placeholders(gm)
    kinds = {n: effects(n, gm) for n in gm.graph.nodes if n.op in _CALLS}
    writers = [n for n, k in kinds.items() if MUTATION in k]
    aliases = AliasInfo(gm) if writers else None
    requires = _requires_grad(gm, constant_inputs, writers, aliases)
    live = _grad_live(differentiated, [n for n, k in kinds.items() if OPAQUE in k], writers, aliases)
    no_grad = tuple(n for n in gm.graph.nodes
                    if n.op in _CALLS and n in requires and n not in live and n.users)
    trainable = {name: n for n in gm.graph.nodes for name in _trainable_params(n, gm, constant_inputs)}
    needing = tuple(sorted({name for name, n in trainable.items() if n in live}))
    losing = tuple(sorted(set(trainable) - set(needing)))
    inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name not in constant_inputs
                   and n in live and n in requires)
    return GradNeeds(frozenset(requires), frozenset(live), no_grad, needing, losing, inputs)


def _fake_like(val: torch.Tensor, mode, requires_grad: bool) -> torch.Tensor:
    with mode:
        t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    return t.requires_grad_(requires_grad and (t.is_floating_point() or t.is_complex()))


def really_saved(node: fx.Node, gm: fx.GraphModule, requires_grad: Collection[fx.Node]) -> SavedForBackward | None:
    """What `node`'s op keeps for backward, observed on fake tensors; None if it cannot run alone."""
    vals = [n.meta.get("val") for n in node.all_input_nodes]
    mode = _torch_private.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    mode = mode or _torch_private.fake_tensor_mode()
    fakes: dict[fx.Node, object] = {}
    for n in node.all_input_nodes:
        if n.op == "get_attr":
            value = _attribute(gm, n.target)
            fakes[n] = mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
        elif isinstance(n.meta.get("val"), torch.Tensor):
            fakes[n] = _fake_like(n.meta["val"], mode, n in requires_grad)
        else:
            return None
    args = fx.node.map_arg(node.args, fakes.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, fakes.__getitem__)
    kept: list[torch.Tensor] = []

    def pack(t):
        kept.append(t)
        return t

    try:
        with mode, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if node.op == "call_module":
                module = gm.get_submodule(node.target)
                state = {k: mode.from_tensor(v) for k, v in [*module.named_parameters(), *module.named_buffers()]}
                out = torch.func.functional_call(module, state, args, kwargs)
            elif node.op == "call_method":
                out = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                out = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that cannot run on fake tensors alone: no observation
        return None
    key = _torch_private.untyped_storage_key
    saved_keys = {key(t) for t in kept}
    out_keys = {key(t) for t in _torch_private.tree_leaves(out) if isinstance(t, torch.Tensor)}
    saved_inputs = tuple(n for n, f in fakes.items() if isinstance(f, torch.Tensor) and key(f) in saved_keys)
    return SavedForBackward(bool(out_keys & saved_keys), saved_inputs, True)
