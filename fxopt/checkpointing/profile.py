"""The memory of one training step (forward + backward), estimated per node, for any checkpoint plan.

`step_profile(gm)` lists the graph's call nodes in execution order as `Step`s: the storages each creates, the storages
autograd keeps for its backward (`fxopt.analysis.saved_tensors`), its FLOPs (`fxopt.analysis.flops`). Tensors are
identified by their storage in the fake tensors of `node.meta["val"]`, so views share bytes with their base;
placeholders, parameters and buffers live anyway and cost nothing (as in `fxopt.measure`).

`estimate(profile, regions)` simulates the step under a plan of checkpointed `Region`s:

* a kept tensor is alive from the forward that makes it until the backward of its *first* holder (backward runs last
  node first); a holder is a node that is not checkpointed and saves it, or a region that keeps it (its inputs, and in a
  selective region the matmul outputs it keeps: kept_steps);
* the backward of a node at position p holds every kept tensor whose first holder is at or before p, plus the gradients
  of the tensors crossing p and of the trainable parameters it reads (`grad_live`: made before they accumulate into
  `.grad`), plus what a convolution's backward allocates beyond those gradients (`Step.backward_scratch`,
  fxopt.analysis.conv_scratch: oneDNN's own copies of the gradients, reorders, partial sums;
  fxopt.analysis.backward_temporaries: pow's and a broadcast mul's products, a CPU batch norm's first input gradient);
* the backward of a region first recomputes it: everything its nodes save is alive at once, on top of what is kept,
  while its backward starts, and each is freed after the backward of its first holder, as the gradients inside the
  region come and go (and a convolution's scratch, as outside regions; a selective region's cached outputs are dropped
  as the recomputation takes them); a region may keep the masks of its dropouts and replay them
  (`Region.replay_dropout`, fxopt.checkpointing._dropout_replay);
* from its forward to the end of its backward a region also keeps its checkpoint's state: on CPU, a copy of the RNG
  state (`preserve_rng_state`; the second copy torch.random.fork_rng holds while it recomputes is freed before the
  gradients of its last step's backward, which the model already counts then, exist), and of each train-mode BatchNorm
  in it, what its recomputation replays from or copies of its running statistics
  (fxopt.checkpointing.eager_region.batch_norm_once);
* the forward at p holds the kept tensors made so far and the tensors still to be read;
* with `caller_loss`, between the forward and the graph's backward the caller's loss runs its own backward over the
  graph's outputs: everything kept is alive, and so are the outputs and what the loss holds, taken as
  CALLER_LOSS_TENSORS output-sized tensors, the outputs' gradients among them: the most a common loss holds, as a user
  measures the step with their loss in it (docs/checkpointing.md).

The peak of the step is the largest of these. `segment_effect` is the one step of this simulation the planner
(fxopt.checkpointing.planner) also takes, so both see the same model.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import statistics
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
import torch.fx as fx

from .. import _torch_private
from ..op_names import op_name
from ..graph_functions import declared
from ..analysis.backward_temporaries import backward_temporary
from ._batch_norm_replay import replayed_batch_norm
from ..analysis.conv_scratch import conv_backward_scratch
from ._dropout_replay import draws_unreplayed, replayed_dropout_p
from ..analysis.flops import node_flops
from ..analysis.grad_needs import analyze_grad_needs
from ._kept_outputs import kept_output
from ._replay_times import node_seconds, replay_key
from ._region_overhead import RegionOverhead, region_overhead
from ..analysis.ops import match_batch_norm, match_conv, state_input
from ..analysis.saved_tensors import RUNTIME_KERNEL_OPS, measurement, saved_bytes, saved_copies, saved_for_backward, tensor_bytes
from ..analysis.shapes import tensor_meta

Key = Hashable  # a storage (or a node's private saved buffer, such as a dropout mask)
COPY = "copy"  # the key (COPY, node name): the copies of its inputs a node saves (saved_tensors.saved_copies)
STATE = "checkpoint_state"  # the key (STATE, start, stop): what the region over [start, stop) keeps besides tensors
LEFT_LOSS_OUTPUTS = "kept_loss_outputs"  # the key (LEFT_LOSS_OUTPUTS, bytes): the kept outputs only the caller's loss
# still reads, summed (segment_delta)
CALLER_LOSS_TENSORS = 4  # output-sized tensors the caller's loss holds at its backward's peak (module docstring)
LEAST_LOSS_TENSORS = 1  # the least a loss holds: the outputs' gradients (planner.plan_floor)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """One call node, at its position in execution order."""

    node: fx.Node
    creates: frozenset  # storages it allocates
    reads: frozenset  # storages of its tensor inputs that cost memory
    saved: frozenset  # storages autograd keeps for its backward
    flops: int  # forward FLOPs (FlopCounterMode)
    compute_intensive: bool  # a matmul / conv / attention: the ops a selective region saves
    seconds: float | None = None  # its forward's measured time (fxopt.analysis.op_times), if measured
    mask: frozenset = frozenset()  # a dropout a region may replay: its mask's key (fxopt.checkpointing._dropout_replay)
    replay_seconds: float | None = None  # the measured time of recomputing it from what a region keeps (a dropout's
    # mask, a BatchNorm's statistics: fxopt.checkpointing._batch_norm_replay), if it has such a replay and was measured
    outputs: frozenset = frozenset()  # the storages of its output value it creates (creates less private buffers)
    backward_scratch: int | None = None  # what its backward allocates beyond its gradients, if known (a convolution's
    # scratch; fxopt.analysis.backward_temporaries for other ops)
    region_state: int = 0  # what a region holding it keeps from its forward to its backward's end: of a train-mode
    # BatchNorm, what it replays from or copies of its running statistics (batch_norm_once)
    saves_for_backward: bool = False  # autograd saves some tensor for its backward, a parameter or graph input (not in `saved`:
    # they cost no memory) included: what checkpoint's early stop counts
    memory_known: bool = True  # what it keeps comes from the saved-tensors table or a measurement, not a guess
    # (fxopt.analysis.saved_tensors: an op neither knows, or attention that could not be run to measure it)
    runs_as_ops: bool = False  # a compute-intensive op autograd records as several ops (attention's math path): torch's
    # selective checkpoint policy sees the products inside it and keeps those, not its output (policy_sees_inside)

    @property
    def replay_saving(self) -> int:
        """What replaying this step (`replay_seconds`) saves over running it again, in recompute_cost's unit."""
        if self.seconds is None or self.replay_seconds is None:
            return 0
        return max(0, round((self.seconds - self.replay_seconds) * 1e9))

    @property
    def recompute_cost(self) -> int:
        """Measured nanoseconds; unmeasured: FLOPs, and one per output element for the ops FlopCounterMode
        does not count."""
        if self.seconds is not None:
            return round(self.seconds * 1e9)
        if self.flops:
            return self.flops
        val = tensor_meta(self.node)
        return max(1, val.numel() if val is not None else 0)


