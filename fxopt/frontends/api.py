"""`fxopt.optimize`: capture a model, run the pipeline, return the optimized module with its report."""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from ..analysis.shapes import propagate_shapes
from ..capture import capture
from ..capture.outputs import restore_output_type
from ..errors import FxoptError
from ..passes import PASSES
from ..passes.base import PassContext
from ..pipeline.instruments import Instrument
from ..pipeline.manager import PassManager
from ..pipeline.pipelines import build_pipeline, resolve_mode
from ..pipeline.verify import Verifier


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


def _independent_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy for an inference result, or the model itself if it cannot be copied."""
    try:
        return copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - e.g. a module holding a file handle: share, as in training
        return model


def optimize(model: torch.nn.Module, example_inputs, *, mode: str = "auto", passes: Sequence[str] | None = None,
             verify: bool = False, instruments: Sequence[Instrument] = (), **pass_options) -> torch.nn.Module:
    """Optimize `model` for `example_inputs`; the result carries `.fxopt_report`.

    mode: "inference", "training", or "auto" (training if `model.training`).
    passes: pass names to run in order; None runs the default pipeline for the mode.
    verify: compare the optimized model with the original after every pass (outputs; in
        training also gradients and buffers) and raise FxoptError at the first mismatch.
    instruments: observers of the pipeline (fxopt.pipeline.instruments).
    pass_options: options for the selected passes, e.g. memory_budget=0.5.

    In inference the result owns a copy of the model's modules, so `.to()`, `.half()` or
    `.train()` on it leave the caller's model alone; in training it shares them (and so the
    parameters an optimizer updates).
    """
    if not isinstance(model, torch.nn.Module):
        raise FxoptError(f"expected a torch.nn.Module, got {type(model).__name__}")
    example_inputs = normalize_inputs(example_inputs)
    _check_pass_names(passes)
    mode = resolve_mode(mode, model.training)
    pipeline = build_pipeline(mode, passes, pass_options)
    captured = capture(_independent_copy(model) if mode == "inference" else model, example_inputs)
    for g in captured.graphs:
        propagate_shapes(g.gm, g.example_inputs)
    verifier = Verifier(model, example_inputs, training=mode == "training",
                        differentiable=pass_options.get("differentiable_outputs")) if verify else None
    ctx = PassContext(mode, dict(pass_options))
    report = PassManager(pipeline, instruments, verifier).run(captured.module, captured.graphs, ctx)
    report.opaque = captured.opaque
    report.specialized = captured.specialized
    for g in captured.graphs:
        restore_output_type(g.gm, g.output_type)
    result = captured.module
    result.fxopt_report = report
    return result


def available_passes() -> list[str]:
    return list(PASSES)
