"""checkpoint_activations: recompute chosen regions in backward so one training step fits a memory budget.

What it rewrites: runs of nodes chosen by a cost model move into `CheckpointedRegion` submodules (named
`checkpointed_<first>_to_<last>`), which run under non-reentrant `torch.utils.checkpoint`; a region is either recomputed
whole, or selectively (its matmul, conv and attention outputs are kept, only the cheap ops between them are recomputed:
by torch's selective checkpoint policy, or, where all it keeps are convolutions and matrix products, by the region
itself, which spares every op the policy's dispatch mode: fxopt.checkpointing._kept_outputs; it keeps only those its
recomputation runs, and a third kind keeps only the costly ones, recomputing cheap ones such as attention's score
matmul: StepProfile.kept_steps)::

    a = fc1(x); b = norm(a); c = gelu(b); d = drop(c); e = fc2(d); ...
  becomes (budget 0.5 on a deep MLP)
    checkpointed_fc1_to_drop = self.checkpointed_fc1_to_drop(x)   # selective: fc1's output kept
    e = fc2(checkpointed_fc1_to_drop); ...

How it chooses (fxopt.checkpointing.planner): `memory_budget` bounds the estimated peak of the whole step, forward *and*
backward (a fraction of the step's peak as captured, before fxopt's passes, or bytes), the caller's loss included: its
backward runs beside everything the graph keeps, and is taken to hold four tensors the size of the outputs
(fxopt.checkpointing.profile), as a mean of squares does. Where graph breaks split the step, what the graphs before
this one keep for backward counts too (`PassContext.step_held`, fxopt/frontends/step_memory.py): the graph gets the
budget less that, a fraction being of eager's step there (checkpointing.budget.graph_limit). The estimate
(fxopt.checkpointing.profile) walks the plan: what stays saved, when each saved tensor is freed in backward, the
gradients in flight, and the moment a region is recomputed next to everything still kept -- where the peak of a
checkpointed step usually lands, and what a plan that only counts bytes saved at the end of forward misses.
Recomputation is priced in time, for the steps a region's recomputation runs (checkpoint stops it once the last saved
tensor is saved again, so a region over a transformer layer never recomputes its last linear): each node's forward
measured on real tensors shaped like the example (fxopt.analysis.op_times; FLOPs where the graph cannot run so), plus
what a region costs beyond its ops (per op it holds: measured once, fxopt.checkpointing._region_overhead; per region: on
a block of this graph, fxopt.checkpointing.calibration, figure `region_overhead_ms`), so the plan with the lowest
predicted step time whose predicted peak fits is chosen (figure `predicted_recompute_s`). An exact dynamic program over
region boundaries and the region kinds returns the cheapest plan under the budget (a √n split would ignore both the
prices and where the peak lands); if no plan fits, the cheapest plan at the lowest reachable peak -- loudly: a
UserWarning (at the caller's line) and the report's headline name the budget, that floor ("lowest reachable: 0.45x"),
what keeps the step above it and the budget it meets. A region that would free nothing (no saved bytes, no lower peak)
is never made.

Why it is safe: a recomputed region computes the same values from the same inputs; the non-reentrant checkpoint restores
the RNG state before recomputing, so dropout draws the same mask; a BatchNorm updates its running statistics on the
first run only, and a train-mode one on a contiguous float CPU input is recomputed from the batch statistics its first
run kept, by the same kernel, so the same bits (fxopt.checkpointing._batch_norm_replay); parameters are shared, so
gradients accumulate into the same tensors.

When a node stays out of every region (reason in the report):
  bn_training           a train-mode BatchNorm subclass or one called in a form fxopt cannot rewrite:
                        recomputing it would update its running statistics twice (`F.batch_norm` and
                        `aten.batch_norm` may be recomputed: a recomputation replays its statistics or
                        updates throwaway copies, `batch_norm_once`)
  mutation              a write fxopt cannot place (`out=`, setitem): recomputing after it ran would
                        read the mutated tensor. An in-place op (`add_`, `relu_`) may be recomputed inside
                        a region that made the tensor it writes (not in a selective region's cached
                        outputs): the recomputation makes it again and writes it again.
  already_checkpointed  a region the user (or an earlier run) checkpointed: left as it is
  unknown_op            a call fxopt cannot see into (it may mutate state or draw random numbers)
and no region keeps (as input, or as a selective region's cached output) a tensor written in place after it, through
any alias (`kept_tensor_written_later`, fxopt.checkpointing.kept_writes): the recomputation would read the new values;
the report names the value, its writer and a refused region.
When no plan fits `memory_budget` (`budget_unreachable`, at `<graph>`), the pass applies the plan with the lowest
reachable peak and reports that peak and what stood in the way (headline: NOT met).
The whole pass is skipped when the graph already holds its regions (a second run changes nothing), cannot run on fake
tensors, or is handed on to torch.compile (whose partitioner decides recomputation itself).
"""
from __future__ import annotations