class Region(NamedTuple):
    """Steps [start, stop) recomputed in backward; `save_compute_intensive`: except matmul/conv/attention outputs;
    `replay_dropout`: its CPU dropouts keep their masks and replay from them (else they draw again);
    `keep_costly_only`: with `save_compute_intensive`, the cheap ones among those (StepProfile.cheap_to_recompute) are recomputed too.
    A tuple: the planner hashes one per candidate and label."""

    start: int
    stop: int
    save_compute_intensive: bool = False
    replay_dropout: bool = True
    keep_costly_only: bool = False


@dataclasses.dataclass
class StepProfile:
    steps: list[Step]
    nbytes: dict  # Key -> bytes
    last_read: dict  # Key -> position of its last reader (len(steps) for graph outputs)
    grad_live: list[int]  # bytes of gradients alive during the backward of each position
    overhead: RegionOverhead | None = None  # what regions cost beyond their ops (timed profiles only)
    rng_state: int = 0  # bytes of the RNG state a region's checkpoint copies where the step's memory is (0 off CPU)
    loss_outputs: frozenset = frozenset()  # with `caller_loss`: the outputs' storages the caller's loss differentiates
    loss_tensors: int = CALLER_LOSS_TENSORS  # output-sized tensors the caller's loss holds (module docstring)

    @property
    def timed(self) -> bool:
        """Recompute costs are measured nanoseconds (else FLOPs)."""
        return bool(self.steps) and self.steps[0].seconds is not None

    def bytes_of(self, keys) -> int:
        return sum(self.nbytes[k] for k in keys)

    def region_keeps(self, r: Region) -> frozenset:
        """What a region keeps for backward: its inputs, its checkpoint's state (`region_state`) and, if selective,
        its compute-intensive ops' outputs."""
        return self._region_sets(r)[0]

    def region_state(self, r: Region) -> frozenset:
        """The key of what the region's checkpoint keeps besides tensors from its forward to its backward's end:
        the RNG state and its BatchNorms' statistics (none when that is nothing)."""
        key = (STATE, r.start, r.stop)
        if key not in self.nbytes:
            self.nbytes[key] = self.rng_state + sum(s.region_state for s in self.steps[r.start:r.stop])
            self.last_read[key] = r.start
        return frozenset({key}) if self.nbytes[key] else frozenset()

    def region_recompute_bytes(self, r: Region) -> int:
        return self._region_sets(r)[2]

    def _region_sets(self, r: Region) -> tuple[frozenset, frozenset, int]:
        if r not in self._regions:
            inputs, masks, recomputes, recomputed_bytes = self._span_sets(r.start, r.stop)
            keeps = inputs | self.region_state(r)
            if r.save_compute_intensive:
                keeps = keeps | self._kept_outputs(r)
            if r.replay_dropout and masks:
                keeps = keeps | masks
            self._regions[r] = (keeps, recomputes, recomputed_bytes)
        return self._regions[r]

    def _span_sets(self, start: int, stop: int) -> tuple:
        """What steps [start, stop) read from before them, keep as dropout masks and save, with the bytes saved:
        shared by every kind of region over the span."""
        if (start, stop) not in self._spans:
            steps = self.steps[start:stop]
            made = frozenset().union(*(s.creates for s in steps))
            recomputes = frozenset().union(*(s.saved for s in steps))
            self._spans[start, stop] = (frozenset().union(*(s.reads for s in steps)) - made,
                                        frozenset().union(*(s.mask for s in steps)), recomputes,
                                        self.bytes_of(recomputes))
        return self._spans[start, stop]

    def keeps_itself(self, r: Region) -> bool:
        """Whether a selective region over r's steps keeps its ops' outputs itself (outputs_kept_by_region): every
        compute-intensive step its recomputation runs is one it can keep; else torch's selective policy keeps them."""
        return self._sum(self._counted_not_kept_prefix, self.recomputed_steps(r)) == 0

    def kept_steps(self, r: Region, early_stop: bool = True) -> list[int]:
        """The compute-intensive steps whose outputs a selective region keeps, less the cheap ones with `keep_costly_only`.

        The one rule for both lowerings. An eager region (`early_stop`: torch.utils.checkpoint's recomputation
        stops early) that keeps them itself (keeps_itself) keeps those its recomputation runs (recomputed_steps):
        the early stop never reaches the others, which need nothing kept (the last linear of a transformer layer's
        MLP); under torch's selective policy instead, every compute-intensive step's output. A partitioner's recomputation
        (not `early_stop`) is tagged node by node, so it keeps every compute-intensive step of the region."""
        if not r.save_compute_intensive:
            return []
        if early_stop and not self.keeps_itself(r):
            return [p for p in range(r.start, r.stop) if self.steps[p].compute_intensive]
        steps = self.recomputed_steps(r) if early_stop else range(r.start, r.stop)
        return [p for p in steps if self.steps[p].compute_intensive and not (r.keep_costly_only and self.cheap_to_recompute[p])]

    def _kept_outputs(self, r: Region) -> frozenset:
        """What a selective region keeps of its compute-intensive steps (kept_steps): their outputs, not the copies of inputs
        they save."""
        if r not in self._kept:
            self._kept[r] = frozenset(k for p in self.kept_steps(r) for k in self.steps[p].creates if not _is_copy(k))
        return self._kept[r]

    def _kept_prices(self, r: Region) -> tuple[int, int]:
        """(recompute cost, FLOPs) of the compute-intensive steps a region keeps (kept_steps) that its recomputation would
        otherwise run."""
        if r not in self._kept_price:
            run = self.recomputed_steps(r)
            kept = [self.steps[p] for p in self.kept_steps(r) if p in run]
            self._kept_price[r] = (sum(s.recompute_cost for s in kept), sum(s.flops for s in kept))
        return self._kept_price[r]

    def recomputed_steps(self, r: Region) -> range:
        """The steps a region's recomputation runs. Checkpoint stops it once the last tensor the forward saved is
        saved again (its early stop): the last step that saves something runs only when it saves a tensor it makes
        (a softmax's result, a dropout's mask), not when it saves its inputs alone (a linear's), and no later step
        runs (a region over a transformer layer never recomputes its last linear)."""
        last = self._last_saver[r.stop]
        if last < r.start:
            return range(r.start, r.start)
        return range(r.start, last + 1 if self._saves_what_it_makes[last] else last)

    def region_cost(self, r: Region) -> int:
        """Recompute cost of a region: every step it recomputes (recomputed_steps), less the compute-intensive ones a
        selective region keeps and what replays save (Step.replay_saving: BatchNorms always, dropouts where the
        region keeps their masks), plus the region's own overhead."""
        run = self.recomputed_steps(r)
        recomputed = self._sum(self._cost_prefix, run) - self._kept_prices(r)[0]
        replayed = self._sum(self._statistics_replay_saving_prefix, run)
        if r.replay_dropout:
            replayed += self._sum(self._dropout_replay_saving_prefix, run)
        return recomputed - replayed + self.overhead_ns(r)

    def overhead_ns(self, r: Region) -> int:
        """What the region costs beyond recomputing its ops (`overhead`), in region_cost's unit."""
        if self.overhead is None:
            return 0
        per_region = self.overhead.selective_per_region if r.save_compute_intensive else self.overhead.per_region
        return round((per_region + self.overhead_per_op(r) * (r.stop - r.start)) * 1e9)

    def overhead_per_op(self, r: Region) -> float:
        """Seconds the region adds per op it holds: a selective one that keeps an op it cannot keep itself runs every
        op through torch's selective checkpoint dispatch mode (fxopt.checkpointing._kept_outputs)."""
        dispatched = r.save_compute_intensive and not self.keeps_itself(r)
        return self.overhead.selective_per_op if dispatched else self.overhead.per_op

    def policy_sees_inside(self, r: Region) -> bool:
        """Whether a selective region over r would run an op torch's policy sees as several (Step.runs_as_ops): it would
        keep the products inside that op, which this model does not describe, so the planner makes no such region."""
        return r.save_compute_intensive and not self.keeps_itself(r) and self._sum(self._runs_as_ops_prefix, r) > 0

    def has_replayable_dropout(self, r: Region) -> bool:
        """Whether a region over r's steps may replay dropouts from masks: it has one, and no other op in it
        draws random numbers (fxopt.checkpointing._dropout_replay.replayable_dropouts)."""
        return self._sum(self._mask_prefix, r) > 0 and self._sum(self._unreplayed_random_prefix, r) == 0

    def region_flops(self, r: Region) -> int:
        """FLOPs of the steps a region recomputes, less the compute-intensive ones a selective region keeps."""
        return self._sum(self._flops_prefix, self.recomputed_steps(r)) - self._kept_prices(r)[1]

    def __post_init__(self):
        self._regions: dict = {}  # Region -> (keeps, recomputes, bytes recomputed)
        self._spans: dict = {}  # (start, stop) -> _span_sets
        self._kept: dict = {}  # Region -> _kept_outputs
        self._kept_price: dict = {}  # Region -> _kept_prices
        self._holders: dict = {}  # (start, stop) -> _span_holders
        self._deltas: dict = {}  # (held, segment) -> segment_delta
        self._aboves: dict = {}  # (region, the held tensors it saves or makes) -> _region_above
        self._cost_prefix = list(itertools.accumulate((s.recompute_cost for s in self.steps), initial=0))
        self._dropout_replay_saving_prefix = list(itertools.accumulate((s.replay_saving if s.mask else 0
                                                                        for s in self.steps), initial=0))
        self._statistics_replay_saving_prefix = list(itertools.accumulate((0 if s.mask else s.replay_saving
                                                                           for s in self.steps), initial=0))
        self._mask_prefix = list(itertools.accumulate((bool(s.mask) for s in self.steps), initial=0))
        self._unreplayed_random_prefix = list(itertools.accumulate(map(draws_unreplayed, (s.node for s in self.steps)),
                                                                   initial=0))
        self._runs_as_ops_prefix = list(itertools.accumulate((s.runs_as_ops for s in self.steps), initial=0))
        self._flops_prefix = list(itertools.accumulate((s.flops for s in self.steps), initial=0))
        self._counted_not_kept_prefix = list(itertools.accumulate(
            (s.compute_intensive and kept_output(s.node) is None for s in self.steps), initial=0))
        self.cheap_to_recompute = _cheap_to_recompute_steps(self.steps, self.nbytes)  # per step (keep_costly_only)
        # [p]: the last step before p that saves a tensor (Step.saves_for_backward)
        self._last_saver = list(itertools.accumulate((p if s.saves_for_backward else -1 for p, s in enumerate(self.steps)), max,
                                                     initial=-1))
        self._saves_what_it_makes = [bool(s.saved & s.creates) for s in self.steps]
        # each step's backward holds the gradients and what it allocates beyond them (Step.backward_scratch)
        self._backward_above = [g + (s.backward_scratch or 0) for g, s in zip(self.grad_live, self.steps)]
        # how long a kept graph output matters to the segments after it by itself (segment_delta's tensors still
        # readable): until its last reader among the steps
        last_step_read = {k: p for p, s in enumerate(self.steps) for k in s.creates | s.reads}
        self._read_until = {k: p for k, p in last_step_read.items() if self.last_read[k] == len(self.steps)}

    def segment_delta(self, held: frozenset, segment: Region | int) -> tuple[int, int, frozenset]:
        """(bytes newly kept, live bytes above everything kept during its backward, tensors still readable after).

        A kept graph output leaves the tensors still readable after its last reader among the steps: no later
        segment keeps it again, so which of them were kept no longer tells plans apart (GPT-2's key/value cache
        split the planner's labels into hundreds of held sets: docs/checkpointing.md). Only the caller's loss
        still reads it, and its term needs only their bytes, summed into one key (LEFT_LOSS_OUTPUTS)."""
        key = (held, segment)
        if key not in self._deltas:
            if isinstance(segment, int):
                keeps, stop, above = self.steps[segment].saved, segment + 1, self._backward_above[segment]
            else:
                keeps, stop, above = self.region_keeps(segment), segment.stop, self._region_above(segment, held)
            if stop == len(self.steps) and self.loss_outputs:  # the caller's loss runs before this backward
                above = max(above, self._caller_loss_above(held | keeps))
            kept = held | keeps
            leaving = frozenset(k for k in kept if self._read_until.get(k, self.last_read[k]) < stop)
            still_read = kept - leaving
            if leaving & self.loss_outputs:
                still_read = self._loss_outputs_summed(still_read, self.bytes_of(leaving & self.loss_outputs))
            self._deltas[key] = (self.bytes_of(keeps - held), above, still_read)
        return self._deltas[key]

    def _loss_outputs_summed(self, held: frozenset, leaving: int) -> frozenset:
        """`held` with its summed key of kept loss outputs (LEFT_LOSS_OUTPUTS) grown by `leaving` bytes."""
        summed = _summed_loss_outputs(held)
        total = leaving + sum(k[1] for k in summed)
        key = (LEFT_LOSS_OUTPUTS, total)
        self.nbytes[key], self.last_read[key] = total, len(self.steps)
        return held - summed | {key}

    def _region_above(self, r: Region, held: frozenset) -> int:
        """Live bytes above everything kept during a region's backward, with `held` kept before it. That depends on
        `held` only where its recomputation saves or makes a tensor, so each region computes it once per such
        overlap, not once per held set."""
        touched = self._region_sets(r)[1] | self.steps[r.stop - 1].creates
        key = (r, held & touched)
        if key not in self._aboves:
            cached = self._cached_outputs(r)
            self._aboves[key] = (self._region_backward_peak(r, (self.region_keeps(r) | held) - cached)
                                 - self.bytes_of(cached))
        return self._aboves[key]

    def _caller_loss_above(self, kept: frozenset) -> int:
        """Live bytes above everything kept while the caller's loss runs its backward: the outputs no step keeps,
        and the loss's own tensors (module docstring)."""
        summed = sum(k[1] for k in _summed_loss_outputs(kept))  # kept, though their own keys are not in `kept`
        return (self.bytes_of(self.loss_outputs - kept) - summed
                + self.loss_tensors * self.bytes_of(self.loss_outputs))

    def _cached_outputs(self, r: Region) -> frozenset:
        """The outputs a selective region keeps that its recomputation takes from torch's cache, which drops each
        then (torch.utils.checkpoint's _CachedTorchDispatchMode marks the entry consumed): after it, each lives on
        only where a step saves it, as a recomputed tensor. The recomputation stops once the last step that saves
        something has saved its inputs (checkpoint's early stop), so outputs of that step and later ones stay
        cached, and so do graph outputs. The masks of the dropouts it replays are not in that cache: the region
        holds them (RegionRun.scratch) until its backward ends, as it holds its inputs."""
        saving = [q for q in range(r.start, r.stop) if self.steps[q].saves_for_backward]
        if not r.save_compute_intensive or not saving:
            return frozenset()
        made = frozenset().union(*(self.steps[q].creates for q in range(r.start, saving[-1])))
        return frozenset(k for k in made & self._kept_outputs(r) if self.last_read[k] < len(self.steps))

    def _region_backward_peak(self, r: Region, counted: frozenset) -> int:
        """Live bytes above `counted` during a region's backward: its recomputation makes again what its steps save,
        a selective region's cached outputs among them (`_cached_outputs`), and where it stops (recomputed_steps)
        what it made for a step it did not run is still alive; each is freed after the backward of its first
        holder, while the gradients at each step are alive, with a convolution's scratch (fxopt.analysis.conv_scratch)
        or the temporaries of pow, broadcast mul and batch norm (fxopt.analysis.backward_temporaries). No other
        temporary: ATen's backward kernels of linear, matmul, GELU, softmax, layer norm, dropout and add allocate the
        gradients they return and nothing else (profiler_allocations, each run alone; a layer norm's small per-row
        partial sums aside), so counting one more would over-predict (docs/checkpointing.md)."""
        first_holder, freed_by_all, pending = self._span_holders(r)
        freed_at = freed_by_all  # what each step's backward frees, of what it first holds, less what is counted
        if excluded := counted & first_holder.keys():
            freed_at = list(freed_by_all)
            for k in excluded:
                freed_at[first_holder[k] - r.start] -= self.nbytes[k]
        alive = list(itertools.accumulate(freed_at))  # alive at q's backward: what steps at or before q still hold,
        peak = max(map(operator.add, alive, self._backward_above[r.start:r.stop]))  # + gradients and temporary
        return max(peak, alive[-1] + self.bytes_of(pending - counted) + self.grad_live[r.stop - 1])

    def _span_holders(self, r: Region) -> tuple[dict, list[int], frozenset]:
        """For _region_backward_peak, of the steps [r.start, r.stop), whatever is counted: the first step saving
        each tensor they save; the bytes each step's backward frees so, by position in the span; and what the
        recomputation (recomputed_steps) makes for a step it does not run, that no step saves."""
        if (r.start, r.stop) not in self._holders:
            first_holder: dict = {}
            for q in range(r.start, r.stop):
                for k in self.steps[q].saved:
                    first_holder.setdefault(k, q)
            freed_at = [0] * (r.stop - r.start)
            for k, q in first_holder.items():
                freed_at[q - r.start] += self.nbytes[k]
            run = self.recomputed_steps(r)
            pending = frozenset(k for q in run for k in self.steps[q].creates if self.last_read[k] >= run.stop
                                and k not in first_holder)
            self._holders[r.start, r.stop] = first_holder, freed_at, pending
        return self._holders[r.start, r.stop]

    def repriced(self, steps: list[Step]) -> StepProfile:
        """The same memory profile with `steps` priced otherwise (no region overhead): it shares the
        memory caches, which do not depend on prices."""
        other = StepProfile(steps, self.nbytes, self.last_read, self.grad_live, rng_state=self.rng_state,
                            loss_outputs=self.loss_outputs, loss_tensors=self.loss_tensors)
        other._regions, other._deltas, other._spans = self._regions, self._deltas, self._spans
        other._holders = self._holders
        other._aboves = self._aboves
        return other

    def with_loss_tensors(self, loss_tensors: int) -> StepProfile:
        """The same profile with the caller's loss holding `loss_tensors` output-sized tensors (memory caches that do
        not depend on it shared)."""
        other = StepProfile(self.steps, self.nbytes, self.last_read, self.grad_live, self.overhead, self.rng_state,
                            self.loss_outputs, loss_tensors)
        other._regions, other._spans, other._holders, other._aboves = (self._regions, self._spans, self._holders,
                                                                       self._aboves)
        return other

    @staticmethod
    def _sum(prefix: list[int], span: Region | range) -> int:
        return prefix[span.stop] - prefix[span.start]


