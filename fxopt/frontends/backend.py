"""The torch.compile backend "fxopt", and what `fxopt.optimize` compiles with: fxopt's passes on each Dynamo graph.

    compiled = torch.compile(model, backend="fxopt")                 # found via the entry point
    compiled = torch.compile(model, backend="fxopt", options={"inner": "aot_eager", "report": print})
    compiled = torch.compile(model, backend=fxopt.backend(memory_budget=0.5))   # options checked now

Dynamo hands a backend one graph per captured region (a graph break gives several; DDP's optimizer
splits at bucket boundaries), with the model's parameters and buffers as graph inputs. Each graph is
traced to ATen ops (fxopt.capture.aten_graph: pre-dispatch, so autograd still sees every op; Dynamo's
symbolic sizes kept) and goes through the passes `build_pipeline` chooses (fxopt/pipeline/run.py),
planned at the sizes of the call being compiled (on the eager path a dynamic training graph under
memory_budget is planned again at the first call of each size class: fxopt/frontends/size_classes.py; and
the graphs of a step split by graph breaks share the budget: fxopt/frontends/step_memory.py).
An inference graph on the eager path that holds nothing for the default passes (linear layers, GELU, eval
dropouts, attention on the caller's mask: a Transformer's dynamic graph) runs as Dynamo captured it, untraced,
and its report says so (fxopt/pipeline/untouched_graphs.py): the trace would cost a recompile a third more.
Mode: "training" when autograd will differentiate the graph (grad enabled and an input requires grad),
else "inference". A graph the ATen trace would change (a custom autograd Function) runs as Dynamo
captured it, with one warning and the reason in its report.

Lowering (`inner`):
  "eager"      the optimized ATen graph as it is, under eager autograd: checkpointed regions, in-place
               ReLUs and pruned gradients stay as the passes made them (fxopt.optimize's default). In
               inference its parameter inputs are frozen as below, the subgraphs computed from them alone
               (the fold) run once by torch.fx's `split_const_subgraphs`, with the same checks.
  "inductor"   Inductor's compile_fx, after AOTAutograd (`PassContext.aot_autograd_next`: inplace_relu
               does nothing, as functionalization would undo it; checkpoint_activations makes no
               regions: with `memory_budget` fxopt's planner tags what AOTAutograd's min-cut partitioner
               recomputes, fxopt.pipeline.compile_budget, and its outcome replaces the pass's entry in
               the report). In inference, parameter inputs become constants of the graph (Inductor
               freezing: the fold is constant-folded, weights pre-packed), and every call checks that
               each parameter input is the same tensor, with the same storage (`p.data = t` replaces it)
               at the same version (in-place writes bump it), and that BatchNorm running statistics keep
               their values (a train-mode step outside the graph updates them without bumping their
               versions); if one changed, the graph falls back, for good, to a non-frozen compile in
               which the fold is recomputed per call. Not detected: a write through `p.data`
               (`p.data.mul_(2)`), which bumps no version counter, as with Inductor's own freezing.
               `freeze=False` compiles non-frozen from the start.
  "aot_eager"  AOTAutograd with Inductor's decompositions (except those of random ops, so dropout
               draws the same numbers as eager and torch's own aot_eager) and min-cut partitioner,
               no code generation (debugging the Inductor lowering).

Options: passes (None: the default pipeline of the mode), memory_budget (a fraction or a size;
training graphs), differentiable_outputs (training graphs; passed to prune_dead_grads), the other
passes' options (relu_mask, channels_last), inner, freeze, verify (compare the graph before/after each
pass: outputs, input gradients, updated buffers), report (a callable taking each graph's `Report`, or a
path to which one JSON line per graph is appended), instruments. Unknown or malformed options raise
FxoptError (wrapped by Dynamo as BackendCompilerFailed when they reach it through `options=`;
`fxopt.backend(...)` checks at once).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import operator
import os
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.fx as fx

from .. import _torch_private
from ..analysis.ops import match_batch_norm
from ..analysis.written_state import written_state
from ..checkpointing.budget import KeptBytes
from ..capture import NotTraceable, aten_graph
from ..errors import FxoptError
from ..host_rng import forked_rng
from ..model_copy import constants_as_attributes, graph_module_copy
from ..output_selection import OutputPlaces, chosen_outputs, parse_differentiable_outputs
from ..passes import PASSES
from ..passes.base import INFERENCE, TRAINING, PassContext
from ..pipeline.compile_budget import compile_with_memory_budget, parse_budget
from ..pipeline.pipelines import build_pipeline
from ..pipeline.report import PassReport, Report
from ..pipeline.untouched_graphs import left_as_captured
from ..pipeline.run import from_dynamo_graph, run_pipeline
from ..pipeline.verify import Verifier
from ..user_code import warn_at_users_line
from .graph_breaks import GraphBreaks
from .size_classes import SizeClassPlans, describe_class, symbolic_dims, symbolic_inputs
from .step_memory import RecordedCalls, StepBudget, StepLedger, StepShare

INNER_COMPILERS = ("eager", "inductor", "aot_eager")

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
    instruments: tuple = ()  # observers of the pipeline (fxopt.pipeline.instruments), per graph
    other_pass_options: tuple[tuple[str, object], ...] = ()  # the passes' other options (relu_mask, channels_last)
    output_places: OutputPlaces | None = None  # fxopt.optimize's: where the model's outputs are (fxopt.capture.outputs)

    @classmethod
    def parse(cls, options: dict | None) -> BackendOptions:
        """Check `options` (as given to torch.compile); anything unknown or malformed is a FxoptError."""
        options = dict(options or {})
        fields = [f.name for f in dataclasses.fields(cls) if f.name not in ("other_pass_options", "output_places")]
        declared = sorted({name for p in PASSES.values() for name in p.options} - set(fields))
        unknown = sorted(set(options) - set(fields) - set(declared))
        if unknown:
            raise FxoptError(f"unknown option {unknown[0]!r} for backend 'fxopt'; options: "
                             f"{', '.join(fields + declared)}")
        others = tuple((name, options.pop(name)) for name in declared if name in options)
        parsed = cls(**options, other_pass_options=others)
        parsed._check()
        if isinstance(parsed.passes, str):
            parsed = dataclasses.replace(parsed, passes=(parsed.passes,))
        elif parsed.passes is not None:
            parsed = dataclasses.replace(parsed, passes=tuple(parsed.passes))
        return parsed

    def pass_options(self, mode: str) -> dict:
        """The options of the passes for a graph of `mode`: memory_budget and differentiable_outputs
        concern training graphs only (an inference graph saves nothing and differentiates nothing)."""
        taken = {name for p in PASSES.values() if mode in p.modes for name in p.options}
        others = {name: value for name, value in self.other_pass_options if name in taken}
        if mode != TRAINING:
            return others
        given = {"memory_budget": self.memory_budget, "differentiable_outputs": self.differentiable_outputs}
        return {**others, **{name: value for name, value in given.items() if value is not None}}

    def _check(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise FxoptError(f"unknown inner compiler {self.inner!r}; expected one of: {', '.join(INNER_COMPILERS)}")
        for mode in (INFERENCE, TRAINING):  # unknown passes, options no selected pass takes
            build_pipeline(mode, self.passes, self.pass_options(mode), mode_per_graph=True)
        if self.memory_budget is not None:
            parse_budget(self.memory_budget)  # a fraction or a size with a unit, as in fxopt.optimize
        for flag in ("freeze", "verify"):
            if not isinstance(getattr(self, flag), bool):
                raise FxoptError(f"option {flag!r} must be True or False, got {getattr(self, flag)!r}")
        if self.report is not None and not (callable(self.report) or isinstance(self.report, (str, os.PathLike))):
            raise FxoptError(f"option 'report' must be a callable or a file path, got {type(self.report).__name__}")


@dataclasses.dataclass(frozen=True)
class Keeping:
    """What a backend's caller keeps of each graph: its report (`on_report`), the optimized graph the eager path runs
    with the inputs it was made on (`on_graph`), the ledger of what the training graphs of the step in flight keep
    for backward (`ledger`: graphs split by graph breaks share memory_budget, fxopt/frontends/step_memory.py), and the
    model's graph breaks not yet reported (`graph_breaks`, fxopt/frontends/graph_breaks.py)."""
    on_report: Callable[[Report], object] | None = None
    on_graph: Callable[[fx.GraphModule, list], object] | None = None
    ledger: StepLedger | None = None
    graph_breaks: GraphBreaks = dataclasses.field(default_factory=GraphBreaks)


