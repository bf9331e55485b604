"""`relu_mask(x)`: a ReLU whose backward keeps a bool mask instead of its float output.

`torch.relu` saves its whole output for backward although backward only needs where it was
positive; this saves `output <= 0` as `torch.bool`, one byte per element (4x less for float32,
2x for bfloat16/float16). The gradient is `torch.where(zeroed, 0, grad)`, bit-for-bit what
`threshold_backward(grad, output, 0)` computes: NaN and inf gradients included, and a NaN
output (a NaN input) passes its gradient as ATen's does, since `NaN <= 0` is false.

`relu_mask_(x)` does the same in place (`x` is marked dirty, as `torch.relu_` would).
"""
from __future__ import annotations

import torch

from ..analysis.saved_tensors import bool_mask_bytes
from ..graph_functions import graph_function


class _ReluMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, inplace: bool) -> torch.Tensor:
        out = torch.relu_(x) if inplace else torch.relu(x)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(out <= 0)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (zeroed,) = ctx.saved_tensors
        return torch.where(zeroed, torch.zeros((), dtype=grad.dtype, device=grad.device), grad), None


@graph_function(name="relu_mask", saves=bool_mask_bytes)
def relu_mask(x: torch.Tensor) -> torch.Tensor:
    return _ReluMask.apply(x, False)


@graph_function(name="relu_mask_", mutates=True, saves=bool_mask_bytes)
def relu_mask_(x: torch.Tensor) -> torch.Tensor:
    return _ReluMask.apply(x, True)