def _cheap_to_recompute_steps(steps: list[Step], nbytes: dict) -> list[bool]:
    """Per step: whether it is a cheap step, one whose FLOPs per byte of its output are under half the
    median of the compute-intensive steps'. Such an op is cheap to recompute for what keeping it holds (attention's score
    matmul: two 64-wide heads in, a sequence-square out), so a selective region may recompute it rather than keep it
    (Region.keep_costly_only). By FLOPs, not measured times: what a region keeps must not depend on how it is
    priced (StepProfile.repriced shares the memory caches)."""
    price = {p: s.flops / size for p, s in enumerate(steps)
             if s.compute_intensive and (size := sum(nbytes[k] for k in s.outputs))}
    bar = statistics.median(price.values()) / 2 if price else 0
    return [price.get(p, bar) < bar for p in range(len(steps))]


class SegmentEffect(NamedTuple):  # a tuple: the planner makes one per step and label
    held: frozenset  # kept tensors still readable later (the planner's state)
    kept_bytes: int  # bytes kept by every segment so far
    peak: int  # the largest backward live bytes inside this segment


def _summed_loss_outputs(keys: frozenset) -> frozenset:
    """The summed key of kept loss outputs (LEFT_LOSS_OUTPUTS) among `keys`: none or one."""
    return frozenset(k for k in keys if isinstance(k, tuple) and k[0] == LEFT_LOSS_OUTPUTS)