class FxoptBackend:
    """A torch.compile backend with fixed options; `reports` holds one Report per compiled graph, and
    `graph_modules` what the eager lowering runs for each (the optimized ATen graph)."""

    def __init__(self, **options):
        self.options = BackendOptions.parse(options)
        self.reports: list[Report] = []
        self.graph_modules: list[fx.GraphModule] = []
        self.graph_inputs: list[list] = []  # per graph module, the inputs it was compiled on, held weakly
        self.graph_calls = 0  # calls of its compiled graphs so far: whether a model's call ran any (OptimizedModule)
        self.keeping = Keeping(self.reports.append, self._keep_graph, StepLedger(lambda: self.options.memory_budget))

    @classmethod
    def from_options(cls, options: BackendOptions) -> FxoptBackend:
        """A backend with options already checked (a result being unpickled)."""
        backend = cls()
        backend.options = options
        return backend

    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        run = _forward_of(compile_graph(gm, list(example_inputs), self.options, self.keeping))

        def counted(*args):
            self.graph_calls += 1
            return run(*args)
        return counted

    def _keep_graph(self, graph: fx.GraphModule, inputs: list) -> None:
        self.graph_modules.append(graph)
        self.graph_inputs.append([weakref.ref(x) if isinstance(x, torch.Tensor) else x for x in inputs])

    def inputs_of(self, index: int) -> list | None:
        """The inputs graph module `index` was compiled on (parameters, the call's tensors), while they live."""
        values = [x() if isinstance(x, weakref.ref) else x for x in self.graph_inputs[index]]
        return None if any(v is None for v in values) else values


