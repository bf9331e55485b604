"""inplace_relu: run ReLU-family activations in place where that is proven safe, and in training
let relu keep a bool mask instead of its output where that frees memory.

What it rewrites::

    y = aten.conv2d(x);  z = aten.relu(y)      ->  y = aten.conv2d(x);  z = aten.relu_(y)
    y = bn(x);    z = relu(y) -> dropout       ->  y = bn(x);    z = relu_mask_(y)   (training: keeps y > 0 as bool)

for relu and the family relu6, hardtanh, leaky_relu, elu, hardswish, silu
(`fxopt.analysis.activations`): ATen overloads (torch.export) become their in-place overloads
(`aten.relu_`), torch functions and methods (`F.relu`, `x.relu()`) `F.<kind>(..., inplace=True)`.
Eval-mode dropouts are removed before it, by `drop_eval_dropout`. Inside a `no_grad` or `autocast`
block the same rules hold; the block's switches stay where they were captured.

Why it is safe: overwriting the activation's input with its output is invisible when nothing
else can observe the old values. The shared analyses prove that, site by site:
`fxopt.analysis.aliasing` finds every tensor that may share the input's storage (views, reshapes,
slices, in-place results), `fxopt.analysis.saved_tensors` says what each op keeps for backward.
`relu_mask` (`fxopt.passes._relu_mask`) computes the same output and bit-identical gradients.

When it refuses an in-place rewrite (reason in the report):
  unknown_op             the input may alias the result of an op fxopt does not know
  graph_input            the input is (a view of) a graph input, parameter or buffer: never mutated
  used_later             the input itself is read after the activation
  aliased                a view or other alias of the input is read after the activation, or the input
                         is an expanded view or one of several views from `chunk`/`split`/`unbind`
  producer_saves_output  (training) the op that produced the input keeps its output for backward
  saved_by_other_op      (training) another op keeps the input for backward (e.g. a `mul` reading it)
  slope_not_constant     (training) a slope/alpha the graph takes as an input (Dynamo made a float
                         that changed between calls dynamic): its sign, which decides the next rule, is unknown
  backward_needs_input   (training) hardtanh/relu6/hardswish/silu, or a negative slope/alpha:
                         in place, autograd would keep a copy of the input (or cannot differentiate)
  output_written_later   (training) leaky_relu/elu, whose in-place form keeps its OUTPUT for backward
                         (out of place they keep the input), and the model later writes that output
                         in place: backward would fail with autograd's version-counter error
In training, relu keeps a mask only where nothing else keeps its output alive; otherwise:
  mask_kept_by_other_op  another op keeps the output for backward anyway (a following conv/linear)
  mask_graph_output      the output is returned by the graph, so it stays alive anyway

Scope: this is for the eager path (`fxopt.optimize` without torch.compile). Under torch.compile,
AOTAutograd functionalizes the graph and Inductor plans buffers itself, so in-place rewrites
have no effect there; as a torch.compile backend the pass does nothing and says so.
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.activations import ActivationCall, match_activation
from ..analysis.aliasing import AliasInfo, has_internal_overlap, returns_several_views
from ..analysis.saved_tensors import is_known_op, keeps_output_only_in_place, saved_for_backward
from ..analysis.shapes import tensor_meta
from ..analysis.side_effects import MUTATION, effects
from ..op_names import op_name
from ._relu_mask import relu_mask, relu_mask_
from .base import TRAINING, Pass, PassContext, PassResult, site_name

# In place, autograd keeps a copy of the input of these (their backward needs it): nothing is saved.
_BACKWARD_NEEDS_INPUT = {"hardtanh", "relu6", "hardswish", "silu"}
_CONSTANT = ("placeholder", "get_attr")


def _describe(node: fx.Node) -> str:
    return f"{node.name} ({op_name(node) or node.target})" if node.op not in _CONSTANT else node.name


def _inplace_refusal(act: ActivationCall, gm: fx.GraphModule, aliases: AliasInfo, training: bool) -> tuple[str, str]:
    x, node = act.input, act.node
    group = aliases.aliases(x)
    unknown = [a for a in group if a.op not in (*_CONSTANT, "output") and not is_known_op(a)]
    if unknown:
        return "unknown_op", f"{x.name} may alias the result of {_describe(unknown[0])}, which fxopt does not know"
    inputs = [a for a in group if a.op in _CONSTANT]
    if inputs:
        what = "a graph input" if inputs[0].op == "placeholder" else "a parameter or buffer"
        return "graph_input", f"{x.name} is {'' if inputs[0] is x else 'a view of '}{what} ({inputs[0].name})"
    views = [a for a in group if returns_several_views(a)]
    if views or has_internal_overlap(x):
        why = f"one of several views returned by {_describe(views[0])}" if views else "an expanded view"
        return "aliased", f"{x.name} is {why}; autograd or the kernel forbids writing it in place"
    later = aliases.value_reads_after(x, node)
    if later:
        return "used_later", f"{later[0].name} reads {x.name} after {node.name}"
    for a in group:
        later = aliases.value_reads_after(a, node) if a is not x else []
        if later:
            return "aliased", f"{later[0].name} reads {a.name}, which shares storage with {x.name}, after {node.name}"
    if not training:
        return "", ""
    slopes = [act.params.get("negative_slope", 0), act.params.get("alpha", 0)]
    if not all(isinstance(s, (int, float)) for s in slopes):  # a float Dynamo made dynamic: its sign may change
        return "slope_not_constant", f"{act.kind}'s slope is a graph input (it changed between calls), its sign unknown"
    if act.kind in _BACKWARD_NEEDS_INPUT or min(slopes) < 0:
        return "backward_needs_input", f"in place, autograd would keep a copy of {x.name} for {act.kind}'s backward"
    if keeps_output_only_in_place(act.kind):
        writers = [a for a in aliases.aliases(node) if a is not node and MUTATION in effects(a, gm)]
        if writers:
            return "output_written_later", (f"{_describe(writers[0])} writes {node.name} in place, which "
                                            f"{act.kind}_ would keep for backward")
    for a in group:
        if a is not node and saved_for_backward(a).saves_output:
            return "producer_saves_output", f"{_describe(a)} keeps its output for backward"
    for a in group:
        keepers = [u for u in a.users if u is not node and a in saved_for_backward(u).saved_inputs]
        if keepers:
            return "saved_by_other_op", f"{_describe(keepers[0])} keeps {a.name} for backward"
    return "", ""


def _mask_refusal(node: fx.Node, aliases: AliasInfo) -> tuple[str, str]:
    """Why keeping a bool mask would free nothing: something else keeps relu's output alive."""
    for a in aliases.aliases(node):
        if a is not node and a.op not in _CONSTANT and saved_for_backward(a).saves_output:
            return "mask_kept_by_other_op", f"{_describe(a)} keeps {a.name} for backward"
        for user in a.users:
            if user.op == "output":
                return "mask_graph_output", f"{a.name} is returned by the graph"
            if user is not node and a in saved_for_backward(user).saved_inputs:
                return "mask_kept_by_other_op", f"{_describe(user)} keeps {a.name} for backward"
    return "", ""


