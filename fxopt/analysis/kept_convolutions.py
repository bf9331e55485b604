"""Convolutions whose outputs a selective region keeps itself, without torch's selective-checkpoint dispatch mode.

A selective region keeps the outputs of its matmuls, convolutions and attention and recomputes the rest. torch's
selective checkpoint (`create_selective_checkpoint_contexts`) does that by sending every op of the region's forward
and of its recomputation through a Python dispatch mode, which on CPU costs more than many of a CNN's ops
themselves (fxopt.analysis.region_overhead measures it per op). When every op a region keeps is a convolution,
the region keeps them itself instead: each convolution runs as an autograd Function whose first run keeps its output
and whose recomputation hands that output back, and whose backward is ATen's `convolution_backward` over the same
input and weight, the call autograd's own convolution node makes, so gradients come out with the same bits. The
region's other ops run at full speed under a plain checkpoint.

`kept_convolution(node)` gives the arguments of such a convolution (a batched one whose padding is numbers, not
"same"/"valid"), or None; `convolutions_kept_by_region(counted)` says whether a region keeps its ops' outputs so,
the one rule both the region (fxopt.passes._checkpoint_region) and its price (fxopt.analysis.memory) follow.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch.fx as fx

from .ops import match_conv
from .shapes import tensor_meta


class ConvolutionArguments(NamedTuple):
    """`aten.convolution`'s arguments after input, weight and bias, each list as long as the spatial dims."""

    stride: list[int]
    padding: list[int]
    dilation: list[int]
    transposed: bool
    output_padding: list[int]
    groups: int


def _spelled_out(value, dims: int) -> list[int] | None:
    """An int-or-list argument as a list of `dims` ints, or None if it is not numbers (a padding of "same")."""
    values = [value] if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else None
    if values is None or not all(isinstance(v, int) for v in values) or len(values) not in (1, dims):
        return None
    return values * dims if len(values) == 1 else values


def kept_convolution(node: fx.Node) -> ConvolutionArguments | None:
    """The arguments with which a selective region runs `node` keeping its output itself (module docstring), or
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
    return ConvolutionArguments(stride, padding, dilation, conv.transposed, output_padding, conv.groups)


def convolutions_kept_by_region(counted: Iterable[fx.Node]) -> dict[fx.Node, ConvolutionArguments] | None:
    """The convolutions a selective region keeps the outputs of itself, with their arguments, when every op it keeps
    (`counted`: the matmuls, convolutions and attention it holds) is one (kept_convolution); else None: torch's
    selective checkpoint keeps them."""
    kept = {node: kept_convolution(node) for node in counted}
    return None if None in kept.values() else kept
