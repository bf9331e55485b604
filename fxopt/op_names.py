"""The op a graph node computes, by one name in every form a graph holds it in.

A call_module of `nn.ReLU`, a call_function of `F.relu` or `torch.relu`, a call_method `relu` and
ATen's `aten.relu.default` are all "relu"; in-place forms are "relu_". Tables keyed by op name
(saved-for-backward, aliasing, the passes' patterns) read it from here.
"""
from __future__ import annotations

import builtins
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import _torch_private
from .graph_functions import declared

# nn.Module types in the torch.nn namespace, by the op name their forward computes.
_MODULE_OPS: dict[type, str] = {
    torch.nn.ReLU: "relu", torch.nn.ReLU6: "relu6", torch.nn.Hardtanh: "hardtanh", torch.nn.LeakyReLU: "leaky_relu",
    torch.nn.ELU: "elu", torch.nn.Hardswish: "hardswish", torch.nn.SiLU: "silu", torch.nn.GELU: "gelu",
    torch.nn.Mish: "mish", torch.nn.Softplus: "softplus", torch.nn.Hardsigmoid: "hardsigmoid",
    torch.nn.Sigmoid: "sigmoid", torch.nn.Tanh: "tanh", torch.nn.Softmax: "softmax", torch.nn.LogSoftmax: "log_softmax",
    torch.nn.Conv1d: "conv1d", torch.nn.Conv2d: "conv2d", torch.nn.Conv3d: "conv3d",
    torch.nn.ConvTranspose1d: "conv_transpose1d", torch.nn.ConvTranspose2d: "conv_transpose2d",
    torch.nn.ConvTranspose3d: "conv_transpose3d", torch.nn.Linear: "linear",
    torch.nn.BatchNorm1d: "batch_norm", torch.nn.BatchNorm2d: "batch_norm", torch.nn.BatchNorm3d: "batch_norm",
    torch.nn.LayerNorm: "layer_norm", torch.nn.GroupNorm: "group_norm",
    torch.nn.MaxPool1d: "max_pool1d", torch.nn.MaxPool2d: "max_pool2d", torch.nn.MaxPool3d: "max_pool3d",
    torch.nn.AvgPool1d: "avg_pool1d", torch.nn.AvgPool2d: "avg_pool2d", torch.nn.AvgPool3d: "avg_pool3d",
    torch.nn.AdaptiveAvgPool1d: "adaptive_avg_pool1d", torch.nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d",
    torch.nn.AdaptiveAvgPool3d: "adaptive_avg_pool3d", torch.nn.Dropout: "dropout", torch.nn.Dropout1d: "dropout",
    torch.nn.Dropout2d: "dropout", torch.nn.Dropout3d: "dropout", torch.nn.Flatten: "flatten",
    torch.nn.Identity: "identity", torch.nn.Embedding: "embedding",
}
_FUNCTION_NAMESPACES = (torch, F, operator, builtins, torch.Tensor)
# Functional activations that take `inplace`, and its position among their arguments.
_INPLACE_ARG = {"relu": 1, "relu6": 1, "hardtanh": 3, "leaky_relu": 2, "elu": 2, "hardswish": 1, "silu": 1}


def _module_is_pristine(module: torch.nn.Module) -> bool:
    """A torch.nn module whose forward is the library's (a subclass may compute anything)."""
    op_type = next((t for t in type(module).__mro__ if t in _MODULE_OPS), None)
    return op_type is not None and type(module).forward is op_type.forward


def op_name(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """The op a node computes, the same name in every form ("relu", "conv2d", "relu_"), or None.

    In-place forms get a trailing underscore (`x.relu_()`, `F.relu(x, inplace=True)`,
    `nn.ReLU(inplace=True)`). fxopt's own functions have the name they are declared with
    (`fxopt.graph_functions`).
    Calls of anything else outside torch / operator / builtins are None.
    """
    if node.op == "call_method":
        return node.target
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if not _module_is_pristine(module):
            return None
        name = next(_MODULE_OPS[t] for t in type(module).__mro__ if t in _MODULE_OPS)
        return name + "_" if getattr(module, "inplace", False) and name in _INPLACE_ARG else name
    if node.op != "call_function":
        return None
    helper = declared(node.target)
    own = helper.name if helper is not None else _torch_private.aten_op_name(node.target)
    if own is not None:
        return own
    name = getattr(node.target, "__name__", None)
    if name is None or not any(getattr(ns, name, None) is node.target for ns in _FUNCTION_NAMESPACES):
        return None
    position = _INPLACE_ARG.get(name)
    if position is not None and node.target is getattr(F, name, None):
        inplace = node.args[position] if len(node.args) > position else node.kwargs.get("inplace", False)
        return name + "_" if inplace is True else name
    return name
