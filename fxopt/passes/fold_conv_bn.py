"""fold_conv_bn: fold an eval-mode BatchNorm into the convolution or linear layer before it.

What it rewrites::

    y = conv(x, W, b);  z = batch_norm(y, mean, var, gamma, beta, training=False, eps)
  becomes
    z = conv(x, W', b')   with  s = gamma / sqrt(var + eps),  W' = W * s (per output channel),
                                b' = (b - mean) * s + beta

for Conv1d/2d/3d, ConvTranspose1d/2d/3d (whose output channels are dim 1 of the weight,
grouped into `groups` blocks), and Linear followed by BatchNorm1d on a 2-D output; in
torch.export's ATen form (`aten.conv2d` + `aten.batch_norm(..., training=False, ...)`, what
`fxopt.optimize` captures) and the TorchDynamo form (`F.conv2d` / `torch.conv2d`, parameters as
graph inputs) alike, through `fxopt.analysis.ops`. The folded layer is emitted in the graph's
own form. A grad-mode or autocast region is a barrier: a conv inside
one and a BN outside (or the reverse) never meet, and the pairs inside keep the region's mode.

Why it is safe: an eval-mode BatchNorm with running statistics is an affine map per channel
with constant coefficients, and a convolution is linear in its weight per output channel, so
the composition is the same convolution with scaled weights; the only difference is float
rounding. Nothing is mutated: every site gets its own folded tensors, so one conv module
called at several sites (where torch.fx's `fuse` silently reuses the first fold) stays right.

Where the weights are plain constants (inference through `fxopt.optimize`: get_attr nodes)
the folded tensors are computed once and stored on the GraphModule. Otherwise (training,
parameters as graph inputs, or any graph handed on to torch.compile) the fold is emitted as graph ops
(`folded_conv_bn_params`): in training with a frozen (eval-mode) BN, gradients still reach
the conv weight and the BN affine parameters, and the BN input is no longer saved for backward
("Efficient ConvBN Blocks", arXiv 2305.11624); under torch.compile the parameters are graph
inputs, so the fold follows later parameter updates and Inductor's freezing constant-folds it.

When it refuses (reason in the report):
  conv_has_other_users  the conv output is read by something besides the BN
  bn_training           the BN normalises with batch statistics (train mode, or no running stats)
  not_constant          a weight or statistic is computed in the graph rather than a parameter/buffer
  state_written         a weight or statistic may be written by the graph itself (the same buffers
                        updated by a train-mode BN or in place): the fold would go stale, and eager
                        autograd reads an eval BN's running stats at backward time, after the write
  channel_axis_mismatch the layer's output channel is not dim 1: a conv on an unbatched input, or a
                        Linear output that is not 2-D

A BN's train/eval flag is read when the pass runs, as in torch.fx's `fuse` and Inductor's
freezing (export bakes it into `batch_norm(training=...)`). The fold records what it relies on
as guards (`fxopt.guards`): the BN's module path in eval mode (TRAIN_MODE) and, where the
folded tensors are precomputed, each weight and statistic keeping its value (SAME_VALUE, also on
the BN's `num_batches_tracked`: ATen updates the statistics in place without bumping their
versions, the module's counter `add_(1)` does); the
result re-optimizes or runs the original when one no longer holds, never a stale fold. A BN with no
such counter beside its statistics (`F.batch_norm` over a module's own buffers) is folded in the
graph instead, from the statistics as they are at each call: no guard would see a train-mode step
update them.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.ops import (BatchNormCall, ConvCall, LinearCall, is_constant, match_batch_norm, match_conv,
                            match_linear, resolve)
from ..analysis.shapes import tensor_meta
from ..analysis.written_state import state_key, written_state
from ..capture.naming import module_path
from ..graph_functions import graph_function
from ..guards import SAME_VALUE, TRAIN_MODE, Guard
from .base import Pass, PassContext, PassResult, model_name, site_name


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


def _batch_counter(gm: fx.GraphModule, running_mean) -> str | None:
    """The target of the `num_batches_tracked` buffer beside a BN's `running_mean` attribute, where `gm` has one."""
    if not (isinstance(running_mean, fx.Node) and running_mean.op == "get_attr"):
        return None
    owner, _, _ = running_mean.target.rpartition(".")
    target = f"{owner}.num_batches_tracked" if owner else "num_batches_tracked"
    try:
        gm.get_buffer(target)
    except AttributeError:
        return None
    return target


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
            # precomputed only where a guard sees the statistics change: ATen's train-mode update of them bumps no
            # version, the module's batch counter is what moves (a functional BN without one: folded in the graph)
            counter = _batch_counter(gm, bn.running_mean)
            guarded = ctx.mode == "inference" and ctx.guards_checked  # a precomputed fold is checked on every call
            precompute = guarded and counter is not None
            self._record_guards(layer, bn, precompute, counter, ctx)
            self._fold(gm, layer, bn, precompute)
            result.record("folded", site_name(node), detail=f"{site_name(layer.node)} + {site_name(node)}" + (
                ", as graph ops: no batch counter shows when its statistics change" if guarded and not precompute
                else ""))
        if result.changed and ctx.mode == "inference":
            gm.delete_all_unused_submodules()
        return result

    def _record_guards(self, layer: ConvCall | LinearCall, bn: BatchNormCall, precompute: bool, counter: str | None,
                       ctx: PassContext) -> None:
        """What the fold relies on: the BN stays in eval mode; precomputed, weights, statistics and the BN's batch
        `counter` (there is one wherever the fold is precomputed) keep their values (the counter: ATen updates the
        statistics in place without bumping their versions, the module's `add_(1)` on it does)."""
        why = f"{site_name(bn.node)} folded into {site_name(layer.node)}"
        path = module_path(bn.node)
        if path is not None:
            ctx.guards.add(Guard(TRAIN_MODE, model_name(ctx, path), False, self.name, why))
        if not precompute:
            return
        refs = (layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias)
        for ref in refs:
            if isinstance(ref, fx.Node) and ref.op == "get_attr":
                ctx.guards.add(Guard(SAME_VALUE, model_name(ctx, ref.target), None, self.name, why))
        ctx.guards.add(Guard(SAME_VALUE, model_name(ctx, counter), None, self.name,
                             f"{why}: a train-mode step updates its statistics, and counts it here"))

    def _fold(self, gm: fx.GraphModule, layer: ConvCall | LinearCall, bn: BatchNormCall, precompute: bool) -> None:
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
            real = [resolve(r, gm) for r in refs]
            if precompute and all(t is not None or r is None for t, r in zip(real, refs)):
                with torch.no_grad():
                    w, b = folded_conv_bn_params(*real, eps=bn.eps, transposed=transposed, groups=groups)
                base = site_name(bn.node).replace(".", "_")
                weight = self._store(gm, f"{base}_folded_weight", w)
                bias = self._store(gm, f"{base}_folded_bias", b)
            else:
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

    @staticmethod
    def _store(gm: fx.GraphModule, base: str, tensor: torch.Tensor) -> fx.Node:
        name, suffix = base, 0
        while hasattr(gm, name):
            suffix += 1
            name = f"{base}_{suffix}"
        gm.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
        return gm.graph.get_attr(name)
