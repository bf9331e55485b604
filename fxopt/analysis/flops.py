"""FLOPs of each node's forward, counted by `torch.utils.flop_counter.FlopCounterMode` on fake tensors.

`node_flops(gm)` runs the graph once on the fake tensors shape propagation left in the
placeholders' `node.meta["val"]` (no real compute, no real memory), with one FlopCounterMode per
node, and returns {node name: forward FLOPs}. FlopCounterMode counts matrix products,
convolutions and attention (`is_counted_op`); pointwise ops, normalisation and reductions count 0.
Parameters and buffers are swapped for fake copies, so running statistics are never touched.
(`fxopt.analysis.costs` gives the whole graph's FLOPs; this module splits them by node.)
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from .costs import fake_call_arguments, placeholder_values


def is_counted_op(op) -> bool:
    """True for the aten ops FlopCounterMode counts: matmuls, convolutions, attention."""
    return getattr(op, "overloadpacket", op) in flop_registry


class _PerNodeFlops(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.flops: dict[str, int] = {}

    def run_node(self, n: fx.Node):
        if n.op in ("placeholder", "get_attr", "output"):
            return super().run_node(n)
        with FlopCounterMode(display=False) as counter:
            out = super().run_node(n)
        self.flops[n.name] = counter.get_total_flops()
        return out


class _Interpreting(torch.nn.Module):
    """Runs `gm` node by node; a module so `functional_call` can swap in fake parameters and buffers."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self.gm = gm
        self.flops: dict[str, int] = {}

    def forward(self, *inputs):
        interpreter = _PerNodeFlops(self.gm)
        out = interpreter.run(*inputs)
        self.flops = interpreter.flops
        return out


def node_flops(gm: fx.GraphModule) -> dict[str, int] | None:
    """Forward FLOPs of every call node of `gm`, or None if the graph cannot run on fake tensors."""
    mode, state, fake_inputs = fake_call_arguments(gm, placeholder_values(gm))
    runner = _Interpreting(gm)
    try:
        with mode, torch.no_grad():
            torch.func.functional_call(runner, {f"gm.{k}": v for k, v in state.items()}, fake_inputs)
    except Exception:  # noqa: BLE001 - data-dependent code cannot run on fake tensors
        return None
    return runner.flops
