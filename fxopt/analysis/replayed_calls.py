"""A graph node's call replayed on real tensors: a hashable description of its arguments, and real arguments back.

Analyses that measure what an op does when it runs (fxopt.analysis.conv_scratch: a CPU convolution's scratch;
fxopt.analysis.opaque_memory: what an op whose memory no rule gives keeps and allocates) describe a node's arguments
by their values' shapes, strides, dtypes and devices (`argument_spec`, `call_spec`: hashable, the key of their
caches) and rebuild from that real tensors filled with ones (`real_argument`, `real_call`), inside `replaying()`:
no fake mode, and torch's, Python's and NumPy's generators put back afterwards, so that a measurement draws nothing
from the caller's streams.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

from .. import _torch_private
from ..host_rng import forked_host_rng


class NotReplayable(Exception):
    """An argument the call cannot be rebuilt from: a tensor on a device it may not use, or a value of another kind."""


def tensor_spec(t, any_device: bool = False) -> tuple:
    """("tensor", sizes, strides, dtype, device) of a tensor (fake or real): a CPU one, or with `any_device` one on
    any device this process can allocate on (not meta)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or not (any_device or t.device.type == "cpu"):
        raise NotReplayable
    if t.device.type == "cuda" and not torch.cuda.is_available():
        raise NotReplayable
    return ("tensor", tuple(map(_torch_private.size_hint, t.shape)),
            tuple(map(_torch_private.size_hint, t.stride())), t.dtype, str(t.device))


def argument_spec(value, any_device: bool = False):
    """A hashable description of a call argument (a node by its fake tensor, a list element by element), from which
    `real_argument` rebuilds it."""
    if isinstance(value, fx.Node):
        return tensor_spec(value.meta.get("val"), any_device)
    if isinstance(value, (list, tuple)):
        return tuple(argument_spec(v, any_device) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise NotReplayable


def call_spec(node: fx.Node, any_device: bool = False) -> tuple[tuple, tuple]:
    """(arguments, keyword arguments sorted by name) of `node`'s call, each described by `argument_spec`."""
    return (argument_spec(tuple(node.args), any_device),
            tuple((k, argument_spec(node.kwargs[k], any_device)) for k in sorted(node.kwargs)))


def call_input_nodes(node: fx.Node) -> list[fx.Node]:
    """The nodes among `node`'s arguments, in the order `real_call`'s tensors come: arguments, then keyword arguments
    by name."""
    values = (node.args, [node.kwargs[k] for k in sorted(node.kwargs)])
    return [a for a in _torch_private.tree_leaves(values) if isinstance(a, fx.Node)]


def real_argument(spec):
    """The argument `spec` describes: tensors real, on their device, filled with ones; sequences as lists."""
    if isinstance(spec, tuple) and spec and spec[0] == "tensor":
        _, shape, stride, dtype, device = spec
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(1)
    if isinstance(spec, tuple):
        return [real_argument(v) for v in spec]
    return spec


def real_call(spec: tuple[tuple, tuple]) -> tuple[list, dict]:
    """Real arguments and keyword arguments for a `call_spec`."""
    args, kwargs = spec
    return real_argument(args), {k: real_argument(v) for k, v in kwargs}


def _devices(spec) -> set[str]:
    if isinstance(spec, tuple) and spec and spec[0] == "tensor":
        return {spec[4]}
    return set().union(*map(_devices, spec)) if isinstance(spec, tuple) else set()


@contextlib.contextmanager
def replaying(spec):
    """Where a call described by `spec` is replayed: no fake mode, and every generator it may draw from (the CPU's,
    its accelerators', Python's and NumPy's) restored afterwards."""
    accelerators = sorted({torch.device(d) for d in _devices(spec)} - {torch.device("cpu")}, key=str)
    devices = [d.index if d.index is not None else 0 for d in accelerators]
    device_type = accelerators[0].type if accelerators else "cuda"
    with (_torch_private.unset_fake_mode(), forked_host_rng(),
          torch.random.fork_rng(devices=devices, device_type=device_type)):
        yield
