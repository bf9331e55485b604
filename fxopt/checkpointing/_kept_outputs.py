"""The ops whose outputs a selective region keeps itself, without torch's selective-checkpoint dispatch mode.

A selective region keeps the outputs of its matmuls, convolutions and attention and recomputes the rest. torch's
selective checkpoint (`create_selective_checkpoint_contexts`) does that by sending every op of the region's forward and
of its recomputation through a Python dispatch mode, which on CPU costs more than many of a model's ops themselves
(fxopt.checkpointing._region_overhead measures it per op). When every op a region keeps is a convolution or a matrix
product (`linear`, `addmm`, `mm`, `bmm`, a `matmul` of two batched operands), the region keeps them itself instead: its
first run keeps each one's output and its recomputation hands that output back (fxopt.checkpointing._kept_outputs_run).
A convolution's first run is ATen's own, whose node does the backward; a product runs as an autograd Function whose
backward makes the `mm`/`bmm` calls of the matmul formulas, in the operand layouts ATen's path through the op gives
them. Either way gradients come out with the same bits. The region's other ops run at full speed under a plain
checkpoint.

`kept_convolution(node)` gives the operands and arguments of such a convolution (a batched one whose padding is numbers,
not "same"/"valid"), or None; `kept_product(node)` the kind and operands of such a product, or None; `kept_output(node)`
either; `outputs_kept_by_region(compute_intensive)` says whether a region keeps its ops' outputs so, the one rule both
the region (fxopt.checkpointing.eager_region) and its price (fxopt.checkpointing.profile) follow.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.fx as fx

from ..op_names import call_arguments
from ..analysis.ops import match_conv, match_linear
from ..analysis.shapes import tensor_meta

aten = torch.ops.aten

# target -> (kind, the operand count, the rank each operand must have (None: any of at least 3; 0: any))
_PRODUCTS = {
    **dict.fromkeys((aten.addmm.default, torch.addmm), ("addmm", 3, (0, 2, 2))),
    **dict.fromkeys((aten.mm.default, torch.mm), ("mm", 2, (2, 2))),
    **dict.fromkeys((aten.bmm.default, torch.bmm), ("bmm", 2, (3, 3))),
    **dict.fromkeys((aten.matmul.default, torch.matmul), ("matmul", 2, (None, None))),
}


class ConvolutionArguments(NamedTuple):
    """`aten.convolution`'s arguments after input, weight and bias, each list as long as the spatial dims."""

    stride: list[int]
    padding: list[int]
    dilation: list[int]
    transposed: bool
    output_padding: list[int]
    groups: int


class ConvolutionCall(NamedTuple):
    """A convolution a region keeps the output of: its tensor operands (input, weight, bias or None) and the rest."""

    operands: tuple
    arguments: ConvolutionArguments


class ProductCall(NamedTuple):
    """A matrix product a region keeps the output of: its kind and its tensor operands, in the op's order (`linear`:
    input, weight, bias or None)."""

    kind: str
    operands: tuple


def _spelled_out(value, dims: int) -> list[int] | None:
    """An int-or-list argument as a list of `dims` ints, or None if it is not numbers (a padding of "same")."""
    values = [value] if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else None
    if values is None or not all(isinstance(v, int) for v in values) or len(values) not in (1, dims):
        return None
    return values * dims if len(values) == 1 else values


def kept_convolution(node: fx.Node) -> ConvolutionCall | None:
    """How a selective region runs convolution `node` keeping its output itself (module docstring), or
    None where it cannot: not a convolution, tensors that are not graph nodes, an unbatched input, or arguments that
    are not plain numbers."""
    conv = match_conv(node)
    if conv is None or not all(isinstance(a, fx.Node) for a in (conv.input, conv.weight, conv.bias) if a is not None):
        return None
    x = tensor_meta(conv.input)
    if x is None or x.dim() != conv.spatial_dims + 2 or not isinstance(conv.groups, int):
        return None
    lists = [_spelled_out(getattr(conv, name), conv.spatial_dims)
             for name in ("stride", "padding", "dilation", "output_padding")]
    if any(v is None for v in lists):
        return None
    stride, padding, dilation, output_padding = lists
    arguments = ConvolutionArguments(stride, padding, dilation, conv.transposed, output_padding, conv.groups)
    return ConvolutionCall((conv.input, conv.weight, conv.bias), arguments)


def _product_operands(node: fx.Node) -> tuple[str, tuple, tuple] | None:
    """(kind, operands, the ranks they must have) of a matrix product call, or None."""
    linear = match_linear(node)
    if linear is not None:
        return "linear", (linear.input, linear.weight, linear.bias), (0, 2, 0)
    if node.op != "call_function" or node.target not in _PRODUCTS:
        return None
    kind, count, ranks = _PRODUCTS[node.target]
    arguments = call_arguments(node)
    if arguments is None:
        return None
    values = list(arguments.values())
    if kind == "addmm" and (arguments.get("beta", 1) != 1 or arguments.get("alpha", 1) != 1):
        return None
    if any(arguments.get(name) is not None for name in ("out", "out_dtype")):
        return None
    return kind, tuple(values[:count]), ranks


def kept_product(node: fx.Node) -> ProductCall | None:
    """The matrix product a selective region runs keeping its output itself (module docstring), or None where it
    cannot: not one of those products, operands that are not graph nodes, an `addmm` that scales, ranks outside the
    op's plain form (a `matmul` is kept where both operands are batched, the path of ATen's `bmm`), or tensors that
    are not real, dense ones."""
    found = _product_operands(node)
    if found is None:
        return None
    kind, operands, ranks = found
    for operand, rank in zip(operands, ranks):
        if operand is None and kind == "linear":
            continue  # a linear without bias
        t = tensor_meta(operand)
        if t is None or t.layout != torch.strided or t.is_complex() or (rank is None and t.dim() < 3) or (
                rank and t.dim() != rank):
            return None
    return ProductCall(kind, operands)


def kept_output(node: fx.Node) -> ConvolutionCall | ProductCall | None:
    """How a selective region keeps `node`'s output itself (a convolution or a matrix product), or None."""
    return kept_convolution(node) or kept_product(node)


def outputs_kept_by_region(compute_intensive: Iterable[fx.Node]) -> dict[fx.Node, ConvolutionCall | ProductCall] | None:
    """The ops a selective region keeps the outputs of itself, each with how (kept_output), when every op it keeps
    (`compute_intensive`: the matmuls, convolutions and attention it holds) is one; else None: torch's selective checkpoint
    keeps them."""
    kept = {node: kept_output(node) for node in compute_intensive}
    return None if None in kept.values() else kept
