"""What an op's backward allocates beyond the gradients it returns, from autograd's formulas (a convolution's aside).

The memory model (fxopt.checkpointing.profile) counts at each backward the gradients of the tensors
crossing it; most ATen backwards allocate nothing else (linear, matmul, GELU, softmax, layer norm,
add: tests/test_memory_backward.py runs each alone under the allocator's profiler). Two formulas of
torch's derivatives.yaml do, and both sit where models keep their losses and layer scales:

* `pow(x, e)` with a number e: `grad * (e * x.pow(e - 1))` holds x.pow(e - 1) and its product with
  e at once before the gradient is made: two tensors the size of x (a mean-square loss);
* `mul(a, b)` where an operand that needs a gradient is broadcast (ConvNeXt's layer scale, a
  per-channel gain): its gradient `(grad * other).sum_to_size(...)` first makes the full product,
  one tensor the size of the output, then reduces it.

And one kernel: ATen's CPU batch norm backward (batch_norm_backward_cpu_template) allocates its input's
gradient twice, for any layout and again in its contiguous path, and frees the first on return: one
tensor the size of the input, in train and eval mode alike.

And fxopt's own `relu_mask` (fxopt.passes._relu_mask) holds its mask converted to the gradient's dtype: one
tensor the size of its output.

A convolution's scratch is fxopt.analysis.conv_scratch's; everything else: 0.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..op_names import op_name
from .shapes import tensor_meta


def _nbytes(node) -> int:
    val = tensor_meta(node) if isinstance(node, fx.Node) else None
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def backward_temporary(node: fx.Node, requires_grad) -> int:
    """Bytes `node`'s backward holds beyond its gradients (module docstring); `requires_grad`: the nodes
    whose values need a gradient."""
    name, args, out = op_name(node), node.args, tensor_meta(node)
    if name == "pow" and len(args) == 2 and isinstance(args[0], fx.Node) and isinstance(args[1], (int, float)):
        return 2 * _nbytes(args[0]) if args[0] in requires_grad and args[1] != 0 else 0
    if name == "mul" and len(args) == 2 and all(isinstance(a, fx.Node) for a in args):
        broadcast = [a for a in args if a in requires_grad and tensor_meta(a) is not None
                     and out is not None and tensor_meta(a).shape != out.shape]
        return _nbytes(node) * len(broadcast)
    if name in ("relu_mask", "relu_mask_") and args and args[0] in requires_grad:
        return _nbytes(node)
    if name == "batch_norm" and args and args[0] in requires_grad and out is not None and out.device.type == "cpu":
        return _nbytes(args[0])
    return 0