def _forward_of(compiled) -> Callable:
    """What Dynamo calls for a compiled graph: a GraphModule's `forward` (as Dynamo's eager backend does: a module's
    __call__ costs µs on every call), looked up at each call, so a graph changed and recompiled after compiling
    (`result.graph_module`) is what runs; any other compiled callable as it is."""
    if not isinstance(compiled, fx.GraphModule):
        return compiled

    def forward(*args):
        return compiled.forward(*args)
    return forward


def fxopt_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, **unexpected):
    """The backend registered as "fxopt": `torch.compile(model, backend="fxopt", options={...})`."""
    if unexpected:
        raise FxoptError(f"backend 'fxopt' takes options={{...}}, not {', '.join(sorted(unexpected))}=")
    parsed = BackendOptions.parse(options)
    keeping = Keeping(ledger=_STRING_BACKEND_LEDGERS.ledger_of(options, parsed))
    return _forward_of(compile_graph(gm, list(example_inputs), parsed, keeping))


class _LedgersByOptions:
    """The step ledger of each `torch.compile(..., backend="fxopt", options=...)` with a memory_budget.

    torch.compile hands every graph of one call the same `options` dict (its wrapper keeps it), and nothing else of
    that call reaches a backend function: so the graphs of one compile, split by graph breaks, find their shared
    ledger by that dict's identity. The dict is held, so its identity names no other dict while its entry lives;
    only the `LIMIT` newest entries live, and a graph whose entry was dropped starts a new ledger (its step's graphs
    then share the budget from the next step on)."""

    LIMIT = 64

    def __init__(self):
        self._entries: dict[int, tuple[dict, StepLedger]] = {}

    def ledger_of(self, options: dict | None, parsed: BackendOptions) -> StepLedger | None:
        if options is None or parsed.memory_budget is None:
            return None
        held, ledger = self._entries.pop(id(options), (None, None))
        if held is not options:
            ledger = StepLedger(lambda: options.get("memory_budget"))  # as given, which `parsed` checked
        self._entries[id(options)] = (options, ledger)  # newest last
        while len(self._entries) > self.LIMIT:
            del self._entries[next(iter(self._entries))]
        return ledger


_STRING_BACKEND_LEDGERS = _LedgersByOptions()


def backend(**options) -> FxoptBackend:
    """A backend object with `options` checked now: `torch.compile(model, backend=fxopt.backend(...))`."""
    return FxoptBackend(**options)


