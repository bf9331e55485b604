"""Ops of a selective region that keep their own outputs (fxopt.checkpointing._kept_outputs says which).

The region's first run computes the op and keeps its output (RegionRun); a recomputation hands that output back
instead of computing it, saving what the first run saved, so checkpoint sees the same saved tensors on both runs and
the memory model's account of them holds.

  convolution   runs as ATen's own op on the first run, whose node saves its input and weight and does the
                backward; a recomputation is `recomputed_as_saved` (fxopt.checkpointing._region_run)
  products      run as an autograd Function on both runs, saving the operands in the form ATen's path through the
                op gives them (`linear` flattens its input to a matrix, `matmul` of batched operands expands and
                folds them to `bmm`'s three dims), copies where it copies; its backward makes the `mm` / `bmm` calls
                of the matmul formulas over them, the bias's gradient summed as autograd sums a broadcast one
                (which operands ATen's path saves depends on which need gradients: the Function saves them all)

so gradients come out with the same bits as without the region (tests/test_kept_outputs.py checks each path).
Under autocast an op runs as its node did, recomputed with the rest: autocast casts the inputs of the op the graph
calls, not of the one the Function would.
"""
from __future__ import annotations

import torch

from ._kept_outputs import ConvolutionArguments
from ..graph_functions import graph_function, import_by_name
from ._region_run import RegionRun, output_once, recomputed_as_saved, take_output

aten = torch.ops.aten


def _mm_grad_of_first(grad, mat1, mat2):
    """d(mat1 @ mat2)/d mat1 as autograd's mm node computes it: column-major where mat1 was."""
    if mat1.stride(0) == 1 and mat1.stride(1) == mat1.size(0):
        return mat2.mm(grad.t()).t()
    return grad.mm(mat2.t())


def _mm_grad_of_second(grad, mat1, mat2):
    """d(mat1 @ mat2)/d mat2 as autograd's mm node computes it: column-major where mat2 was."""
    if mat2.stride(0) == 1 and mat2.stride(1) == mat2.size(0):
        return grad.t().mm(mat1).t()
    return mat1.t().mm(grad)


def _mm_grads(grad, mat1, mat2, needed) -> tuple:
    """The gradients of `mat1 @ mat2` that `needed` asks for, as autograd's mm node computes them."""
    return (_mm_grad_of_first(grad, mat1, mat2) if needed[0] else None,
            _mm_grad_of_second(grad, mat1, mat2) if needed[1] else None)


class _Product:
    """One kind of matrix product (`op`): what its backward saves (`saved`, which may note facts on ctx), its output
    (`compute`, on the first run only) and its operands' gradients (`grads`)."""

    op = None

    @classmethod
    def saved(cls, ctx, *operands) -> tuple:
        return operands

    @classmethod
    def compute(cls, ctx, operands, saved):
        return cls.op(*operands)


class _Mm(_Product):
    """`mm(a, b)`."""

    op = torch.mm

    @staticmethod
    def grads(ctx, grad, a, b, needed):
        return _mm_grads(grad, a, b, needed)


class _Addmm(_Product):
    """`addmm(bias, mat1, mat2)` (beta and alpha 1): autograd saves the matrices; the bias's gradient is summed as
    autograd sums a broadcast one."""

    op = torch.addmm

    @classmethod
    def saved(cls, ctx, bias, mat1, mat2):
        ctx.bias_shape = bias.shape
        return mat1, mat2

    @staticmethod
    def grads(ctx, grad, mat1, mat2, needed):
        return grad.sum_to_size(ctx.bias_shape) if needed[0] else None, *_mm_grads(grad, mat1, mat2, needed[1:])