def _rewrite(node: fx.Node, target, args: tuple, kwargs: dict) -> None:
    """Turn `node` into a call of `target` where it stands (users, name and position are kept)."""
    node.op, node.target = "call_function", target
    node.args, node.kwargs = args, kwargs


class InplaceReLU(Pass):
    name = "inplace_relu"
    summary = "Run ReLU-family activations in place where proven safe; in training relu keeps a bool mask."
    options = {"relu_mask": (True, "in training, relu keeps a bool mask instead of its output where that frees memory")}

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        if ctx.aot_autograd_next:
            result.skipped = "under torch.compile, AOTAutograd functionalizes in-place ops and Inductor plans buffers"
            return result
        training = ctx.mode == TRAINING
        aliases = AliasInfo(gm)
        for node in list(gm.graph.nodes):
            act = match_activation(node)
            if act is None or act.inplace or not isinstance(act.input, fx.Node):
                continue
            reason, detail = _inplace_refusal(act, gm, aliases, training)
            inplace = not reason
            if inplace:
                _rewrite(node, *act.inplace_form())
                aliases.merge(node, act.input)
                result.record("inplaced", site_name(node), detail=f"{act.kind} overwrites {act.input.name}")
            else:
                result.record("refused", site_name(node), reason, detail)
            if training and act.kind == "relu" and self.option(ctx, "relu_mask"):
                self._mask(node, act, inplace, aliases, result)
        return result

    @staticmethod
    def _mask(node: fx.Node, act: ActivationCall, inplace: bool, aliases: AliasInfo,
              result: PassResult) -> None:
        out = tensor_meta(node)
        if out is None or not out.is_floating_point():
            return
        reason, detail = _mask_refusal(node, aliases)
        if reason:
            result.record("refused", site_name(node), reason, detail)
            return
        _rewrite(node, relu_mask_ if inplace else relu_mask, (act.input,), {})
        freed = out.numel() * (out.element_size() - 1)
        result.figures["mask_saved_bytes"] = result.figures.get("mask_saved_bytes", 0) + freed
        result.record("masked", site_name(node), detail=f"keeps a bool mask: {freed} bytes less kept for backward")
