"""Recognise the ReLU family (relu, relu6, hardtanh, leaky_relu, elu, hardswish, silu) in any form.

`aten.relu.default(x)` (torch.export), `F.relu(x)` / `torch.relu(x)` calls and `x.relu()` methods
(TorchDynamo) all become one `ActivationCall` with the op's parameters, so a pass can
re-emit it in place: `aten.relu_.default(x)` in an ATen graph (the in-place overload takes the
same arguments), `F.<kind>(x, ..., inplace=True)` otherwise.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import _torch_private
from ..op_names import op_name

# kind -> (its parameters in functional argument order, with their defaults)
_PARAMETERS: dict[str, dict[str, Any]] = {
    "relu": {}, "relu6": {}, "hardswish": {}, "silu": {},
    "hardtanh": {"min_val": -1.0, "max_val": 1.0},
    "leaky_relu": {"negative_slope": 0.01},
    "elu": {"alpha": 1.0},
}


@dataclasses.dataclass
class ActivationCall:
    node: fx.Node
    input: Any  # normally an fx.Node
    kind: str  # a key of _PARAMETERS
    params: dict[str, Any]
    inplace: bool
    aten: bool = False  # an ATen op of an exported graph

    def inplace_form(self) -> tuple[Any, tuple, dict]:
        """(target, args, kwargs) of the same activation written in place."""
        if self.aten:
            return getattr(torch.ops.aten, f"{self.kind}_").default, (self.input, *self.params.values()), {}
        return getattr(F, self.kind), (self.input, *self.params.values()), {"inplace": True}


def match_activation(node: fx.Node) -> ActivationCall | None:
    name = op_name(node)
    if name is None or not node.args:
        return None
    inplace = name.endswith("_")
    kind = name[:-1] if inplace else name
    if kind not in _PARAMETERS:
        return None
    defaults = _PARAMETERS[kind]
    if node.op == "call_function" and _torch_private.aten_op_name(node.target) is not None:
        bound = _torch_private.bind_aten_arguments(node.target, node.args, node.kwargs)  # self, then parameters
        x = bound.pop("self")
        return ActivationCall(node, x, kind, bound, inplace, aten=True)
    if node.op == "call_method" or node.target is not getattr(F, kind, None):
        # torch.relu(x), torch.relu_(x), x.relu(): no parameters
        return ActivationCall(node, node.args[0], kind, dict(defaults), inplace) if not defaults else None
    names = ("input", *defaults, "inplace")
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    params = {p: bound.get(p, default) for p, default in defaults.items()}
    return ActivationCall(node, bound["input"], kind, params, inplace)
