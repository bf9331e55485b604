"""Recognise an op in any of the forms a graph can hold it, as one record.

The same convolution reaches fxopt as `aten.conv2d.default(x, weight, ...)` (the ATen graph fxopt's
backend traces; weights are placeholders, or `get_attr` once frozen), or as `torch.conv2d(...)` /
`F.conv2d(...)` (a torch.fx trace of Python code). `match_conv`, `match_linear` and `match_batch_norm`
turn each into a record whose tensor fields are graph nodes (`get_attr` or placeholder), so a
pass is written once for both forms. A `call_module` is an opaque module (or a region fxopt
made), never a layer these recognise.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import _torch_private

aten = torch.ops.aten

_CONV_FUNCTIONS = {
    F.conv1d: (1, False), F.conv2d: (2, False), F.conv3d: (3, False),
    torch.conv1d: (1, False), torch.conv2d: (2, False), torch.conv3d: (3, False),
    F.conv_transpose1d: (1, True), F.conv_transpose2d: (2, True), F.conv_transpose3d: (3, True),
    torch.conv_transpose1d: (1, True), torch.conv_transpose2d: (2, True), torch.conv_transpose3d: (3, True),
}
# ATen's convolutions (export's training IR); `aten.convolution` says transposed and dims in its arguments.
_ATEN_CONVS = {
    aten.conv1d.default: (1, False), aten.conv2d.default: (2, False), aten.conv3d.default: (3, False),
    aten.conv1d.padding: (1, False), aten.conv2d.padding: (2, False), aten.conv3d.padding: (3, False),
    aten.conv_transpose1d.default: (1, True), aten.conv_transpose2d.input: (2, True),
    aten.conv_transpose3d.input: (3, True),
}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T_ARGS = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_CONVOLUTION_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding",
                     "groups")
_CONV_DEFAULTS = dict(bias=None, stride=1, padding=0, dilation=1, groups=1, output_padding=0)
# The batch-norm entry points: F.batch_norm orders its arguments differently from torch / aten.
_TORCH_BN_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
                  "cudnn_enabled")
_BN_FUNCTIONS = {
    F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
    torch.batch_norm: _TORCH_BN_ARGS,
    aten.batch_norm.default: _TORCH_BN_ARGS,
}
_BN_DEFAULTS = dict(weight=None, bias=None, training=False, momentum=0.1, eps=1e-5)
_LINEAR_FUNCTIONS = (F.linear, aten.linear.default)


def _bind(node: fx.Node, names: tuple[str, ...], defaults: dict) -> dict[str, Any]:
    bound = dict(defaults)
    bound.update(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


@dataclasses.dataclass
class ConvCall:
    node: fx.Node
    input: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    spatial_dims: int
    transposed: bool
    stride: Any
    padding: Any
    dilation: Any
    groups: int
    output_padding: Any

    def call_with(self, weight, bias) -> tuple[Any, tuple, dict]:
        """(target, args, kwargs) of this convolution with another weight and bias, in the graph's own form."""
        return _replace_weight_and_bias(self.node, weight, bias)


def _replace_weight_and_bias(node: fx.Node, weight, bias) -> tuple[Any, tuple, dict]:
    """`node`'s call with its weight and bias (arguments 1 and 2 of every conv and linear) replaced."""
    args, kwargs = list(node.args), dict(node.kwargs)
    for position, name, value in ((1, "weight", weight), (2, "bias", bias)):
        if len(args) > position:
            args[position] = value
        else:
            kwargs[name] = value
    return node.target, tuple(args), kwargs


def match_conv(node: fx.Node) -> ConvCall | None:
    if node.op != "call_function":
        return None
    if node.target is aten.convolution.default:
        b = _bind(node, _CONVOLUTION_ARGS, _CONV_DEFAULTS)
        dims, transposed = len(b["stride"]), b["transposed"]
    elif node.target in _CONV_FUNCTIONS or node.target in _ATEN_CONVS:
        dims, transposed = _CONV_FUNCTIONS.get(node.target) or _ATEN_CONVS[node.target]
        b = _bind(node, _CONV_T_ARGS if transposed else _CONV_ARGS, _CONV_DEFAULTS)
    else:
        return None
    return ConvCall(node, b["input"], b["weight"], b["bias"], dims, transposed, b["stride"], b["padding"],
                    b["dilation"], b["groups"], b["output_padding"])


