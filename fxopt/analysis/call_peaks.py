"""The most an op holds while it runs, outputs included, measured once per distinct call, for the ops whose kernel
torch (or oneDNN) picks at run time: no formula of the shapes gives what they allocate.

A CPU convolution and its backward (fxopt.analysis.conv_scratch: oneDNN's copies of the operands, partial sums)
and attention's ATen kernels (`ATTENTION_FORWARD_OPS`, `ATTENTION_BACKWARD_OPS`: the CPU flash kernel's
backward copies of its gradient and accumulators; on CUDA, the flash, memory-efficient and cuDNN kernels' own
workspaces) are run once on real tensors of the same shapes, strides, dtypes and devices under the allocator's
profiler (`measure`, cached per call and thread count; the first call allocates as every later one), and what
they held at once is read from the events. `call_peak(node)` is that figure for a graph node (a compiled
partition calls these ops itself: fxopt.checkpointing._partition_memory).

Not measured (0): a convolution off the CPU (CUDA's cuDNN workspace is its own), a call whose operands are not all
known tensors, a call that fails when replayed, and any call while a torch profiler records (a second one would
end the caller's session; not cached).
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from .. import _torch_private
from .replayed_calls import NotReplayable, call_spec, real_call, replaying

CONVOLUTION_OPS = ("convolution", "convolution_backward")  # ATen ops whose CPU kernels allocate scratch
# attention as torch.nn.functional and ATen's dispatcher name it, and the kernels it picks at run time
ATTENTION_FORWARD_OPS = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "_efficient_attention_forward",
    "_flash_attention_forward"})
ATTENTION_BACKWARD_OPS = frozenset({
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
    "_efficient_attention_backward", "_flash_attention_backward"})


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


def measure(target, spec: tuple) -> tuple[int, int]:
    """(the most bytes held at once, the bytes held when it returns) of `target` called as `spec` describes."""
    if _torch_private.profiler_running():
        return 0, 0  # the caller's profiler is recording: a second one would end its session (not cached)
    return _measured(target, spec, torch.get_num_threads())


def call_peak(node: fx.Node) -> int:
    """The most bytes a CPU `convolution` / `convolution_backward` node, or an attention kernel's forward or backward
    on any device, holds at once while it runs, outputs included; 0 for other nodes, or where it is not measured."""
    name = _torch_private.aten_op_name(node.target) if node.op == "call_function" else None
    attention = name in ATTENTION_FORWARD_OPS or name in ATTENTION_BACKWARD_OPS
    if not attention and name not in CONVOLUTION_OPS:
        return 0
    try:
        spec = call_spec(node, any_device=attention)
    except NotReplayable:
        return 0
    return measure(node.target, spec)[0]
