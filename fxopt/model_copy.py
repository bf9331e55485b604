"""Copies of models: one that shares no state with it (inference results), and a graph module's
copy that shares its state but not its graph (`graph_module_copy`; `graph_snapshot` without deep-copying
node values).

`independent_copy` tries `copy.deepcopy` first. Some models cannot be deep-copied: a
`threading.Lock` attribute, a file handle, old-style `torch.nn.utils.weight_norm` (its computed
`weight` is a non-leaf tensor, which deepcopy refuses). Those get a structural copy: every
module object is copied, with its own parameter / buffer / submodule / hook dicts, every tensor
(parameters, buffers, plain tensor attributes) cloned once (tied weights stay tied), and other
attributes (the lock, a config object) shared. If even that fails, FxoptError: an inference
result never silently shares the caller's model.
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx

from . import _torch_private
from .errors import FxoptError


def graph_module_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule running a copy of `gm`'s graph (its own nodes, each with its own `meta` dict) on `gm`'s
    submodules, parameters and buffers (shared, not copied): edit or re-annotate it without touching `gm`."""
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def graph_snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` on a copy of its graph (same attributes, codegen, node meta dicts copied but their values shared): the
    graph as it is now, which later edits of `gm` leave alone. Its code is generated when first needed: most
    snapshots are only analysed, never run (HF MobileNetV2: 10-25 ms a snapshot saved)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    _torch_private.set_graph_codegen(graph, _torch_private.graph_codegen(gm.graph))
    return _torch_private.lazily_compiled_graph_module(gm, graph)


def independent_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with its own modules and tensors (see module docstring)."""
    try:
        return copy.deepcopy(model)
    except Exception as deep_error:  # noqa: BLE001 - any object deepcopy refuses
        try:
            return _copy_module(model, {})
        except Exception as e:  # noqa: BLE001
            raise FxoptError(
                f"fxopt.optimize needs its own copy of {type(model).__name__} for an inference result (so that "
                f".to(), .half() or .train() on the result leave your model alone), but it cannot be copied: "
                f"deepcopy failed ({type(deep_error).__name__}: {deep_error}) and so did copying its modules and "
                f"tensors ({type(e).__name__}: {e}). Pass a copy you made yourself, or mode='training' "
                f"(which shares the model's parameters by design)") from e


def _copy_tensor(t: torch.Tensor, memo: dict) -> torch.Tensor:
    if id(t) not in memo:
        data = t.detach().clone()
        memo[id(t)] = torch.nn.Parameter(data, requires_grad=t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else data
    return memo[id(t)]


def _copy_value(key: str, value, memo: dict):
    """A module attribute in the copy: tensors cloned, containers fxopt or torch mutate copied, the rest shared."""
    if isinstance(value, torch.Tensor):
        return _copy_tensor(value, memo)
    if key in ("_parameters", "_buffers"):
        return {name: None if t is None else _copy_tensor(t, memo) for name, t in value.items()}
    if key == "_modules":
        return {name: None if m is None else _copy_module(m, memo) for name, m in value.items()}
    if isinstance(value, (dict, set)) and key.startswith("_"):  # hook dicts, _non_persistent_buffers_set
        return type(value)(value)
    return value


def _copy_module(module: torch.nn.Module, memo: dict) -> torch.nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    clone = object.__new__(type(module))
    memo[id(module)] = clone
    clone.__dict__.update({key: _copy_value(key, value, memo) for key, value in module.__dict__.items()})
    return clone


def constants_as_attributes(gm: fx.GraphModule, positions: list[int], example_inputs: list) -> fx.GraphModule:
    """A copy of `gm` whose placeholders at `positions` are get_attr of the (shared, not copied) tensors."""
    frozen = graph_module_copy(gm)
    placeholders = [n for n in frozen.graph.nodes if n.op == "placeholder"]
    first_op = next(n for n in frozen.graph.nodes if n.op != "placeholder")
    for k, i in enumerate(positions):
        node, value = placeholders[i], example_inputs[i]
        attr = f"_fxopt_constant_{k}"
        if isinstance(value, torch.nn.Parameter):
            frozen.register_parameter(attr, value)
        else:
            frozen.register_buffer(attr, value)
        with frozen.graph.inserting_before(first_op):
            get = frozen.graph.get_attr(attr)
        get.meta.update(node.meta)
        node.replace_all_uses_with(get)
        frozen.graph.erase_node(node)
    frozen.recompile()
    return frozen