def compile_graph(gm: fx.GraphModule, example_inputs: list, options: BackendOptions, keeping: Keeping):
    """`_compile_graph`, leaving torch's, Python's and NumPy's random streams where they were: a compile inside
    the user's call (a recompile, a first call) must not shift what the model draws next."""
    with forked_rng():
        return _compile_graph(gm, example_inputs, options, keeping)


def _compile_graph(gm: fx.GraphModule, example_inputs: list, options: BackendOptions, keeping: Keeping):
    """Optimize one Dynamo graph with fxopt's pipeline, report, and lower it: run it eagerly, or hand it to
    AOTAutograd (with Inductor, or without code generation).

    Dynamo's graph is traced to ATen ops first (pre-dispatch: autograd still sees every op), the form every
    pass knows. The passes plan at this call's sizes (a dynamic graph's symbolic sizes take their values from
    it); the graph itself stays generic, so it runs at every size. On the eager path a dynamic training graph
    under `memory_budget` is planned again at the first call of each size class (fxopt/frontends/size_classes.py);
    otherwise one plan serves every size, and the report says which. A training graph under a budget is planned
    beside what the step's earlier graphs keep, and may be planned again once for its share of a step split by
    graph breaks (fxopt/frontends/step_memory.py); through AOTAutograd, a dynamic graph is not planned again: its
    plan, made with Dynamo's symbolic sizes, serves every size, and a plan made at one call's sizes would not.
    """
    training = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                               for x in example_inputs)
    mode = TRAINING if training else INFERENCE
    if _may_run_as_captured(gm, example_inputs, mode, options):
        return _untraced(gm, example_inputs, options, keeping)
    try:
        aten, constant_inputs = aten_graph(gm, example_inputs)
    except NotTraceable as e:  # run as Dynamo captured it: eager's ops, eager's cost, never a wrong result
        return _unoptimized(gm, example_inputs, Report(mode, not_optimized=str(e)), options, keeping)
    if not (training and options.memory_budget is not None):
        return _optimized(aten, example_inputs, constant_inputs, gm, mode, options, keeping)[0]
    dims = symbolic_dims(gm)
    if dims and options.inner != "eager":  # AOTAutograd's plan for a dynamic graph serves every size: made once
        compiled, report = _optimized(aten, example_inputs, constant_inputs, gm, mode, options, keeping)
        share = _step_share(report)
        return RecordedCalls(_forward_of(compiled), share, keeping.ledger) if share and keeping.ledger else compiled
    pristine = graph_module_copy(aten)  # planned again: per size class on the eager path, for the step's share

    def plan(args: list, size_class: str, step_budget: StepBudget | None):
        """The graph planned at `args`' sizes (inside the user's call): at the first call of their class, or again
        for its share of the step's budget."""
        with _torch_private.outside_tracing_context(), forked_rng():
            return _plan_of(*_optimized(graph_module_copy(pristine), args, constant_inputs, gm, mode, options,
                                        keeping, size_class, step_budget, by_dynamo=False))

    first = _optimized(aten, example_inputs, constant_inputs, gm, mode, options, keeping,
                       describe_class(dims, SizeClassPlans.key_of(dims, example_inputs)))
    return SizeClassPlans(dims, example_inputs, _plan_of(*first), plan, keeping.ledger)


def _plan_of(compiled, report: Report) -> tuple[Callable, StepShare | None]:
    """A training graph's plan: its forward, and its part in the step where checkpoint_activations planned it."""
    return _forward_of(compiled), _step_share(report)


# What a plan keeps for backward and its step peak, before and after planning, as each lowering's checkpoint_activations
# entry names them: the pass on the eager path, AOTAutograd's partitioner (fxopt.checkpointing.partitioner.Outcome).
_SHARE_FIGURES = (("saved_bytes_before", "saved_bytes_after", "peak_estimate_captured", "peak_estimate_after"),
                  ("saved_bytes_before", "saved_bytes_after", "peak_bytes_before", "peak_bytes_after"))


def _step_share(report: Report) -> StepShare | None:
    """A training graph's part in its step, where checkpoint_activations planned it (None: a pipeline without it)."""
    try:
        figures = report["checkpoint_activations"].figures
    except KeyError:  # a pipeline without it (`passes=` chosen by the caller)
        return None
    for names in _SHARE_FIGURES:
        if all(name in figures for name in names):
            kept_before, kept_after, captured_peak, planned_peak = (figures[name] for name in names)
            return StepShare(KeptBytes(kept_before, kept_after), captured_peak, planned_peak)
    return None


