"""prepack_conv_weights: give an inference graph's CPU convolutions their weights in oneDNN's own layout.

What it rewrites::

    y = aten.conv2d(x, w, b, stride, padding, dilation, groups)
        ->  w_packed = prepacked_conv_weight(w, padding, stride, dilation, groups, x.shape)
            y = onednn_conv2d(x, w_packed, b, padding, stride, dilation, groups)

    y = aten.conv2d(x, w, ...);  z = aten.relu_(y)      ->  z = onednn_conv2d(x, w_packed, ..., "relu")
    (relu6 and hardtanh likewise: oneDNN's "hardtanh" with their bounds)

    y = aten.conv2d(x, w, ...);  s = aten.add(y, r);  z = aten.relu_(s)
        ->  z = onednn_conv2d(x, w_packed, ..., "relu", added=r)      (ResNet's residual addition)
        ->  z = onednn_conv2d_add_(r, x, w_packed, ..., "relu")       (the sum written into r, where nothing reads
                                                                      r afterwards and r is no input or output)

(fxopt graph helpers around `mkldnn._reorder_convolution_weight` and `mkldnn._convolution_pointwise`, its
`.binary` overload with an addition, declared so that fxopt's analyses know they write nothing and alias nothing)

for 2-D convolutions (`aten.conv2d`, or `aten.convolution` not transposed) on the CPU in float32 whose
weight and bias are computed from the model's parameters and buffers alone (the weights as they
are, or `fold_conv_bn`'s folded ones) and whose input is channels-last (after `channels_last`).

Why it pays: ATen's CPU convolution runs oneDNN, which first copies the weight into its blocked
layout on every call. Reordered in the graph, that copy depends on the parameters alone, so the
eager path's freezing (fxopt.frontends.backend.FrozenInference) makes it once; the graph then
runs the oneDNN convolution directly, as Inductor's freezing and `torch.jit.optimize_for_inference`
do (ResNet-50 at batch 4, two threads: 1.14x eager's speed before, 1.23-1.42x after; figures in
docs/benchmarks.md). Where a parameter changes after freezing, the unfrozen graph reorders on
every call, as ATen does inside.

Why it is safe: `_convolution_pointwise` with no fused op is the oneDNN convolution ATen's CPU
convolution calls for float32; only the weight's memory layout changes, and the values are the
same up to oneDNN's choice of kernel. Its output is channels-last, as ATen's is for a
channels-last input, so every later op sees eager's strides (checked on the fake values). An
activation is fused only where it is the convolution output's one reader: oneDNN applies the same
elementwise function to each result as it writes it, and nothing else could have seen the value
before it. An addition that alone reads a convolution is fused likewise (`_fusable_addition` says when: the added
tensor of the output's size and layout, alpha 1, no write into the other operand, no write between the two; then a
ReLU that alone reads the sum); oneDNN adds the bias first, then the tensor, as eager does. The sum is written
into the added tensor's memory only where fxopt's alias analysis finds that nothing sharing that memory is a
graph input, parameter, buffer or output, the convolution's own input, or read after it (`_sum_in_place`); the
in-place helper is declared as writing its first argument alone, so the eager path still sees no parameter written
and freezes. The rewrite is for inference graphs only: the oneDNN op has no derivative.

When it refuses (reason in the report):
  not_channels_last   the input is not channels-last: the oneDNN op would return channels-last
                      where ATen returns contiguous, and later ops and the caller would see it
  weight_not_constant the weight or bias is computed from a graph input that is not a parameter
                      or buffer (or drawn at random): it cannot be reordered once
  not_float32_cpu     the input is not a float32 CPU tensor, or this torch has no oneDNN
  unsupported_conv    a transposed or not 2-D convolution, or padding='same' that is not the same on
                      both sides (an even dilated kernel)
Under torch.compile it does not run: Inductor's freezing packs the weights itself.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import _torch_private
from ..analysis.activations import match_activation
from ..analysis.aliasing import AliasInfo, has_internal_overlap
from ..analysis.ops import ConvCall, computed_from_state, match_conv
from ..analysis.shapes import tensor_meta
from ..analysis.side_effects import MUTATION, OPAQUE, STATS, effects
from ..graph_functions import graph_function
from ..op_names import op_name
from .base import INFERENCE, Pass, PassContext, PassResult, site_name

@graph_function
def prepacked_conv_weight(weight, padding: list[int], stride: list[int], dilation: list[int], groups: int,
                          input_size: list[int] | None):
    """`weight` copied into oneDNN's blocked layout for a convolution with these settings (inputs of `input_size`,
    where known, pick the layout; any input size runs on it). On fake tensors (shape propagation, cost estimates)
    the weight as it is: oneDNN's layout has no fake form."""
    if _torch_private.is_fake(weight):
        return weight
    return _torch_private.onednn_convolution_ops().reorder(weight, padding, stride, dilation, groups, input_size)


