"""What a checkpointed region costs beyond recomputing its ops, measured once on this machine.

A non-reentrant `torch.utils.checkpoint` region pays for its own wrapper and saved-tensor hooks (per region), and its
recomputation records an autograd graph again (per op); a selective region under torch's policy also sends every op of
its forward and of its recomputation through a Python dispatch mode (one that keeps only convolutions and matrix
products does not: fxopt.checkpointing._kept_outputs). Op times (fxopt.analysis.op_times) see none of it.
`region_overhead(device)` times one training step of a chain of tiny ops plain and inside each kind of region, with 1
and with CHAIN ops, and returns the difference split into per region and per op (medians of interleaved rounds, on the
clock op_times uses). The ops save their input for backward, as a model's convolutions, norms and activations do, so
each saved tensor passes the region's hooks (an op that saves nothing would price the per-op part at nothing:
docs/checkpointing.md). It is measured once per device and thread count, and cached. Its per-region figures are a floor:
a model's regions cost more, so checkpoint_activations measures them on a block of the graph it plans
(fxopt.checkpointing.calibration) and keeps this per-op price.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..analysis.op_times import step_clock

CHAIN = 16  # ops in the long chain; the short one has one
ROUNDS = 15


@dataclasses.dataclass(frozen=True)
class RegionOverhead:
    """Seconds a region adds beyond its ops' recomputation: once per region, and per op it holds."""

    per_region: float
    per_op: float
    selective_per_region: float
    selective_per_op: float


def _chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x.sin()  # saves its input, as a model's ops do: each saved tensor passes the region's hooks twice
    return x


def _keep_nothing(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _step(kind: str, n: int, x: torch.Tensor, clock) -> float:
    start = clock()
    if kind == "plain":
        y = _chain(x, n)
    elif kind == "whole":
        y = checkpoint(_chain, x, n, use_reentrant=False)
    else:
        context_fn = functools.partial(create_selective_checkpoint_contexts, _keep_nothing)
        y = checkpoint(_chain, x, n, use_reentrant=False, context_fn=context_fn)
    y.sum().backward()
    return clock() - start


@functools.cache
def _measured(device: str, threads: int) -> RegionOverhead:
    clock, x = step_clock(), torch.full((8,), 0.5, device=device, requires_grad=True)  # not drawn: the caller's RNG
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(ROUNDS):  # interleaved, so load falls on every variant alike
        for kind in ("plain", "whole", "selective"):
            for n in (1, CHAIN):
                times.setdefault((kind, n), []).append(_step(kind, n, x, clock))
    t = {k: statistics.median(v) for k, v in times.items()}
    split = []
    for kind in ("whole", "selective"):
        extra_short, extra_long = t[kind, 1] - t["plain", 1], t[kind, CHAIN] - t["plain", CHAIN]
        per_op = max(0.0, (extra_long - extra_short) / (CHAIN - 1))
        split += [max(0.0, extra_short - per_op), per_op]
    return RegionOverhead(*split)


def region_overhead(device: torch.device | str = "cpu") -> RegionOverhead:
    """The overhead of checkpointed regions on `device` with torch's current thread count (cached)."""
    return _measured(str(torch.device(device)), torch.get_num_threads())
