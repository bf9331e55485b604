"""Choose the checkpoint regions of one graph: least recompute cost (measured time, or FLOPs) whose step peak fits a budget.

A plan cuts the steps (call nodes in execution order) into segments: a plain step, or a region [start, stop) of
checkpointable steps, either recomputed whole or selectively (matmul, conv and attention outputs saved, everything
else recomputed; or only the costly ones of those saved, the cheap ones recomputed too:
StepProfile.cheap_to_recompute). Walking the plan in forward order, `fxopt.checkpointing.profile.segment_effect`
gives the backward peak inside each segment from two numbers: the bytes kept so far and which kept tensors later
steps may still read (so a tensor saved by two nodes counts once). That makes the problem a shortest path:

    label = (bytes kept, recompute cost, peak so far) at a position, keyed by the tensors held
    extend each label by a plain step, or, at a region boundary, by every region to a later
    boundary, in both variants,
    dropping labels whose peak exceeds the budget and labels another label dominates
    (no more bytes kept and no more cost under the same key).

Region boundaries are restricted to cheap-to-save points (`region_boundaries`: per window of the steps, where the
fewest activation bytes cross, and the end of a chain crossing as few), at most 2 × MAX_BOUNDARIES of them, so the
search does not grow with the square of the depth (docs/checkpointing.md); the price is a higher lowest reachable
peak, since regions cannot start anywhere. A region [start, stop) is only tried when no refused step lies inside, and
whether each region is allowed is asked once, not per label. The last position's cheapest label is the optimal plan
among those boundaries under this memory model (dynamic programming, not a greedy cut), in O(steps × labels +
boundaries² × labels); it is exact while at most MAX_LABELS labels survive domination at a position, else the cheapest
and the leanest label of each band of bytes kept are kept (`_prune`); labels keeping so much that the gradients of a
later backward would exceed the budget are dropped first (`_backward_floor`). Regions stop growing once what they
would recompute alone exceeds the budget, and a budget the plan without regions already meets returns at once: nothing
to recompute.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import operator
from collections.abc import Callable, Sequence

from .profile import LEAST_LOSS_TENSORS, Estimate, Region, StepProfile, estimate


MAX_LABELS = 64  # bands of bytes kept per position and held tensors: bounds the search at a small loss of optimality
# (fewer miss the optimum where selective regions may keep their costly ops only: docs/checkpointing.md)
MAX_BOUNDARIES = 48  # region starts/stops considered: the search grows with their square, not the depth's
PEAK_SEARCH_RISES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)  # plan_regions' limits for the lowest peak, above its floor
FLOOR_TOLERANCE = 0.05  # plan_floor: a plan this fraction above the lowest reachable peak still counts as reaching it


# A label is a plain tuple (bytes kept, recompute cost, peak so far, regions): the search makes one per label and
# segment, and a tuple display is made faster than any NamedTuple (docs/checkpointing.md).
_Label = tuple[int, int, int, tuple[Region, ...]]
_KEPT = operator.itemgetter(0)
_BY_COST = operator.itemgetter(1, 2)  # (cost, peak)
_BY_PEAK = operator.itemgetter(2, 1)  # (peak, cost)
_BY_KEPT_PEAK = operator.itemgetter(0, 2, 1)  # (kept, peak, cost)


def _prune(labels: list[_Label], objective: str, most_kept: float) -> list[_Label]:
    """Labels no other label beats on (bytes kept, objective) that keep at most `most_kept` bytes (more can no
    longer fit the budget), in order of bytes kept; beyond MAX_LABELS of them, spread evenly over the bytes they
    keep: the one keeping the least, then per band of bytes kept its best and the one keeping the least in it (the
    best keeps the most: a later region may not fit beside it; the best alone can miss the optimum). Bands of bytes,
    not of the labels' ranks, which crowd where many plans keep similar bytes (docs/checkpointing.md)."""
    score_of = _BY_COST if objective == "cost" else _BY_PEAK
    best, kept = None, []  # sorted by (kept, cost, peak) as tuples, or (kept, peak, cost)
    for label in (sorted(labels) if objective == "cost" else sorted(labels, key=_BY_KEPT_PEAK)):
        if label[0] > most_kept:
            break
        score = score_of(label)
        if best is None or score < best:
            best = score
            kept.append(label)
    if len(kept) > MAX_LABELS:
        least, span = kept[0][0], max(1, kept[-1][0] - kept[0][0])
        bands: dict[int, list[_Label]] = {}
        for label in kept[1:]:
            bands.setdefault((label[0] - least) * (MAX_LABELS - 1) // span, []).append(label)
        kept = [kept[0], *(l for band in bands.values() for l in dict.fromkeys((band[0], band[-1])))]
    return kept


def _backward_floor(profile: StepProfile) -> list[int]:
    """Per position p: the least any plan's step holds above its kept bytes during some backward at or after p: the
    gradients there and a convolution's scratch, or, where the caller's loss runs first, its own tensors and the
    outputs made at or after p (kept or not, they are not among a label's kept bytes at p yet). Kept bytes only
    grow, so a label at p keeping more than the budget less this fits no plan."""
    n = len(profile.steps)
    loss_outputs_from = [0] * (n + 1)  # bytes of the caller loss's outputs made at or after p
    for p, step in enumerate(profile.steps):
        loss_outputs_from[p] += profile.bytes_of(step.creates & profile.loss_outputs)
    loss_outputs_from = list(itertools.accumulate(reversed(loss_outputs_from)))[::-1]
    loss = profile.loss_tensors * profile.bytes_of(profile.loss_outputs)  # 0 without the caller's loss
    floor = [loss] * (n + 1)
    for p in range(n - 1, -1, -1):
        floor[p] = max(floor[p + 1], profile.grad_live[p] + (profile.steps[p].backward_scratch or 0),
                       loss + loss_outputs_from[p])
    return floor


def region_boundaries(profile: StepProfile) -> frozenset[int]:
    """Positions a region may start or stop at: cheap-to-save points, one or two per window of MAX_BOUNDARIES windows.

    Each window offers the position where the fewest bytes of activations cross (in a chain of
    blocks: a block boundary, where only the residual stream crosses). Where the positions right
    after it cross as few bytes and the steps between make new tensors (a chain such as
    add -> layer_norm, each step reading only its predecessor), the last of that run is offered
    too: a region stopping there keeps only the chain's last tensor, not each one its next step
    saves (the final layer norm before a language model's head). This bounds the region search at
    O(MAX_BOUNDARIES²) whatever the depth.
    """
    n = len(profile.steps)
    made = {k: p for p, s in enumerate(profile.steps) for k in s.creates}
    delta = [0] * (n + 2)
    for k, p in made.items():
        if profile.last_read[k] > p:
            delta[p + 1] += profile.nbytes[k]
            delta[profile.last_read[k] + 1] -= profile.nbytes[k]
    crossing = list(itertools.accumulate(delta))
    windows = max(1, min(MAX_BOUNDARIES, n - 1))
    chosen = {0, n}
    for w in range(windows):
        lo, hi = 1 + w * (n - 1) // windows, 1 + (w + 1) * (n - 1) // windows
        if lo < hi:
            first = min(range(lo, hi), key=lambda p: (crossing[p], p))
            last = first
            while last + 1 < hi and crossing[last + 1] == crossing[first]:
                last += 1
            chosen.add(first)
            if any(profile.steps[q].outputs for q in range(first, last)):  # a chain of new tensors, not only views
                chosen.add(last)
    return frozenset(chosen)


def regions_between(cuts: Sequence[int], checkpointable: Sequence[bool]) -> tuple[Region, ...]:
    """Whole regions between consecutive `cuts` (sorted positions), each split around the refused steps inside."""
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
    return tuple(regions)


def plan_regions(profile: StepProfile, budget: float, checkpointable: Sequence[bool],
                 objective: str = "cost", allowed: Callable[[Region], bool] = lambda region: True
                 ) -> tuple[Region, ...] | None:
    """The plan with the least recompute cost (objective "cost") whose estimated backward peak is at
    most `budget` bytes, or the plan with the lowest peak (objective "peak"); None if none fits.
    Only regions `allowed` accepts are used.

    With no budget, the lowest peak is searched under a rising limit: from just above the least any
    plan holds (`_backward_floor` at the start) up to the peak of a plan known to exist (a region
    between every two boundaries, or none), then with none. The first limit a plan fits admits every
    plan of a lower peak, so it gives the unbounded search's plan, and a tight limit drops most labels
    from the start (GPT-2, 12 layers: 13-58 s unbounded, under 1 s from its floor: docs/checkpointing.md)."""
    if objective == "peak" and budget == math.inf:
        every_boundary = tuple(r for r in regions_between(sorted(region_boundaries(profile)), checkpointable)
                               if allowed(r))
        known = min(estimate(profile).peak, estimate(profile, every_boundary).peak)
        least = _backward_floor(profile)[0]
        for limit in [least * (1 + rise) for rise in PEAK_SEARCH_RISES if least * (1 + rise) < known] + [known]:
            found = _search(profile, limit, checkpointable, objective, allowed)
            if found is not None:
                return found
    return _search(profile, budget, checkpointable, objective, allowed)


def _search(profile: StepProfile, budget: float, checkpointable: Sequence[bool], objective: str,
            allowed: Callable[[Region], bool]) -> tuple[Region, ...] | None:
    """plan_regions' shortest-path search (module docstring) under `budget`."""
    n = len(profile.steps)
    if objective == "cost" and estimate(profile).backward_peak <= budget:
        return ()
    boundaries = sorted(region_boundaries(profile))
    refused_from = [n] * (n + 1)  # refused_from[i]: the first step at or after i no region may hold
    for p in range(n - 1, -1, -1):
        refused_from[p] = p if not checkpointable[p] else refused_from[p + 1]
    frontier: list[dict[frozenset, list[_Label]]] = [dict() for _ in range(n + 1)]
    frontier[0][frozenset()] = [(0, 0, 0, ())]
    variants_cache: dict[tuple[int, int], list[Region]] = {}
    floor = _backward_floor(profile)

    def variants(start: int, stop: int) -> list[Region]:
        """The allowed regions [start, stop): whole, and selective where it has a matmul to keep, also keeping
        only the costly ones where it has cheap ones too (StepProfile.cheap_to_recompute); with dropouts, also whole with them
        drawn again (no mask kept: the least memory)."""
        if (start, stop) not in variants_cache:
            replay = profile.has_replayable_dropout(Region(start, stop))
            whole = Region(start, stop, replay_dropout=replay)
            selective = Region(start, stop, save_compute_intensive=True, replay_dropout=replay)
            costly = selective._replace(keep_costly_only=True)
            tried = [whole] + [r for r in (selective, costly) if profile.region_cost(r) < profile.region_cost(whole)]
            if len(tried) == 3 and profile.kept_steps(costly) == profile.kept_steps(selective):
                tried.pop()  # no cheap step kept: the same region
            if replay:
                tried.append(Region(start, stop, replay_dropout=False))
            variants_cache[start, stop] = [r for r in tried if allowed(r)]
        return variants_cache[start, stop]

    def extend(labels: list[_Label], held: frozenset, segment: Region | int, stop: int, cost: int) -> None:
        """Every label followed by `segment` (ending at `stop`, costing `cost`) whose peak fits the budget. What a
        segment adds depends on the tensors held only (segment_delta): read once for all labels under one key."""
        added, above, still_read = profile.segment_delta(held, segment)
        region = (segment,) if isinstance(segment, Region) else ()
        fitting = bisect.bisect_right(labels, budget - above - added, key=_KEPT)  # in order of bytes kept (_prune)
        # as segment_effect: kept bytes grow by `added`, the segment peaks `above` them
        reached = [(now, spent + cost, peak if peak > (top := now + above) else top, regions + region)
                   for kept, spent, peak, regions in labels[:fitting] for now in (kept + added,)]
        if reached:
            frontier[stop].setdefault(still_read, []).extend(reached)

    for i in range(n):
        stops = [b for b in boundaries if i < b <= refused_from[i]] if i in boundaries else []
        for held, labels in frontier[i].items():
            labels = _prune(labels, objective, budget - floor[i])
            if not labels:
                continue
            extend(labels, held, i, i + 1, 0)
            held_bytes = profile.bytes_of(held)
            for stop in stops:
                room = budget + held_bytes - profile.region_recompute_bytes(Region(i, stop))
                labels = [label for label in labels if label[0] <= room]  # the others: recomputing it alone
                if not labels:  # would exceed the budget, and longer regions more
                    break
                for region in variants(i, stop):
                    extend(labels, held, region, stop, profile.region_cost(region))
        frontier[i] = {}  # done with this position
    return _best_final([label for labels in frontier[n].values() for label in labels], profile, budget, objective)


def _best_final(finals: list[_Label], profile: StepProfile, budget: float, objective: str) -> tuple[Region, ...] | None:
    """The best plan by (cost, peak) or (peak, cost) once the forward's peak is counted too: the walk bounds
    the backward only. A label's walked peak is a lower bound of its whole peak, so its walked (cost, peak) or
    (peak, cost) is a lower bound of its whole one: the labels are taken in that order and the whole estimate
    (O(steps) each) is made only while one may still win. (Stopping on the first of the two alone would estimate
    every label tied with the best on it: docs/checkpointing.md.)"""
    order = _BY_COST if objective == "cost" else _BY_PEAK
    best = None
    for kept, cost, peak, regions in sorted(finals, key=order):
        if best is not None and order((kept, cost, peak)) >= order(best):
            break  # sorted by a lower bound of the whole order: no later label can beat the best
        whole = (kept, cost, estimate(profile, regions).peak, regions)
        if whole[2] <= budget and (best is None or order(whole) < order(best)):
            best = whole
    return None if best is None else best[3]


def untimed(profile: StepProfile) -> StepProfile:
    """The same profile priced by FLOPs instead of measured times: plans chosen on it do not depend on timing noise."""
    steps = [dataclasses.replace(s, seconds=None, replay_seconds=None) for s in profile.steps]
    return profile.repriced(steps)


def plan_floor(profile: StepProfile, checkpointable: Sequence[bool],
               allowed: Callable[[Region], bool] = lambda region: True) -> tuple[Region, ...]:
    """The plan applied when no plan fits a budget: the lowest estimated peak, and among plans reaching it the fewest
    recomputed FLOPs. Priced by FLOPs, not by measured times, so every budget below the floor gets the same plan in
    every run (plans of equal estimated peak may differ in measured peak).

    Where the caller's loss after the forward holds that floor (the budget's cautious guess, CALLER_LOSS_TENSORS
    output-sized tensors), every plan keeping about as little ties, however high the graph's own backward climbs (one
    region over the whole model, recomputed while the logits' gradient is alive); a loss that holds less (a
    cross-entropy fxopt captured too: inplace_log_softmax_grad) then leaves the step's peak in that backward. So the
    plan with the lowest peak where the loss holds the least a loss holds (LEAST_LOSS_TENSORS) is taken instead,
    where it stays within FLOOR_TOLERANCE of the floor under the guess."""
    profile = untimed(profile)
    lowest_plan = plan_regions(profile, math.inf, checkpointable, objective="peak", allowed=allowed)
    floor = estimate(profile, lowest_plan).peak
    if profile.loss_outputs:
        light = profile.with_loss_tensors(LEAST_LOSS_TENSORS)
        light_plan = _cheapest_at(light, plan_regions(light, math.inf, checkpointable, objective="peak",
                                                      allowed=allowed), checkpointable, allowed)
        if estimate(profile, light_plan).peak <= (1 + FLOOR_TOLERANCE) * floor:
            return light_plan
    return _cheapest_at(profile, lowest_plan, checkpointable, allowed)


def _cheapest_at(profile: StepProfile, lowest_plan: tuple[Region, ...], checkpointable: Sequence[bool],
                 allowed: Callable[[Region], bool]) -> tuple[Region, ...]:
    """Among plans reaching `lowest_plan`'s peak, the cheapest."""
    cheapest = plan_regions(profile, estimate(profile, lowest_plan).peak, checkpointable, allowed=allowed)
    return cheapest if cheapest is not None else lowest_plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """One plan as both lowerings take it: its regions, the steps each keeps (`StepProfile.kept_steps`), and what it
    is predicted to cost: the step's memory (`estimate`) and the recompute cost in the profile's price list
    (measured nanoseconds, or FLOPs)."""

    regions: tuple[Region, ...]
    kept: tuple[tuple[int, ...], ...]
    estimate: Estimate
    recompute_cost: int
    name: str = ""  # where it comes from, where there are several ("planner at 0.5x peak", "lowest-peak plan")


def as_plan(profile: StepProfile, regions: Sequence[Region], early_stop: bool = True, name: str = "") -> Plan:
    """`regions` as a Plan over `profile`; `early_stop`: regions recompute as torch.utils.checkpoint does (the eager
    lowering), else as a partitioner does (kept_steps)."""
    return Plan(regions=tuple(regions), kept=tuple(tuple(profile.kept_steps(r, early_stop)) for r in regions),
                estimate=estimate(profile, regions), recompute_cost=sum(profile.region_cost(r) for r in regions),
                name=name)
