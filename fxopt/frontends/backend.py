"""The torch.compile backend "fxopt": fxopt's passes on each Dynamo graph, then Inductor.

    compiled = torch.compile(model, backend="fxopt")                 # found via the entry point
    compiled = torch.compile(model, backend="fxopt", options={"inner": "eager", "report": print})
    compiled = torch.compile(model, backend=fxopt.backend(memory_budget=0.5))   # options checked now

Dynamo hands a backend one graph per captured region (a graph break gives several; DDP's
optimizer splits at bucket boundaries). Each graph gets the same pass pipeline as
`fxopt.optimize`, in the Dynamo form: no `call_module`, parameters and buffers are graph
inputs (`torch.conv2d(x, weight_placeholder, ...)`), named in `PassContext.constant_inputs`.
Mode: "training" when autograd will differentiate the graph (grad enabled and an input
requires grad), else "inference".

Per pass on this path:
  fold_conv_bn            weights are placeholders, so the fold is emitted as graph ops on them:
                          it always follows the current parameter values.
  inplace_relu            skipped: AOTAutograd functionalizes the graph, which undoes in-place ops.
  checkpoint_activations  not run as a pass: with `memory_budget` (a fraction or a size, as in
                          fxopt.optimize) fxopt's planner tags what AOTAutograd's min-cut
                          partitioner recomputes (fxopt.frontends.backend_memory).

Hand-off (`inner`):
  "inductor"   Inductor's compile_fx. In inference, parameter inputs become constants of the
               graph (Inductor freezing: the fold is constant-folded, weights pre-packed), and
               every call checks that each parameter input is the same tensor, with the same
               storage (`p.data = t` replaces it) at the same version (in-place writes bump it);
               if one changed, the graph falls back, for good, to a non-frozen compile in which
               the fold is recomputed per call. Not detected: a write through `p.data`
               (`p.data.mul_(2)`), which bumps no version counter — Inductor's own freezing has
               the same blind spot. `freeze=False` compiles non-frozen from the start.
  "aot_eager"  AOTAutograd with Inductor's decompositions (except those of random ops, so dropout
               draws the same numbers as eager and torch's own aot_eager) and min-cut partitioner,
               no code generation (debugging; without the decompositions a train-mode BatchNorm
               under a memory budget fails in backward, as with torch's own aot_eager).
  "eager"      the optimized fx graph as is (debugging).

Options: passes (None: the default pipeline of the mode), memory_budget (a fraction or a size;
training graphs), differentiable_outputs (training graphs; passed to prune_dead_grads), inner, freeze,
verify (compare the graph before/after each pass: outputs, input gradients, updated buffers),
report (a callable taking each graph's `Report`, or a path to which one JSON line per graph is
appended). Unknown or malformed options raise FxoptError (wrapped by Dynamo as
BackendCompilerFailed when they reach it through `options=`; `fxopt.backend(...)` checks at once).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import warnings
from collections.abc import Callable

import torch
import torch.fx as fx

from .. import _torch_private
from ..passes.checkpoint_activations import parse_budget
from ..analysis.shapes import propagate_shapes
from ..capture import CapturedGraph
from ..errors import FxoptError
from ..passes import PASSES
from ..passes.base import INFERENCE, TRAINING, PassContext
from ..pipeline.manager import PassManager
from ..pipeline.pipelines import DEFAULT_PIPELINES, ONLY_WITH_OPTION, build_pipeline
from ..pipeline.report import PassReport, Report
from ..pipeline.verify import max_difference, run_step
from .backend_memory import compile_with_memory_budget

INNER_COMPILERS = ("inductor", "aot_eager", "eager")

# Passes that do not run on Dynamo graphs, and why (shown in the report).
SKIPPED_ON_BACKEND = {
    "inplace_relu": "no-op under torch.compile: AOTAutograd functionalizes the graph, undoing in-place ops",
    "checkpoint_activations": "on torch.compile, fxopt's planner tags what AOTAutograd's min-cut partitioner "
                              "recomputes (fxopt.frontends.backend_memory)",
}

_graph_numbers = itertools.count()


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    passes: tuple[str, ...] | None = None
    memory_budget: float | None = None
    differentiable_outputs: object = None
    inner: str = "inductor"
    freeze: bool = True
    verify: bool = False
    report: Callable[[Report], object] | str | os.PathLike | None = None

    @classmethod
    def parse(cls, options: dict | None) -> BackendOptions:
        """Check `options` (as given to torch.compile); anything unknown or malformed is a FxoptError."""
        options = dict(options or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise FxoptError(f"unknown option {unknown[0]!r} for backend 'fxopt'; options: {', '.join(known)}")
        parsed = cls(**options)
        parsed._check()
        if isinstance(parsed.passes, str):
            parsed = dataclasses.replace(parsed, passes=(parsed.passes,))
        elif parsed.passes is not None:
            parsed = dataclasses.replace(parsed, passes=tuple(parsed.passes))
        return parsed

    def _check(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise FxoptError(f"unknown inner compiler {self.inner!r}; expected one of: {', '.join(INNER_COMPILERS)}")
        if self.passes is not None:
            names = [self.passes] if isinstance(self.passes, str) else list(self.passes)
            unknown = [n for n in names if n not in PASSES and n not in SKIPPED_ON_BACKEND]
            if unknown:
                raise FxoptError(f"unknown pass {unknown[0]!r}; available passes: {', '.join(PASSES)}")
        if self.memory_budget is not None:
            parse_budget(self.memory_budget)  # a fraction or a size with a unit, as in fxopt.optimize
            if self.inner == "eager":
                raise FxoptError("memory_budget needs inner='inductor' or 'aot_eager' (the eager hand-off has no "
                                 "partitioner to recompute activations)")
        for flag in ("freeze", "verify"):
            if not isinstance(getattr(self, flag), bool):
                raise FxoptError(f"option {flag!r} must be True or False, got {getattr(self, flag)!r}")
        if self.report is not None and not (callable(self.report) or isinstance(self.report, (str, os.PathLike))):
            raise FxoptError(f"option 'report' must be a callable or a file path, got {type(self.report).__name__}")


class FxoptBackend:
    """A torch.compile backend with fixed options; `reports` holds one Report per compiled graph."""

    def __init__(self, **options):
        self.options = BackendOptions.parse(options)
        self.reports: list[Report] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        return compile_graph(gm, list(example_inputs), self.options, self.reports.append)


def fxopt_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, **unexpected):
    """The backend registered as "fxopt": `torch.compile(model, backend="fxopt", options={...})`."""
    if unexpected:
        raise FxoptError(f"backend 'fxopt' takes options={{...}}, not {', '.join(sorted(unexpected))}=")
    return compile_graph(gm, list(example_inputs), BackendOptions.parse(options))


def backend(**options) -> FxoptBackend:
    """A backend object with `options` checked now: `torch.compile(model, backend=fxopt.backend(...))`."""
    return FxoptBackend(**options)


def compile_graph(gm: fx.GraphModule, example_inputs: list, options: BackendOptions,
                  on_report: Callable[[Report], object] | None = None):
    """Optimize one Dynamo graph with fxopt's pipeline, report, and hand it to the inner compiler."""
    training = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                               for x in example_inputs)
    mode = TRAINING if training else INFERENCE
    constant_inputs = _torch_private.dynamo_parameter_placeholders(gm, example_inputs)
    to_run, skipped = _select_passes(mode, options)
    pass_options = {}
    if training and options.differentiable_outputs is not None:
        pass_options["differentiable_outputs"] = options.differentiable_outputs
    pipeline = build_pipeline(mode, to_run, pass_options)

    name = f"dynamo_graph_{next(_graph_numbers)}"
    fake_inputs = _reuse_dynamo_shapes(gm, example_inputs)
    verifier = GraphVerifier(gm, example_inputs, training) if options.verify else None
    ctx = PassContext(mode, pass_options, constant_inputs, frontend="backend")
    report = PassManager(pipeline, verifier=verifier).run(gm, [CapturedGraph(name, gm, fake_inputs)], ctx)
    for pass_name, reason in skipped:
        report.passes.append(PassReport(pass_name, skipped=reason))
    if training and options.memory_budget is not None:  # fxopt's planner tags what the partitioner recomputes
        compiled = compile_with_memory_budget(gm, example_inputs, options.memory_budget, options.inner, report)
        _deliver(report, options.report, on_report)
        return compiled
    _deliver(report, options.report, on_report)
    if options.inner == "eager":
        return gm
    if options.inner == "aot_eager":
        return _torch_private.aot_eager_compile(gm, example_inputs)
    if not training and options.freeze and constant_inputs:
        return FrozenInference(gm, example_inputs, constant_inputs)
    return _torch_private.inductor_compile(gm, example_inputs)