@graph_function
def onednn_conv2d(x, packed_weight, bias, padding: list[int], stride: list[int], dilation: list[int], groups: int,
                  activation: str = "none", bounds: tuple[float, ...] = (), added=None):
    """oneDNN's convolution of `x` with a weight from `prepacked_conv_weight`, plus the tensor `added` (of the
    result's size and strides) where given, then the `activation` oneDNN applies to its results ("none", "relu", or
    "hardtanh" between `bounds`; after an addition "relu" only). On fake tensors, ATen's ops: the same shapes and
    strides, and FLOPs that FlopCounterMode counts."""
    if _torch_private.is_fake(x):
        y = torch.ops.aten.convolution.default(x, packed_weight, bias, stride, padding, dilation, False, [0, 0], groups)
        if added is not None:
            y = y + added
        if activation == "relu":
            return y.relu()
        return y.clamp(*bounds) if activation == "hardtanh" else y
    ops = _torch_private.onednn_convolution_ops()
    if added is None:
        return ops.convolve(x, packed_weight, bias, padding, stride, dilation, groups, activation, list(bounds), "")
    return ops.convolve_add(x, added, packed_weight, bias, padding, stride, dilation, groups, "add", None,
                            None if activation == "none" else activation, list(bounds), "")


@graph_function(name="onednn_conv2d_add_", mutates=True, saves=lambda node: 0)
def onednn_conv2d_add_(added, x, packed_weight, bias, padding: list[int], stride: list[int], dilation: list[int],
                       groups: int, activation: str = "none", bounds: tuple[float, ...] = ()):
    """`onednn_conv2d(x, ..., added=added)` written into `added` (oneDNN's in-place sum), which it returns: no new
    tensor for the result. An inference helper: it keeps nothing for a backward."""
    if _torch_private.is_fake(x):
        return added.copy_(onednn_conv2d(x, packed_weight, bias, padding, stride, dilation, groups, activation,
                                         bounds, added))
    return _torch_private.onednn_convolution_ops().convolve_add_(
        added, x, packed_weight, bias, padding, stride, dilation, groups, "add", None,
        None if activation == "none" else activation, list(bounds), "")


# Activations oneDNN runs inside its convolution (fxopt.analysis.activations' kinds): oneDNN's name for each, and its
# bounds (None: the op's own `min_val` and `max_val`). After an addition, oneDNN runs "relu" alone.
_FUSABLE = {"relu": ("relu", ()), "relu6": ("hardtanh", (0.0, 6.0)), "hardtanh": ("hardtanh", None)}
_ADDITIONS = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)
# Effects of a node between a convolution and the addition it takes in that forbid moving the convolution down to the
# addition: they may write a tensor the convolution reads
_WRITES = frozenset({MUTATION, STATS, OPAQUE})


@dataclasses.dataclass
class _Epilogue:
    """What oneDNN runs inside a convolution after it: an addition of `added`, then `activation` within `bounds`;
    `nodes` are the graph nodes this replaces (the last one gives the result)."""

    nodes: list[fx.Node] = dataclasses.field(default_factory=list)
    added: fx.Node | None = None
    activation: str = "none"
    bounds: tuple[float, ...] = ()


def _sole_reader(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _fusable_activation(node: fx.Node, kinds=tuple(_FUSABLE)) -> tuple[fx.Node, str, tuple[float, ...]] | None:
    """The activation of one of `kinds` that alone reads `node`'s output, with oneDNN's name for it and its bounds;
    None if none."""
    reader = _sole_reader(node)
    activation = match_activation(reader) if reader is not None else None
    if activation is None or activation.kind not in kinds or activation.input is not node:
        return None
    post_op, bounds = _FUSABLE[activation.kind]
    if bounds is None:
        bounds = (activation.params["min_val"], activation.params["max_val"])
        if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds):
            return None  # computed in the graph
    return activation.node, post_op, tuple(float(b) for b in bounds)


