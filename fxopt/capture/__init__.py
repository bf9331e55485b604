"""Capture: turn a model into torch.fx graphs, as much of it as can be traced.

`capture(model, example_inputs)` returns a `Capture`: the module to hand back (a GraphModule
when the whole model traced, else a copy of the module tree whose traceable parts are
GraphModules), each graph with the example inputs of its placeholders, and the modules that
stayed opaque, with the reason. The caller's model is never modified: module containers on
the way to a replaced child are shallow copies; leaf modules and parameters are shared.

The model runs once first (recording each submodule's first call, and naming the module that
fails if the inputs are rejected). Each module is then traced as called there (`tracer.py`);
a graph valid only for some calls — fixed flag arguments, the example's shapes, the train/eval
mode it read — is wrapped in a `SpecializedCall` that runs the original module for any other
call. A module that cannot be traced stays opaque and its children are captured instead.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect

import torch
import torch.fx as fx

from ..errors import FxoptError
from .specialized import Specialization, SpecializedCall, is_specializable, tensor_spec
from .outputs import output_type_name
from .stand_in import stand_in_for
from .state import flipped_mode, record_submodule_calls
from .tracer import OpaqueModule, trace_with_opaque_leaves

__all__ = ["Capture", "CapturedGraph", "OpaqueModule", "Specialization", "capture"]


@dataclasses.dataclass
class CapturedGraph:
    """One traced graph: where it sits in the result, and the example values of its placeholders."""

    path: str
    gm: fx.GraphModule
    example_inputs: tuple
    output_type: str | None = None  # import path of a dict-subclass result fx turned into a dict


@dataclasses.dataclass
class Capture:
    module: torch.nn.Module
    graphs: list[CapturedGraph]
    opaque: list[OpaqueModule]
    specialized: list[Specialization]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclasses.dataclass
class _BoundCall:
    """A recorded call, split for tracing: placeholder values, fixed flag values, fx's concrete_args."""

    values: tuple  # one value per placeholder, in order
    fixed: dict  # parameter name -> the non-tensor value the graph is specialized to
    concrete_args: dict  # the same, keyed the way fx names them ("*args", "**kwargs" for varargs)


