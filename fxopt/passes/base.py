"""What a pass is: a small object with a name, a summary, the options it takes and one `run`.

`run` rewrites the GraphModule in place and returns a `PassResult` saying what it changed
and what it refused, site by site, with a reason. It never returns None.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, ClassVar

import torch.fx as fx

from ..analysis.grad_needs import GradNeeds, analyze_grad_needs
from ..capture.naming import module_path
from ..checkpointing.budget import KeptBytes
from ..output_selection import OutputPlaces

INFERENCE = "inference"
TRAINING = "training"
MODES = (INFERENCE, TRAINING)


def site_name(node: fx.Node) -> str:
    """How a report names a node: the path of the module that computed it (`layer1.0.bn1`, from
    torch.export's `nn_module_stack`), or the node's own name for code of the model itself."""
    return module_path(node) or node.name


@dataclasses.dataclass
class Site:
    """One place a pass looked at: what it did there (`action`), where, and why."""

    action: str  # e.g. "folded", "refused", "inplaced", "checkpointed", "pruned"
    node: str  # the graph node the decision is about
    reason: str = ""  # a short machine-readable reason, e.g. "conv_has_other_users"
    detail: str = ""  # a human sentence

    @property
    def refused(self) -> bool:
        return self.action == "refused"


@dataclasses.dataclass(kw_only=True)
class PassResult:
    """What one run of a pass did: counters, one record per site, and free-form figures.

    (`fxopt.pipeline.report.PassReport` is the same record summed over a model's graphs.)
    """

    sites: list[Site] = dataclasses.field(default_factory=list)
    stats: Counter = dataclasses.field(default_factory=Counter)
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    skipped: str = ""  # non-empty when the whole pass did not apply, with the reason

    @property
    def changed(self) -> bool:
        """Whether the pass changed the graph: at least one site it did not refuse."""
        return any(not s.refused for s in self.sites)

    def record(self, action: str, node: fx.Node | str, reason: str = "", detail: str = "") -> None:
        """Note one site and count it under `action` (or `refused_<reason>`)."""
        name = node.name if isinstance(node, fx.Node) else str(node)
        self.sites.append(Site(action, name, reason, detail))
        self.stats[f"refused_{reason}" if action == "refused" else action] += 1


@dataclasses.dataclass
class PassContext:
    """What a pass may know beyond the graph: the mode, its options, where parameters live, and what
    happens to the graph after the passes. A pass that does not apply says so from these facts.

    `constant_inputs` names placeholders that hold parameters or buffers (TorchDynamo makes a model's
    state graph inputs). `aot_autograd_next`: the graph goes on to torch.compile's AOTAutograd, which
    functionalizes it (undoing in-place ops) and whose partitioner chooses what backward recomputes;
    else it runs as it is, under eager autograd.
    """

    mode: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    constant_inputs: frozenset[str] = frozenset()
    aot_autograd_next: bool = False
    graph_path: str | None = None  # the graph's name in the report; "": a graph returning the whole model's outputs
    captured: fx.GraphModule | None = None  # that graph as captured, before any pass (passes that read it)
    output_places: OutputPlaces | None = None  # where the model's outputs are among a Dynamo graph's outputs
    step_held: KeptBytes = KeptBytes()  # kept for backward by the graphs before this one in its step (graph breaks)
    later_passes: tuple[str, ...] = ()  # the passes that run on this graph after this one (a timing pass times the
    # graph as they will leave it)


class Pass:
    """Base class: subclasses set the class attributes and implement `run`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    modes: ClassVar[tuple[str, ...]] = MODES
    reads_captured_graph: ClassVar[bool] = False  # gets the graph as captured in `PassContext.captured`
    # option name -> (default, one-line help) or (default, one-line help, the values it may take)
    options: ClassVar[dict[str, tuple]] = {}

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:  # pragma: no cover
        raise NotImplementedError

    def option(self, ctx: PassContext, name: str):
        return ctx.options.get(name, self.options[name][0])


def eager_backward_facts(gm: fx.GraphModule, ctx: PassContext,
                         result: PassResult) -> tuple[list[fx.Node], GradNeeds] | None:
    """For a pass that changes what eager autograd does in backward: the graph's output values and what needs a
    gradient; or None, with `result` skipped, where AOTAutograd takes the graph next (it plans that backward)."""
    if ctx.aot_autograd_next:
        result.skipped = "AOTAutograd takes the graph next and plans its backward itself"
        return None
    outputs = next(iter(gm.graph.find_nodes(op="output"))).all_input_nodes
    return outputs, analyze_grad_needs(gm, outputs, ctx.constant_inputs)
