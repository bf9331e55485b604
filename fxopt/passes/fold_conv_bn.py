"""fold_conv_bn: fold an eval-mode BatchNorm into the convolution or linear layer before it.

What it rewrites::

    y = conv(x, W, b);  z = batch_norm(y, mean, var, gamma, beta, training=False, eps)
  becomes
    z = conv(x, W', b')   with  s = gamma / sqrt(var + eps),  W' = W * s (per output channel),
                                b' = (b - mean) * s + beta

for Conv1d/2d/3d, ConvTranspose1d/2d/3d (whose output channels are dim 1 of the weight,
grouped into `groups` blocks), and Linear followed by BatchNorm1d on a 2-D output; in the
`call_module`, functional (`F.conv2d` + `F.batch_norm`) and TorchDynamo (parameters as graph
inputs) forms alike, through `fxopt.analysis.ops`.

Why it is safe: an eval-mode BatchNorm with running statistics is an affine map per channel
with constant coefficients, and a convolution is linear in its weight per output channel, so
the composition is the same convolution with scaled weights; the only difference is float
rounding. Nothing is mutated: every site gets its own folded tensors, so one conv module
called at several sites (where torch.fx's `fuse` silently reuses the first fold) stays right.

Where the weights are plain constants (inference, module form) the folded tensors are computed
once and stored on the GraphModule. Otherwise the fold is emitted as graph ops
(`folded_conv_bn_params`): in training with a frozen (eval-mode) BN, gradients still reach
the conv weight and the BN affine parameters, and the BN input is no longer saved for backward
("Efficient ConvBN Blocks", arXiv 2305.11624); under torch.compile the parameters are graph
inputs, so the fold follows later parameter updates and Inductor's freezing constant-folds it.

When it refuses (reason in the report):
  conv_has_other_users  the conv output is read by something besides the BN
  bn_training           the BN normalises with batch statistics (train mode, or no running stats)
  not_constant          a weight or statistic is computed in the graph rather than a parameter/buffer
  unsupported_conv      padding_mode other than zeros, or ConvTranspose called with output_size
  channel_axis_mismatch Linear output that is not 2-D, so BN's channel is not the feature axis
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.ops import (BatchNormCall, ConvCall, LinearCall, is_constant, match_batch_norm, match_conv,
                            match_linear, materialize, resolve)
from ..analysis.shapes import tensor_meta
from .base import Pass, PassContext, PassResult


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


def _refusal(layer: ConvCall | LinearCall, bn: BatchNormCall, ctx: PassContext) -> tuple[str, str]:
    if isinstance(layer, ConvCall) and layer.unsupported:
        return "unsupported_conv", layer.unsupported
    if len(layer.node.users) > 1:
        users = ", ".join(u.name for u in layer.node.users if u is not bn.node)
        return "conv_has_other_users", f"{layer.node.name} is also read by {users}"
    if bn.training is not False:
        return "bn_training", "BatchNorm uses batch statistics (train mode or no running stats)"
    refs = (layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias)
    if not all(is_constant(r, ctx.constant_inputs) for r in refs):
        return "not_constant", "a weight or statistic is computed in the graph"
    if isinstance(layer, LinearCall):
        out = tensor_meta(layer.node)
        if out is None or out.dim() != 2:
            return "channel_axis_mismatch", "BatchNorm after Linear folds only on a 2-D (batch, features) output"
    return "", ""


class FoldConvBN(Pass):
    name = "fold_conv_bn"
    summary = "Fold eval-mode BatchNorm into the preceding conv/linear (on the fly when training)."

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        for node in list(gm.graph.nodes):
            bn = match_batch_norm(node, gm)
            if bn is None or not isinstance(bn.input, fx.Node):
                continue
            layer = match_conv(bn.input, gm) or match_linear(bn.input, gm)
            if layer is None:
                continue
            reason, detail = _refusal(layer, bn, ctx)
            if reason:
                result.record("refused", node, reason, detail)
                continue
            self._fold(gm, layer, bn, precompute=ctx.mode == "inference")
            result.record("folded", node, detail=f"{layer.node.name} + {node.name}")
        if result.changed and ctx.mode == "inference":
            gm.delete_all_unused_submodules()
        return result

    def _fold(self, gm: fx.GraphModule, layer: ConvCall | LinearCall, bn: BatchNormCall, precompute: bool) -> None:
        transposed = getattr(layer, "transposed", False)
        groups = getattr(layer, "groups", 1)
        refs = (layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias)
        graph = gm.graph
        with graph.inserting_before(bn.node):
            real = [resolve(r, gm) for r in refs]
            if precompute and all(t is not None or r is None for t, r in zip(real, refs)):
                with torch.no_grad():
                    w, b = folded_conv_bn_params(*real, eps=bn.eps, transposed=transposed, groups=groups)
                weight = self._store(gm, f"{bn.node.name}_folded_weight", w)
                bias = self._store(gm, f"{bn.node.name}_folded_bias", b)
            else:
                args = tuple(materialize(r, gm) for r in refs)
                folded = graph.call_function(folded_conv_bn_params, args,
                                             {"eps": bn.eps, "transposed": transposed, "groups": groups})
                weight = graph.call_function(operator.getitem, (folded, 0))
                bias = graph.call_function(operator.getitem, (folded, 1))
            if isinstance(layer, ConvCall):
                new = graph.call_function(layer.function, layer.functional_args(layer.input, weight, bias))
            else:
                new = graph.call_function(torch.nn.functional.linear, (layer.input, weight, bias))
        new.meta.update(bn.node.meta)
        bn.node.replace_all_uses_with(new)
        graph.erase_node(bn.node)
        graph.erase_node(layer.node)
        for ref in refs:  # get_attr nodes that only fed the old pair
            if isinstance(ref, fx.Node) and ref.op == "get_attr" and not ref.users:
                graph.erase_node(ref)

    @staticmethod
    def _store(gm: fx.GraphModule, name: str, tensor: torch.Tensor) -> fx.Node:
        gm.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
        return gm.graph.get_attr(name)