def _bind_call(module: torch.nn.Module, args: tuple, kwargs: dict) -> _BoundCall | str:
    """Split a recorded call of `module` (see _BoundCall), or say why it cannot be traced."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values, fixed, concrete = [], {}, {}
    for name, value in bound.arguments.items():
        param = bound.signature.parameters[name]
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            entries = value.values() if isinstance(value, dict) else value
            if not all(is_specializable(v) for v in entries):
                return f"takes tensors or objects through *args/**kwargs ({name}={_short(value)})"
            fixed[name] = value
            concrete[("*" if param.kind == param.VAR_POSITIONAL else "**") + name] = value
            continue
        if not isinstance(value, torch.Tensor):
            if not is_specializable(value):
                return f"argument {name!r} is a {type(value).__name__}"
            fixed[name] = concrete[name] = value
        values.append(value)
    return _BoundCall(tuple(values), fixed, concrete)


def _short(value) -> str:
    return f"{{{', '.join(value)}}}" if isinstance(value, dict) else f"{len(value)} values"


def _depends_on_training_flag(module: torch.nn.Module, call: _BoundCall, example_call: tuple, gm: fx.GraphModule) -> bool:
    """Whether tracing baked `self.training` into `gm` (`F.dropout(x, p, self.training)`): the other mode traces differently.

    Such a graph must not run after the caller switches the result to the other mode.
    """
    with flipped_mode(module):
        other = trace_with_opaque_leaves(module, concrete_args=call.concrete_args or None, example_call=example_call)
    return other.gm is None or other.gm.code != gm.code


def _is_torch_leaf(module: torch.nn.Module) -> bool:
    """A torch.nn layer without children (Conv2d, ReLU, ...): alone in a graph there is nothing to optimize."""
    return fx.Tracer().is_leaf_module(module, "") and not any(True for _ in module.children())


class _Capturer:
    def __init__(self, model: torch.nn.Module, example_inputs: tuple):
        self.model = model
        self.example_inputs = example_inputs
        self.graphs: list[CapturedGraph] = []
        self.opaque: list[OpaqueModule] = []
        self.specialized: list[Specialization] = []
        self.outputs: dict[str, object] = {}
        self.calls = record_submodule_calls(model, example_inputs, self.outputs)

    def capture_call(self, module, path: str, args: tuple, kwargs: dict) -> torch.nn.Module:
        """Capture `module` as called with (args, kwargs); return what should stand in its place."""
        if isinstance(module, SpecializedCall):  # an fxopt result optimized again: recapture its graph
            graph_args, graph_kwargs, _ = module.graph_arguments(args, kwargs)
            self.specialized.append(Specialization(path, module.describe()))
            return module.with_graph(self.capture_call(module.graph_module, path, graph_args, graph_kwargs))
        call = _bind_call(module, args, kwargs)
        if isinstance(call, str):
            self.opaque.append(OpaqueModule(path, type(module).__name__, call))
            return self.capture_children(module, path)
        traced = trace_with_opaque_leaves(module, concrete_args=call.concrete_args or None,
                                          example_call=(args, kwargs))
        if traced.gm is None:
            self.opaque.append(dataclasses.replace(traced.opaque[0], path=path))
            return self.capture_children(module, path)
        gm = traced.gm
        mode_bound = _depends_on_training_flag(module, call, (args, kwargs), gm)
        stand_in_for(module, gm)
        self.graphs.append(CapturedGraph(path, gm, call.values, output_type_name(self.outputs.get(path))))
        for leaf in traced.opaque:
            self.opaque.append(dataclasses.replace(leaf, path=_join(path, leaf.path)))
            original = gm.get_submodule(leaf.path)
            replacement = self.capture_children(original, _join(path, leaf.path))
            if replacement is not original:
                parent, _, name = leaf.path.rpartition(".")
                setattr(gm.get_submodule(parent), name, replacement)
        specs = {}
        if traced.shape_specialized:
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
            specs = {name: tensor_spec(v) for name, v in bound.arguments.items() if isinstance(v, torch.Tensor)}
        if call.fixed or specs or mode_bound:
            guarded = SpecializedCall(gm, module, call.fixed, specs, module.training if mode_bound else None)
            self.specialized.append(Specialization(path, guarded.describe()))
            return guarded
        return gm

    def capture_children(self, module: torch.nn.Module, path: str) -> torch.nn.Module:
        """A shallow copy of `module` whose called children are captured (or `module` if none was)."""
        replaced = {}
        for name, child in module.named_children():
            child_path = _join(path, name)
            if _is_torch_leaf(child):
                continue
            if child_path in self.calls:
                new_child = self.capture_call(child, child_path, *self.calls[child_path])
            else:  # never called itself (a ModuleList, or unused): its children may have been
                new_child = self.capture_children(child, child_path)
            if new_child is not child:
                replaced[name] = new_child
        if not replaced:
            return module
        shell = copy.copy(module)
        shell._modules = {**module._modules, **replaced}
        return shell


def capture(model: torch.nn.Module, example_inputs: tuple) -> Capture:
    if not isinstance(model, torch.nn.Module):
        raise FxoptError(f"expected a torch.nn.Module, got {type(model).__name__}")
    capturer = _Capturer(model, example_inputs)
    result = capturer.capture_call(model, "", example_inputs, {})
    if not capturer.graphs:
        reasons = "; ".join(f"{o.path or '<model>'} ({o.type}): {o.reason}" for o in capturer.opaque[:5])
        raise FxoptError(f"nothing in {type(model).__name__} could be traced: {reasons}")
    return Capture(result, capturer.graphs, capturer.opaque, capturer.specialized)
