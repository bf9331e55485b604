"""`fxopt.optimize`: the model compiled by TorchDynamo with fxopt's backend, returned with its reports."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from ..capture import check_initialized
from ..capture.outputs import output_places
from .. import _torch_private
from ..errors import FxoptError
from ..model_copy import independent_copy
from ..output_selection import OutputPlaces, chosen_outputs, parse_differentiable_outputs
from ..passes import PASSES
from ..passes.base import INFERENCE
from ..pipeline.instruments import Instrument
from ..pipeline.pipelines import build_pipeline, resolve_mode
from ..running_modules import rejection
from ..state_preservation import preserved_state
from ..tree import tensors_in
from .backend import FxoptBackend
from .result import OptimizedModule

LOWERINGS = ("eager", "inductor")


def normalize_inputs(example_inputs) -> tuple:
    """A tuple of tensors from a tensor, a tuple or a list of tensors; anything else is an FxoptError."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, list):
        example_inputs = tuple(example_inputs)
    if not isinstance(example_inputs, tuple) or not example_inputs:
        raise FxoptError("example_inputs must be a tensor or a non-empty tuple of tensors, "
                         f"got {type(example_inputs).__name__}")
    wrong = [f"[{i}] is a {type(x).__name__}" for i, x in enumerate(example_inputs) if not isinstance(x, torch.Tensor)]
    if wrong:
        raise FxoptError(f"example_inputs must all be tensors: {', '.join(wrong)}")
    return example_inputs


def _check_pass_names(passes) -> None:
    if passes is None or isinstance(passes, str):
        return
    if not isinstance(passes, Sequence) or not all(isinstance(name, str) for name in passes):
        raise FxoptError(f"passes must be None or a list of pass names, got {passes!r}; "
                         f"available passes: {', '.join(PASSES)}")


def optimize(model: torch.nn.Module, example_inputs=None, *, example_kwargs: Mapping | None = None,
             mode: str = "auto", passes: Sequence[str] | None = None, lowering: str = "eager", verify: bool = False,
             freeze: bool = True, instruments: Sequence[Instrument] = (), **pass_options) -> OptimizedModule:
    """Optimize `model` on every call it gets: `torch.compile` with fxopt's backend; each graph's report is in
    `.fxopt_reports` (the latest in `.fxopt_report`).

    example_inputs, example_kwargs: an optional example call, compiled now (leaving no trace on the model,
        its buffers or the random generators) so the report exists at once; without one, the first call compiles.
    mode: "inference", "training", or "auto" (training if `model.training`): which options are valid, and how the
        example runs (inference: under `torch.no_grad()`). Each graph is then optimized for what its call does:
        a graph autograd will differentiate gets the training pipeline.
    passes: pass names to run in order; None runs the default pipeline for each graph's mode.
    lowering: "eager" runs the optimized graphs as they are, under eager autograd (checkpointed regions,
        in-place ReLUs, pruned gradients); "inductor" hands them to Inductor.
    verify: compare each graph with the optimized one after every pass (outputs; in training also
        gradients and buffers) and raise FxoptError at the first mismatch.
    freeze: in inference, compute what depends on the parameters alone (folded weights) once, and check on
        each call that no parameter or BatchNorm statistic changed (if one did: a warning, and that graph
        recomputes them on every call from then on); False recomputes them on every call from the start.
    instruments: observers of the pipeline (fxopt.pipeline.instruments).
    pass_options: options for the passes, e.g. memory_budget=0.5.

    The result is an `OptimizedModule` (fxopt/frontends/result.py) standing for the model: in inference for a
    private copy of it, so `.to()`, `.half()` or `.train()` on the result leave the caller's model alone; in
    training for the model itself (its parameters, which an optimizer updates).
    """
    if not isinstance(model, torch.nn.Module):
        raise FxoptError(f"expected a torch.nn.Module, got {type(model).__name__}")
    args = normalize_inputs(example_inputs) if example_inputs is not None else None
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise FxoptError(f"example_kwargs must be a dict of keyword arguments, got {type(example_kwargs).__name__}")
    _check_pass_names(passes)
    if lowering not in LOWERINGS:
        raise FxoptError(f"unknown lowering {lowering!r}; expected one of: {', '.join(LOWERINGS)}")
    mode = resolve_mode(mode, model.training)
    build_pipeline(mode, passes, pass_options)  # bad options fail here, before any copy or compile
    if mode == INFERENCE and pass_options.get("differentiable_outputs") is not None:
        raise FxoptError("differentiable_outputs applies to training; in inference nothing is differentiated")
    if isinstance(model, OptimizedModule):  # optimizing a result again: the model it stands for, with these options
        model = model.original
    check_initialized(model)  # a lazy module cannot be copied: say why, not that deepcopy failed
    source = independent_copy(model) if mode == INFERENCE else model
    backend = FxoptBackend(passes=passes, inner=lowering, verify=verify, freeze=freeze,
                           instruments=tuple(instruments), **pass_options)
    if pass_options.get("differentiable_outputs") is not None:
        backend.options = dataclasses.replace(backend.options, output_places=_output_places(
            source, args, example_kwargs, pass_options["differentiable_outputs"]))
    result = OptimizedModule(source, backend)
    if args is not None or example_kwargs:
        _compile_on_example(result, args or (), dict(example_kwargs or {}), mode)
    return result