def segment_effect(profile: StepProfile, held: frozenset, kept_bytes: int, segment: Region | int) -> SegmentEffect:
    """Add one segment (a plain step at a position, or a region) to a plan walked in forward order."""
    added, above_kept, still_read = profile.segment_delta(held, segment)
    return SegmentEffect(still_read, kept_bytes + added, kept_bytes + added + above_kept)


@dataclasses.dataclass(frozen=True)
class Estimate:
    saved_bytes: int  # kept for backward at the end of forward
    forward_peak: int
    backward_peak: int
    recompute_flops: int

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)


def segments(n_steps: int, regions: Sequence[Region]) -> list[Region | int]:
    """The plan as forward-ordered segments: plain step positions and regions."""
    by_start = {r.start: r for r in regions}
    out, p = [], 0
    while p < n_steps:
        r = by_start.get(p)
        out.append(r if r is not None else p)
        p = r.stop if r is not None else p + 1
    return out


def estimate(profile: StepProfile, regions: Sequence[Region] = ()) -> Estimate:
    """Saved bytes, forward and backward peak, and recomputed FLOPs of the step under `regions`."""
    held, kept, backward_peak, kept_keys = frozenset(), 0, 0, set()
    for seg in segments(len(profile.steps), regions):
        effect = segment_effect(profile, held, kept, seg)
        kept_keys |= profile.steps[seg].saved if isinstance(seg, int) else profile.region_keeps(seg)
        held, kept, backward_peak = effect.held, effect.kept_bytes, max(backward_peak, effect.peak)
    forward_peak, live = 0, set()
    states = {r.start: profile.region_state(r) for r in regions}  # made as each region's forward begins
    for p, step in enumerate(profile.steps):
        live |= step.creates | states.get(p, frozenset())
        forward_peak = max(forward_peak, profile.bytes_of(live))
        live = {k for k in live if k in kept_keys or profile.last_read[k] > p}
    flops = sum(profile.region_flops(r) for r in regions)
    return Estimate(profile.bytes_of(kept_keys), forward_peak, backward_peak, flops)


