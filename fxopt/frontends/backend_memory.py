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
   ATen nodes it becomes in the joint graph. Nodes Inductor's joint-graph passes make (its attention
   pattern) have none: they take the region of the nodes that read them (`_made_by_joint_passes`).
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
functional graph; random draws are never tagged (the partitioner then saves what they return, so
nothing is drawn again), and nodes the eager pass refuses stay untagged. A dropout may lie in a
region: its output is rewritten as ATen computes it from the mask the draw returns
(`_dropout_applied_from_masks`, bitwise equal), so the region keeps the bool mask and recomputes
the rest; under Inductor the decomposed dropout's values come from a saved seed, recomputed alike.
Two rewrites of the joint graph, after the untagged partition (min-cut's own choice stays the
baseline), keep values bitwise and cut what the backward holds at once: dropouts read from their
masks (above), and a mean's gradient divided before it is expanded (`_pointwise_before_expand`:
the benchmark's CNN peaked on that full-size temporary at its widest block, 0.57x -> 0.54x).
Limits: the prediction follows aot_eager, which runs the partition op by op (a CPU convolution's
scratch is measured, `fxopt.analysis.conv_scratch`); Inductor fuses pointwise ops (their
intermediates never exist), lays convolutions out channels-last and reuses buffers, so there the
prediction is only a guide and the measured ratios differ (benchmarks/compile_budget.py --inner
inductor). There the benchmark's CNN bottoms out at 0.56x of its 10.73 MB step peak (every
candidate measured; the lowest recomputes blocks 1-2, 3-4 and 5 from the input and the outputs of
blocks 2 and 4, and peaks at 6.05 MB in block 4's backward). Its widest block's backward alone holds
the recomputed convolution output and the gradient Inductor writes beside it (2.10 MB each), the
block's input (1.05 MB: its weight gradient reads it), block 2's output (0.52 MB) and the
channels-last copies of the input and weights Inductor's forward saves (0.24 MB): 6.01 MB, above
0.55x (5.90 MB); saving no output of blocks 1-4 instead makes their one recomputation keep all of
theirs at once (0.71x). Needs torch with
`torch._inductor.config.custom_partitioner_fn` for `inner="inductor"`.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .. import _torch_private
from ..analysis.memory import Region, StepProfile, estimate, step_profile
from ..analysis.partition_memory import partition_peak
from ..analysis.shapes import propagate_shapes
from ..collector import collector_paused
from ..errors import FxoptError
from ..model_copy import graph_module_copy
from ..passes._checkpoint_plan import plan_regions, region_boundaries
from ..passes.checkpoint_activations import parse_budget, refusal
from ..pipeline.report import PassReport, Report
from ..user_code import warn_at_users_line

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
    checkpointable = [not refusal(s.node, copy) for s in profile.steps]  # a step that draws too: see `_tag`
    peak = estimate(profile).peak
    with collector_paused():  # the planner makes hundreds of thousands of small tuples, no cycles
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
                save = region.save_counted and profile.steps[p].counted and not (region.keep_costly_only
                                                                                 and profile.light[p])
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
            if candidate is not None and len(tried) == 1:  # after the untagged partition: min-cut's own choice is
                _dropout_applied_from_masks(joint)  # the baseline
                _pointwise_before_expand(joint)
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
            warn_at_users_line(f"fxopt: memory_budget {self.budget!r} ({limit / 1e6:.2f} MB step peak) NOT met under "
                          f"torch.compile: lowest reachable {after.step / max(before.step, 1):.2f}x "
                          f"({after.step / 1e6:.2f} MB) of the step peak without recomputation")
        return chosen[3]

    @staticmethod
    def _tag(forward: list[fx.Node], candidate: Candidate | None, user_tags: dict) -> None:
        """Set `candidate`'s tags on the forward nodes (None: none); the user's own tags are kept."""
        made = _made_by_joint_passes(forward) if candidate is not None else {}
        for node in forward:
            if node.name in user_tags:
                node.meta["recompute"], node.meta["ac_graph_id"] = user_tags[node.name]
                continue
            node.meta.pop("recompute", None)
            node.meta.pop("ac_graph_id", None)
            if candidate is None:
                continue
            step = _step(node)
            if _draws(node):
                continue  # never recomputed: the partitioner saves what it makes (a dropout's mask)
            if step in candidate.tags:
                node.meta["recompute"], node.meta["ac_graph_id"] = candidate.tags[step]
            elif node in made:
                regions = {candidate.tags.get(s, (None, None)) for s in made[node]}
                policy, region = next(iter(regions))
                if len(regions) == 1 and policy == CheckpointPolicy.MUST_RECOMPUTE:
                    node.meta["recompute"], node.meta["ac_graph_id"] = policy, region


def _step(node: fx.Node):
    return node.meta.get("custom", {}).get(STEP_KEY)


