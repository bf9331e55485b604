"""`memory_budget` under torch.compile: fxopt's planner chooses what AOTAutograd recomputes.

    torch.compile(model, backend="fxopt", options={"memory_budget": 0.5})      # or "64MB"

On the eager path `checkpoint_activations` wraps regions in `torch.utils.checkpoint`. Under
torch.compile AOTAutograd traces forward and backward into one joint graph and its min-cut
partitioner decides what the forward saves and what the backward recomputes; it honours
`node.meta["recompute"]` (`CheckpointPolicy.MUST_RECOMPUTE` / `MUST_SAVE`, with `ac_graph_id`
per region), the vocabulary selective activation checkpointing uses. So here:

1. Candidates (`plan_candidates`): fxopt's own planner (`fxopt.passes._checkpoint_plan`, the
   same memory model and cost model as the eager pass) plans the Dynamo graph for a ladder of
   limits (`LADDER`, fractions of its estimated step peak) down to its lowest reachable plan.
   Each plan becomes tags per Dynamo node: a node in a whole region MUST_RECOMPUTE, in a
   selective region its matmul/conv/attention outputs MUST_SAVE and the rest MUST_RECOMPUTE.
   Each Dynamo node carries its position in `node.meta["custom"]`, which tracing copies to the
   ATen nodes it becomes in the joint graph.
2. Choice (`BudgetPartitioner`, AOTAutograd's partition function): the joint graph is
   partitioned untagged first (the min-cut partitioner's own choice: budget 1.0), then under
   each candidate's tags in order of fxopt's recompute cost, until a partition's predicted step
   peak fits the budget (a fraction of the untagged partition's peak, or a size in bytes). The
   peak is predicted on the partition itself (`fxopt.analysis.partition_memory`): the forward's
   intermediates, the saved tensors until their last use in the backward, the backward's
   temporaries and recomputed values; not the gradients the step leaves in `.grad`. The first
   fit in one fixed order is the cheapest fit, and monotonic by construction: a larger budget
   stops at the same partition or an earlier one, whose peak is lower only if the smaller
   budget could have taken it. If none fits, the partition with the lowest peak is taken and a
   UserWarning names the budget and that floor.

Why bounding saved bytes was not enough (measured, benchmarks/compile_budget.py): a partition
saving a quarter of the bytes can peak higher than one saving half, because one big recomputed
region brings all its activations back at once in the backward; and the gradients of the
parameters, all outputs of one backward graph, live until it returns.

Budgets are parsed as in `fxopt.optimize` (`fxopt.passes.checkpoint_activations.parse_budget`):
a fraction in (0, 1], or a size with a unit. Under torch.compile both bound each compiled
graph's step peak (a graph break gives each graph the whole byte budget).

Why it is safe: the partitioner recomputes tagged nodes from saved values inside the same
functional graph; random ops are never tagged (the partitioner then saves their outputs, so
dropout masks are not redrawn), and nodes the eager pass refuses stay untagged.
Limits: the prediction is exact for aot_eager, which runs the partition op by op; Inductor fuses
pointwise ops (their intermediates never exist) and reuses buffers, so there the prediction is an
upper bound and the measured ratios differ (benchmarks/compile_budget.py --inner inductor). Needs
torch with `torch._inductor.config.custom_partitioner_fn` for `inner="inductor"`.
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .. import _torch_private
from ..analysis.memory import Region, StepProfile, estimate, step_profile
from ..analysis.partition_memory import partition_peak
from ..analysis.shapes import propagate_shapes
from ..analysis.side_effects import RNG, effects
from ..errors import FxoptError
from ..model_copy import graph_module_copy
from ..passes._checkpoint_plan import plan_regions, region_boundaries
from ..passes.checkpoint_activations import parse_budget, refusal
from ..pipeline.report import PassReport, Report

LADDER = (0.9, 0.75, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)  # planner limits, fractions of the estimated step peak
STRIDE_GROWTH = 1.5  # strided plans: regions between every s-th boundary, s = 1, 2, 3, 5, 8, 11, 17, ...
STEP_KEY = "fxopt_step"  # in node.meta["custom"]: the Dynamo node's position, copied onto its ATen nodes


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan of fxopt's planner as partitioner tags: Dynamo position -> (policy, region id)."""

    tags: dict[int, tuple[CheckpointPolicy, int]]
    cost: int  # fxopt's recompute cost of the plan
    name: str  # where it comes from: "planner at 0.5x peak", "lowest-peak plan", "every 2nd boundary"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the partitioner chose for one graph (shown in the report as checkpoint_activations' figures)."""

    budget: object
    budget_bytes: int  # the limit on the step's peak
    peak_bytes_before: int  # predicted step peak (fxopt.analysis.partition_memory) of the min-cut partitioner's own choice
    peak_bytes_after: int  # ... of the partition taken
    saved_bytes_before: int  # bytes saved for backward, the same two partitions
    saved_bytes_after: int
    budget_met: bool
    plan: str  # the candidate taken ("min-cut alone": untagged)
    regions: int
    candidates: int  # partitions tried besides the untagged one