def _optimized(aten: fx.GraphModule, example_inputs: list, constant_inputs: frozenset[str], gm: fx.GraphModule,
               mode: str, options: BackendOptions, keeping: Keeping, size_class: str = "",
               step_budget: StepBudget | None = None, by_dynamo: bool = True) -> tuple[object, Report]:
    """`aten` (Dynamo's graph `gm` traced) through the pipeline of `mode`, planned at `example_inputs`' sizes,
    reported and lowered; `by_dynamo`: in a compile of Dynamo's (not a plan made later, inside a call). A training
    graph is planned (on the eager path) or partitioned (through AOTAutograd) beside what the step's graphs before it
    keep (`keeping.ledger`), for its share `step_budget` of the step's budget where one was made."""
    training = mode == TRAINING
    ledger = keeping.ledger if training else None
    if step_budget is not None:
        options = dataclasses.replace(options, memory_budget=step_budget.fraction)
    statistics = _batch_norm_statistics(aten)  # before the passes fold them away
    pass_options = options.pass_options(mode)
    pipeline = build_pipeline(mode, options.passes, pass_options, mode_per_graph=True)
    # A symbolic size reaches the backend as a SymInt: its value in this call, so no pass adds a guard
    concrete = [_torch_private.size_hint(x) if isinstance(x, torch.SymInt) else x for x in example_inputs]
    with _torch_private.outside_tracing_context():  # concrete sizes, and no guard added to Dynamo's shape env
        verifier = Verifier(aten, concrete, training, differentiable=_differentiated_positions(aten, options),
                            inputs_are_state=True) if options.verify else None
        captured = from_dynamo_graph(aten, concrete, f"dynamo_graph_{next(_graph_numbers)}", constant_inputs)
        ctx = PassContext(mode, pass_options, constant_inputs, aot_autograd_next=options.inner != "eager",
                          output_places=options.output_places,
                          step_held=ledger.held() if ledger is not None else KeptBytes())
        report = run_pipeline(captured, pipeline, ctx, instruments=options.instruments, verifier=verifier)
    report.dynamic_sizes = symbolic_inputs(gm)
    report.size_class = size_class
    report.step_budget = step_budget.note if step_budget is not None else ""
    if by_dynamo:
        _note_dynamo_facts(report, keeping.graph_breaks)
    compiled = _lowered(aten, example_inputs, constant_inputs, statistics, training, options, report,
                        ledger.held() if ledger is not None else KeptBytes())
    _deliver(report, options.report, keeping.on_report)
    graph = compiled if isinstance(compiled, fx.GraphModule) else getattr(compiled, "eager_graph", None)
    if graph is not None and keeping.on_graph is not None:
        keeping.on_graph(graph, example_inputs)
    return compiled, report


def _lowered(aten: fx.GraphModule, example_inputs: list, constant_inputs: frozenset[str], statistics,
             training: bool, options: BackendOptions, report: Report, held: KeptBytes):
    """The optimized graph lowered as `options` ask: frozen for inference where it may be, as it is under eager
    autograd, or through AOTAutograd (under a memory budget: fxopt's plans tag what its partitioner recomputes,
    beside what the step's earlier graphs keep, `held`)."""
    if not training and options.freeze and options.inner != "aot_eager" and _freezable(aten, example_inputs,
                                                                                      constant_inputs):
        frozen = FrozenInference(aten, example_inputs, constant_inputs, statistics, options.inner)
        return aten if frozen.folds_nothing else frozen
    if options.inner == "eager":
        return aten
    if training and options.memory_budget is not None:
        return compile_with_memory_budget(aten, example_inputs, options.memory_budget, options.inner, report, held)
    if options.inner == "aot_eager":
        return _torch_private.aot_eager_compile(aten, example_inputs)
    return _torch_private.inductor_compile(aten, example_inputs)


