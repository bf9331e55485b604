"""Shape and dtype of every node, from example inputs, without running the model for real.

FakeTensor propagation stores a fake tensor in `node.meta["val"]` (the key Dynamo and AOTAutograd
use too). A graph whose opaque leaves branch on tensor values cannot run on fake tensors; then
the graph runs once on the real inputs, with buffers and RNG restored, and meta tensors are kept.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private
from ..state_preservation import preserved_state


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value


class _RealShapeProp(fx.Interpreter):
    def run_node(self, n):
        out = super().run_node(n)
        n.meta["val"] = _to_meta(out)
        return out


def propagate_shapes(gm: fx.GraphModule, example_inputs: tuple) -> None:
    """Fill `node.meta["val"]` for every node of `gm` (see module docstring).

    Buffers are restored afterwards: even under fake tensors, a train-mode BatchNorm bumps its
    real `num_batches_tracked`.
    """
    with preserved_state(gm):
        try:
            mode = _torch_private.detect_fake_mode(example_inputs) or _torch_private.fake_tensor_mode()
            fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
            _torch_private.fake_tensor_prop(gm, mode).propagate_dont_convert_inputs(*fake_inputs)
        except Exception:  # noqa: BLE001 - data-dependent code: fall back to one real run
            _RealShapeProp(gm).run(*example_inputs)


def tensor_meta(node) -> torch.Tensor | None:
    """The fake/meta tensor a node produces, or None if it does not produce a single tensor."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val", node.meta.get("example_value"))
    return val if isinstance(val, torch.Tensor) else None
