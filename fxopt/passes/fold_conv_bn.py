"""fold_conv_bn: fold an eval-mode BatchNorm into the convolution or linear layer before it.

What it rewrites::

    y = conv(x, W, b);  z = batch_norm(y, mean, var, gamma, beta, training=False, eps)
  becomes
    z = conv(x, W', b')   with  s = gamma / sqrt(var + eps),  W' = W * s (per output channel),
                                b' = (b - mean) * s + beta

for Conv1d/2d/3d, ConvTranspose1d/2d/3d (whose output channels are dim 1 of the weight,
grouped into `groups` blocks), and Linear followed by BatchNorm1d on a 2-D output, in the ATen
form fxopt captures (`aten.conv2d` + `aten.batch_norm(..., training=False, ...)`, parameters as
graph inputs), through `fxopt.analysis.ops`. A `torch.no_grad()` or `torch.autocast` block stays as
captured (its switches are graph calls, never moved): a pair inside keeps the block's mode and dtype.

Why it is safe: an eval-mode BatchNorm with running statistics is an affine map per channel
with constant coefficients, and a convolution is linear in its weight per output channel, so
the composition is the same convolution with scaled weights; the only difference is float
rounding. Nothing is mutated: every site gets its own folded tensors, so one conv module
called at several sites (where torch.fx's `fuse` silently reuses the first fold) stays right.

The fold is emitted as graph ops (`folded_conv_bn_params`) on the weights and statistics the graph
is given, so it always follows their current values (an optimizer step, `load_state_dict`, a
train-mode step of the BN outside the graph). In training with a frozen (eval-mode) BN, gradients
still reach the conv weight and the BN affine parameters, and the BN input is no longer saved for
backward ("Efficient ConvBN Blocks", arXiv 2305.11624); under Inductor with freezing the fold is
constant-folded. The BN's train/eval flag is baked into the graph (`batch_norm(training=...)`), and
TorchDynamo guards it: `train()` compiles the graph again.

When it refuses (reason in the report):
  conv_has_other_users  the conv output is read by something besides the BN
  bn_training           the BN normalises with batch statistics (train mode, or no running stats)
  not_constant          a weight or statistic is computed in the graph rather than a parameter/buffer
  state_written         a weight or statistic may be written by the graph itself (the same buffers
                        updated by a train-mode BN or in place): the fold would go stale, and eager
                        autograd reads an eval BN's running stats at backward time, after the write
  channel_axis_mismatch the layer's output channel is not dim 1: a conv on an unbatched input, or a
                        Linear output that is not 2-D

"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.ops import (BatchNormCall, ConvCall, LinearCall, is_constant, match_batch_norm, match_conv,
                            match_linear)
from ..analysis.shapes import tensor_meta
from ..analysis.written_state import state_key, written_state
from ..graph_functions import graph_function
from .base import Pass, PassContext, PassResult, site_name


@graph_function
def folded_conv_bn_params(weight, bias, running_mean, running_var, bn_weight, bn_bias, eps: float,
                          transposed: bool = False, groups: int = 1):
    """(weight, bias) of the single conv/linear that computes `conv -> batch_norm(eval)`."""
    scale = torch.rsqrt(running_var + eps)
    if bn_weight is not None:
        scale = scale * bn_weight
    shift = -running_mean * scale if bias is None else (bias - running_mean) * scale
    if bn_bias is not None:
        shift = shift + bn_bias
    ones = [1] * (weight.dim() - 2)
    if transposed:  # weight is (C_in, C_out // groups, *k); output channel = g * (C_out // groups) + j
        c_in, c_out_per_group = weight.shape[:2]
        grouped = weight.reshape(groups, c_in // groups, c_out_per_group, *weight.shape[2:])
        folded = (grouped * scale.reshape(groups, 1, c_out_per_group, *ones)).reshape(weight.shape)
    else:
        folded = weight * scale.reshape(-1, 1, *ones)
    return folded.to(weight.dtype), shift.to(weight.dtype)


def _refusal(gm: fx.GraphModule, layer: ConvCall | LinearCall, bn: BatchNormCall, ctx: PassContext,
             written: set) -> tuple[str, str]:
    """(reason, detail) for leaving this layer + BN pair as it is, or ("", "") to fold it."""
    if len(layer.node.users) > 1:
        users = ", ".join(site_name(u) for u in layer.node.users if u is not bn.node)
        return "conv_has_other_users", f"{site_name(layer.node)} is also read by {users}"
    if not bn.uses_running_stats:
        return "bn_training", "BatchNorm uses batch statistics (train mode or no running stats)"
    refs = (layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias)
    if not all(is_constant(r, ctx.constant_inputs) for r in refs):
        return "not_constant", "a weight or statistic is computed in the graph"
    if any(r is not None and state_key(r, gm) in written for r in refs):
        return "state_written", "a weight or statistic is also written by the graph (train-mode BN, in-place op)"
    batched_dims = layer.spatial_dims + 2 if isinstance(layer, ConvCall) else 2
    out = tensor_meta(layer.node)
    if out is None or out.dim() != batched_dims:
        return "channel_axis_mismatch", (f"{layer.node.name} output is not {batched_dims}-D (batch, channels, ...), "
                                         "so BatchNorm's channel axis is not its output channel")
    return "", ""


class FoldConvBN(Pass):
    name = "fold_conv_bn"
    summary = "Fold eval-mode BatchNorm into the preceding conv/linear (on the fly when training)."

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        written = written_state(gm)
        for node in list(gm.graph.nodes):
            bn = match_batch_norm(node)
            if bn is None or not isinstance(bn.input, fx.Node):
                continue
            layer = match_conv(bn.input) or match_linear(bn.input)
            if layer is None:
                continue
            reason, detail = _refusal(gm, layer, bn, ctx, written)
            if reason:
                result.record("refused", site_name(node), reason, detail)
                continue
            self._fold(gm, layer, bn)
            result.record("folded", site_name(node), detail=f"{site_name(layer.node)} + {site_name(node)}")
        if result.changed and ctx.mode == "inference":
            gm.delete_all_unused_submodules()
        return result

    def _fold(self, gm: fx.GraphModule, layer: ConvCall | LinearCall, bn: BatchNormCall) -> None:
        transposed = getattr(layer, "transposed", False)
        groups = getattr(layer, "groups", 1)
        refs = (layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias)
        graph = gm.graph
        # The folded layer runs where the layer ran, not where the BN ran: the layer's input may be written in
        # place in between (fuzz seed 59745474, a conv -> BN -> BN chain folded twice).
        order = {n: i for i, n in enumerate(graph.nodes)}
        for ref in refs:
            if isinstance(ref, fx.Node) and ref.op == "get_attr" and order[ref] > order[layer.node]:
                layer.node.prepend(ref)
        with graph.inserting_before(layer.node):
            kwargs = {"eps": bn.eps, "transposed": transposed, "groups": groups}
            folded = graph.call_function(folded_conv_bn_params, refs, kwargs)
            weight = graph.call_function(operator.getitem, (folded, 0))
            bias = graph.call_function(operator.getitem, (folded, 1))
            new = graph.call_function(*layer.call_with(weight, bias))
        new.meta.update(bn.node.meta)
        bn.node.replace_all_uses_with(new)
        graph.erase_node(bn.node)
        graph.erase_node(layer.node)
        for ref in refs:  # get_attr nodes that only fed the old pair
            if isinstance(ref, fx.Node) and ref.op == "get_attr" and not ref.users:
                graph.erase_node(ref)