import math

import torch.fx as fx

from ..analysis.saved_tensors import RUNTIME_KERNEL_OPS, measurement
from ..analysis.shapes import remember_shape_sources
from ..checkpointing.budget import graph_limit, parse_budget
from ..checkpointing.calibration import calibrated_overhead, calibration_span
from ..checkpointing.eager_region import CheckpointedRegion, extract_region
from ..checkpointing.eligibility import refusal
from ..checkpointing.kept_writes import KeptWrites
from ..checkpointing.peak_holders import peak_holders
from ..checkpointing.planner import as_plan, plan_floor, plan_regions, region_boundaries
from ..checkpointing.profile import Estimate, Region, StepProfile, estimate, step_profile
from ..collector import collector_paused
from ..op_names import op_name
from ..user_code import warn_at_users_line
from .base import TRAINING, Pass, PassContext, PassResult

def _captured_peak(ctx: PassContext, peak_now: int) -> int:
    """The estimated step peak of the graph as captured, which a fractional budget is a fraction of (what the
    passes before this one freed, such as activation_masks' bytes, then counts towards the budget)."""
    captured = step_profile(ctx.captured, caller_loss=True) if ctx.captured is not None else None
    return estimate(captured).peak if captured is not None else peak_now


def _frees(profile: StepProfile, region: Region) -> int:
    """Bytes a region stops keeping: what its steps would save, less what it keeps (its inputs, cached outputs)."""
    return profile.region_recompute_bytes(region) - profile.bytes_of(profile.region_keeps(region))


def _megabytes(n: int) -> str:
    """Bytes in MB, two decimals, or two significant digits below 0.01 MB: a small region may free only a few KB
    once its checkpoint's own state (fxopt.checkpointing.profile) is paid for."""
    return f"{n / 1e6:.2f} MB" if abs(n) >= 1e4 else f"{n / 1e6:.2g} MB"


def _why_unreachable(result: PassResult, floor: Estimate) -> str:
    """One line on what holds the lowest reachable peak (`floor`): where it lands, and what cannot be recomputed."""
    if floor.backward_peak >= floor.forward_peak:
        held = ("its peak is in backward, held by region inputs, tensors saved outside regions and the gradients "
                "in flight (of activations and of parameters)")
    else:
        held = "its peak is in forward, held by the tensors kept for backward and those the next ops still read"
    refusals = {k.removeprefix("refused_"): n for k, n in result.stats.items() if k.startswith("refused_")}
    blocked = ", ".join(f"{n} {reason}" for reason, n in sorted(refusals.items()))
    return f"{held}; {blocked} node(s) cannot be recomputed" if blocked else held


def _what_next(kind: str, lowest: int, reference: int) -> str:
    """What the caller can change: a budget the floor meets, or a smaller step."""
    size = f"{math.ceil(lowest / 1e3)}KB" if lowest < 1e7 else f"{math.ceil(lowest / 1e6)}MB"
    met = f"memory_budget={math.ceil(100 * lowest / reference) / 100:g}" if kind == "fraction" else \
        f"memory_budget='{size}'"
    return f"give {met} or more, or a smaller batch"


def _peak_text(profile: StepProfile, regions, refused: bool) -> str:
    """Which ops hold the lowest reachable peak, and what the user could change (for the NOT met warning)."""
    holders = peak_holders(profile, regions)
    if holders is None:
        return ""
    parts, hints = [], []
    if holders.kept:
        parts.append("tensors kept by " + ", ".join(f"{name} {_megabytes(n)}" for name, n in holders.kept))
        made = {s.node.name: s.node for s in profile.steps}
        math_attention = [name for name, _ in holders.kept if name in made
                          and op_name(made[name]) in RUNTIME_KERNEL_OPS
                          and (m := measurement(made[name])) is not None and m.private_bytes]
        if math_attention:
            hints.append(f"attention ({', '.join(math_attention)}) keeps its sequence-square weights and dropout mask "
                         f"(torch's math kernel, chosen for attention dropout or a mask that needs a gradient): "
                         f"attention dropout 0 lets torch run a kernel that keeps far less")
    if holders.waiting:
        parts.append("the gradient of " + ", ".join(f"{name} {_megabytes(n)}" for name, n in holders.waiting)
                     + ", read at several places (tied), waiting for its sum")
        hints.append("tied_embedding_grads (training pipeline) makes a tied lookup's gradient its rows where it may: see "
                     "its refusals in the report; freezing the tied parameter also removes its waiting gradient")
    parts.append(f"{_megabytes(holders.above_kept)} of gradients and scratch in all")
    hints.append("a smaller batch or sequence lowers every activation" +
                 (", and recomputable nodes in place of the refused ones more of them" if refused else ""))
    return f"at {holders.at}'s backward the peak holds {'; '.join(parts)}; to lower it: {'; '.join(hints)}"


