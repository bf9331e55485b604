"""What a CPU convolution's backward allocates beyond the gradients it returns, measured: the eager step's model
(fxopt.checkpointing.profile) reads it, as a compiled partition's (fxopt.checkpointing._partition_memory) reads the whole call's
peak (fxopt.analysis.call_peaks, which measures both).

On CPU, ATen runs a float convolution and its backward through oneDNN, which allocates beyond the
result: copies of the operands in its own (blocked) layout, each gradient made twice (oneDNN's and
the dense copy ATen returns), a weight-sized partial sum per thread block for a channels-last
depthwise kernel above 3x3 (HF ConvNeXt's 7x7: 4.8 MB), a compact copy for a strided 1x1. What it
allocates depends on the path ATen and oneDNN pick from the dtype, the operands' strides, the
kernel's shape and the thread count (single-threaded, an unstrided 1x1 on a batch under 16 runs
ATen's own `Slow2d`, a matrix product without scratch; float64 runs `Slow2d` with its column buffer):
no formula of the shapes held over all of them. So `conv_backward_scratch(conv, input_grad, weight_grad)` runs
the backward autograd runs for a matched convolution (`convolution_backward` of a gradient shaped and strided as
its output) once (fxopt.analysis.call_peaks.measure) and returns what it holds beyond the gradients it returns,
which the eager model counts already.

Not measured (0): other devices (CUDA's cuDNN workspace is its own), a string padding, operands that are not all
known tensors, a call that fails when replayed or runs while a torch profiler records.
"""
from __future__ import annotations

import torch

from .call_peaks import measure
from .ops import ConvCall
from .replayed_calls import NotReplayable, tensor_spec


def _tuple(value, dims: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,) * dims


def conv_backward_scratch(conv: ConvCall, input_grad: bool, weight_grad: bool) -> int:
    """Bytes the backward of the matched convolution `conv` holds beyond the gradients it returns (module
    docstring), 0 where not measured; `input_grad` / `weight_grad`: which gradients its backward makes."""
    if not (input_grad or weight_grad) or isinstance(conv.padding, str):
        return 0
    dims = conv.spatial_dims
    try:
        x, weight, y = (tensor_spec(n.meta.get("val")) for n in (conv.input, conv.weight, conv.node))
    except NotReplayable:
        return 0
    args = (y, x, weight, None, _tuple(conv.stride, dims), _tuple(conv.padding, dims), _tuple(conv.dilation, dims),
            conv.transposed, _tuple(conv.output_padding, dims), conv.groups, (input_grad, weight_grad, False))
    peak, returned = measure(torch.ops.aten.convolution_backward.default, (args, ()))
    return peak - returned
