"""channels_last: run an inference graph's convolutions on channels-last (NHWC) activations.

What it rewrites::

    y = aten.conv2d(x, w)                      ->  x_cl = aten.clone(x, memory_format=torch.channels_last)
    ... convs, norms, pointwise ops ...            y = aten.conv2d(x_cl, w)        (NHWC strides from here on)
    return y                                       ... the same ops ...
                                                   return aten.clone(y, memory_format=torch.contiguous_format)

A 4-D image input that reaches a convolution is copied once into channels-last order. The ops in
`LAYOUT_FREE_OPS` and every pointwise op then take and give NHWC strides on their own (oneDNN and
cuDNN convolutions are faster on them; on this project's CPU, 6-10% of a CNN's forward). Where a
tensor leaves that set of ops (another op, a graph output) it is copied back to the strides eager
gives it, so every other op and the caller see exactly eager's layout. Weights are not touched.

Why it is safe: the ops of `LAYOUT_FREE_OPS` and pointwise ops compute the same values whatever
their inputs' strides; only the order of floating-point sums inside a convolution may differ, as
with any other kernel choice. The new strides are not assumed but propagated on fake tensors, and
every boundary is checked against eager's strides after the rewrite.

When it does nothing (reason in the report):
  no_image_input      no 4-D floating-point input reaches a convolution through those ops in NCHW
                      order (a graph this pass rewrote already reads it through its channels-last copy)
  input_aliased       the input, or a view of it, is written in place or returned: the copy would
                      hide that write or that alias from the caller
  layout_not_restored a tensor leaving the rewritten ops has strides in eager that are not contiguous,
                      so a copy cannot give them back, or it (or a view of it) is written in place,
                      so a copy would take the write or hide it (the graph is left as it was)
  not_faster          the rewritten graph, timed against the original on real inputs of the example's
                      shapes (fxopt.analysis.op_times.graph_seconds), is not faster: the copies cost
                      more than the convolutions gain (a single small convolution before a flatten).
                      Where `prepack_conv_weights` runs later, both are timed as they will run: the
                      rewritten graph's convolutions prepacked, and both frozen (weights reordered and
                      folded once), since only channels-last convolutions can skip oneDNN's reorder.
                      Option `channels_last="always"` keeps the rewrite regardless.
In training mode and under torch.compile (Inductor picks layouts itself) it does not run.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private
from ..analysis.aliasing import AliasInfo
from ..analysis.op_times import graph_seconds
from ..analysis.shapes import FakeRerun, tensor_meta
from ..analysis.side_effects import MUTATION, effects
from ..model_copy import graph_module_copy, graph_snapshot
from ..op_names import op_name
from .base import INFERENCE, Pass, PassContext, PassResult
from .prepack_conv_weights import PrepackConvWeights, prepack_convolutions

# Non-pointwise ops whose values do not depend on their inputs' strides, and which pass NHWC on.
LAYOUT_FREE_OPS = frozenset({
    "conv2d", "convolution", "batch_norm", "_native_batch_norm_legit_no_training", "layer_norm", "group_norm",
    "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "mean", "permute", "linear", "pad", "constant_pad_nd",
})
_CONVOLUTIONS = frozenset({"conv2d", "convolution"})


def _layout_free(node: fx.Node) -> bool:
    """A pointwise op (in place too: it keeps its input's strides) or one of `LAYOUT_FREE_OPS`."""
    if node.op != "call_function":
        return False
    return _torch_private.op_is_pointwise(node.target) or (
        op_name(node) in LAYOUT_FREE_OPS and not _torch_private.op_is_mutable(node.target))


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides wherever they matter (a dimension of size 1 has no stride that can be observed)."""
    return a.shape == b.shape and all(size == 1 or x == y for size, x, y in zip(a.shape, a.stride(), b.stride()))


def _is_channels_last(node: fx.Node) -> bool:
    val = tensor_meta(node)
    return val is not None and val.dim() == 4 and val.is_contiguous(memory_format=torch.channels_last) \
        and not val.is_contiguous()


def _reaches_convolution(node: fx.Node) -> bool:
    """Whether `node` reaches a convolution through layout-free ops whose outputs are not channels-last already."""
    seen, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user not in seen and _layout_free(user) and not _is_channels_last(user):
                if op_name(user) in _CONVOLUTIONS:
                    return True
                seen.add(user)
                todo.append(user)
    return False


def _image_inputs(gm: fx.GraphModule, ctx: PassContext) -> list[fx.Node]:
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = tensor_meta(node)
        if (node.name not in ctx.constant_inputs and val is not None and val.dim() == 4
                and val.is_floating_point() and val.is_contiguous() and _reaches_convolution(node)):
            inputs.append(node)
    return inputs


def _written_or_returned(node: fx.Node, aliases: AliasInfo) -> bool:
    returned = {n for out in node.graph.find_nodes(op="output") for n in out.all_input_nodes}
    return any(n in returned or _writes(n) for n in aliases.aliases(node))


def _writes(node: fx.Node) -> bool:
    return MUTATION in effects(node, node.graph.owning_module)


def _fake_mode(gm: fx.GraphModule):
    """The fake mode of the placeholders' values (None where shapes came from a real run instead)."""
    return _torch_private.detect_fake_mode([n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")])


def _propagate_and_restore(gm: fx.GraphModule, eager_values: dict, added: list[fx.Node],
                           aliases: AliasInfo) -> fx.Node | None:
    """Run the graph on fake tensors in order; before each op outside the layout-free ones (and the output),
    copy an input whose strides now differ from eager's back to eager's contiguous strides, appending the
    copies to `added`. Returns the first tensor whose eager strides cannot be given back, if any: not
    contiguous in eager, or a tensor that it or one of its aliases (`aliases`, of the graph before the
    rewrite) is written in place, where the copy's reader would no longer see the write (or take it).

    Nodes none of whose inputs changed strides keep their value (as `update_shapes` would)."""
    copies: dict[fx.Node, fx.Node] = {}
    with FakeRerun(gm, _fake_mode(gm)) as rerun:
        rerun.changed.update(added)
        for node in list(gm.graph.nodes):
            if node.op == "placeholder":
                continue
            if not _layout_free(node) and node not in added:
                for value in node.all_input_nodes:
                    now, eager = tensor_meta(value), eager_values.get(value)
                    if now is None or eager is None or _same_layout(now, eager):
                        continue
                    if _writes(node) or not eager.is_contiguous() or any(map(_writes, aliases.aliases(value))):
                        return value  # a copy would take a write, or hide one from this reader
                    if value not in copies:
                        with gm.graph.inserting_before(node):
                            copies[value] = gm.graph.call_function(
                                torch.ops.aten.clone.default, (value,), {"memory_format": torch.contiguous_format})
                        rerun.run(copies[value])
                        added.append(copies[value])
                    node.replace_input_with(value, copies[value])
            if node.op == "output":
                break
            if node in rerun.changed or rerun.input_changed(node):
                try:
                    rerun.run(node)
                except Exception:  # noqa: BLE001 - an op that cannot take the new strides (a view)
                    return node
                if tensor_meta(node) is None or eager_values.get(node) is None \
                        or not _same_layout(tensor_meta(node), eager_values[node]):
                    rerun.changed.add(node)
    return None


class ChannelsLast(Pass):
    name = "channels_last"
    summary = "Run convolutions on channels-last activations (inference); every other op sees eager's strides."
    modes = (INFERENCE,)
    options = {"channels_last": ("when_faster", "'when_faster': keep the rewrite only if the graph runs faster so on "
                                                "inputs of the example's shapes (timed); 'always': keep it",
                                 ("when_faster", "always"))}

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        if ctx.aot_autograd_next:
            result.skipped = "under torch.compile Inductor chooses memory layouts itself"
            return result
        aliases = AliasInfo(gm)
        inputs = []
        for node in _image_inputs(gm, ctx):
            if _written_or_returned(node, aliases):
                result.record("refused", node, "input_aliased",
                              "the input or a view of it is written in place or returned by the graph")
            else:
                inputs.append(node)
        if not inputs:
            if not result.sites:
                result.skipped = "no 4-D floating-point input reaches a convolution in NCHW order"
            return result
        if _fake_mode(gm) is None:
            result.skipped = "the graph's shapes come from a real run, not fake tensors that can be run again"
            return result
        original = graph_snapshot(gm) if self.option(ctx, "channels_last") == "when_faster" else None
        eager_values = {n: tensor_meta(n) for n in gm.graph.nodes}
        eager_meta = {n: n.meta.get("val") for n in gm.graph.nodes}
        added = [self._convert_input(gm.graph, node) for node in inputs]
        wrong = _propagate_and_restore(gm, eager_values, added, aliases)
        if wrong is not None:
            _undo(gm, added, eager_meta)
            result.record("refused", wrong, "layout_not_restored",
                          "eager gives this tensor strides a copy cannot give back, or an op writes into it in place")
            return result
        if original is not None:
            gm.recompile()
            seconds = _seconds_as_they_will_run(original, gm, ctx)
            if seconds is not None:
                result.figures["forward_ms"] = {"before": round(seconds[0] * 1e3, 3), "after": round(seconds[1] * 1e3, 3)}
                if seconds[1] >= seconds[0]:
                    _undo(gm, added, eager_meta)
                    gm.recompile()  # the code timed was the rewrite's
                    for node in inputs:
                        result.record("refused", node, "not_faster", f"timed on the example's shapes: "
                                      f"{seconds[1] * 1e3:.3f} ms per forward converted, {seconds[0] * 1e3:.3f} ms as it was")
                    return result
        for node in inputs:
            result.record("converted", node, detail="copied once to channels-last; convolutions read NHWC from here")
        result.figures["copies_back"] = len(added) - len(inputs)
        return result

    @staticmethod
    def _convert_input(graph: fx.Graph, node: fx.Node) -> fx.Node:
        with graph.inserting_after(node):
            copy = graph.call_function(torch.ops.aten.clone.default, (node,), {"memory_format": torch.channels_last})
        node.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy and _layout_free(user))
        return copy


def _seconds_as_they_will_run(original: fx.GraphModule, converted: fx.GraphModule,
                              ctx: PassContext) -> list[float] | None:
    """Both graphs timed as they will run: where `prepack_conv_weights` follows (on the eager path), the converted
    graph's channels-last convolutions prepacked, and both frozen, their weights' reorders and folds made once. The
    original, whose convolutions read NCHW, pays oneDNN's weight reorder inside each one, as ATen does."""
    if PrepackConvWeights.name not in ctx.later_passes:
        return graph_seconds([original, converted])
    prepacked = prepack_convolutions(graph_module_copy(converted), ctx.constant_inputs)
    return graph_seconds([original, prepacked], frozen=ctx.constant_inputs)


def _undo(gm: fx.GraphModule, added: list[fx.Node], eager_meta: dict) -> None:
    """Take the copies out again and give every node back its value from before the rewrite."""
    for node in reversed(added):
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    for node, val in eager_meta.items():
        node.meta["val"] = val