def _fusable_addition(conv: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node, fx.Node] | None:
    """The addition that alone reads `conv`'s output, and the tensor it adds, where oneDNN can add it inside the
    convolution and give eager's values and strides; None if none.

    oneDNN adds a tensor of the output's size and layout, with alpha 1 (IEEE addition is commutative, so either
    operand may be the convolution); `x += conv` writes into the other tensor and is left alone. The fused op runs
    where the addition is, so nothing between the two may write a tensor the convolution reads."""
    add = _sole_reader(conv)
    if add is None or add.op != "call_function" or add.target not in _ADDITIONS:
        return None
    bound = _torch_private.bind_aten_arguments(add.target, add.args, add.kwargs)
    if bound.get("alpha", 1) != 1 or (add.target is torch.ops.aten.add_.Tensor and bound["self"] is not conv):
        return None
    other = bound["other"] if bound["self"] is conv else bound["self"]
    out, added, total = tensor_meta(conv), tensor_meta(other) if isinstance(other, fx.Node) else None, tensor_meta(add)
    if other is conv or added is None or total is None or not all(
            t.shape == out.shape and t.dtype == out.dtype and t.device == out.device
            and t.is_contiguous(memory_format=torch.channels_last) for t in (added, total)):
        return None
    node = conv.next
    while node is not add:
        if effects(node, gm) & _WRITES:
            return None
        node = node.next
    return add, other


def _epilogue(conv: fx.Node, gm: fx.GraphModule) -> _Epilogue:
    """The nodes after `conv` that oneDNN can run inside it (module docstring)."""
    addition = _fusable_addition(conv, gm)
    if addition is None:
        activation = _fusable_activation(conv)
        return _Epilogue([activation[0]], None, *activation[1:]) if activation else _Epilogue()
    add, other = addition
    activation = _fusable_activation(add, kinds=("relu",))
    if activation is None:
        return _Epilogue([add], other)
    return _Epilogue([add, activation[0]], other, *activation[1:])


def _pair(value) -> list[int]:
    return [value] * 2 if isinstance(value, int) else list(value)


