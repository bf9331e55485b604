"""Train-mode BatchNorm a checkpointed region recomputes from its kept batch statistics instead of computing them again.

A train-mode BatchNorm first reduces its input to per-channel statistics (the mean and the inverse standard
deviation), then maps each element as `x * alpha + beta`, with `alpha = invstd * weight` and `beta = bias -
mean * alpha`. On CPU the reduction is most of its time (docs/checkpointing.md; benchmarks/batch_norm_replay.py).
Autograd keeps both statistics for the backward anyway, so a region keeps them from its first run (with the two
vectors `replay` passes: four numbers per channel) and its recomputation only maps.

`replay` issues ATen's own map: an eval-mode `native_batch_norm` with the kept mean as running mean, a running
variance of 1 and eps 0 (so its inverse standard deviation is exactly 1), and `weight * invstd` as weight (the
product its train-mode run forms, rounded once either way). On a contiguous input (either memory format) both
modes run the same CPU kernel, so every element comes out with the same bits. Elsewhere the kernels differ
(a strided input's generic loop, a bfloat16 weight's float accumulation, CUDA's cuDNN), and the region computes
the statistics again (`replays_statistics` says which).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx as fx

from ..analysis.ops import match_batch_norm
from ..analysis.shapes import tensor_meta

REPLAYED_DTYPES = (torch.float32, torch.float64)


def replays_statistics(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Whether `replay` gives a train-mode BatchNorm of `x` the same bits (module docstring)."""
    contiguous = any(x.is_contiguous(memory_format=f) for f in _memory_formats(x.dim()))
    return (x.device.type == "cpu" and x.dtype in REPLAYED_DTYPES and contiguous
            and all(p is None or (p.dtype == x.dtype and p.is_contiguous()) for p in (weight, bias)))


def replayed_batch_norm(node: fx.Node) -> bool:
    """Whether `node` is a train-mode BatchNorm a region recomputes by `replay`, judged from its input's example."""
    bn = match_batch_norm(node)
    if bn is None or bn.training is not True:
        return False
    x, weight, bias = (tensor_meta(a) if isinstance(a, fx.Node) else None for a in (bn.input, bn.weight, bn.bias))
    return x is not None and replays_statistics(x, weight, bias)


class KeptStatistics(NamedTuple):
    """What a region keeps of a train-mode BatchNorm's first run: its batch statistics, and the weight and running
    variance `replay` passes (made on the first run, so a recomputation issues no op the forward did not: a
    selective checkpoint replays only ops it has seen)."""

    mean: torch.Tensor
    invstd: torch.Tensor
    scale: torch.Tensor  # weight * invstd
    unit_variance: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor | None, mean: torch.Tensor, invstd: torch.Tensor) -> KeptStatistics:
        """Made outside autograd (a region's first run records the BatchNorm's own node only)."""
        mean, invstd = mean.detach(), invstd.detach()
        return cls(mean, invstd, invstd if weight is None else weight.detach() * invstd, torch.ones_like(mean))


def replay(x: torch.Tensor, bias: torch.Tensor | None, kept: KeptStatistics) -> torch.Tensor:
    """The output of the train-mode BatchNorm of `x` whose first run `kept` describes, again."""
    return torch.ops.aten.native_batch_norm(x, kept.scale, bias, kept.mean, kept.unit_variance, False, 0.0, 0.0)[0]


def _memory_formats(ndim: int) -> tuple:
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return (torch.contiguous_format, formats[ndim]) if ndim in formats else (torch.contiguous_format,)