def _storage(val) -> Key | None:
    return _torch_private.untyped_storage_key(val) if isinstance(val, torch.Tensor) else None


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in _torch_private.tree_leaves(value) if isinstance(t, torch.Tensor)]


def step_profile(gm: fx.GraphModule, timed: bool = False, caller_loss: bool = False) -> StepProfile | None:
    """The steps of `gm` (see module docstring), or None if its FLOPs cannot be counted on fake tensors.

    `timed`: price recomputation by each node's measured time (`fxopt.analysis.op_times`) plus what
    a region costs beyond its ops (`fxopt.checkpointing._region_overhead`, measured once), where the graph
    runs on real tensors; else by FLOPs. `caller_loss`: the step includes the caller's loss over the
    outputs (module docstring); else it starts its backward with the outputs' gradients."""
    flops = node_flops(gm)
    if flops is None:
        return None
    seconds = node_seconds(gm) if timed else None
    free = set()  # storages alive before the step: inputs, parameters, buffers
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            free |= {_storage(t) for t in _tensors(node.meta.get("val"))}
    nbytes: dict = {}
    position: dict[fx.Node, int] = {}
    steps: list[Step] = []
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    grad_needs = analyze_grad_needs(gm, _output_nodes(gm))
    needs_grad = {n for n in calls if grad_needs.recorded(n)}
    for p, node in enumerate(calls):
        position[node] = p
        creates = set()
        for t in _tensors(node.meta.get("val")):
            key = _storage(t)
            if key not in free and key not in nbytes:
                nbytes[key] = t.untyped_storage().nbytes()
                creates.add(key)
        outputs = frozenset(creates)
        reads = {_storage(t) for a in node.all_input_nodes for t in _tensors(a.meta.get("val"))} - free
        requires_grad = grad_needs.requires_grad
        saved = _saved_keys(node, free, nbytes, requires_grad) if node in needs_grad else set()
        saves_for_backward = node in needs_grad and (bool(saved) or _saves_any(node, requires_grad))
        creates |= {k for k in saved if isinstance(k, tuple)}  # private buffers (masks) are made here
        mask = _replay_mask(node, nbytes)
        creates |= mask
        timed = seconds is not None
        steps.append(Step(
            node=node, creates=frozenset(creates), reads=frozenset(reads & nbytes.keys()), saved=frozenset(saved),
            flops=flops.get(node.name, 0), compute_intensive=flops.get(node.name, 0) > 0,
            seconds=seconds.get(node.name, 0.0) if timed else None, mask=mask,
            replay_seconds=seconds.get(replay_key(node.name)) if timed else None, outputs=outputs,
            backward_scratch=_backward_scratch(node, grad_needs) if node in needs_grad else None,
            region_state=_statistics_kept(node), saves_for_backward=saves_for_backward,
            memory_known=node not in needs_grad or saved_for_backward(node, requires_grad).known,
            runs_as_ops=flops.get(node.name, 0) > 0 and _runs_as_ops(node, requires_grad)))
    last_read = {k: p for p, s in enumerate(steps) for k in s.creates}
    for p, s in enumerate(steps):
        for k in s.reads:
            last_read[k] = max(last_read[k], p)
    output = next(iter(gm.graph.find_nodes(op="output")))
    for t in _tensors([a.meta.get("val") for a in output.all_input_nodes]):
        if _storage(t) in last_read:
            last_read[_storage(t)] = len(steps)
    differentiated = [a for a in output.all_input_nodes if a in needs_grad]
    loss_outputs = frozenset(_storage(t) for t in _tensors([a.meta.get("val") for a in differentiated])
                             if _storage(t) in nbytes) if caller_loss else frozenset()
    grads = _gradient_bytes(calls, position, len(steps), needs_grad)
    trainable = frozenset(grad_needs.params_needing_grad)
    grads = [g + _parameter_gradient_bytes(node, gm, trainable) + waiting
             for g, node, waiting in zip(grads, calls, _waiting_parameter_gradient_bytes(gm, position, trainable))]
    overhead = region_overhead(_device(gm)) if seconds is not None else None
    rng_state = torch.get_rng_state().untyped_storage().nbytes() if _device(gm).type == "cpu" else 0
    return StepProfile(steps, nbytes, last_read, grads, overhead, rng_state, loss_outputs)