def _differentiated_positions(aten: fx.GraphModule, options: BackendOptions) -> list[int] | None:
    """The graph outputs a loss reads where `differentiable_outputs` names them (fxopt.optimize found where the
    model's outputs are), for the verifier to differentiate only those; None: all."""
    places, selection = options.output_places, parse_differentiable_outputs(options.differentiable_outputs)
    entries = places.entries_of(len(aten.graph.find_nodes(op="output")[0].args[0])) if places is not None else None
    if entries is None or selection is None:
        return None
    return sorted(p for key in chosen_outputs(entries, selection) for p in entries[key])


def _unoptimized(gm: fx.GraphModule, example_inputs: list, report: Report, options: BackendOptions, keeping: Keeping):
    """Dynamo's graph as it is, lowered as asked, with a report and one warning saying why fxopt left it alone."""
    warnings.warn(f"fxopt: a graph of this model runs unoptimized: {report.not_optimized}", stacklevel=2)
    return _as_captured(gm, example_inputs, report, options, keeping)


def _as_captured(gm: fx.GraphModule, example_inputs: list, report: Report, options: BackendOptions, keeping: Keeping):
    """Dynamo's graph as it is, lowered as asked; `report` completed with what Dynamo did, and delivered."""
    report.dynamic_sizes = symbolic_inputs(gm)
    _note_dynamo_facts(report, keeping.graph_breaks)
    _deliver(report, options.report, keeping.on_report)
    if options.inner == "eager":
        return gm
    if options.inner == "aot_eager":
        return _torch_private.aot_eager_compile(gm, example_inputs)
    return _torch_private.inductor_compile(gm, example_inputs)


def _may_run_as_captured(gm: fx.GraphModule, example_inputs: list, mode: str, options: BackendOptions) -> bool:
    """Whether an inference graph on the eager path may skip the ATen trace: the default pipeline, nothing in the
    graph for it (pipeline/untouched_graphs.py), and no instrument observing the passes (the command line's
    `inspect`, which is there to show them)."""
    return (mode == INFERENCE and options.inner == "eager" and options.passes is None and not options.instruments
            and left_as_captured(gm, _torch_private.dynamo_parameter_placeholders(gm, example_inputs)))


def _untraced(gm: fx.GraphModule, example_inputs: list, options: BackendOptions, keeping: Keeping):
    """Dynamo's inference graph as it is, not traced to ATen: nothing in it for an inference pass
    (pipeline/untouched_graphs.py), as each pass's line in its report says."""
    nodes = len(gm.graph.nodes)
    report = Report(INFERENCE, graphs=[f"dynamo_graph_{next(_graph_numbers)}"])
    for p in build_pipeline(INFERENCE, options.passes, options.pass_options(INFERENCE), mode_per_graph=True):
        report.passes.append(PassReport(p.name, nodes_before=nodes, nodes_after=nodes, skipped=(
            "nothing in Dynamo's graph for the inference passes: it runs as captured, untraced")))
    if keeping.on_graph is not None:
        keeping.on_graph(gm, example_inputs)
    return _as_captured(gm, example_inputs, report, options, keeping)


