"""Checkpoint regions named by their first and last node, estimated by the memory model and extracted into the
graph, as checkpoint_activations would: for tests that compare a chosen plan's prediction with measurement."""
from __future__ import annotations

import torch.fx as fx

from fxopt.checkpointing.profile import Region, StepProfile
from fxopt.checkpointing.eager_region import extract_region


def named_regions(profile: StepProfile, bounds, **kind) -> list[Region]:
    """One Region per (first node name, last node name) in `bounds`, of the `kind` given (save_compute_intensive, ...)."""
    names = [s.node.name for s in profile.steps]
    return [Region(names.index(first), names.index(last) + 1, **kind) for first, last in bounds]


def extract_regions(gm: fx.GraphModule, profile: StepProfile, regions: list[Region]) -> None:
    """Move each region's nodes into a CheckpointedRegion of `gm`, named as checkpoint_activations names them."""
    for r in regions:
        steps = profile.steps[r.start:r.stop]
        nodes = [s.node for s in steps]
        extract_region(gm, nodes, f"checkpointed_{nodes[0].name}_to_{nodes[-1].name}", r.save_compute_intensive,
                       r.replay_dropout, compute_intensive=[profile.steps[p].node for p in profile.kept_steps(r)])
    gm.recompile()