def _runs_as_ops(node: fx.Node, requires_grad) -> bool:
    """Whether autograd records attention `node` as several ops (Step.runs_as_ops), as its measurement shows (other ops
    that decompose, einsum's products, leave the policy keeping their output all the same)."""
    if op_name(node) not in RUNTIME_KERNEL_OPS:
        return False
    measured = measurement(node, requires_grad)
    return measured is not None and measured.autograd_nodes > 1


def _statistics_kept(node: fx.Node) -> int:
    """Bytes a region holding train-mode BatchNorm `node` keeps of it until its backward ends (batch_norm_once):
    four per-channel vectors to replay it from (fxopt.checkpointing._batch_norm_replay.KeptStatistics), else copies of
    its running statistics."""
    bn = match_batch_norm(node)
    if bn is None or bn.training is False:
        return 0
    if replayed_batch_norm(node):
        x = tensor_meta(bn.input)
        return 4 * x.shape[1] * x.element_size()
    if bn.running_mean is None:
        return 0
    return sum(tensor_bytes(stat) for stat in (bn.running_mean, bn.running_var))


def _backward_scratch(node: fx.Node, grad_needs) -> int | None:
    """What `node`'s backward allocates beyond its gradients: a convolution's scratch, an opaque op's as measured
    (fxopt.analysis.saved_tensors.measurement: an opaque op, attention, an op the table does not know), else
    fxopt.analysis.backward_temporaries' rule (None where that is nothing)."""
    scratch = _conv_scratch(node, grad_needs)
    if scratch is None and (opaque := measurement(node, grad_needs.requires_grad)) is not None:
        scratch = opaque.backward_scratch
    return scratch if scratch is not None else backward_temporary(node, grad_needs.requires_grad) or None


