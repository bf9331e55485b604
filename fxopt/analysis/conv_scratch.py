"""What a CPU convolution allocates while it runs, measured once per distinct call: the one source of both
memory models (the eager step's, fxopt.analysis.memory, and a compiled partition's, fxopt.analysis.partition_memory).

On CPU, ATen runs a float convolution and its backward through oneDNN, which allocates beyond the
result: copies of the operands in its own (blocked) layout, each gradient made twice (oneDNN's and
the dense copy ATen returns), a weight-sized partial sum per thread block for a channels-last
depthwise kernel above 3x3 (HF ConvNeXt's 7x7: 4.8 MB), a compact copy for a strided 1x1. What it
allocates depends on the path ATen and oneDNN pick from the dtype, the operands' strides, the
kernel's shape and the thread count (single-threaded, an unstrided 1x1 on a batch under 16 runs
ATen's own `Slow2d`, a matrix product without scratch; float64 runs `Slow2d` with its column buffer):
no formula of the shapes held over all of them. So the call is run once on real tensors of the
same shapes, strides and dtype under the allocator's profiler (`_measured`, cached per call and thread count;
the first call allocates as every later one), and what it held at once is read from the events:

* `call_peak(node)`: the most a graph's `convolution` / `convolution_backward` node holds at once,
  outputs included (a compiled partition calls these ops itself);
* `conv_backward_scratch(conv, input_grad, weight_grad)`: what the backward autograd runs for a
  matched convolution (`convolution_backward` of a gradient shaped and strided as its output)
  holds beyond the gradients it returns, which the eager model counts already.

Not measured (0): other devices (CUDA's cuDNN workspace is its own), a call whose operands are not
all known tensors, a string padding, a call that fails when replayed, and any call while a torch
profiler records (a second one would end the caller's session; not cached).
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from .. import _torch_private
from .ops import ConvCall
from .replayed_calls import NotReplayable, call_spec, real_call, replaying, tensor_spec

MEASURED_OPS = ("convolution", "convolution_backward")  # ATen ops whose CPU kernels allocate scratch


@functools.lru_cache(maxsize=1024)
def _measured(target, spec: tuple, threads: int) -> tuple[int, int]:
    """(the most bytes held at once, the bytes still held when it returns: its outputs) of one call (a `call_spec`)
    at `threads` intra-op threads (ATen's and oneDNN's paths depend on it), or (0, 0) where it cannot be replayed."""
    with replaying(spec):
        real_args, real_kwargs = real_call(spec)
        try:
            with _torch_private.allocation_profile() as prof:
                outputs = target(*real_args, **real_kwargs)  # held until the profile ends: `live` counts them
        except Exception:  # noqa: BLE001  the call the graph makes could not be replayed: not measured
            return 0, 0
    del outputs
    return _torch_private.allocation_peak(prof)


def _measure(target, spec: tuple) -> tuple[int, int]:
    if _torch_private.profiler_running():
        return 0, 0  # the caller's profiler is recording: a second one would end its session (not cached)
    return _measured(target, spec, torch.get_num_threads())


def call_peak(node: fx.Node) -> int:
    """The most bytes a CPU `convolution` or `convolution_backward` node holds at once while it runs, outputs
    included; 0 for other nodes, or where it is not measured (module docstring)."""
    if node.op != "call_function" or _torch_private.aten_op_name(node.target) not in MEASURED_OPS:
        return 0
    try:
        spec = call_spec(node)
    except NotReplayable:
        return 0
    return _measure(node.target, spec)[0]


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
    peak, returned = _measure(torch.ops.aten.convolution_backward.default, (args, ()))
    return peak - returned