def _explicit_padding(conv: ConvCall) -> list[int] | None:
    """The convolution's padding as two widths: 'valid' is none, 'same' (stride 1) half the dilated kernel where that
    is even on both sides; None for a 'same' oneDNN's symmetric padding cannot give."""
    padding, weight = conv.padding, tensor_meta(conv.weight)
    if padding == "valid":
        return [0, 0]
    if padding != "same":
        return _pair(padding)
    if weight is None:
        return None
    spans = [d * (k - 1) for d, k in zip(_pair(conv.dilation), weight.shape[2:])]
    return [span // 2 for span in spans] if all(span % 2 == 0 for span in spans) else None


def _refusal(conv: ConvCall, constant_inputs: frozenset[str]) -> str:
    x = tensor_meta(conv.input)
    if x is None or x.device.type != "cpu" or x.dtype != torch.float32 or _torch_private.onednn_convolution_ops() is None:
        return "not_float32_cpu"
    if conv.spatial_dims != 2 or conv.transposed or _explicit_padding(conv) is None:
        return "unsupported_conv"
    if not all(computed_from_state(t, constant_inputs) for t in (conv.weight, conv.bias) if t is not None):
        return "weight_not_constant"
    out = tensor_meta(conv.node)
    if not (x.is_contiguous(memory_format=torch.channels_last) and out is not None
            and out.is_contiguous(memory_format=torch.channels_last)):
        return "not_channels_last"
    return ""


_DETAILS = {
    "not_channels_last": "its input is not channels-last: oneDNN's convolution would return other strides than ATen's",
    "weight_not_constant": "its weight or bias is not computed from parameters and buffers alone",
    "not_float32_cpu": "its input is not a float32 CPU tensor, or this torch has no oneDNN",
    "unsupported_conv": "a transposed or not 2-D convolution, or padding='same' wider on one side",
}


def _prepack(graph: fx.Graph, conv: ConvCall, epilogue: _Epilogue) -> fx.Node:
    """`conv` replaced by oneDNN's convolution on its reordered weight, with the `epilogue` run inside it and taken
    out of the graph."""
    stride, dilation, padding = _pair(conv.stride), _pair(conv.dilation), _explicit_padding(conv)
    sizes = [int(s) if isinstance(s, int) else None for s in tensor_meta(conv.input).shape]
    with graph.inserting_before(conv.node):
        weight = graph.call_function(prepacked_conv_weight, (conv.weight, padding, stride, dilation, conv.groups,
                                                             None if None in sizes else sizes))
    with graph.inserting_before(epilogue.nodes[0] if epilogue.added is not None else conv.node):
        packed = graph.call_function(onednn_conv2d, (conv.input, weight, conv.bias, padding, stride, dilation,
                                                     conv.groups, epilogue.activation, epilogue.bounds,
                                                     epilogue.added))
    weight.meta["val"] = tensor_meta(conv.weight)  # its shape; the values take oneDNN's layout at run time
    replaced = [conv.node, *epilogue.nodes]
    packed.meta.update(conv.node.meta)
    packed.meta["val"] = replaced[-1].meta.get("val")
    replaced[-1].replace_all_uses_with(packed)
    for node in reversed(replaced):
        graph.erase_node(node)
    return packed


class PrepackConvWeights(Pass):
    name = "prepack_conv_weights"
    summary = "Reorder CPU convolution weights into oneDNN's layout once, not on every call (inference)."
    modes = (INFERENCE,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        if ctx.aot_autograd_next:
            result.skipped = "under torch.compile Inductor's freezing packs the weights itself"
            return result
        prepack_convolutions(gm, ctx.constant_inputs, result)
        return result


def prepack_convolutions(gm: fx.GraphModule, constant_inputs: frozenset[str],
                         result: PassResult | None = None) -> fx.GraphModule:
    """The rewrite (module docstring) on `gm`, each site recorded in `result`; `gm`, recompiled if it changed.
    `channels_last` also calls it, on a copy, to time the graph as this pass will leave it."""
    result = result if result is not None else PassResult()
    for node in list(gm.graph.nodes):
        conv = match_conv(node)  # matched here, not up front: a fusion before it may have replaced its input
        if conv is None:
            continue
        reason = _refusal(conv, constant_inputs)
        if reason:
            result.record("refused", node, reason, f"{site_name(node)}: {_DETAILS[reason]}")
            continue
        result.record("prepacked", node, detail=f"{site_name(node)}: weight reordered for oneDNN, once frozen")
        epilogue = _epilogue(node, gm)
        for fused in epilogue.nodes:
            result.record("fused", fused, detail=f"{site_name(fused)}: {op_name(fused)} runs inside "
                                                 f"{site_name(node)}'s oneDNN convolution")
        _prepack(gm.graph, conv, epilogue)
    _sum_in_place(gm, result)
    if result.changed:
        gm.recompile()
    return gm


def _sum_in_place(gm: fx.GraphModule, result: PassResult) -> None:
    """Each fused addition whose added tensor nothing reads afterwards written into that tensor's memory, as
    Inductor does: a new output of an activation's size costs the allocator fresh pages on every call (ResNet-50's
    16 additions at batch 4: about 2 ms a call). Not where the tensor, or anything sharing its storage, is a graph
    input, a parameter or buffer, an output, read after the convolution, or read by it (its input)."""
    aliases = AliasInfo(gm)
    for node in list(gm.graph.nodes):
        if node.target is not onednn_conv2d:
            continue
        x, *settings, added = node.args  # as `_prepack` gives them: every argument, `added` last
        if added is None:
            continue
        sharing = aliases.aliases(added)
        if (x in sharing or has_internal_overlap(added)
                or any(a.op in ("placeholder", "get_attr") or aliases.value_reads_after(a, node) for a in sharing)):
            continue
        with gm.graph.inserting_before(node):
            in_place = gm.graph.call_function(onednn_conv2d_add_, (added, x, *settings))
        in_place.meta.update(node.meta)
        node.replace_all_uses_with(in_place)
        gm.graph.erase_node(node)
        aliases.replaced(node, in_place)
        aliases.merge(in_place, added)
        result.record("summed_in_place", in_place, detail=f"{site_name(in_place)}: the sum is written into "
                                                         f"{added.name}'s memory, which nothing reads after")