def _conv_scratch(node: fx.Node, grad_needs) -> int | None:
    """A convolution's backward scratch (fxopt.analysis.conv_scratch), None for any other node."""
    conv = match_conv(node)
    if conv is None:
        return None
    return conv_backward_scratch(conv, conv.input in grad_needs.requires_grad, conv.weight in grad_needs.requires_grad)


def _device(gm: fx.GraphModule) -> torch.device:
    """Where the graph runs: its first tensor input's device (CPU if it has none)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        for t in _tensors(node.meta.get("val")):
            return t.device
    return torch.device("cpu")


def _is_copy(key: Key) -> bool:
    return isinstance(key, tuple) and key[0] == COPY


def _saved_keys(node: fx.Node, free: set, nbytes: dict, requires_grad) -> set:
    """Storages kept for `node`'s backward; bytes saved beyond its inputs/output get a private key, and the
    copies it saves of its inputs (saved_tensors.saved_copies) a key of their own: a selective region does
    not cache them (their op, a copy, is recomputed). `requires_grad`: the values that need a gradient."""
    info, (copies, copied_bytes) = saved_for_backward(node, requires_grad), saved_copies(node)
    tensors = [t for a in info.saved_inputs if a not in copies for t in _tensors(a.meta.get("val"))]
    if info.saves_output:
        tensors += _tensors(node.meta.get("val"))
    keys = {_storage(t) for t in tensors} - free
    keys = {k for k in keys if k in nbytes}
    private = saved_bytes(node, requires_grad) - copied_bytes - sum(nbytes[k] for k in keys)
    for kind, size in ((COPY, copied_bytes), ("private", private)):
        if size > 0:
            nbytes[kind, node.name] = size
            keys.add((kind, node.name))
    return keys


def _saves_any(node: fx.Node, requires_grad) -> bool:
    """Whether autograd saves any tensor for `node`'s backward, free ones (parameters, graph inputs) included."""
    info = saved_for_backward(node, requires_grad)
    return info.saves_output or any(_tensors(a.meta.get("val")) for a in info.saved_inputs)


def _replay_mask(node: fx.Node, nbytes: dict) -> frozenset:
    """The bool mask a region keeps to replay a dropout (fxopt.checkpointing._dropout_replay), one byte an element."""
    if replayed_dropout_p(node) is None:
        return frozenset()
    key = ("dropout_mask", node.name)
    nbytes[key] = tensor_meta(node).numel()
    return frozenset({key})


def _output_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's output values: the step differentiates every one that carries a gradient."""
    return next(iter(gm.graph.find_nodes(op="output"))).all_input_nodes