@dataclasses.dataclass
class LinearCall:
    node: fx.Node
    input: fx.Node
    weight: fx.Node
    bias: fx.Node | None

    def call_with(self, weight, bias) -> tuple[Any, tuple, dict]:
        """(target, args, kwargs) of this linear layer with another weight and bias, in the graph's own form."""
        return _replace_weight_and_bias(self.node, weight, bias)


def match_linear(node: fx.Node) -> LinearCall | None:
    if node.op != "call_function" or node.target not in _LINEAR_FUNCTIONS:
        return None
    b = _bind(node, ("input", "weight", "bias"), {"bias": None})
    return LinearCall(node, b["input"], b["weight"], b["bias"])


@dataclasses.dataclass
class BatchNormCall:
    node: fx.Node
    input: fx.Node
    running_mean: fx.Node | None
    running_var: fx.Node | None
    weight: fx.Node | None
    bias: fx.Node | None
    training: Any  # bool, or a Node when it is computed in the graph
    eps: Any

    @property
    def uses_running_stats(self) -> bool:
        return self.training is False and self.running_mean is not None and self.running_var is not None


def match_batch_norm(node: fx.Node) -> BatchNormCall | None:
    if node.op != "call_function" or node.target not in _BN_FUNCTIONS:
        return None
    b = _bind(node, _BN_FUNCTIONS[node.target], _BN_DEFAULTS)
    return BatchNormCall(node, b["input"], b["running_mean"], b["running_var"], b["weight"], b["bias"],
                         b["training"], b["eps"])


def resolve(ref: fx.Node | None, gm: fx.GraphModule) -> torch.Tensor | None:
    """The real tensor (or module) a get_attr node fetches; None for placeholders and other nodes."""
    if ref is None or ref.op != "get_attr":
        return None
    owner, _, name = ref.target.rpartition(".")
    return getattr(gm.get_submodule(owner), name)


def constant_placeholders(gm: fx.GraphModule) -> frozenset[str]:
    """Names of the placeholders holding a parameter or buffer, as capture marks them (`constant_input`)."""
    return frozenset(n.name for n in gm.graph.find_nodes(op="placeholder") if n.meta.get("constant_input"))


def state_input(ref: fx.Node, gm: fx.GraphModule) -> tuple[str, torch.Tensor] | None:
    """(the model's name for it, its tensor or example value) of a node reading a parameter or buffer: a get_attr,
    or a placeholder capture marked as one (`constant_input`, named by its `state_name`); None for any other node."""
    if ref.op == "get_attr":
        value = resolve(ref, gm)
        return (ref.target, value) if isinstance(value, torch.Tensor) else None
    if ref.op == "placeholder" and ref.meta.get("constant_input") and isinstance(ref.meta.get("val"), torch.Tensor):
        return ref.meta.get("state_name", ref.name), ref.meta["val"]
    return None


def is_constant(ref: fx.Node | None, constant_inputs: frozenset[str]) -> bool:
    """True for parameters and buffers: get_attr nodes, or parameter placeholders (and an absent tensor)."""
    if ref is None:
        return True
    if not isinstance(ref, fx.Node):
        return False
    return ref.op == "get_attr" or (ref.op == "placeholder" and ref.name in constant_inputs)


def computed_from_state(node: fx.Node, constant_inputs: frozenset[str]) -> bool:
    """Whether `node` is computed from the graph's parameters and buffers alone (placeholders in `constant_inputs`,
    get_attr nodes), through ops that neither draw random numbers nor write in place: a value freezing computes once."""
    todo, seen = [node], set()
    while todo:
        ref = todo.pop()
        if ref in seen:
            continue
        seen.add(ref)
        if ref.op == "placeholder" and ref.name not in constant_inputs:
            return False
        if ref.op == "call_function":
            if _torch_private.op_is_random(ref.target) or _torch_private.op_is_mutable(ref.target):
                return False
            todo += ref.all_input_nodes
        elif ref.op not in ("placeholder", "get_attr"):
            return False
    return True


def draws_random_numbers(node: fx.Node) -> bool:
    """Whether `node` draws random numbers, or is an element of what such an op returns."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.op == "call_function" and _torch_private.op_is_random(node.target)
