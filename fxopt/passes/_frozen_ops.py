"""Ops that keep for backward only what the gradients actually asked for need (used by prune_dead_grads).

Eager autograd keeps a convolution's input even when its weight is frozen (`convolution_backward`
takes the input whatever `output_mask` says), and keeps an eval-mode BatchNorm's input even when
its affine parameters are frozen. These replacements keep the minimum ("memsave_torch",
arXiv 2404.12406), deciding at run time from `requires_grad`, so they stay right if the caller
later unfreezes a layer (a ReLU keeping a bool mask is `fxopt.passes._relu_mask`, placed by
inplace_relu, which runs next and sees that a frozen conv no longer keeps the ReLU's output):

  conv_saving_what_grads_need  input only if the weight needs a gradient, weight only if the input does
  eval_batch_norm_scale_shift  eval BatchNorm as `x * scale + shift`: autograd's mul keeps `x` only
                               when `scale` needs a gradient (a trainable affine weight)
  call_without_grad            run one graph node under `torch.no_grad()` (nothing recorded or kept);
  call_method_without_grad     the same for a method call

The convolution's backward is `once_differentiable`: double backward through it raises a clear
error instead of running (second-order gradients of a frozen-middle network are not supported).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..analysis.saved_tensors import tensor_bytes
from ..graph_functions import graph_function, import_by_name


@graph_function(runs_without_grad="callable")
def call_without_grad(target, *args, **kwargs):
    """`target(*args, **kwargs)` under `torch.no_grad()`; `target` is a module or an importable function name.

    A graph holds the function by name: fx cannot print a function object as an argument.
    """
    function = import_by_name(target) if isinstance(target, str) else target
    with torch.no_grad():
        return function(*args, **kwargs)


@graph_function(runs_without_grad="method")
def call_method_without_grad(name: str, self, *args, **kwargs):
    """`self.name(*args, **kwargs)` under `torch.no_grad()`."""
    with torch.no_grad():
        return getattr(self, name)(*args, **kwargs)


def _shape_only(like: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A tensor of `shape` holding one element: for backward formulas that read only the shape."""
    return like.new_empty(1).expand(shape)


class _ConvSavingWhatGradsNeed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
        ctx.config = (stride, padding, dilation, transposed, output_padding, groups)
        ctx.shapes = (x.shape, weight.shape, None if bias is None else bias.shape)
        # The weight's gradient reads the input; the input's gradient reads the weight.
        ctx.save_for_backward(x if weight.requires_grad else None, weight if x.requires_grad else None)
        return torch.convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x_shape, w_shape, b_shape = ctx.shapes
        x = _shape_only(grad, x_shape) if x is None else x
        weight = _shape_only(grad, w_shape) if weight is None else weight
        mask = list(ctx.needs_input_grad[:3])
        grads = torch.ops.aten.convolution_backward(grad, x, weight, b_shape, *ctx.config, mask)
        return (*(g if needed else None for g, needed in zip(grads, mask)), None, None, None, None, None, None)


def _weight_if_computed(node) -> int:
    """Bytes of the weight the conv keeps when the graph computes it (a parameter or input lives anyway)."""
    weight = node.args[1]
    return 0 if weight.op in ("placeholder", "get_attr") else tensor_bytes(weight)


@graph_function(name="conv_saving_what_grads_need", saves=_weight_if_computed)
def conv_saving_what_grads_need(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """`torch.convolution(...)` whose backward keeps the input only if the weight needs a gradient."""
    return _ConvSavingWhatGradsNeed.apply(x, weight, bias, stride, padding, dilation, transposed, output_padding,
                                          groups)


@graph_function
def eval_batch_norm_scale_shift(running_mean, running_var, weight, bias, eps: float, ndim: int):
    """(scale, shift), shaped to broadcast over an `ndim`-D input, with eval BN(x) == x * scale + shift."""
    scale = torch.rsqrt(running_var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -running_mean * scale
    if bias is not None:
        shift = shift + bias
    shape = (-1,) + (1,) * (ndim - 2)
    return scale.reshape(shape), shift.reshape(shape)
