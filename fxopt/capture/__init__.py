"""Capture: turn a model into torch.fx graphs with `torch.export` (non-strict), as much of it as exports.

`capture(model, args, kwargs)` exports the whole model first (`exporting.py`). Where export
refuses (a branch on a tensor's value, code export cannot trace), the model runs once for real
(state preserved) to record how each child is called, and each child is exported instead, so
only the part that cannot be exported stays opaque — listed with export's own reason and where
in the user's code it failed.

It returns a `Capture`: the module to hand back (the exported whole model, or a copy of the
module tree with exported children), each graph with the example values of its placeholders,
and the opaque modules. Every exported graph stands where its module was inside a
`SpecializedCall`, which runs the original module for a call or a train/eval state the graph
was not exported for; the whole-model graph is guarded by the result object (`fxopt.guards`,
from `CapturedGraph.call` and `.training_flags`). The caller's model is never modified: module containers on
the way to a replaced child are shells (`shell.py`: shallow copies whose plain attributes follow the caller's
module); leaf modules and parameters are shared.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import _torch_private
from ..errors import FxoptError
from .call_spec import CallSpec
from .exporting import export_module
from .saving import keep_graph_when_pickled
from .shell import shell_of
from .specialized import Specialization, SpecializedCall, describe_assumptions
from .stand_in import stand_in_for
from .state import record_submodule_calls

__all__ = ["Capture", "CapturedGraph", "OpaqueModule", "Specialization", "capture", "check_initialized"]


@dataclasses.dataclass
class OpaqueModule:
    """A submodule fxopt could not export and runs unchanged (its children may still be captured)."""

    path: str  # qualified name in the caller's model ("" is the model itself)
    type: str
    reason: str


@dataclasses.dataclass
class CapturedGraph:
    """One exported graph: where it sits in the result, and the example values of its placeholders."""

    path: str
    gm: fx.GraphModule
    example_inputs: tuple  # one value per placeholder, in order (tensors and non-tensor constants)
    call: CallSpec | None = None  # which calls the graph may take (None: a Dynamo graph, no capture assumptions)
    training_flags: dict[str, bool] = dataclasses.field(default_factory=dict)  # module path -> baked-in flag


@dataclasses.dataclass
class Capture:
    module: torch.nn.Module
    graphs: list[CapturedGraph]
    opaque: list[OpaqueModule]
    specialized: list[Specialization]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_torch_leaf(module: torch.nn.Module) -> bool:
    """A torch.nn layer without children (Conv2d, ReLU, ...): alone in a graph there is nothing to optimize."""
    return type(module).__module__.startswith("torch.nn.") and not any(True for _ in module.children())


def check_initialized(model: torch.nn.Module) -> None:
    """A lazy module (LazyBatchNorm2d, LazyLinear) has no shapes until its first call: say so, as the reason."""
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
            raise FxoptError(f"module {path or '<model>'!r} ({type(m).__name__}) has uninitialized parameters; "
                             f"run the model once on a batch (which sizes them) before fxopt.optimize")


class _Capturer:
    def __init__(self, model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_batch: bool):
        self.model, self.args, self.kwargs = model, args, kwargs
        self.dynamic_batch = dynamic_batch
        self.graphs: list[CapturedGraph] = []
        self.opaque: list[OpaqueModule] = []
        self.specialized: list[Specialization] = []
        self._calls: dict[str, tuple[tuple, dict]] | None = None
        self.runs_autograd: set[str] = set()  # modules whose forward calls torch.autograd inside

    @property
    def calls(self) -> dict[str, tuple[tuple, dict]]:
        """Each submodule's first call in one real run of the model (made when first needed)."""
        if self._calls is None:
            self._calls = record_submodule_calls(self.model, self.args, self.kwargs, self.runs_autograd)
        return self._calls

    def capture_call(self, module: torch.nn.Module, path: str, args: tuple, kwargs: dict) -> torch.nn.Module:
        """Capture `module` as called with (args, kwargs); return what should stand in its place."""
        if isinstance(module, SpecializedCall):  # an fxopt result optimized again: recapture its graph
            return module.with_graph(self.capture_call(module.graph_module, path, args, kwargs))
        # The whole model's graph is guarded by the result, which re-optimizes with a dynamic batch when a call
        # needs it; a child's graph stands in a SpecializedCall, which can only run the original instead.
        exported = export_module(module, args, kwargs, dynamic_batch=self.dynamic_batch or bool(path))
        if isinstance(exported, str):
            self.calls  # noqa: B018 - the real run names a module that rejects its inputs, and finds autograd calls
            if path in self.runs_autograd:
                exported = f"forward computes gradients inside (torch.autograd.grad/backward), which torch.export " \
                           f"cannot capture; export said: {exported}"
            self.opaque.append(OpaqueModule(path, type(module).__name__, exported))
            return self.capture_children(module, path)
        gm = exported.gm
        stand_in_for(module, gm)
        keep_graph_when_pickled(gm)
        flags = {p: f for p, f in exported.training_flags.items() if p == "" or _has_submodule(gm, p)}
        example_values, _ = _torch_private.tree_flatten((tuple(args), {k: kwargs[k] for k in exported.call.keywords}))
        self.graphs.append(CapturedGraph(path, gm, tuple(example_values), exported.call, flags))
        if not path:  # the result object guards the whole-model graph (fxopt.guards; the report lists its guards)
            return gm
        self.specialized.append(Specialization(path, describe_assumptions(exported.call, flags)))
        return SpecializedCall(gm, module, exported.call, flags)

    def capture_children(self, module: torch.nn.Module, path: str) -> torch.nn.Module:
        """A shell of `module` whose called children are captured (shell.py), or `module` if none was."""
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
        return shell_of(module, replaced) if replaced else module


def _has_submodule(gm: torch.nn.Module, path: str) -> bool:
    try:
        gm.get_submodule(path)
        return True
    except AttributeError:
        return False


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, dynamic_batch: bool = False) -> Capture:
    """Export `model` as called with (args, kwargs), falling back to its children (see module docstring).

    The whole model is exported for the example's sizes, or with `dynamic_batch` for any size of
    dimension 0 of its tensor arguments; children (where the whole model does not export) always
    with a dynamic batch."""
    if not isinstance(model, torch.nn.Module):
        raise FxoptError(f"expected a torch.nn.Module, got {type(model).__name__}")
    check_initialized(model)
    capturer = _Capturer(model, tuple(args), dict(kwargs or {}), dynamic_batch)
    try:
        result = capturer.capture_call(model, "", capturer.args, capturer.kwargs)
    except FxoptError:
        raise
    except Exception as e:  # noqa: BLE001 - a bug of capture, not of the model: say so
        raise FxoptError(f"fxopt's capture failed on {type(model).__name__} (an internal error of fxopt, "
                         f"the model is unchanged): {type(e).__name__}: {e}") from e
    if not capturer.graphs:
        reasons = "; ".join(f"{o.path or '<model>'} ({o.type}): {o.reason}" for o in capturer.opaque[:5])
        raise FxoptError(f"nothing in {type(model).__name__} could be captured: {reasons}")
    return Capture(result, capturer.graphs, capturer.opaque, capturer.specialized)