class _Linear(_Product):
    """`linear(x, weight, bias)`: ATen runs it as `addmm` over x flattened to a matrix (a view where x is
    contiguous; else through `matmul`, which copies x so, and an in-place bias add); autograd saves that matrix."""

    op = torch.nn.functional.linear

    @classmethod
    def saved(cls, ctx, x, weight, bias):
        ctx.x_shape, ctx.has_bias, ctx.fused = x.shape, bias is not None, x.dim() == 2 or x.is_contiguous()
        return x.reshape(-1, x.size(-1)), weight

    @staticmethod
    def grads(ctx, grad, x2, weight, needed):
        grad2 = grad.reshape(-1, grad.size(-1))
        grad_x2, grad_weight_t = _mm_grads(grad2, x2, weight.t(), needed[:2])
        return (grad_x2.reshape(ctx.x_shape) if needed[0] else None,
                grad_weight_t.t() if needed[1] else None,
                # addmm's bias gradient sums the flattened gradient; the in-place add's, the gradient as it is
                (grad2 if ctx.fused else grad).sum_to_size(weight.size(0)) if ctx.has_bias and needed[2] else None)


class _Batched(_Product):
    """`matmul(a, b)` of batched a and b, and `bmm`: ATen expands both to the broadcast batch, folds it into one
    dim (a copy where that is no view) and calls `bmm`; autograd saves the folded operands."""

    @classmethod
    def saved(cls, ctx, a, b):
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        n, m, p, count = a.size(-2), a.size(-1), b.size(-1), batch.numel()
        ctx.a_shape, ctx.b_shape, ctx.out_shape = a.shape, b.shape, (*batch, n, p)
        return a.expand(*batch, n, m).reshape(count, n, m), b.expand(*batch, m, p).reshape(count, m, p)

    @classmethod
    def compute(cls, ctx, operands, saved):
        a3, b3 = saved
        return a3.bmm(b3).view(ctx.out_shape)  # as ATen's matmul: bmm of the folded operands, unfolded

    @staticmethod
    def grads(ctx, grad, a3, b3, needed):
        grad3 = grad.reshape(a3.size(0), a3.size(1), b3.size(2))
        batch = ctx.out_shape[:-2]
        return (grad3.bmm(b3.transpose(1, 2)).reshape(*batch, *a3.shape[1:]).sum_to_size(ctx.a_shape)
                if needed[0] else None,
                a3.transpose(1, 2).bmm(grad3).reshape(*batch, *b3.shape[1:]).sum_to_size(ctx.b_shape)
                if needed[1] else None)


_PRODUCTS = {"linear": _Linear, "addmm": _Addmm, "mm": _Mm, "bmm": _Batched, "matmul": _Batched}


class _ProductKeepingOutput(torch.autograd.Function):
    """A matrix product keeping its output (module docstring); `kind` a key of _PRODUCTS, `operands` its tensors
    in the op's order. Its backward keeps what autograd's own node for the op keeps."""

    @staticmethod
    def forward(ctx, kind: str, key: str, run: RegionRun, *operands):
        product = _PRODUCTS[kind]
        saved = product.saved(ctx, *operands)
        out = output_once(run, key, lambda: product.compute(ctx, operands, saved))
        ctx.save_for_backward(*saved)
        ctx.product = product
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, *ctx.product.grads(ctx, grad, *ctx.saved_tensors, ctx.needs_input_grad[3:])


def _as_written(original: tuple):
    """Call `original` (target, args, kwargs), its target an ATen op or a function's importable name."""
    target, args, kwargs = original
    return (import_by_name(target) if isinstance(target, str) else target)(*args, **kwargs)


@graph_function(name="convolution")
def convolution_once(x, weight, bias, arguments: ConvolutionArguments, key: str, run: RegionRun, original: tuple):
    """A convolution in a selective region, its output computed on the first run only and kept (`key`: its node's
    name); under autocast as the node did (`original`: its target or the target's importable name, args, kwargs)."""
    if torch.is_autocast_enabled(x.device.type):
        return _as_written(original)
    if run.first:  # ATen's node saves (x, weight) and does the backward
        return output_once(run, key, lambda: aten.convolution(x, weight, bias, *arguments))
    return recomputed_as_saved(lambda: take_output(run, key), (x, weight, bias), saved=(x, weight))


@graph_function(name="matmul")
def product_once(kind: str, operands: tuple, key: str, run: RegionRun, original: tuple):
    """A matrix product in a selective region (`kind`, its tensor `operands`), its output computed on the first run
    only and kept (`key`: its node's name); under autocast as the node did (`original`: as convolution_once's)."""
    if torch.is_autocast_enabled(operands[0].device.type):
        return _as_written(original)
    return _ProductKeepingOutput.apply(kind, key, run, *operands)
