"""Which checkpoint regions would keep a tensor the model writes in place after the region.

A region keeps its inputs for the recomputation (and a selective region also the outputs of the matmuls, convolutions
and attention it keeps: StepProfile.kept_steps). If the forward writes into one of those tensors later -- through any
alias: the tensor itself, a view of it, its base -- the recomputation reads the new values (autograd raises "modified by
an inplace operation", or a selective region "cached ... has been mutated"), although eager, which may never have kept
that tensor, runs fine. `KeptWrites(gm, profile)` finds, with the shared alias analysis (`fxopt.analysis.aliasing`), the
last in-place write into each tensor, and answers per region which kept tensor is written after it (the planner then
moves the boundary or drops the region).

In-place ops inside a region (a residual `h += x`, an in-place ReLU) are fine when they write only tensors the region
itself made: the recomputation makes them again and writes them again. `write_inside` finds the other writes: into a
region input, a parameter or buffer, or (in a selective region) a matmul/conv output it keeps.

Writes into running statistics by a BatchNorm are not writes into a kept value: a recomputed BatchNorm updates throwaway
copies (`fxopt.checkpointing.eager_region`) and never reads them.
"""
from __future__ import annotations

import bisect

import torch.fx as fx

from ..analysis.aliasing import AliasInfo, is_inplace_op
from .profile import Region, StepProfile
from ..op_names import op_name
from ..analysis.side_effects import MUTATION, effects
from .eager_region import can_recompute_batch_norm, is_lone_state_update


def written_inputs(node: fx.Node, gm: fx.GraphModule) -> list[fx.Node]:
    """The graph values `node` writes in place: the first input of an in-place op, every input of
    another mutating call (`out=`, setitem, an unknown in-place method); none for a BatchNorm or an
    update of buffers nothing else reads (num_batches_tracked)."""
    if MUTATION not in effects(node, gm) or can_recompute_batch_norm(node) or is_lone_state_update(node):
        return []
    inputs = node.all_input_nodes
    return inputs[:1] if is_inplace_op(op_name(node)) else list(inputs)


class KeptWrites:
    """For each region, the first tensor it would keep that is written in place after it (see module docstring)."""

    def __init__(self, gm: fx.GraphModule, profile: StepProfile):
        self.profile = profile
        self.steps = steps = profile.steps
        self.position = {s.node: p for p, s in enumerate(steps)}
        aliases = AliasInfo(gm)
        self.last_write: dict[fx.Node, tuple[int, fx.Node]] = {}  # value -> (position, writer) of its last write
        for p, step in enumerate(steps):
            for written in written_inputs(step.node, gm):
                for alias in aliases.aliases(written):
                    self.last_write[alias] = (p, step.node)
        # in-place writers, with every value that may share storage with what they write
        self.writers = {p: [alias for w in written_inputs(s.node, gm) for alias in aliases.aliases(w)]
                        for p, s in enumerate(steps) if written_inputs(s.node, gm)}
        self.writer_positions = sorted(self.writers)
        # positions whose step reads or makes a value written somewhere: the only ones a region must check
        self.watched = [p for p, s in enumerate(steps)
                        if s.node in self.last_write or any(a in self.last_write for a in s.node.all_input_nodes)]

    def write_inside(self, region: Region) -> tuple[fx.Node, fx.Node] | None:
        """(value, writer) for an in-place write inside the region into a value the region did not make
        (recomputing would write it again) or, in a selective region, into a matmul/conv output it keeps
        (a mutated kept output is refused); None if every write inside is into its own temporaries."""
        kept = frozenset(self.profile.kept_steps(region))
        for p in self.writer_positions[bisect.bisect_left(self.writer_positions, region.start):
                                       bisect.bisect_left(self.writer_positions, region.stop)]:
            for value in self.writers[p]:
                made_at = self.position.get(value, -1)
                if not region.start <= made_at < region.stop or made_at in kept:
                    return value, self.steps[p].node
        return None

    def conflict(self, region: Region) -> tuple[fx.Node, fx.Node] | None:
        """(kept value, the node writing it after the region), or None if the region may keep what it keeps."""
        kept_outputs = frozenset(self.profile.kept_steps(region))
        for p in self.watched[bisect.bisect_left(self.watched, region.start):
                              bisect.bisect_left(self.watched, region.stop)]:
            node = self.steps[p].node
            kept = [a for a in node.all_input_nodes if self.position.get(a, -1) < region.start]
            if p in kept_outputs:
                kept.append(node)
            for value in kept:
                position, writer = self.last_write.get(value, (-1, None))
                if position >= region.stop:
                    return value, writer
        return None