def _note_dynamo_facts(report: Report, graph_breaks: GraphBreaks) -> None:
    """Which compile this graph is, why Dynamo compiled again, and the model's graph breaks since its last graph."""
    report.compile_id, report.recompile_reason = _torch_private.dynamo_compile_facts()
    report.graph_breaks = graph_breaks.take()


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
    """An inference graph with its parameter inputs frozen into constants, guarded against parameter changes.

    Lowered by `inner`: "inductor" compiles it with Inductor's freezing (the fold constant-folded, weights
    pre-packed); "eager" runs it as is, its constant subgraphs (a fold's scaled weights, transposed
    weights, prepack_conv_weights' reordered ones) computed once by torch.fx's `split_const_subgraphs`,
    random and in-place ops never folded.
    Each call checks that every parameter input is the tensor seen at compile time, with the same
    storage (`p.data = t` swaps it without touching the version) at the same `_version` (bumped by
    every in-place change: optimizer steps, `copy_`, `load_state_dict`), and that BatchNorm running
    statistics (`statistics`: their placeholders' names) keep their values: a train-mode BatchNorm run
    outside this graph (the module's own steps) updates them in place without bumping their versions.
    On a mismatch the frozen code is never used again: the optimized graph runs without freezing
    (the fold then runs on the current parameters each call) and a warning says so. A write through
    `p.data` (`p.data.mul_(2)`) into a parameter changes neither and is not detected, as with Inductor's
    own freezing. The folded constants take memory beside the parameters, as any freezing's do.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: list, constant_inputs: frozenset[str],
                 statistics: frozenset[str] = frozenset(), inner: str = "inductor"):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.inner = inner
        self.constant_positions = [i for i, n in enumerate(placeholders) if n.name in constant_inputs]
        self.runtime_positions = [i for i, n in enumerate(placeholders) if n.name not in constant_inputs]
        self.constants_of = _picker(self.constant_positions)
        self.runtime_inputs_of = _picker(self.runtime_positions)
        self.constants = self.constants_of(example_inputs)
        self.state = _frozen_state(self.constants)
        self.statistics = [c for i, c in zip(self.constant_positions, self.constants)
                           if placeholders[i].name in statistics]
        self.statistics_values = _values(self.statistics) if self.statistics else None
        self.unfrozen_graph = graph_module_copy(gm)
        self.eager_graph = gm if inner == "eager" else None  # what `graph_module` shows: the optimized graph
        frozen_gm = constants_as_attributes(gm, self.constant_positions, example_inputs)
        runtime_inputs = [example_inputs[i] for i in self.runtime_positions]
        self.unfrozen = None
        with torch.no_grad():
            if inner != "eager":
                self.frozen = _torch_private.inductor_compile(frozen_gm, runtime_inputs, freezing=True)
                return
            try:
                self.frozen = _torch_private.fold_constant_subgraphs(frozen_gm)
            except Exception:  # noqa: BLE001 - a graph torch.fx cannot split (grad-mode or autocast regions)
                self.frozen = None

    @property
    def folds_nothing(self) -> bool:
        """On the eager path: nothing depends on the parameters alone (or torch.fx could not split the graph), so
        the graph runs as it is, with no checks to pay for."""
        return self.frozen is None

    def __call__(self, *args):
        if self.unfrozen is None:
            constants = self.constants_of(args)
            if (all(map(operator.is_, constants, self.constants)) and _frozen_state(constants) == self.state
                    and (not self.statistics or torch.equal(_values(self.statistics), self.statistics_values))):
                return self.frozen(*self.runtime_inputs_of(args))  # which writes none of them
            warn_at_users_line("fxopt: a parameter or statistic changed after fxopt froze it; this graph now runs "
                               "without freezing, recomputing the folded weights on every call")
            self.unfrozen = (self.unfrozen_graph.forward if self.inner == "eager"
                             else _torch_private.inductor_compile(self.unfrozen_graph, list(args)))
            self.frozen = None
        return self.unfrozen(*args)


def _freezable(gm: fx.GraphModule, example_inputs: list, constant_inputs: frozenset[str]) -> bool:
    """Whether `gm`'s parameter and buffer inputs can be frozen and checked: there are some, the graph writes none
    of them (a train-mode BatchNorm's statistics; an op fxopt cannot see into), and each has a version counter
    (tensors made under `torch.inference_mode()` have none)."""
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    constants = [x for name, x in zip(placeholders, example_inputs) if name in constant_inputs]
    return (bool(constants) and all(isinstance(x, torch.Tensor) and not x.is_inference() for x in constants)
            and not written_state(gm) & constant_inputs)


def _values(statistics: list) -> torch.Tensor:
    """The values of BatchNorm statistics (1-D buffers, no autograd history) in one new tensor: one comparison checks
    them all (cat of the buffers as they are: MobileNetV2's 104 take 0.1 ms, flattened each first 0.23 ms)."""
    return torch.cat(statistics)


def _frozen_state(tensors: list) -> tuple[list[int], list[int]]:
    """What a frozen constant must keep: its version counter and where its data lives."""
    return _torch_private.tensor_versions(tensors), list(map(torch.Tensor.data_ptr, tensors))


def _picker(positions: list[int]) -> Callable[[list], list]:
    """A function taking the items at `positions` from a list, in one C-level call (it runs on every call)."""
    if not positions:
        return lambda items: []
    take = operator.itemgetter(*positions)
    return (lambda items: [take(items)]) if len(positions) == 1 else (lambda items: list(take(items)))
