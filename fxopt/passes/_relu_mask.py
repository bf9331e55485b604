"""`relu_mask(x)`: a ReLU whose backward keeps a bool mask instead of its float output.

`torch.relu` saves its whole output for backward although backward only needs where it was
positive; this saves `output <= 0` as `torch.bool`, one byte per element (4x less for float32,
2x for bfloat16/float16). The gradient is zero where the mask is set and `grad` elsewhere, bit-for-bit
what `threshold_backward(grad, output, 0)` computes: NaN and inf gradients included, and a NaN
output (a NaN input) passes its gradient as ATen's does, since `NaN <= 0` is false.

ATen's `hardtanh_backward` computes it: with the mask as 0/1 in the gradient's dtype and bounds (-1, 1), it
returns +0 where the mask is 1 and the gradient's own bits elsewhere. That holds the mask so converted, one
tensor the size of the output, while it runs (fxopt.analysis.backward_temporaries). `torch.where(mask, 0,
grad)`, which needs no such tensor, is several times slower on CPU (`benchmarks/relu_mask_backward.py`, one
thread, a 4x96x112x112 float32 gradient: 18.3 ms against 3.6 ms; ATen's own relu backward 2.4 ms).

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
        return torch.ops.aten.hardtanh_backward(grad, zeroed.view(torch.uint8).to(grad.dtype), -1.0, 1.0), None


@graph_function(name="relu_mask", saves=bool_mask_bytes)
def relu_mask(x: torch.Tensor) -> torch.Tensor:
    return _ReluMask.apply(x, False)


@graph_function(name="relu_mask_", mutates=True, saves=bool_mask_bytes)
def relu_mask_(x: torch.Tensor) -> torch.Tensor:
    return _ReluMask.apply(x, True)