def _reuse_dynamo_shapes(gm: fx.GraphModule, example_inputs: list) -> tuple:
    """Fill `node.meta["val"]` from the fake tensors Dynamo already computed; return the fake inputs.

    Shapes are then re-propagated (after a pass changes the graph) from Dynamo's fake inputs,
    not from the real parameters, which would have to be converted to fake tensors each time.
    """
    if not all("example_value" in n.meta for n in gm.graph.nodes if n.op not in ("output", "get_attr")):
        propagate_shapes(gm, tuple(example_inputs))
        return tuple(example_inputs)
    for node in gm.graph.nodes:
        if "example_value" in node.meta:
            node.meta.setdefault("val", node.meta["example_value"])
    return tuple(n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder")


def _select_passes(mode: str, options: BackendOptions) -> tuple[list[str], list[tuple[str, str]]]:
    """(passes to run, [(pass skipped on this path, why)])."""
    if options.passes is not None:
        names = list(options.passes)
    else:
        given = {"memory_budget"} if options.memory_budget is not None else set()
        names = [n for n in DEFAULT_PIPELINES[mode] if ONLY_WITH_OPTION.get(n, "") in ("", *given)]
    if options.memory_budget is not None and "checkpoint_activations" not in names:
        names.append("checkpoint_activations")
    skipped = [(n, SKIPPED_ON_BACKEND[n]) for n in names if n in SKIPPED_ON_BACKEND]
    if mode == INFERENCE:
        skipped = [(n, why + " (inference: nothing is saved for backward)" if n == "checkpoint_activations" else why)
                   for n, why in skipped]
    return [n for n in names if n not in SKIPPED_ON_BACKEND], skipped


def _deliver(report: Report, target, on_report) -> None:
    if on_report is not None:
        on_report(report)
    if target is None:
        return
    if callable(target):
        target(report)
        return
    with open(target, "a", encoding="utf-8") as f:
        f.write(json.dumps(report.to_dict(), default=str) + "\n")


class FrozenInference:
    """Inductor with the parameter inputs frozen into constants, guarded against parameter changes.

    Each call checks that every parameter input is the tensor seen at compile time, with the same
    storage (`p.data = t` swaps it without touching the version) at the same `_version` (bumped by
    every in-place change: optimizer steps, `copy_`, `load_state_dict`). On a mismatch the frozen
    code is never used again: the optimized graph is compiled without freezing (the fold then runs
    on the current parameters each call) and a warning says so. A write through `p.data`
    (`p.data.mul_(2)`) changes neither and is not detected, as with Inductor's own freezing.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: list, constant_inputs: frozenset[str]):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.constant_positions = [i for i, n in enumerate(placeholders) if n.name in constant_inputs]
        self.runtime_positions = [i for i, n in enumerate(placeholders) if n.name not in constant_inputs]
        self.constants = [example_inputs[i] for i in self.constant_positions]
        self.state = _frozen_state(self.constants)
        self.unfrozen_graph = _copy_graph_module(gm)
        frozen_gm = _constants_as_attributes(gm, self.constant_positions, example_inputs)
        with torch.no_grad():
            self.frozen = _torch_private.inductor_compile(
                frozen_gm, [example_inputs[i] for i in self.runtime_positions], freezing=True)
        self.unfrozen = None

    def __call__(self, *args):
        if self.unfrozen is None:
            constants = [args[i] for i in self.constant_positions]
            if all(a is c for a, c in zip(constants, self.constants)) and _frozen_state(constants) == self.state:
                out = self.frozen(*[args[i] for i in self.runtime_positions])
                self.state = _frozen_state(constants)  # the graph's own buffer updates are fine
                return out
            warnings.warn("fxopt: a parameter changed after torch.compile froze it; this graph now runs a "
                          "non-frozen compile that recomputes the folded weights on every call", stacklevel=2)
            self.unfrozen = _torch_private.inductor_compile(self.unfrozen_graph, list(args))
            self.frozen = None
        return self.unfrozen(*args)


def _frozen_state(tensors: list) -> tuple[list[int], list[int]]:
    """What a frozen constant must keep: its version counter and where its data lives."""
    return _torch_private.tensor_versions(tensors), [t.data_ptr() for t in tensors]


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return fx.GraphModule(gm, graph)


def _constants_as_attributes(gm: fx.GraphModule, positions: list[int], example_inputs: list) -> fx.GraphModule:
    """A copy of `gm` whose placeholders at `positions` are get_attr of the (shared, not copied) tensors."""
    frozen = _copy_graph_module(gm)
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


class GraphVerifier:
    """`verify=True` on one Dynamo graph: after each pass, the graph must compute what it did before.

    Runs on clones of the example inputs (parameters included, so buffers the graph updates,
    like BatchNorm running statistics, are compared too); in training also compares the
    gradients of every input that requires grad, for fixed random output gradients.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: list, training: bool, rtol: float = 1e-4,
                 atol: float = 1e-4):
        self.example_inputs = tuple(example_inputs)
        self.training = training
        self.rtol, self.atol = rtol, atol
        self.reference = self._run(_copy_graph_module(gm))

    def _run(self, gm: fx.GraphModule) -> dict[str, torch.Tensor]:
        with _torch_private.unset_fake_mode():
            step = run_step(gm, self.example_inputs, self.training)
        tensors = dict(step.tensors)
        tensors.update({f"input_after[{i}]": x.detach() for i, x in enumerate(step.inputs_after)})
        return tensors

    def check(self, candidate: fx.GraphModule, pass_name: str) -> float:
        worst, name, ok = max_difference(self.reference, self._run(candidate), self.rtol, self.atol)
        if not ok:
            raise FxoptError(f"verification failed after pass {pass_name!r}: {name} of the Dynamo graph differs "
                             f"from the original by up to {worst:.3g}")
        return worst
