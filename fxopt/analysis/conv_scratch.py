"""What a convolution's backward allocates beyond the gradients it returns, from the op's arguments.

On CPU, ATen runs a float convolution's backward through oneDNN (`ConvBackend.Mkldnn`; torch's own
`_select_conv_backend` says which backend a call takes, thread count included: single-threaded,
an unstrided 1x1 convolution on a batch under 16 takes `Slow2d`, a matrix product with no scratch).
`mkldnn_convolution_backward` (aten/src/ATen/native/mkldnn/Conv.cpp) then allocates, beyond the
gradients of input, weight and bias that the memory model counts already
(fxopt.analysis.memory, `grad_live` and the parameter gradients):

* plain (NCHW) layout: oneDNN computes on blocked layouts, so each gradient is made twice, oneDNN's
  own and the dense copy ATen returns, and the inputs of each primitive are reordered first
  (`_plain_layout_scratch`, phase by phase). With both gradients that is max(x + y, w) beyond them
  (x, y, w: the bytes of input, output and weight), and at least 2x - w for a strided 1x1
  convolution (oneDNN computes its input gradient in a compact copy); with the input gradient only,
  max(y + w, x) (2x for a strided 1x1).
  (HF ResNet-50's last 3x3, 512 -> 512 at 7x7: a second 9.44 MB weight-sized buffer.)
* channels-last (input or weight suggests it): ATen gives oneDNN the input gradient itself; the
  weight gradient is oneDNN's, then dense, then a channels-last copy where that layout differs from
  the dense one (2w or w); an input or weight not already channels-last is copied first (x, w); and
  oneDNN's depthwise backward-weights kernel for kernels above 3x3 keeps 64 weight-sized partial
  sums (HF ConvNeXt's 7x7 depthwise, 384 channels: 4.8 MB). Without a weight gradient: the weight
  reordered (w).

Measured on torch 2.13's CPU build with the allocator's events (tests/test_conv_scratch.py checks
the rule against them on the layers it names). Other backends (float64's `Slow2d`, CUDA's cuDNN,
whose workspace is its own) are not modelled: 0.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private
from .ops import match_conv

DEPTHWISE_PARTIAL_SUMS = 64  # weight-sized buffers oneDNN's channels-last depthwise backward-weights kernel keeps


def _tuple(value, dims: int) -> list[int]:
    return list(value) if isinstance(value, (list, tuple)) else [value] * dims


def _nbytes(t: torch.Tensor) -> int:
    return _torch_private.size_hint(t.numel()) * t.element_size()


def _strided_1x1(conv, weight: torch.Tensor) -> bool:
    return all(k == 1 for k in weight.shape[2:]) and any(s > 1 for s in _tuple(conv.stride, conv.spatial_dims))


def _plain_layout_scratch(xb: int, yb: int, wb: int, input_grad: bool, weight_grad: bool, strided_1x1: bool) -> int:
    """The most a plain-layout backward holds at once, less the gradients it returns (module docstring), phase
    by phase: backward-data holds the reordered output gradient and weight with oneDNN's input gradient, then
    oneDNN's and the dense input gradient (and, for a strided 1x1, the compact copy oneDNN computes it in);
    backward-weights holds the dense input gradient, reordered input and output gradient with oneDNN's weight
    gradient, then oneDNN's and the dense weight gradient."""
    returned = (xb if input_grad else 0) + (wb if weight_grad else 0)
    held = []
    if input_grad:
        held += [yb + wb + xb, (3 if strided_1x1 else 2) * xb]
    if weight_grad:
        dense_input_grad = xb if input_grad else 0
        held += [dense_input_grad + xb + yb + wb, dense_input_grad + 2 * wb]
    return max(held) - returned


def conv_backward_scratch(node: fx.Node, input_grad: bool, weight_grad: bool) -> int:
    """Bytes `node`'s backward allocates beyond its gradients (module docstring), 0 if not a convolution
    or its backend is not modelled; `input_grad` / `weight_grad`: which gradients its backward makes."""
    conv = match_conv(node)
    if conv is None or not (input_grad or weight_grad) or isinstance(conv.padding, str):
        return 0
    x, weight, y = conv.input.meta.get("val"), conv.weight.meta.get("val"), node.meta.get("val")
    if not all(isinstance(t, torch.Tensor) for t in (x, weight, y)) or x.device.type != "cpu":
        return 0
    dims = conv.spatial_dims
    backend = _torch_private.conv_backend(x, weight, _tuple(conv.stride, dims), _tuple(conv.padding, dims),
                                          _tuple(conv.dilation, dims), conv.transposed,
                                          _tuple(conv.output_padding, dims), conv.groups)
    if backend != "Mkldnn" or conv.transposed:
        return 0
    xb, yb, wb = _nbytes(x), _nbytes(y), _nbytes(weight)
    if not any(_torch_private.suggests_channels_last(t) for t in (x, weight)):
        return _plain_layout_scratch(xb, yb, wb, input_grad, weight_grad, _strided_1x1(conv, weight))
    channels_last = torch.channels_last if dims == 2 else torch.channels_last_3d
    copies = sum(b for t, b in ((x, xb), (weight, wb)) if not t.is_contiguous(memory_format=channels_last))
    if not weight_grad:
        return copies + wb
    dense_is_channels_last = torch.empty(weight.shape, device="meta").is_contiguous(memory_format=channels_last)
    weight_copies = 1 if dense_is_channels_last else 2
    depthwise = conv.groups > 1 and weight.shape[1] == 1 and conv.groups == x.shape[1]
    if depthwise and max(weight.shape[2:]) > 3:
        weight_copies += DEPTHWISE_PARTIAL_SUMS
    return copies + weight_copies * wb
