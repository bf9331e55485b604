"""`log_softmax_grad_in_place(x, dim)`: a log-softmax whose backward writes its input's gradient over its output's.

ATen's log-softmax backward makes a new gradient beside the one it is given and the output it saved: three tensors
the size of the input at once. Before a cross-entropy over a vocabulary (GPT-2: 2 x 512 tokens x 50,257 classes,
206 MB each) that is the step's peak. This one computes the same gradient with the same kernel
(`aten._log_softmax_backward_data`, `out=` the gradient it is given): per row the kernel sums the incoming gradient
first, then writes each element from the same element of the gradient and of the output, so writing over the
gradient gives ATen's bits (tests/test_inplace_log_softmax_grad.py checks them bitwise). Two tensors instead of three.

Writing over the incoming gradient is safe only where nobody else holds it: fxopt.passes.inplace_log_softmax_grad
puts this only where a negative log-likelihood, whose backward makes a new gradient, is the output's one reader.
Under `create_graph=True` (grad mode on in backward) it returns ATen's own, differentiable gradient: the saved
output is this function's, so a second backward comes back through it.
"""
from __future__ import annotations

import torch

from .._torch_private import is_view
from ..graph_functions import graph_function

_aten = torch.ops.aten


class _LogSoftmaxGradInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        out = _aten._log_softmax(x, dim, False)
        ctx.save_for_backward(out)
        ctx.dim = dim
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        if torch.is_grad_enabled() or not _writable_like(grad, out):  # double backward, or a gradient not its own
            return _aten._log_softmax_backward_data(grad, out, ctx.dim, out.dtype), None
        return _aten._log_softmax_backward_data.out(grad, out, ctx.dim, out.dtype, out=grad), None


def _writable_like(grad: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel may write its result over `grad`: its own dense storage, laid out as the output."""
    return (grad.shape == out.shape and grad.dtype == out.dtype and grad.is_contiguous() and not is_view(grad)
            and grad.numel() == grad.untyped_storage().nbytes() // grad.element_size())


@graph_function(name="log_softmax", gradient_in_place=True)
def log_softmax_grad_in_place(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _LogSoftmaxGradInPlace.apply(x, dim)