def _parameter_gradient_bytes(node: fx.Node, gm: fx.GraphModule, trainable: frozenset[str]) -> int:
    """Bytes of the gradients `node`'s backward makes for the parameters that get one (`trainable`,
    from fxopt.analysis.grad_needs) before they accumulate into `.grad` (an embedding's is
    vocabulary-sized, and may hold the step's peak: docs/checkpointing.md)."""
    if node.op == "call_module":
        return sum(t.numel() * t.element_size() for name, t in gm.get_submodule(node.target).named_parameters()
                   if f"{node.target}.{name}" in trainable)
    return sum(_gradient_for(node, a, state[1]) for a in node.all_input_nodes
               if (state := state_input(a, gm)) is not None and state[0] in trainable)


def _gradient_for(reader: fx.Node, param: fx.Node, value: torch.Tensor) -> int:
    """Bytes of the gradient `reader`'s backward makes for parameter `param`: its size, or what a graph helper
    declares for its weight (a lookup's sparse rows: fxopt.passes._row_grads)."""
    helper = declared(reader.target) if reader.op == "call_function" else None
    if helper is not None and helper.weight_gradient is not None and reader.args and reader.args[0] is param:
        return min(helper.weight_gradient(reader), value.numel() * value.element_size())
    return value.numel() * value.element_size()


def _waiting_parameter_gradient_bytes(gm: fx.GraphModule, position: dict, trainable: frozenset[str]) -> list[int]:
    """Per position: bytes of the gradients of parameters read at several positions (tied weights: BART's encoder and
    decoder share their embedding) waiting for the rest of their sum. Autograd adds up a parameter's gradients
    before it accumulates them into `.grad`: the sum of those the later readers' backward made lives until the first
    reader's backward (BART's: through the encoder's whole backward; docs/checkpointing.md). It is dense once one
    of them is; sparse row gradients alone add up to at most their sizes."""
    waiting = [0] * len(position)
    for node in gm.graph.nodes:  # a parameter read as an attribute, or a graph input (TorchDynamo's form)
        state = state_input(node, gm) if node.op in ("get_attr", "placeholder") else None
        readers = sorted((position[u], u) for u in node.users if u in position)
        if state is None or state[0] not in trainable or len(readers) < 2:
            continue
        full = state[1].numel() * state[1].element_size()
        held = 0
        for (q, _), (_, later) in zip(readers[-2::-1], readers[:0:-1]):  # from the last reader back to the first
            held = min(full, held + _gradient_for(later, node, state[1]))
            for p in range(q, position[later]):  # the later reader's own backward counts its gradient already
                waiting[p] += held
    return waiting


def _gradient_bytes(calls: list[fx.Node], position: dict, n: int, needs_grad: set) -> list[int]:
    """Per position p: bytes of the gradients of tensors crossing into and out of p (needing grad); a
    tensor that only passes over p (made before, read after, not by p) has one gradient, not two."""
    crossing = [0] * (n + 1)  # crossing[p]: made before p, read at or after p
    over = [0] * (n + 1)  # over[p]: made before p, read after p but not by p
    for node in calls:
        val = tensor_meta(node)
        if val is None or node not in needs_grad:
            continue
        readers = {position.get(u, n) for u in node.users}
        last = max(readers, default=position[node])
        size = val.numel() * val.element_size()
        for q in range(position[node] + 1, last + 1):
            crossing[q] += size
            if q < last and q not in readers:
                over[q] += size
    shared = _shared_gradient_bytes(calls, position, needs_grad)
    return [crossing[p] + crossing[p + 1] - over[p] - shared[p] for p in range(n)]


def _shared_gradient_bytes(calls: list[fx.Node], position: dict, needs_grad: set) -> list[int]:
    """Per position: bytes _gradient_bytes counts twice because autograd makes them one tensor. A helper declared
    `gradient_in_place` writes its input's gradient over its output's. An add hands its
    output's gradient to both inputs as it is, and an alias (a view, a p=0 dropout) hands it on to its input:
    from the branch's last op that makes a tensor up to the add, the residual stream passing over holds the
    gradient the branch holds (HF ViT: the residual's and the MLP output's gradient at fc2's backward)."""
    shared = [0] * len(calls)
    for node in calls:  # a helper writing its input's gradient over its output's (fxopt.graph_functions)
        helper = declared(node.target) if node.op == "call_function" else None
        out = tensor_meta(node)
        if helper is not None and helper.gradient_in_place and out is not None and node.args[0] in needs_grad:
            shared[position[node]] += out.numel() * out.element_size()
    for add in calls:
        inputs = [a for a in add.args[:2] if isinstance(a, fx.Node)]
        out = tensor_meta(add)
        if (op_name(add) != "add" or add.kwargs.get("alpha", 1) != 1 or len(set(inputs)) != 2 or out is None
                or any(a not in needs_grad or a not in position or not _same_layout(tensor_meta(a), out)
                       for a in inputs)):
            continue
        residual, branch = sorted(inputs, key=position.get)
        while (source := _aliased_input(branch)) in position and source in needs_grad:
            branch = source
        size = out.numel() * out.element_size()
        for q in range(max(position[branch], position[residual] + 1), position[add]):
            shared[q] += size
        shared[position[add]] += 2 * size  # its two inputs' gradients and its output's: one tensor
    return shared


def _same_layout(a, b) -> bool:
    return a is not None and a.shape == b.shape and a.dtype == b.dtype


def _aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage `node`'s value is, whole (a view, a p=0 dropout): its gradient is passed on."""
    out = tensor_meta(node)
    if out is None:
        return None
    for a in node.all_input_nodes:
        val = tensor_meta(a)
        if val is not None and val.numel() == out.numel() and _storage(val) == _storage(out):
            return a
    return None
