"""Which ops hold a plan's estimated step peak: the tensors kept there, summed by the op that made them.

An unmet memory budget is only useful to the user with what stands in the way. `peak_holders(profile, regions)`
walks the plan as fxopt.checkpointing.profile.estimate does, finds the segment whose backward holds the peak, and sums
what is kept at that moment (what every segment up to it keeps: backward runs last segment first) by the op that
made each tensor; what the backward there holds beyond that (gradients, scratch) is reported beside it, and among
those gradients the ones of parameters read both before and after that point (tied weights: their gradient waits
there for the rest of its sum, fxopt.checkpointing.profile).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from .profile import STATE, Region, StepProfile, segment_effect, segments


@dataclasses.dataclass(frozen=True)
class PeakHolders:
    at: str  # the node (or the first node of the region) whose backward holds the peak
    kept: tuple[tuple[str, int], ...]  # (op that made them, bytes kept) at the peak, largest first
    above_kept: int  # bytes beyond what is kept there: gradients in flight, a backward's scratch, a recomputation
    waiting: tuple[tuple[str, int], ...] = ()  # (parameter, bytes) of tied parameters' gradients waiting there


def peak_holders(profile: StepProfile, regions: Sequence[Region] = (), top: int = 3) -> PeakHolders | None:
    """The `top` ops whose kept tensors make up most of the backward peak under `regions` (module docstring); None
    for an empty profile."""
    maker = {k: s.node.name for s in profile.steps for k in s.creates}
    held, kept_bytes, kept_keys = frozenset(), 0, set()
    best = None
    for seg in segments(len(profile.steps), regions):
        effect = segment_effect(profile, held, kept_bytes, seg)
        kept_keys |= profile.steps[seg].saved if isinstance(seg, int) else profile.region_keeps(seg)
        if best is None or effect.peak > best[0]:
            best = (effect.peak, seg, frozenset(kept_keys), effect.kept_bytes)
        held, kept_bytes = effect.held, effect.kept_bytes
    if best is None:
        return None
    peak, seg, keys, kept_total = best
    by_op = Counter()
    for k in keys:
        by_op[maker.get(k) or _owner(k)] += profile.nbytes[k]
    position = seg if isinstance(seg, int) else seg.start
    return PeakHolders(profile.steps[position].node.name, tuple(by_op.most_common(top)), peak - kept_total,
                       _waiting_gradients(profile, position))


def _waiting_gradients(profile: StepProfile, at: int) -> tuple[tuple[str, int], ...]:
    """Parameters that get a gradient (get_attr nodes, or graph inputs capture marked as state) read at `at` or before
    and after it: their gradient is alive at `at`'s backward (a buffer or a frozen weight read twice has none)."""
    position = {s.node: p for p, s in enumerate(profile.steps)}
    params = {a for s in profile.steps for a in s.node.all_input_nodes
              if a.op == "get_attr" or (a.op == "placeholder" and a.meta.get("constant_input"))}
    waiting = []
    for param in params:
        readers = [position[u] for u in param.users if u in position]
        value = param.meta.get("val")
        name = param.target if param.op == "get_attr" else param.meta.get("state_name", param.name)
        if (len(set(readers)) > 1 and min(readers) <= at < max(readers) and value is not None
                and value.requires_grad):
            waiting.append((name, value.numel() * value.element_size()))
    return tuple(sorted(waiting, key=lambda w: -w[1]))


def _owner(key) -> str:
    """Who keeps a tensor no step makes: a region's checkpoint (its RNG state, its BatchNorms' statistics)."""
    return "checkpoint state" if isinstance(key, tuple) and key[0] == STATE else "?"
