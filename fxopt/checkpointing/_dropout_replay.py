"""Dropout a checkpointed region replays from its kept noise instead of drawing it again.

On CPU `aten.dropout(x, p, train=True)` is `noise = empty_like(x).bernoulli_(1 - p).div_(1 - p);
x * noise` (ATen's `_dropout_impl`), and autograd keeps `noise` for the backward anyway. Drawing the noise is
most of the op's time (docs/checkpointing.md), so a region that recomputes a dropout keeps which elements its first
run dropped, as a bool mask (`RegionRun.scratch`; a quarter of float32 noise), and its recomputation rebuilds the
noise from it: the same values (0 or 1, divided by 1 - p), the same saved tensor, the same RNG stream (the first run
issues exactly ATen's ops). Elsewhere (CUDA's fused `native_dropout`, a flag or probability computed in the graph,
in-place dropout) the dropout is recomputed as it is.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import _torch_private
from ..op_names import call_arguments
from ..analysis.shapes import tensor_meta

DROPOUT_FUNCTIONS = (torch.ops.aten.dropout.default, F.dropout, torch.dropout)


def replayed_dropout_p(node: fx.Node) -> float | None:
    """The probability of a train-mode CPU dropout `node` a region replays from its noise, else None."""
    if node.op != "call_function" or node.target not in DROPOUT_FUNCTIONS:
        return None
    kwargs = call_arguments(node)
    if kwargs is None:
        return None
    p, training = kwargs.get("p", 0.5), kwargs.get("train", kwargs.get("training", True))
    val = tensor_meta(node)
    if (kwargs.get("inplace", False) is not False or training is not True or isinstance(p, fx.Node)
            or not 0 < p < 1 or val is None or val.device.type != "cpu" or not val.is_floating_point()):
        return None
    return float(p)


def replayable_dropouts(nodes) -> dict[fx.Node, float]:
    """The dropouts a region of `nodes` may replay from their masks, with their probabilities: none when
    another op in it draws random numbers (a replay draws nothing, so an op drawing after it in the
    recomputation would read the generator at another state than the forward did: an SDPA's own dropout)."""
    if any(map(draws_unreplayed, nodes)):
        return {}
    return {n: p for n in nodes if (p := replayed_dropout_p(n)) is not None}


def draws_unreplayed(node: fx.Node) -> bool:
    """Whether `node` draws random numbers and is not a dropout a region can replay. Attention draws only with
    a dropout probability other than 0 (ATen tags it random either way)."""
    if node.op != "call_function" or not _torch_private.op_is_random(node.target):
        return False
    if node.target is torch.ops.aten.scaled_dot_product_attention.default:
        arguments = call_arguments(node)
        dropout_p = arguments.get("dropout_p", 0.0) if arguments is not None else None
        return not (isinstance(dropout_p, (int, float)) and dropout_p == 0)
    return replayed_dropout_p(node) is None


def draw(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ATen's CPU dropout of `x`, the bool mask of the elements it kept): the same ops, so the same RNG stream."""
    noise = torch.empty_like(x)
    noise.bernoulli_(1 - p)
    mask = noise.bool()
    return x * noise.div_(1 - p), mask


def replay(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """The dropout `draw` returned, again, from its mask: the same noise times `x`."""
    return x * mask.to(x.dtype).div_(1 - p)
