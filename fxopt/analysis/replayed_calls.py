"""A graph node's call replayed on real tensors: a hashable description of its arguments, and real arguments back.

Analyses that measure what an op does when it runs (fxopt.analysis.conv_scratch: a CPU convolution's scratch;
fxopt.analysis.opaque_memory: what an opaque op keeps and allocates) describe a node's arguments by their values'
shapes, strides and dtypes (`argument_spec`: hashable, the key of their caches) and rebuild from that real CPU
tensors filled with ones (`real_argument`).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private


class NotReplayable(Exception):
    """An argument the call cannot be rebuilt from: not a CPU tensor, or a value of another kind."""


def tensor_spec(t) -> tuple:
    """("tensor", sizes, strides, dtype) of a CPU tensor (fake or real)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise NotReplayable
    return ("tensor", tuple(map(_torch_private.size_hint, t.shape)),
            tuple(map(_torch_private.size_hint, t.stride())), t.dtype)


def argument_spec(value):
    """A hashable description of a call argument (a node by its fake tensor, a list element by element), from which
    `real_argument` rebuilds it."""
    if isinstance(value, fx.Node):
        return tensor_spec(value.meta.get("val"))
    if isinstance(value, (list, tuple)):
        return tuple(argument_spec(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise NotReplayable


def real_argument(spec):
    """The argument `spec` describes: tensors real, on the CPU, filled with ones; sequences as lists."""
    if isinstance(spec, tuple) and spec and spec[0] == "tensor":
        _, shape, stride, dtype = spec
        return torch.empty_strided(shape, stride, dtype=dtype).fill_(1)
    if isinstance(spec, tuple):
        return [real_argument(v) for v in spec]
    return spec
