"""`fxopt.optimize`: capture a model, run the pipeline, return the guarded optimized model with its report."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..capture import check_initialized
from ..capture.direct_reads import read_attributes_directly
from ..capture.saving import keep_graph_when_pickled
from ..collector import heap_frozen
from ..errors import FxoptError
from ..guards import CALL, TRAIN_MODE, Guard, GuardSet, model_state_guards
from ..model_copy import independent_copy
from ..passes import PASSES
from ..passes._checkpoint_region import CheckpointedRegion
from ..passes.base import INFERENCE, TRAINING, PassContext
from ..pipeline.instruments import Instrument
from ..pipeline.pipelines import build_pipeline, resolve_mode
from ..pipeline.run import from_model, run_pipeline
from ..pipeline.verify import Verifier
from .result import DYNAMIC_BATCH_SETTING, OptimizedModule, Variant


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


def optimize(model: torch.nn.Module, example_inputs, *, mode: str = "auto", passes: Sequence[str] | None = None,
             verify: bool = False, instruments: Sequence[Instrument] = (), **pass_options) -> OptimizedModule:
    """Optimize `model` for `example_inputs`; the result carries `.fxopt_report`.

    mode: "inference", "training", or "auto" (training if `model.training`).
    passes: pass names to run in order; None runs the default pipeline for the mode.
    verify: compare the optimized model with the original after every pass (outputs; in
        training also gradients and buffers) and raise FxoptError at the first mismatch.
    instruments: observers of the pipeline (fxopt.pipeline.instruments).
    pass_options: options for the selected passes, e.g. memory_budget=0.5.

    The result is an `OptimizedModule` (fxopt/frontends/result.py) standing for the model: in
    inference for a private copy of it, so `.to()`, `.half()` or `.train()` on the result leave
    the caller's model alone; in training for the model itself (its parameters, which an
    optimizer updates). Every call checks the facts the optimization relied on (guards) and,
    when one changed, optimizes again for the new state or runs the model as written.
    """
    if not isinstance(model, torch.nn.Module):
        raise FxoptError(f"expected a torch.nn.Module, got {type(model).__name__}")
    example_inputs = normalize_inputs(example_inputs)
    _check_pass_names(passes)
    mode = resolve_mode(mode, model.training)
    settings = {"mode": mode, "passes": passes, "pass_options": dict(pass_options)}
    build_pipeline(mode, passes, pass_options)  # bad options fail here, before any copy or capture
    if isinstance(model, OptimizedModule):
        model = _model_to_optimize_again(model)
    check_initialized(model)  # a lazy module cannot be copied: say why, not that deepcopy failed
    source = independent_copy(model) if mode == INFERENCE else model
    first = build_variant(source, example_inputs, {}, settings, verify=verify, instruments=instruments)
    return OptimizedModule(source, first, build_variant, settings)


def _model_to_optimize_again(result: OptimizedModule) -> torch.nn.Module:
    """What an fxopt result optimized again captures: its current variant, whose passes then find nothing
    left to do; or, where that variant holds checkpointed regions (torch.utils.checkpoint calls, which
    export would inline and drop), the model it stands for, optimized anew (the same parameters and buffers)."""
    if any(isinstance(m, CheckpointedRegion) for m in result.graph_module.modules()):
        return result.original
    return result.graph_module


def build_variant(source: torch.nn.Module, args: tuple, kwargs: dict, settings: dict, *, verify: bool = False,
                  instruments: Sequence[Instrument] = ()) -> Variant:
    """Capture `source` as it is now, run the pipeline, and collect the guards the result relies on.

    Also how a result optimizes itself again when its model's state or its calls' batch size changed:
    the model is exported for the example's sizes, or with `settings["dynamic_batch"]` for any batch size.
    """
    mode = settings["mode"]
    pass_options = settings["pass_options"]
    pipeline = build_pipeline(mode, settings["passes"], pass_options)
    verifier = None
    if verify:  # the reference runs on the model as it is now, before capture
        verifier = Verifier(source, args, training=mode == TRAINING,
                            differentiable=pass_options.get("differentiable_outputs"))
    with heap_frozen():  # collections walk what capture and the passes make, not the caller's whole heap
        captured = from_model(source, args, kwargs, dynamic_batch=settings.get(DYNAMIC_BATCH_SETTING, False))
        ctx = PassContext(mode, dict(pass_options))
        report = run_pipeline(captured, pipeline, ctx, instruments=instruments, verifier=verifier)
    keep_graph_when_pickled(captured.module)  # also the GraphModules passes added
    for module in captured.module.modules():
        if isinstance(module, torch.fx.GraphModule):
            read_attributes_directly(module)
    guards = GuardSet(ctx.guards)
    guards.extend(_capture_guards(captured, settings.get(DYNAMIC_BATCH_SETTING, False)))
    guards.extend(model_state_guards(source, "fxopt.optimize", storage=mode == INFERENCE,
                                     graph_paths=[g.path for g in captured.graphs]))
    untrue = guards.bind(source).untrue_now()
    if untrue:  # not facts about this model (a target it does not have): checking them would always fail
        guards = GuardSet(g for g in guards if g not in untrue)
        for g in untrue:
            report.guard_events[f"{g.owner} recorded {g.describe()!r}, not true of the model: not checked"] += 1
    return Variant(captured.module, guards, report)


_CALL_REASONS = {  # by whether the batch dimension was exported dynamic
    False: "torch.export specialized the graph to calls like the example; a call with another batch size "
           "optimizes the model again once, with the batch dimension dynamic",
    True: "torch.export specialized the graph to calls like the example, but for the batch size",
}


def _capture_guards(captured, dynamic_batch: bool) -> list[Guard]:
    """What capture relied on: the call the whole-model graph was exported for, the modes it baked in."""
    guards = []
    for g in captured.graphs:
        if g.path == "" and getattr(g, "call", None) is not None:
            guards.append(Guard(CALL, "", g.call, "capture", _CALL_REASONS[dynamic_batch]))
        for path, flag in getattr(g, "training_flags", {}).items():
            target = f"{g.path}.{path}" if g.path and path else (g.path or path)
            guards.append(Guard(TRAIN_MODE, target, flag, "capture",
                                "torch.export baked this mode into batch_norm(training=) / dropout(train=)"))
    return guards


def available_passes() -> list[str]:
    return list(PASSES)
