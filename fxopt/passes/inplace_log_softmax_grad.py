"""inplace_log_softmax_grad: a cross-entropy's log-softmax writes its input's gradient over the loss's gradient.

What it rewrites (a cross-entropy with class indices; or a log-softmax whose one reader is a negative
log-likelihood)::

    loss = aten.cross_entropy_loss(logits, labels, w, r, i)  ->  lp = log_softmax_grad_in_place(logits, 1)
                                                                 loss = aten.nll_loss_nd(lp, labels, w, r, i)
    lp = aten.log_softmax.int(logits, -1)                    ->  lp = log_softmax_grad_in_place(logits, -1)
    loss = aten.nll_loss_nd(lp, labels, ...)                     (kept)

In backward, eager holds three tensors the size of the logits at once: the log-probabilities the log-softmax saved,
the loss's gradient of them, and the log-softmax's new gradient of the logits. Over a language model's vocabulary
that is the step's peak (GPT-2 small, 8 x 100 tokens: 161 MB each), and no checkpoint lowers it. The helper
(fxopt.passes._log_softmax_grad) writes the logits' gradient over the loss's gradient: two tensors. Run before
checkpoint_activations, whose memory model prices the shared gradient (fxopt.checkpointing.profile).

Why it is safe: a cross-entropy with class indices and no label smoothing is, in ATen, exactly `_log_softmax` over
the class dimension then `nll_loss_nd`; the rewrite calls those same kernels, and the helper's backward ATen's
same backward kernel, whose result it writes over a gradient only it holds: the log-probabilities' one reader is
the negative log-likelihood, whose backward makes that gradient new. Values, gradients and double backward are
eager's bit for bit (tests/test_inplace_log_softmax_grad.py).

When it refuses (reason in the report):
  log_probs_read_elsewhere  the log-probabilities are read by another op or are an output of the graph: their
                            gradient may be shared
  class_dim_not_last        the classes are not the last dimension ((N, C, L) inputs): another kernel, not checked
  label_smoothing           a cross-entropy with label smoothing (other ops, each with its own gradient)
  probability_targets       a cross-entropy against class probabilities (likewise)
  other_dtype               the log-softmax converts its input's dtype, or works in a dtype other than float32 or
                            float64 (reduced precision computes in float: not checked bit for bit)
  not_cpu                   the logits are not on the CPU: checked bit for bit against CPU kernels only
  not_a_plain_tensor        the logits are a tensor subclass (DTensor), not strided, or of no known value
It does nothing in inference mode, where the logits need no gradient, or where AOTAutograd takes the graph next
(torch.compile: it plans its own backward).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private
from ..analysis.shapes import tensor_meta
from ..op_names import call_arguments
from ._log_softmax_grad import log_softmax_grad_in_place
from .base import TRAINING, Pass, PassContext, PassResult, eager_backward_facts, site_name

_aten = torch.ops.aten
_CROSS_ENTROPY = _aten.cross_entropy_loss.default
_LOG_SOFTMAX = (_aten.log_softmax.int, _aten._log_softmax.default)
_NLL_LOSS = (_aten.nll_loss_nd.default, _aten.nll_loss.default, _aten.nll_loss_forward.default)
_CHECKED_DTYPES = (torch.float32, torch.float64)


class InplaceLogSoftmaxGrad(Pass):
    name = "inplace_log_softmax_grad"
    summary = "A cross-entropy's log-softmax writes the logits' gradient over the loss's gradient: one less tensor."
    modes = (TRAINING,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        facts = eager_backward_facts(gm, ctx, result)
        if facts is None:
            return result
        outputs, needs = facts
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in (_CROSS_ENTROPY, *_LOG_SOFTMAX):
                continue
            arguments = call_arguments(node)
            logits = arguments["input"]
            if not (isinstance(logits, fx.Node) and needs.recorded(node) and logits in needs.requires_grad):
                continue
            reason = (_cross_entropy_refusal(arguments) if node.target is _CROSS_ENTROPY
                      else _log_softmax_refusal(node, arguments, outputs))
            if reason:
                result.record("refused", site_name(node), reason, f"the gradient of {logits.name} stays beside "
                                                                   f"the loss's ({node.name})")
                continue
            _rewrite(gm, node, arguments)
            value = tensor_meta(logits)
            result.record("in_place", site_name(node), detail=f"{logits.name}'s gradient written over the loss's: "
                                                               f"{value.numel() * value.element_size() / 1e6:.2f} MB "
                                                               f"less in backward")
        if result.changed:
            gm.recompile()
        return result


def _class_dim(logits: fx.Node) -> int:
    return 0 if tensor_meta(logits).dim() == 1 else 1


def _common_refusal(logits: fx.Node, dim: int) -> str:
    value = tensor_meta(logits)
    if value is None or _torch_private.is_tensor_subclass(value) or value.layout != torch.strided:
        return "not_a_plain_tensor"
    if value.dtype not in _CHECKED_DTYPES:
        return "other_dtype"
    if value.device.type != "cpu":
        return "not_cpu"
    if dim % max(value.dim(), 1) != value.dim() - 1:
        return "class_dim_not_last"
    return ""


def _cross_entropy_refusal(arguments: dict) -> str:
    logits, target = arguments["input"], arguments["target"]
    if arguments["label_smoothing"] != 0.0:
        return "label_smoothing"
    target_value = tensor_meta(target) if isinstance(target, fx.Node) else None
    if target_value is None or target_value.dtype.is_floating_point:
        return "probability_targets"
    return _common_refusal(logits, _class_dim(logits))


def _log_softmax_refusal(node: fx.Node, arguments: dict, outputs: list[fx.Node]) -> str:
    readers = list(node.users)
    if (node in outputs or len(readers) != 1 or readers[0].target not in _NLL_LOSS
            or call_arguments(readers[0])["input"] is not node):
        return "log_probs_read_elsewhere"
    logits = arguments["input"]
    converts = arguments.get("dtype") not in (None, tensor_meta(logits).dtype) or arguments.get("half_to_float")
    return "other_dtype" if converts else _common_refusal(logits, arguments["dim"])


def _rewrite(gm: fx.GraphModule, node: fx.Node, arguments: dict) -> None:
    """The log-softmax (alone, or the one a cross-entropy makes) becomes the helper; a cross-entropy's loss becomes
    ATen's own `nll_loss_nd` of it, as ATen's cross-entropy computes it."""
    logits = arguments["input"]
    dim = _class_dim(logits) if node.target is _CROSS_ENTROPY else arguments["dim"]
    with gm.graph.inserting_before(node):
        log_probs = gm.graph.call_function(log_softmax_grad_in_place, (logits, dim))
        if node.target is _CROSS_ENTROPY:
            loss = gm.graph.call_function(_aten.nll_loss_nd.default, (
                log_probs, arguments["target"], arguments["weight"], arguments["reduction"],
                arguments["ignore_index"]))
            log_probs.meta = {k: v for k, v in node.meta.items() if k != "val"}
            loss.meta = dict(node.meta)
        else:
            log_probs.meta = dict(node.meta)
            loss = log_probs
    node.replace_all_uses_with(loss)
    gm.graph.erase_node(node)