def _unmeasured(profile: StepProfile, result: PassResult) -> None:
    """Report (sites, figure, warning) the ops whose memory the plan's prediction guessed: neither the saved-tensors
    table nor a measurement knows what they keep (fxopt.analysis.saved_tensors)."""
    guessed = [s.node for s in profile.steps if not s.memory_known]
    if not guessed:
        return
    for node in guessed:
        result.record("unmeasured", node, "memory_not_measured",
                      "what it keeps and allocates is guessed (its output and every input), not measured or known: "
                      "the predicted peak may be off")
    result.figures["unmeasured_ops"] = [n.name for n in guessed]
    warn_at_users_line(f"fxopt: the predicted step peak rests on {len(guessed)} op(s) whose memory was guessed, not "
                       f"measured: {', '.join(n.name for n in guessed[:5])}{' ...' if len(guessed) > 5 else ''}")


def _region_name(gm: fx.GraphModule, profile: StepProfile, region: Region) -> str:
    first, last = profile.steps[region.start].node.name, profile.steps[region.stop - 1].node.name
    base = f"checkpointed_{first}_to_{last}" if first != last else f"checkpointed_{first}"
    name, k = base, 1
    while hasattr(gm, name):
        name, k = f"{base}_{k}", k + 1
    return name


class CheckpointActivations(Pass):
    name = "checkpoint_activations"
    summary = "Recompute cost-model-chosen regions in backward so the training step fits memory_budget."
    modes = (TRAINING,)
    reads_captured_graph = True  # a fractional budget is a fraction of the step's peak as captured
    options = {"memory_budget": (None, "peak memory of a training step, the caller's loss included: a fraction in "
                                       "(0, 1] of its peak as captured, before fxopt's passes (1 = no recomputation), "
                                       "or a size with a unit such as '512MB'")}

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        value = self.option(ctx, "memory_budget")
        if value is None:
            result.skipped = "no memory_budget given"
            return result
        kind, amount = parse_budget(value)
        if ctx.aot_autograd_next:
            result.skipped = ("under torch.compile, fxopt's planner tags what AOTAutograd's partitioner "
                              "recomputes (fxopt.pipeline.compile_budget)")
            return result
        if any(isinstance(m, CheckpointedRegion) for m in gm.modules()):
            result.skipped = "the graph already holds checkpointed regions"
            return result
        with collector_paused():  # the planner makes hundreds of thousands of small tuples, no cycles
            self._checkpoint(gm, ctx, value, kind, amount, result)
        return result

    @staticmethod
    def _checkpoint(gm: fx.GraphModule, ctx: PassContext, value, kind: str, amount: float,
                    result: PassResult) -> None:
        """Profile the step, plan the regions for the budget (`value`, parsed: `kind`, `amount`), extract them."""
        profile = step_profile(gm, timed=True, caller_loss=True)
        if profile is None:
            result.skipped = "the graph cannot run on fake tensors, so its memory cannot be estimated"
            return
        checkpointable = []
        for step in profile.steps:
            reason = refusal(step.node, gm)
            checkpointable.append(not reason)
            if reason:
                result.record("refused", step.node, reason, "kept out of every checkpointed region")
        before = estimate(profile)
        reference = _captured_peak(ctx, before.peak)
        held = ctx.step_held  # what the step's graphs before this one keep (graph breaks): the budget's, too
        limit = graph_limit(kind, amount, reference, held)
        writes, conflicts = KeptWrites(gm, profile), {}

        def may_make(region: Region) -> bool:
            """A region the plan may hold: none whose selective policy would see inside an attention, none that
            keeps a tensor written in place later (noting the first such conflict per value)."""
            if profile.policy_sees_inside(region):  # a selective policy would keep products inside an attention
                return False
            if writes.write_inside(region) is not None:
                return False
            conflict = writes.conflict(region)
            if conflict is not None:
                conflicts.setdefault(conflict, region)
            return conflict is None

        if profile.timed:  # regions priced by what one of this graph's blocks costs as a region
            span = calibration_span(profile, sorted(region_boundaries(profile)), checkpointable,
                                    may_make)
            calibrated = calibrated_overhead(gm, profile, span) if span is not None else None
            if calibrated is not None:
                profile.overhead = calibrated
                result.figures["region_overhead_ms"] = {"whole": round(calibrated.per_region * 1e3, 3),
                                                        "selective": round(calibrated.selective_per_region * 1e3, 3)}
        regions = plan_regions(profile, limit, checkpointable, allowed=may_make)
        unreachable = regions is None
        if unreachable:
            regions = plan_floor(profile, checkpointable, allowed=may_make)
        if unreachable:
            floor = estimate(profile, regions)
            lowest, why = floor.peak, _why_unreachable(result, floor)
            holders = _peak_text(profile, regions, refused=any(k.startswith("refused_") for k in result.stats))
            why = f"{why}; {holders}" if holders else why
            # figures of the step: what the graphs before this one keep, and eager's step there
            step_lowest, step_reference = held.planned + lowest, held.eager + reference
            before_text = f" with {held.planned / 1e6:.2f} MB kept by the graphs before it" if held.planned else ""
            result.record("refused", "<graph>", "budget_unreachable",
                          f"no plan fits {limit / 1e6:.2f} MB{before_text}; lowest reachable "
                          f"{step_lowest / step_reference:.2f}x ({lowest / 1e6:.2f} MB): {why}")
            result.figures["headline"] = (f"memory_budget {value!r} ({limit / 1e6:.2f} MB{before_text}) NOT met: "
                                          f"lowest reachable {step_lowest / step_reference:.2f}x of the step peak "
                                          f"({lowest / 1e6:.2f} MB); {why}: "
                                          f"{_what_next(kind, step_lowest, step_reference)}")
            warn_at_users_line(f"fxopt: {result.figures['headline']}")
        useful = tuple(r for r in regions if _frees(profile, r) > 0)  # a region that frees nothing only costs,
        if estimate(profile, useful).peak <= estimate(profile, regions).peak:  # unless it lowers the peak
            regions = useful
        for (value, writer), region in conflicts.items():
            first, last = profile.steps[region.start].node.name, profile.steps[region.stop - 1].node.name
            result.record("refused", value, "kept_tensor_written_later",
                          f"{writer.name} writes it in place later; no region keeps it (refused: "
                          f"{'selective ' if region.save_compute_intensive else ''}region {first}..{last})")
        plan = as_plan(profile, regions)
        _unmeasured(profile, result)
        names, shapes_kept = [], True
        for region, kept in zip(plan.regions, plan.kept):
            steps = profile.steps[region.start:region.stop]
            nodes = [s.node for s in steps]
            name = _region_name(gm, profile, region)
            call = extract_region(gm, nodes, name, region.save_compute_intensive, region.replay_dropout,
                                  compute_intensive=[profile.steps[p].node for p in kept])
            kind_text = gm.get_submodule(name).kind
            if region.keep_costly_only:
                cheap = [profile.steps[p].node.name for p in profile.recomputed_steps(region)
                         if profile.cheap_to_recompute[p]]
                kind_text += f", light ones recomputed ({', '.join(cheap)})"
            if profile.has_replayable_dropout(region):
                kind_text += ", dropout masks kept" if region.replay_dropout else ", dropout drawn again"
            result.record("checkpointed", call, detail=f"{len(nodes)} nodes {nodes[0].name}..{nodes[-1].name}, "
                                                       f"{kind_text}, frees {_megabytes(_frees(profile, region))}, "
                                                       f"recomputes {profile.region_flops(region)} FLOPs")
            names.append(name)
            shapes_kept = shapes_kept and "val" in call.meta
        if names and shapes_kept:  # every region stands for values whose shapes are known: nothing to propagate
            remember_shape_sources(gm)  # (running the regions on fake tensors again is slow: docs/checkpointing.md)
        after = plan.estimate
        result.figures.update(
            budget_bytes=int(limit), budget_met=after.peak <= limit, regions=names,
            recomputed_flops=after.recompute_flops,
            predicted_recompute_s=plan.recompute_cost / 1e9 if profile.timed else None,
            saved_bytes_before=before.saved_bytes, saved_bytes_after=after.saved_bytes,
            held_by_earlier_graphs=held.planned,
            peak_estimate_captured=reference, peak_estimate_before=before.peak, peak_estimate_after=after.peak)
