"""The torch.compile backend "fxopt": fxopt's passes on each Dynamo graph, then Inductor.

    compiled = torch.compile(model, backend="fxopt")                 # found via the entry point
    compiled = torch.compile(model, backend="fxopt", options={"inner": "eager", "report": print})
    compiled = torch.compile(model, backend=fxopt.backend(memory_budget=0.5))   # options checked now

Dynamo hands a backend one graph per captured region (a graph break gives several; DDP's
optimizer splits at bucket boundaries). Each graph goes the way of `fxopt.optimize`
(fxopt/pipeline/run.py), with the passes `build_pipeline` chooses, in the Dynamo form: no
`call_module`, parameters and buffers are graph inputs (`torch.conv2d(x, weight_placeholder,
...)`), named in `PassContext.constant_inputs`. (torch 2.6-2.12 with Dynamo's
`inline_inbuilt_nn_modules=False` still give nn layers as `call_module` nodes: the passes treat
each as an opaque module and leave it as it is.) Mode: "training" when autograd will differentiate
the graph (grad enabled and an input requires grad), else "inference".

What the passes know of this path (`PassContext`), and so do themselves:
  guards_checked=False    nothing checks guards per call, so fold_conv_bn emits the fold as graph
                          ops on the weight inputs: it always follows the current parameter values.
  aot_autograd_next=True  inplace_relu does nothing (AOTAutograd functionalizes the graph, undoing
                          in-place ops); checkpoint_activations makes no regions: with `memory_budget`
                          (a fraction or a size, as in fxopt.optimize) fxopt's planner tags what
                          AOTAutograd's min-cut partitioner recomputes (fxopt.frontends.backend_memory)
                          and its outcome replaces the pass's entry in the report.

Hand-off (`inner`):
  "inductor"   Inductor's compile_fx. In inference, parameter inputs become constants of the
               graph (Inductor freezing: the fold is constant-folded, weights pre-packed), and
               every call checks that each parameter input is the same tensor, with the same
               storage (`p.data = t` replaces it) at the same version (in-place writes bump it),
               and that BatchNorm running statistics keep their values (a train-mode step of the
               module outside the graph updates them without bumping their versions);
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
from ..analysis.ops import match_batch_norm
from ..errors import FxoptError
from ..model_copy import graph_module_copy
from ..passes.base import INFERENCE, TRAINING, PassContext
from ..passes.checkpoint_activations import parse_budget
from ..pipeline.pipelines import build_pipeline
from ..pipeline.report import Report
from ..pipeline.run import from_dynamo_graph, run_pipeline
from ..pipeline.verify import Verifier
from .backend_memory import compile_with_memory_budget

INNER_COMPILERS = ("inductor", "aot_eager", "eager")

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

    def pass_options(self, mode: str) -> dict:
        """The options of the passes for a graph of `mode`: memory_budget and differentiable_outputs
        concern training graphs only (an inference graph saves nothing and differentiates nothing)."""
        if mode != TRAINING:
            return {}
        given = {"memory_budget": self.memory_budget, "differentiable_outputs": self.differentiable_outputs}
        return {name: value for name, value in given.items() if value is not None}

    def _check(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise FxoptError(f"unknown inner compiler {self.inner!r}; expected one of: {', '.join(INNER_COMPILERS)}")
        for mode in (INFERENCE, TRAINING):  # unknown passes, options no selected pass takes
            build_pipeline(mode, self.passes, self.pass_options(mode), mode_per_graph=True)
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
    statistics = _batch_norm_statistics(gm)  # before the passes fold them away
    pass_options = options.pass_options(mode)
    pipeline = build_pipeline(mode, options.passes, pass_options, mode_per_graph=True)
    verifier = Verifier(gm, example_inputs, training, inputs_are_state=True) if options.verify else None
    captured = from_dynamo_graph(gm, example_inputs, f"dynamo_graph_{next(_graph_numbers)}")
    ctx = PassContext(mode, pass_options, constant_inputs, guards_checked=False, aot_autograd_next=True)
    report = run_pipeline(captured, pipeline, ctx, verifier=verifier)
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
        return FrozenInference(gm, example_inputs, constant_inputs, statistics)
    return _torch_private.inductor_compile(gm, example_inputs)


def _batch_norm_statistics(gm: fx.GraphModule) -> frozenset[str]:
    """Names of the placeholders an eval-mode BatchNorm of `gm` normalizes with (a train-mode one updates its own:
    the graph's own writes, no change from outside)."""
    calls = (match_batch_norm(n) for n in gm.graph.nodes)
    return frozenset(s.name for bn in calls if bn is not None and bn.uses_running_stats
                     for s in (bn.running_mean, bn.running_var) if isinstance(s, fx.Node) and s.op == "placeholder")


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
    every in-place change: optimizer steps, `copy_`, `load_state_dict`), and that BatchNorm running
    statistics (`statistics`: their placeholders' names) keep their values: a train-mode BatchNorm run
    outside this graph (the module's own steps) updates them in place without bumping their versions.
    On a mismatch the frozen code is never used again: the optimized graph is compiled without freezing
    (the fold then runs on the current parameters each call) and a warning says so. A write through
    `p.data` (`p.data.mul_(2)`) into a parameter changes neither and is not detected, as with Inductor's
    own freezing.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: list, constant_inputs: frozenset[str],
                 statistics: frozenset[str] = frozenset()):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.constant_positions = [i for i, n in enumerate(placeholders) if n.name in constant_inputs]
        self.runtime_positions = [i for i, n in enumerate(placeholders) if n.name not in constant_inputs]
        self.constants = [example_inputs[i] for i in self.constant_positions]
        self.state = _frozen_state(self.constants)
        self.statistics = [c for i, c in zip(self.constant_positions, self.constants)
                           if placeholders[i].name in statistics]
        self.statistics_values = _values(self.statistics) if self.statistics else None
        self.unfrozen_graph = graph_module_copy(gm)
        frozen_gm = _constants_as_attributes(gm, self.constant_positions, example_inputs)
        with torch.no_grad():
            self.frozen = _torch_private.inductor_compile(
                frozen_gm, [example_inputs[i] for i in self.runtime_positions], freezing=True)
        self.unfrozen = None

    def __call__(self, *args):
        if self.unfrozen is None:
            constants = [args[i] for i in self.constant_positions]
            if (all(a is c for a, c in zip(constants, self.constants)) and _frozen_state(constants) == self.state
                    and (not self.statistics or torch.equal(_values(self.statistics), self.statistics_values))):
                out = self.frozen(*[args[i] for i in self.runtime_positions])
                self.state = _frozen_state(constants)  # the graph's own buffer updates are fine
                return out
            warnings.warn("fxopt: a parameter or statistic changed after torch.compile froze it; this graph now "
                          "runs a non-frozen compile that recomputes the folded weights on every call", stacklevel=2)
            self.unfrozen = _torch_private.inductor_compile(self.unfrozen_graph, list(args))
            self.frozen = None
        return self.unfrozen(*args)


def _values(tensors: list) -> torch.Tensor:
    """The values of `tensors`, flattened into one new tensor (one comparison checks them all)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _frozen_state(tensors: list) -> tuple[list[int], list[int]]:
    """What a frozen constant must keep: its version counter and where its data lives."""
    return _torch_private.tensor_versions(tensors), [t.data_ptr() for t in tensors]


def _constants_as_attributes(gm: fx.GraphModule, positions: list[int], example_inputs: list) -> fx.GraphModule:
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