def _draws(node: fx.Node) -> bool:
    """Whether `node` draws random numbers, or is an element of what such an op returns."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.op == "call_function" and _torch_private.op_is_random(node.target)


def _dropout_applied_from_masks(joint: fx.GraphModule) -> None:
    """Each train-mode `native_dropout(x, p)` of the forward: its output read as `x * mask * (1 / (1 - p))`.

    That is ATen's own computation of the output (bitwise equal, float32 and float64), written as two
    pointwise ops of the bool mask the dropout returns, which carry the dropout's Dynamo position: a
    region that recomputes the dropout recomputes those from the saved mask (a quarter of a float32
    output) while the draw itself is never tagged (`_draws`), so the random numbers are drawn once, as
    eager draws them. Under Inductor dropout is decomposed before the partitioner (its random values
    come from a saved seed); there is no `native_dropout` to rewrite.
    """
    graph = joint.graph
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.native_dropout.default)):
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        outputs = {user.args[1]: user for user in node.users if user.target is operator.getitem}
        if train is False or not isinstance(p, float) or not 0 < p < 1 or 0 not in outputs:
            continue
        if 1 not in outputs:
            with graph.inserting_after(node):
                outputs[1] = graph.call_function(operator.getitem, (node, 1))
            outputs[1].meta = {**node.meta, "val": node.meta["val"][1]}
        with graph.inserting_after(outputs[1]):
            kept = graph.call_function(torch.ops.aten.mul.Tensor, (x, outputs[1]))
        with graph.inserting_after(kept):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (kept, 1.0 / (1.0 - p)))
        for new in (kept, scaled):
            new.meta = {key: value for key, value in outputs[0].meta.items() if key != "val"}
            new.meta["val"] = torch.empty_like(outputs[0].meta["val"])
        outputs[0].replace_all_uses_with(scaled)
        graph.erase_node(outputs[0])
    joint.recompile()


def _pointwise_before_expand(joint: fx.GraphModule) -> None:
    """Each pointwise op of one expanded tensor and scalars (`expand(g, shape) / n`, a mean's gradient) computed
    before the expand: `expand(g / n, shape)`, the same value in each element, without a full-size tensor.

    Op by op (aot_eager) the full-size result of the original lives until its readers have run; in a CNN
    that is the widest activation's size, at the widest block's backward, where the step peaks. Only where
    every reader is a pointwise op that also reads a full-size tensor of that shape (so what it returns,
    strides included, does not change).
    """
    graph = joint.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or not _torch_private.op_is_pointwise(node.target) or _draws(node):
            continue
        tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
        if len(tensors) != 1 or tensors[0].target is not torch.ops.aten.expand.default or \
                any(isinstance(a, (list, tuple)) for a in (*node.args, *node.kwargs.values())):
            continue
        expand, shape = tensors[0], tuple(node.meta["val"].shape)
        small = expand.args[0]
        if not node.users or not all(_torch_private.op_is_pointwise(user.target) and any(
                isinstance(a, fx.Node) and a is not node and isinstance(a.meta.get("val"), torch.Tensor) and
                tuple(a.meta["val"].shape) == shape and a.meta["val"].is_contiguous()
                for a in user.all_input_nodes) for user in node.users):
            continue
        with graph.inserting_after(node):
            computed = graph.call_function(node.target, tuple(small if a is expand else a for a in node.args),
                                           dict(node.kwargs))
        with graph.inserting_after(computed):
            expanded = graph.call_function(torch.ops.aten.expand.default, (computed, list(expand.args[1])))
        for new in (computed, expanded):
            new.meta = {key: value for key, value in node.meta.items() if key != "val"}
        computed.meta["val"] = torch.empty_like(small.meta["val"], dtype=node.meta["val"].dtype)
        expanded.meta["val"] = computed.meta["val"].expand(expand.meta["val"].shape)
        node.replace_all_uses_with(expanded)
        graph.erase_node(node)
    joint.recompile()


def _made_by_joint_passes(forward: list[fx.Node]) -> dict[fx.Node, set[int]]:
    """Forward nodes without a Dynamo position (made by Inductor's joint-graph passes, e.g. its attention
    pattern, which keep only `recompute` tags already set) -> the positions of the nearest positioned
    forward nodes that read them (through other such nodes); random ops, and nodes no positioned forward
    node reads, are left out.

    Such a node inherits its readers' region when they all lie in one recomputed region: a node the
    candidate cannot name would otherwise be saved, and with it the region's largest tensors (measured:
    HF BERT's attention scores under Inductor). What it reads is saved or recomputed as the partitioner
    decides, as for any recomputed node.
    """
    inside = set(forward)
    out = {}
    for node in forward:
        if _step(node) is not None or _draws(node):
            continue
        readers, stack, seen = set(), [node], {node}
        while stack:
            for user in stack.pop().users:
                if user in seen or user not in inside:
                    continue
                seen.add(user)
                if _step(user) is not None:
                    readers.add(_step(user))
                else:
                    stack.append(user)
        if readers:
            out[node] = readers
    return out


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
