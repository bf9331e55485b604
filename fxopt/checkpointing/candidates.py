"""A plan of fxopt's planner as partitioner tags: what the torch.compile path offers AOTAutograd's partitioner.

`plan_candidates(gm, example_inputs)` plans a Dynamo graph for a ladder of limits (`LADDER`, fractions of its estimated
step peak) down to its lowest reachable plan, adds the strided plans (whole regions between every s-th cheap-to-save
boundary: under torch.compile what counts is what the forward saves, and these reach below the ladder's floor), and
turns each plan into tags per Dynamo node: the steps a region keeps (`StepProfile.kept_steps`, the eager regions' rule
less checkpoint's early stop, which a partitioner does not have) MUST_SAVE, the region's other steps MUST_RECOMPUTE.
Each Dynamo call node carries its position in `node.meta["custom"]` (`STEP_KEY`), which tracing copies to the ATen nodes
it becomes in the joint graph (fxopt.checkpointing.partitioner reads it). Plans are priced by FLOPs: the Dynamo graph is
planned before Inductor decides what runs, so there is no kernel to time.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .. import _torch_private
from ..analysis.shapes import propagate_shapes
from ..collector import collector_paused
from ..model_copy import graph_module_copy
from .eligibility import refusal
from .planner import Plan, as_plan, plan_regions, region_boundaries, regions_between
from .profile import Region, StepProfile, estimate, step_profile

LADDER = (0.9, 0.75, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)  # planner limits, fractions of the estimated step peak
STRIDE_GROWTH = 1.5  # strided plans: regions between every s-th boundary, s = 1, 2, 3, 5, 8, 11, 17, ...
STEP_KEY = "fxopt_step"  # in node.meta["custom"]: the Dynamo node's position, copied onto its ATen nodes


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan of fxopt's planner and its partitioner tags: Dynamo position -> (policy, region id)."""

    plan: Plan
    tags: dict[int, tuple[CheckpointPolicy, int]]


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
        plan = as_plan(profile, regions, early_stop=False, name=name)
        tags = {p: (CheckpointPolicy.MUST_SAVE if p in kept else CheckpointPolicy.MUST_RECOMPUTE, k)
                for k, (region, kept) in enumerate(zip(plan.regions, plan.kept), start=1)
                for p in range(region.start, region.stop)}
        out.append(Candidate(plan, tags))
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
        plans.append((f"regions every {stride} boundaries", regions_between(cuts, checkpointable)))
    return plans
