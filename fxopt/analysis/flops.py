"""FLOPs of each node's forward, counted by `torch.utils.flop_counter.FlopCounterMode` on fake tensors.

`node_flops(gm)` runs each node that may count on the fake values of its arguments
(`node.meta["val"]`, which shape propagation or export left on every node; no real compute, no real
memory) under a FlopCounterMode, and returns {node name: forward FLOPs}. FlopCounterMode counts
matrix products, convolutions and attention (`is_compute_intensive_op`), also inside what a
CompositeImplicitAutograd op (`conv2d`, `linear`) decomposes into; any other ATen op (pointwise ops,
normalisation, reductions) counts 0, so it is not run; a convolution is counted by FlopCounterMode's
own formula from the shapes (HF MobileNetV2: 0.02 s instead of 0.23-0.58 s). A graph whose values
are not all there is run whole from its placeholders' values, with parameters and buffers swapped
for fake copies; running statistics are never touched.
(`fxopt.analysis.costs` gives the whole graph's FLOPs; this module splits them by node.)
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, flop_registry

from .. import _torch_private
from ..node_runner import NodeRunner
from .costs import fake_call_arguments, placeholder_values
from .ops import match_conv


def is_compute_intensive_op(op) -> bool:
    """True for the aten ops FlopCounterMode counts: matmuls, convolutions, attention."""
    return getattr(op, "overloadpacket", op) in flop_registry


class _Interpreting(torch.nn.Module):
    """Runs `gm` node by node counting each node's FLOPs; a module so `functional_call` can swap in fake parameters
    and buffers."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self.gm = gm
        self.flops: dict[str, int] = {}

    def forward(self, *inputs):
        return NodeRunner(self.gm, [self._count]).run(*inputs)

    def _count(self, node: fx.Node, env: dict):
        with FlopCounterMode(display=False) as counter:
            yield
        self.flops[node.name] = counter.get_total_flops()


# CompositeImplicitAutograd ops that decompose into normalisation, padding, pooling, views and random
# draws, never into an op FlopCounterMode counts
_DECOMPOSE_UNCOUNTED = frozenset({"batch_norm", "layer_norm", "group_norm", "instance_norm", "pad", "flatten",
                                  "adaptive_avg_pool1d", "adaptive_avg_pool2d", "dropout", "reshape",
                                  "contiguous"})


def _may_count(target) -> bool:
    """Whether FlopCounterMode may count FLOPs when `target` runs: anything but an ATen op outside its registry
    that does not decompose, or decomposes into nothing it counts."""
    overload, _packet = _torch_private.op_overload_types()
    if not isinstance(target, overload) or is_compute_intensive_op(target):
        return True  # a Python function may call anything
    return _torch_private.decomposed_at_runtime(target) and target.overloadpacket.__name__ not in _DECOMPOSE_UNCOUNTED


def _flops_from_values(gm: fx.GraphModule) -> dict[str, int] | None:
    """Per-node FLOPs from each node's arguments' fake values, or None where a value is missing or an op fails."""
    flops: dict[str, int] = {}
    try:
        values = [n.meta.get("val") for n in gm.graph.nodes]
        mode = _torch_private.detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
        if mode is None:
            return None
        with mode, torch.no_grad():
            for node in gm.graph.nodes:
                conv = match_conv(node)
                if conv is not None:  # FlopCounterMode's own formula, from the shapes: no fake run
                    flops[node.name] = conv_flop_count(list(conv.input.meta["val"].shape),
                                                       list(conv.weight.meta["val"].shape),
                                                       list(node.meta["val"].shape), conv.transposed)
                elif node.op == "call_function" and not _may_count(node.target):
                    flops[node.name] = 0
                elif node.op == "call_function":
                    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
                    with FlopCounterMode(display=False) as counter:
                        node.target(*args, **kwargs)
                    flops[node.name] = counter.get_total_flops()
                elif node.op in ("call_method", "call_module"):
                    return None
    except Exception:  # noqa: BLE001 - a value missing, or an op the fake values cannot run: run the graph
        return None
    return flops


def node_flops(gm: fx.GraphModule) -> dict[str, int] | None:
    """Forward FLOPs of every call node of `gm`, or None if the graph cannot run on fake tensors."""
    flops = _flops_from_values(gm)
    if flops is not None:
        return flops
    mode, state, fake_inputs = fake_call_arguments(gm, placeholder_values(gm))
    runner = _Interpreting(gm)
    try:
        with mode, torch.no_grad():
            torch.func.functional_call(runner, {f"gm.{k}": v for k, v in state.items()}, fake_inputs)
    except Exception:  # noqa: BLE001 - data-dependent code cannot run on fake tensors
        return None
    return runner.flops