def _call_steps(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def plan_candidates(gm: fx.GraphModule, example_inputs: list) -> list[Candidate]:
    """fxopt's plans of `gm` for every limit of LADDER and its lowest reachable peak, as tags (no duplicates).

    Plans a copy (shapes propagated afresh in one fake mode), and stamps each call node of `gm`
    with its position for `BudgetPartitioner`.
    """
    copy = graph_module_copy(gm)
    with _torch_private.outside_tracing_context():
        propagate_shapes(copy, tuple(example_inputs))
        for node, value in zip(copy.graph.find_nodes(op="placeholder"), example_inputs):
            if isinstance(value, torch.Tensor) and value.requires_grad:  # shape propagation detaches
                node.meta["val"].requires_grad_(True)
        profile = step_profile(copy)
    if profile is None:
        return []
    for p, node in enumerate(_call_steps(gm)):
        node.meta["custom"] = {**node.meta.get("custom", {}), STEP_KEY: p}
    checkpointable = [not refusal(s.node, copy) and RNG not in effects(s.node, copy) for s in profile.steps]
    peak = estimate(profile).peak
    plans = [(f"planner at {f}x peak", plan_regions(profile, f * peak, checkpointable)) for f in LADDER]
    plans.append(("lowest-peak plan", plan_regions(profile, math.inf, checkpointable, objective="peak")))
    plans += _strided_plans(profile, checkpointable)
    out, seen = [], set()
    for name, regions in plans:
        if not regions or regions in seen:
            continue
        seen.add(regions)
        tags = {}
        for k, region in enumerate(regions, start=1):
            for p in range(region.start, region.stop):
                save = region.save_counted and profile.steps[p].counted
                tags[p] = (CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.MUST_RECOMPUTE, k)
        out.append(Candidate(tags, sum(profile.region_cost(r) for r in regions), name))
    return out


def _strided_plans(profile: StepProfile, checkpointable: list[bool]) -> list[tuple[str, tuple[Region, ...]]]:
    """Whole regions between every s-th of the planner's cheap-to-save boundaries (STRIDE_GROWTH), named.

    The planner's ladder minimises the eager step's peak, which the gradients in flight keep high;
    under torch.compile what counts is what the forward saves, and these plans (the classic
    checkpoint-every-s-blocks schedules, down to one region) reach below the ladder's floor.
    """
    boundaries = sorted(region_boundaries(profile))
    plans = []
    for stride in sorted({round(STRIDE_GROWTH ** k) for k in range(64) if STRIDE_GROWTH ** k < len(boundaries)}):
        cuts = boundaries[::stride] + ([boundaries[-1]] if (len(boundaries) - 1) % stride else [])
        regions = []
        for start, stop in zip(cuts, cuts[1:]):
            run_start = None
            for p in range(start, stop + 1):
                inside = p < stop and checkpointable[p]
                if inside and run_start is None:
                    run_start = p
                elif not inside and run_start is not None:
                    regions.append(Region(run_start, p))
                    run_start = None
        plans.append((f"regions every {stride} boundaries", tuple(regions)))
    return plans


def _forward_nodes(joint: fx.GraphModule) -> list[fx.Node]:
    """Nodes of a joint graph that do not depend on the gradients' seeds (`tangents_*`)."""
    backward = set()
    for node in joint.graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(a in backward
                                                                                 for a in node.all_input_nodes):
            backward.add(node)
    return [n for n in joint.graph.nodes if n not in backward and n.op == "call_function"]


class BudgetPartitioner:
    """AOTAutograd's partition function: the min-cut partition, under the cheapest candidate tags whose
    predicted step peak fits the budget."""

    def __init__(self, budget, candidates: list[Candidate]):
        self.budget = budget
        self.kind, self.amount = parse_budget(budget)
        self.candidates = candidates
        self.outcome: Outcome | None = None

    def __call__(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        user_tags = {n.name: (n.meta["recompute"], n.meta.get("ac_graph_id"))
                     for n in _forward_nodes(joint) if "recompute" in n.meta}
        tried = []  # (PartitionPeak, cost, candidate, (forward module, backward module)), in order of cost
        limit = None
        for candidate in (None, *sorted(self.candidates, key=lambda c: c.cost)):
            self._tag(_forward_nodes(joint), candidate, user_tags)  # the partitioner may replace the graph (CSE)
            modules = _torch_private.min_cut_partition(joint, joint_inputs, **kwargs)
            tried.append((partition_peak(joint, *modules), candidate.cost if candidate else 0, candidate, modules))
            if limit is None:
                limit = self.amount * tried[0][0].step if self.kind == "fraction" else self.amount
            if tried[-1][0].step <= limit:
                break  # the cheapest that fits: first-fit in a fixed order is monotonic in the budget
        self._tag(_forward_nodes(joint), None, user_tags)
        met = tried[-1][0].step <= limit
        chosen = tried[-1] if met else min(tried, key=lambda t: (t[0].step, t[1]))
        plan, before, after = chosen[2], tried[0][0], chosen[0]
        self.outcome = Outcome(self.budget, int(limit), before.step, after.step, before.saved, after.saved, met,
                               plan.name if plan else "min-cut alone",
                               len({region for _, region in plan.tags.values()}) if plan else 0, len(tried) - 1)
        if not met:
            warnings.warn(f"fxopt: memory_budget {self.budget!r} ({limit / 1e6:.2f} MB step peak) NOT met under "
                          f"torch.compile: lowest reachable {after.step / max(before.step, 1):.2f}x "
                          f"({after.step / 1e6:.2f} MB) of the step peak without recomputation", stacklevel=2)
        return chosen[3]

    @staticmethod
    def _tag(forward: list[fx.Node], candidate: Candidate | None, user_tags: dict) -> None:
        """Set `candidate`'s tags on the forward nodes (None: none); the user's own tags are kept."""
        for node in forward:
            if node.name in user_tags:
                node.meta["recompute"], node.meta["ac_graph_id"] = user_tags[node.name]
                continue
            node.meta.pop("recompute", None)
            node.meta.pop("ac_graph_id", None)
            step = node.meta.get("custom", {}).get(STEP_KEY)
            if candidate is not None and step in candidate.tags:
                node.meta["recompute"], node.meta["ac_graph_id"] = candidate.tags[step]


def compile_with_memory_budget(gm: fx.GraphModule, example_inputs: list, budget, inner: str,
                               report: Report | None = None):
    """Compile a training graph with `inner` ("inductor" or "aot_eager") so it saves at most `budget` for
    backward; the outcome goes into `report`'s checkpoint_activations entry."""
    if inner == "inductor" and not _torch_private.has_custom_partitioner():
        raise FxoptError("memory_budget under torch.compile with inner='inductor' needs a torch whose Inductor takes "
                         "a custom partitioner (torch >= 2.8); use inner='aot_eager' or fxopt.optimize")
    partitioner = BudgetPartitioner(budget, plan_candidates(gm, example_inputs))
    if inner == "aot_eager":
        compiled = _torch_private.aot_eager_compile(gm, example_inputs, partitioner)
    else:
        compiled = _torch_private.inductor_compile_with_partitioner(gm, example_inputs, partitioner)
    if report is not None and partitioner.outcome is not None:
        entry = PassReport(name="checkpoint_activations", figures=dataclasses.asdict(partitioner.outcome))
        if not partitioner.outcome.budget_met:
            entry.figures["headline"] = (f"memory_budget {budget!r} NOT met under torch.compile: lowest reachable "
                                         f"step peak {partitioner.outcome.peak_bytes_after / 1e6:.2f} MB")
        report.passes = [p for p in report.passes if p.name != entry.name] + [entry]
    return compiled
