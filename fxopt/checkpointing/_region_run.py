"""One run of a checkpointed region's body, and the values its first run keeps for its recomputation.

A region (fxopt.checkpointing.eager_region) whose body runs BatchNorm, replays dropout or keeps op outputs itself calls
the body with a `RegionRun` first: the forward (`first`) or a recomputation. What the first run keeps for the
recomputation lives in `scratch`, one dict per call of the region.

A kept convolution and a replayed train-mode BatchNorm run as ATen's own op on the first run, whose autograd node then
does the backward, and on a recomputation as `recomputed_as_saved`: the output from what the first run kept, saving the
tensors that node saved, in its order. That suffices: non-reentrant checkpoint hands each node of the forward's graph,
when it unpacks a saved tensor, the tensor the recomputation saved in the same place, and discards the recomputation's
own graph. So no Python runs for them in the step's autograd graph, and their gradients are ATen's by construction (an
autograd Function on both runs instead would spend about twice the autograd self time: docs/checkpointing.md).
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class RegionRun:
    """One run of a region body: the forward (`first`) or a recomputation. `scratch` lives across the
    runs of one call: per running statistic, a throwaway copy the recomputation updates instead; per op whose
    output the region keeps, that output."""

    first: bool
    scratch: dict


class _RecomputedAsSaved(torch.autograd.Function):
    """On a recomputation: `produce()`, saving the first `count` tensors (module docstring); its graph is never run
    backward."""

    @staticmethod
    def forward(ctx, produce, count: int, *tensors):
        ctx.save_for_backward(*tensors[:count])
        return produce()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("fxopt: backward through a checkpointed region's recomputation, which checkpoint discards")


def recomputed_as_saved(produce, inputs: tuple, saved: tuple) -> torch.Tensor:
    """On a recomputation: the op's output `produce()` gives, saving `saved`, the tensors ATen's node for the op saved on
    the first run, in that order (module docstring). `inputs`, the op's tensor inputs, make autograd record (and so
    save) exactly when it recorded the op: when one of them requires a gradient (a BatchNorm whose bias alone
    does). None stands for no tensor in either."""
    saved = tuple(t for t in saved if t is not None)
    return _RecomputedAsSaved.apply(produce, len(saved), *saved, *(t for t in inputs if t is not None))


def output_once(run: RegionRun, key: str, compute) -> torch.Tensor:
    """The output of the op named `key`: `compute()` on the first run, kept for the recomputation, which takes it."""
    if not run.first:
        return take_output(run, key)
    out = compute()
    run.scratch[key] = (out.detach(), out._version)
    return out


def take_output(run: RegionRun, key: str) -> torch.Tensor:
    """On a recomputation: the output the first run kept for `key`, taken, not read (from here on the recomputation's
    graph holds it only as long as it needs it); a clear error where a second backward or an in-place write makes
    it unusable."""
    if key not in run.scratch:
        raise RuntimeError("fxopt: a second backward through a selective checkpointed region (its kept "
                           f"output of {key!r} was used by the first): backward through it only once")
    kept, version = run.scratch.pop(key)
    if kept._version != version:
        raise RuntimeError(f"fxopt: the output of {key!r}, kept by a checkpointed region for its "
                           "backward, was written in place after the region's forward")
    return kept.detach()  # a tensor of its own for this run's autograd graph, on the kept storage