def _output_places(model: torch.nn.Module, args: tuple | None, kwargs: Mapping | None, selection) -> OutputPlaces:
    """Where the example call's outputs are among its graph's outputs, for differentiable_outputs to name
    them (fxopt.capture.outputs); the selection checked against them."""
    if args is None and not kwargs:
        raise FxoptError("differentiable_outputs needs example inputs: the outputs it names are found on that call")
    places = output_places(model, args or (), dict(kwargs or {}))
    if places is not None:
        chosen_outputs(dict(places.entries), parse_differentiable_outputs(selection))
    return places


def _compile_on_example(result: OptimizedModule, args: tuple, kwargs: dict, mode: str) -> None:
    """Call the result once on the example, as the mode would, and put back all that call changed; where
    the model itself rejects the example, an FxoptError naming the module that failed and its inputs."""
    grad = torch.no_grad if mode == INFERENCE else torch.enable_grad
    leaves = [(t, t.requires_grad) for t in _torch_private.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.is_leaf]
    try:
        with preserved_state(result.original, (args, kwargs)), grad():
            result(*args, **kwargs)
        for t, requires_grad in leaves:  # a model writing its input gave it that write's history: values come back
            if not t.is_leaf and not _torch_private.is_view(t):  # with preserved_state, the history goes here
                t.detach_().requires_grad_(requires_grad)
    except FxoptError:
        raise
    except Exception as compiled_error:
        with grad():
            rejection = _rejection(result.original, args, kwargs)
        if rejection is None:  # eager runs it: the failure is fxopt's or Dynamo's, as it is
            raise
        raise rejection from compiled_error


def _rejection(model: torch.nn.Module, args: tuple, kwargs: dict) -> FxoptError | None:
    """Why `model` itself (uncompiled) rejects the call, naming the innermost module that failed and the
    inputs it was given (`fxopt.running_modules.rejection`); None if it runs."""
    failed = rejection(model, args, kwargs)
    if failed is None:
        return None
    kind = type(failed.module).__name__
    where = f"module {failed.path!r} ({kind})" if failed.path else f"the model ({kind})"
    error = FxoptError(f"{type(model).__name__} rejected the example inputs [{_described([*args, *kwargs.values()])}]: "
                       f"{where} failed on inputs [{_described([*failed.args, *failed.kwargs.values()])}]: "
                       f"{type(failed.error).__name__}: {failed.error}")
    error.__cause__ = failed.error
    return error


def _described(values: list) -> str:
    """`(2, 3, 32, 32) float32` for each tensor among `values`."""
    shapes = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors_in(values)]
    return ", ".join(shapes) or "no tensors"


def available_passes() -> list[str]:
    return list(PASSES)
