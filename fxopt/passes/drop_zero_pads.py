"""drop_zero_pads: remove paddings of width zero, which only copy their input.

What it rewrites::

    p = aten.pad(x, [0, 0, 0, 0]);  y = aten.conv2d(p, w)   ->   y = aten.conv2d(x, w)

(`aten.pad`, `aten.constant_pad_nd`, `F.pad` with every width 0, in any mode.) Hugging Face's
TensorFlow-style "SAME" padding (MobileNetV2, EfficientNet) pads before every convolution, so a
1x1 convolution reads a full copy of its input, and in training keeps that copy for backward.

Why it is safe: a zero-width padding returns a new tensor equal to its input, element for element,
with the same shape, dtype and strides (checked on the fake values), and its backward hands the
gradient through unchanged. Reading the input itself gives every user the same values, unless one
of the two tensors is written after the padding, or the copy leaves the graph.

When it refuses (reason in the report):
  layout_differs  the copy's strides (or dtype) are not the input's, so a kernel could run differently
  written_later   the input or the copy (or a tensor sharing storage with one) is written in place
                  after the padding: the copy is what keeps the two apart
  graph_output    the copy (or a view of it) is returned: the caller would get the input's storage
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.aliasing import AliasInfo
from ..analysis.shapes import tensor_meta
from ..analysis.side_effects import MUTATION, effects
from ..op_names import call_arguments, op_name
from .base import Pass, PassContext, PassResult, site_name

_PADS = ("pad", "constant_pad_nd")


def _zero_width_input(node: fx.Node) -> fx.Node | None:
    """The input of a padding whose widths are all zero, or None."""
    if node.op != "call_function" or op_name(node) not in _PADS:
        return None
    arguments = call_arguments(node) or {}
    x, widths = arguments.get("input", arguments.get("self")), arguments.get("pad")
    zero = isinstance(widths, (list, tuple)) and all(isinstance(w, int) and w == 0 for w in widths)
    return x if zero and isinstance(x, fx.Node) else None


def _refusal(pad: fx.Node, x: fx.Node, aliases: AliasInfo, gm: fx.GraphModule) -> tuple[str, str]:
    before, after = tensor_meta(x), tensor_meta(pad)
    if before is None or after is None or before.stride() != after.stride() or before.dtype != after.dtype:
        return "layout_differs", f"{pad.name} does not have {x.name}'s strides and dtype"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for a in (*aliases.aliases(x), *aliases.aliases(pad)):
        if order[a] > order[pad] and MUTATION in effects(a, gm):
            return "written_later", f"{a.name} writes {x.name} or its copy {pad.name} in place"
    for a in aliases.aliases(pad):
        if any(user.op == "output" for user in a.users):
            return "graph_output", f"{a.name} is returned by the graph"
    return "", ""


class DropZeroPads(Pass):
    name = "drop_zero_pads"
    summary = "Remove paddings of width zero, which only copy their input."

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result, aliases = PassResult(), None
        for node in list(gm.graph.nodes):
            x = _zero_width_input(node)
            if x is None:
                continue
            if aliases is None:  # of the graph as the drops before left it
                aliases = AliasInfo(gm)
            reason, detail = _refusal(node, x, aliases, gm)
            if reason:
                result.record("refused", site_name(node), reason, detail)
                continue
            node.replace_all_uses_with(x)
            gm.graph.erase_node(node)
            aliases = None
            result.record("dropped", site_name(node), detail=f"users read {x.name} instead of its copy")
        return result
