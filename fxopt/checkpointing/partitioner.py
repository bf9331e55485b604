"""`memory_budget` under torch.compile: AOTAutograd's partition function, choosing among fxopt's plans.

AOTAutograd traces forward and backward into one joint graph; its min-cut partitioner decides what the forward
saves and what the backward recomputes, and honours `node.meta["recompute"]` (`CheckpointPolicy.MUST_RECOMPUTE` /
`MUST_SAVE`, with `ac_graph_id` per region), the vocabulary of selective activation checkpointing.
`BudgetPartitioner` partitions the joint graph untagged first (the min-cut partitioner's own choice: budget 1.0),
then under each candidate's tags (fxopt.checkpointing.candidates) in order of recompute cost, until a partition's
predicted step peak fits the budget (a fraction of the untagged partition's peak, or a size in bytes). The peak is
predicted on the partition itself (fxopt.checkpointing._partition_memory): the forward's intermediates, the saved
tensors until their last use in the backward, the backward's temporaries and recomputed values; not the gradients
the step leaves in `.grad`. The first fit in one fixed order is the cheapest fit, and monotonic by construction: a
larger budget stops at the same partition or an earlier one. If none fits, the partition with the lowest peak is
taken and a UserWarning names the budget and that floor. Nodes Inductor's joint-graph passes make (its attention
pattern) have no Dynamo position: they take the region of the nodes that read them (`_made_by_joint_passes`).

Why it is safe: the partitioner recomputes tagged nodes from saved values inside the same functional graph; random
draws are never tagged (the partitioner then saves what they return, so nothing is drawn again), and nodes the eager
regions refuse (fxopt.checkpointing.eligibility) stay untagged. After the untagged partition, the caller's joint
rewrites run (`rewrite_joint`: fxopt.passes.dropout_from_mask, fxopt.passes.pointwise_before_expand, run by the
pipeline), which keep values bitwise and let a region keep less. Limits: the prediction follows aot_eager, which runs
the partition op by op; Inductor fuses pointwise ops, lays convolutions out channels-last and reuses buffers, so there
the prediction is only a guide (benchmarks/compile_budget.py --inner inductor).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .. import _torch_private
from ..analysis.ops import draws_random_numbers
from ..user_code import warn_at_users_line
from .budget import KeptBytes, graph_limit, parse_budget
from .candidates import STEP_KEY, Candidate
from ._partition_memory import partition_peak


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the partitioner chose for one graph (shown in the report as checkpoint_activations' figures)."""

    budget: object
    budget_bytes: int  # the limit on the step's peak
    peak_bytes_before: int  # predicted step peak (fxopt.checkpointing._partition_memory) of the min-cut partitioner's own choice
    peak_bytes_after: int  # ... of the partition taken
    saved_bytes_before: int  # bytes saved for backward, the same two partitions
    saved_bytes_after: int
    budget_met: bool
    plan: str  # the candidate taken ("min-cut alone": untagged)
    regions: int
    candidates: int  # partitions tried besides the untagged one
    held_by_earlier_graphs: int  # what the step's earlier graphs keep, as planned: the budget less it is this graph's


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

    def __init__(self, budget, candidates: list[Candidate], rewrite_joint: Callable[[fx.GraphModule], None],
                 held: KeptBytes = KeptBytes()):
        self.budget = budget
        self.held = held  # what the step's earlier graphs keep while this one runs
        self.rewrite_joint = rewrite_joint
        self.kind, self.amount = parse_budget(budget)
        self.candidates = candidates
        self.outcome: Outcome | None = None

    def __call__(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        user_tags = {n.name: (n.meta["recompute"], n.meta.get("ac_graph_id"))
                     for n in _forward_nodes(joint) if "recompute" in n.meta}
        tried = []  # (PartitionPeak, cost, candidate, (forward module, backward module)), in order of cost
        limit = None
        for candidate in (None, *sorted(self.candidates, key=lambda c: c.plan.recompute_cost)):
            if candidate is not None and len(tried) == 1:  # after the untagged partition: min-cut's own choice is
                self.rewrite_joint(joint)  # the baseline
            self._tag(_forward_nodes(joint), candidate, user_tags)  # the partitioner may replace the graph (CSE)
            modules = _torch_private.min_cut_partition(joint, joint_inputs, **kwargs)
            cost = candidate.plan.recompute_cost if candidate else 0
            tried.append((partition_peak(joint, *modules), cost, candidate, modules))
            if limit is None:
                limit = graph_limit(self.kind, self.amount, tried[0][0].step, self.held)
            if tried[-1][0].step <= limit:
                break  # the cheapest that fits: first-fit in a fixed order is monotonic in the budget
        self._tag(_forward_nodes(joint), None, user_tags)
        met = tried[-1][0].step <= limit
        chosen = tried[-1] if met else min(tried, key=lambda t: (t[0].step, t[1]))
        taken, before, after = chosen[2], tried[0][0], chosen[0]
        self.outcome = Outcome(self.budget, int(limit), before.step, after.step, before.saved, after.saved, met,
                               taken.plan.name if taken else "min-cut alone",
                               len(taken.plan.regions) if taken else 0, len(tried) - 1, self.held.planned)
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
            if draws_random_numbers(node):
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


def _made_by_joint_passes(forward: list[fx.Node]) -> dict[fx.Node, set[int]]:
    """Forward nodes without a Dynamo position (made by Inductor's joint-graph passes, e.g. its attention pattern, which
    keep only `recompute` tags already set) -> the positions of the nearest positioned forward nodes that read them
    (through other such nodes); random ops, and nodes no positioned forward node reads, are left out.

    Such a node inherits its readers' region when they all lie in one recomputed region: a node the candidate cannot
    name would otherwise be saved, and with it the region's largest tensors (attention scores: docs/checkpointing.md).
    What it reads is saved or recomputed as the partitioner decides, as for any recomputed node.
    """
    inside = set(forward)
    out = {}
    for node in forward:
        if _step(node) is not None or draws_random_numbers(node):
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
