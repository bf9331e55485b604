"""prune_dead_grads: do no backward work, and keep no saved tensor, that no gradient needs.

Autograd skips gradients of tensors that do not require grad, but it records and saves for
everything upstream of any output that requires grad, and it keeps a convolution's input even
when only the input gradient is wanted. In training mode this pass removes that waste:

1. Outputs outside the loss. With `differentiable_outputs` (indices into the output tuple, or
   keys of a dict output) naming what the loss differentiates, every node that feeds only the
   other outputs runs under `torch.no_grad()`; those outputs come back with
   `requires_grad=False` (`detach` where their value is also used by the loss). Backward from
   such an output then fails with autograd's own error ("element 0 of tensors does not require
   grad"); adding it into a loss silently contributes no gradient: that is what was declared.
       h = body(x); aux = aux_head(h); return main_head(h), aux
     becomes (differentiable_outputs=[0])
       h = body(x); aux = call_without_grad(aux_head, h); return main_head(h), aux
2. Frozen layers in the middle (trainable stem -> frozen body -> trainable head). Gradient must
   flow through a frozen conv, but its weight needs none, so its input need not be kept:
   the conv becomes `conv_saving_what_grads_need`; an eval-mode BatchNorm with frozen affine
   parameters becomes `x * scale + shift` (nothing kept) (fxopt.passes._frozen_ops). A ReLU
   between frozen convs then has its float output kept by nobody but itself, which lets
   inplace_relu (next in the pipeline) keep a bool mask instead. Each op is first run alone on fake
   tensors under `saved_tensors_hooks` with the graph's requires_grad pattern
   (`grad_needs.really_saved`): a site is rewritten only where the op really keeps the waste
   (`F.linear` with a frozen weight keeps no input in eager already, so it is left alone).
3. Dead code: a node nobody reads is erased unless it has an effect
   (`fxopt.analysis.side_effects`: in-place writes, RNG draws, BatchNorm statistics, print,
   assert, hooks, opaque modules all stay).

Why it is safe: a value no differentiated output depends on receives no gradient, so recording
it only costs memory; values that a differentiated output reads, opaque code, and every in-place
write into a tensor that may share storage with such a value or with a graph input stay recorded
(`grad_needs`). The frozen-layer ops decide at run time from
`requires_grad` what to keep, so unfreezing a layer later still gives full gradients. Running a
dropout or a train-mode BatchNorm under no_grad draws the same numbers and updates the same
statistics. In inference mode only dead-code elimination runs (nothing is recorded there).

When it refuses (reason in the report):
  not_model_outputs   differentiable_outputs given, but this graph's outputs are not known to be the
                      model's (fxopt.optimize maps them on its example call where Dynamo captured the
                      whole forward in one graph; a graph break, or `backend="fxopt"`, leaves them unknown)
  not_importable      a function outside the loss that the graph cannot name again: it stays
                      recorded (the nodes around it still run without grad)
  unsupported_conv    string padding ('same' / 'valid')
  unbatched           a conv input without a batch dimension
  mixed_dtype         a BatchNorm whose statistics and input differ in dtype (autocast, half)
  state_written       a frozen BatchNorm whose statistics or affine parameters the graph itself
                      writes (a train-mode BN sharing them, an in-place op): eager autograd reads them
                      at backward time, after the write, so `x * scale + shift` would differ
  no_waste            the op does not keep its input here (nothing to gain)

Limits: like fold_conv_bn, a BatchNorm's eval mode is taken as given at optimize time. Double
backward through a rewritten conv raises (its backward is `once_differentiable`). On the
torch.compile path the convs are rewritten too, but AOTAutograd then still keeps each ReLU's
output (inplace_relu's masks do not run there), so the saving is an eager-path one.

The report's figures: which parameters and inputs still need a gradient, the trainable
parameters that no longer get one, and saved-for-backward bytes before/after
(`fxopt.analysis.costs.estimate_saved_bytes`, measured on fake tensors).
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Hashable

import torch.fx as fx

from .. import _torch_private
from ..analysis.costs import estimate_saved_bytes, placeholder_values
from ..analysis.grad_needs import GradNeeds, analyze_grad_needs, really_saved
from ..analysis.ops import ConvCall, match_batch_norm, match_conv, resolve
from ..op_names import op_name
from ..analysis.shapes import tensor_meta
from ..analysis.side_effects import removable_if_unused
from ..analysis.written_state import state_key, written_state
from ..errors import FxoptError
from ..graph_functions import importable_name
from ..model_copy import graph_snapshot
from ..output_selection import chosen_outputs, parse_differentiable_outputs
from ._frozen_ops import (call_method_without_grad, call_without_grad, conv_saving_what_grads_need,
                          eval_batch_norm_scale_shift)
from .base import INFERENCE, Pass, PassContext, PassResult, site_name


def output_entries(gm: fx.GraphModule, ctx: PassContext | None = None) -> dict[Hashable, tuple[int, ...]]:
    """The model's outputs by index (tuple/list or a single value) or key (dict, ModelOutput), each as
    the positions of its tensors among the graph's flat outputs: where the front end found them
    (`ctx.output_places`, a Dynamo graph that returns the whole model's outputs), else from the graph's
    own output structure, else the positions themselves."""
    flat = _flat_outputs(gm)
    found = ctx.output_places.entries_of(len(flat)) if ctx is not None and ctx.output_places is not None else None
    if found is not None:
        return found
    structure = _torch_private.output_structure(gm)
    if structure is None:
        return {i: (i,) for i in range(len(flat))}
    entries, start = {}, 0
    for key, size in zip(*structure):
        entries[key] = tuple(range(start, start + size))
        start += size
    return entries


def _flat_outputs(gm: fx.GraphModule) -> list:
    out = gm.graph.find_nodes(op="output")[0].args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _is_trainable(ref, gm: fx.GraphModule, needs: GradNeeds) -> bool:
    if ref is None:
        return False
    if isinstance(ref, fx.Node):
        return ref in needs.requires_grad
    return resolve(ref, gm).requires_grad


def _ntuple(value, n: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


class PruneDeadGrads(Pass):
    name = "prune_dead_grads"
    summary = "Record and save nothing no gradient needs: no_grad side outputs, frozen layers keep no input; DCE."
    options = {"differentiable_outputs": (None, "outputs the loss differentiates: indices into the output "
                                                "tuple or keys of a dict output (None: all)")}

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        selection = parse_differentiable_outputs(self.option(ctx, "differentiable_outputs"))
        if ctx.mode == INFERENCE:
            if selection is not None:
                raise FxoptError("differentiable_outputs applies to training; in inference nothing is differentiated")
            self._eliminate_dead_code(gm, result)
            return result
        self._eliminate_dead_code(gm, result)  # first: a dead node's saved tensors are freed at once anyway
        unchanged = graph_snapshot(gm)  # its saved bytes are estimated only if the pass rewrites `gm` (fake forwards: slow)
        dead_code_sites = len(result.sites)
        chosen = self._chosen_outputs(gm, ctx, selection, result)
        needs = self._analyze(gm, ctx, chosen)
        self._figures(needs, result)
        self._run_without_grad(gm, needs, result)
        self._detach_outputs(gm, needs, chosen, output_entries(gm, ctx), result)
        self._rewrite_frozen(gm, ctx, lambda: self._analyze(gm, ctx, chosen), result)
        if not any(not s.refused for s in result.sites[dead_code_sites:]):
            result.figures["bytes_no_longer_saved"] = 0  # nothing rewritten: no fake forwards (slow) to tell it
            return result
        gm.recompile()  # the fake forward below runs it
        before = estimate_saved_bytes(unchanged, placeholder_values(unchanged))
        after = estimate_saved_bytes(gm, placeholder_values(gm))
        if before is not None and after is not None:
            result.figures["saved_bytes_before"] = before
            result.figures["saved_bytes_after"] = after
            result.figures["bytes_no_longer_saved"] = before - after
        return result

    # ---- analysis ----

    def _chosen_outputs(self, gm: fx.GraphModule, ctx: PassContext, selection, result: PassResult) -> set:
        entries = output_entries(gm, ctx)
        if selection is None:
            return set(entries)
        places = ctx.output_places
        whole_model = ctx.graph_path == "" or (places is not None and places.entries_of(len(_flat_outputs(gm))) is not None)
        if not whole_model:  # a submodule's graph, or a Dynamo graph not known to return the model's outputs
            where = f"graph {ctx.graph_path!r}" if ctx.graph_path else "a graph of unknown place"
            result.record("refused", "output", "not_model_outputs",
                          f"{where} does not return the model's outputs; differentiable_outputs not applied")
            return set(entries)
        return chosen_outputs(entries, selection)

    @staticmethod
    def _analyze(gm: fx.GraphModule, ctx: PassContext, chosen: set) -> GradNeeds:
        entries, flat = output_entries(gm, ctx), _flat_outputs(gm)
        differentiated = [flat[i] for key in chosen for i in entries[key] if isinstance(flat[i], fx.Node)]
        return analyze_grad_needs(gm, differentiated, ctx.constant_inputs)

    # ---- 3. dead code ----

    @staticmethod
    def _eliminate_dead_code(gm: fx.GraphModule, result: PassResult) -> None:
        for node in reversed(list(gm.graph.nodes)):
            if not node.users and removable_if_unused(node, gm):
                if node.op != "get_attr":
                    result.record("removed", site_name(node), "dead", "nothing reads it and it has no side effect")
                gm.graph.erase_node(node)

    # ---- 1. outputs outside the loss ----

    @staticmethod
    def _run_without_grad(gm: fx.GraphModule, needs: GradNeeds, result: PassResult) -> None:
        graph = gm.graph
        for node in needs.no_grad_nodes:
            wrapper, target = call_without_grad, node.target
            if node.op == "call_method":
                wrapper = call_method_without_grad
            elif node.op == "call_function" and not _torch_private.aten_op_name(node.target):  # ATen ops print
                target = importable_name(node.target)
                if target is None:
                    result.record("refused", site_name(node), "not_importable",
                                  f"{node.target!r} cannot be named in the graph; it stays recorded")
                    continue
            with graph.inserting_before(node):
                if node.op == "call_module":
                    target = graph.get_attr(node.target)
                new = graph.call_function(wrapper, (target, *node.args), dict(node.kwargs))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            result.record("no_grad", site_name(new), detail=f"{node.name} feeds only outputs nobody differentiates")

    @staticmethod
    def _detach_outputs(gm: fx.GraphModule, needs: GradNeeds, chosen: set, entries: dict,
                        result: PassResult) -> None:
        output = gm.graph.find_nodes(op="output")[0]
        flat = _flat_outputs(gm)
        differentiated = {i for key in chosen for i in entries[key]}  # a position two outputs share (one tensor
        detached: dict[fx.Node, fx.Node] = {}                          # returned twice) keeps its gradient
        for key, positions in entries.items():
            recorded = [i for i in positions
                        if key not in chosen and i not in differentiated and flat[i] in needs.requires_grad]
            if not recorded:
                continue
            with gm.graph.inserting_before(output):
                for i in recorded:
                    if flat[i] not in detached:
                        detached[flat[i]] = gm.graph.call_method("detach", (flat[i],))
                        detached[flat[i]].meta.update(flat[i].meta)
                    flat[i] = detached[flat[i]]
            result.record("detached", f"output[{key!r}]",
                          detail="declared non-differentiable: returned with requires_grad=False")
        if detached:
            out = output.args[0]
            output.args = (type(out)(flat) if isinstance(out, (tuple, list)) else flat[0],)

    # ---- 2. frozen layers ----

    def _rewrite_frozen(self, gm: fx.GraphModule, ctx: PassContext, analyze: Callable[[], GradNeeds],
                        result: PassResult) -> None:
        """Rewrite frozen convs and eval BatchNorms, re-analysing after each rewrite (new nodes)."""
        needs = analyze()
        for node in list(gm.graph.nodes):
            if not needs.recorded(node) or node.op != "call_function":
                continue
            conv = match_conv(node)
            bn = match_batch_norm(node) if conv is None else None
            if conv is not None:
                rewritten = self._frozen_conv(gm, conv, needs, result)
            elif bn is not None and bn.uses_running_stats and op_name(node) == "batch_norm":
                rewritten = self._frozen_batch_norm(gm, ctx, bn, needs, result)
            else:
                rewritten = False
            if rewritten:
                needs = analyze()

    @staticmethod
    def _refusal(node: fx.Node, gm: fx.GraphModule, needs: GradNeeds, input_node: fx.Node) -> tuple[str, str]:
        saved = really_saved(node, gm, needs.requires_grad)
        if saved is None or input_node not in saved.saved_inputs:
            return "no_waste", "the op keeps no copy of its input here"
        return "", ""

    def _frozen_conv(self, gm: fx.GraphModule, conv: ConvCall, needs: GradNeeds, result: PassResult) -> bool:
        node = conv.node
        if conv.input not in needs.requires_grad or _is_trainable(conv.weight, gm, needs):
            return False  # nothing flows through, or the weight gradient really needs the input
        reason, detail = self._conv_refusal(conv)
        if not reason:
            reason, detail = self._refusal(node, gm, needs, conv.input)
        if reason:
            result.record("refused", site_name(node), reason, detail)
            return False
        n = conv.spatial_dims
        with gm.graph.inserting_before(node):
            args = (conv.input, conv.weight, conv.bias, _ntuple(conv.stride, n),
                    _ntuple(conv.padding, n), _ntuple(conv.dilation, n), conv.transposed,
                    _ntuple(conv.output_padding, n), conv.groups)
            new = gm.graph.call_function(conv_saving_what_grads_need, args)
        self._replace(gm, node, new)
        result.record("frozen_conv", site_name(new), detail=f"{node.name}: weight needs no gradient, so this op no "
                                                 f"longer keeps its input ({_nbytes(conv.input)} B)")
        return True

    @staticmethod
    def _conv_refusal(conv: ConvCall) -> tuple[str, str]:
        if isinstance(conv.padding, str):
            return "unsupported_conv", f"padding={conv.padding!r}"
        x = tensor_meta(conv.input)
        if x is None or x.dim() != conv.spatial_dims + 2:
            return "unbatched", "input has no batch dimension"
        return "", ""

    def _frozen_batch_norm(self, gm: fx.GraphModule, ctx: PassContext, bn, needs: GradNeeds,
                           result: PassResult) -> bool:
        node = bn.node
        if bn.input not in needs.requires_grad or _is_trainable(bn.weight, gm, needs) \
                or _is_trainable(bn.bias, gm, needs):
            return False
        x, mean = tensor_meta(bn.input), resolve(bn.running_mean, gm)
        mean = mean if mean is not None else tensor_meta(bn.running_mean)
        if x is None or mean is None or x.dtype != mean.dtype:
            result.record("refused", site_name(node), "mixed_dtype", "statistics and input differ in dtype")
            return False
        written = written_state(gm)
        if any(r is not None and state_key(r, gm) in written for r in (bn.running_mean, bn.running_var, bn.weight,
                                                                         bn.bias)):
            result.record("refused", site_name(node), "state_written", "a statistic or affine parameter is also "
                                                                         "written by the graph (train-mode BN, in-place op)")
            return False
        reason, detail = self._refusal(node, gm, needs, bn.input)
        if reason:
            result.record("refused", site_name(node), reason, detail)
            return False
        graph = gm.graph
        with graph.inserting_before(node):
            refs = [bn.running_mean, bn.running_var, bn.weight, bn.bias]
            pair = graph.call_function(eval_batch_norm_scale_shift, (*refs,), {"eps": bn.eps, "ndim": x.dim()})
            scale = graph.call_function(operator.getitem, (pair, 0))
            shift = graph.call_function(operator.getitem, (pair, 1))
            scaled = graph.call_function(operator.mul, (bn.input, scale))
            new = graph.call_function(operator.add, (scaled, shift))
        self._replace(gm, node, new)
        result.record("frozen_bn", site_name(new), detail=f"{node.name}: eval BatchNorm with frozen affine no longer "
                                               f"keeps its input ({_nbytes(bn.input)} B)")
        return True

    @staticmethod
    def _replace(gm: fx.GraphModule, old: fx.Node, new: fx.Node) -> None:
        new.meta.update(old.meta)
        old.replace_all_uses_with(new)
        gm.graph.erase_node(old)

    # ---- report ----

    @staticmethod
    def _figures(needs: GradNeeds, result: PassResult) -> None:
        """Which parameters and inputs still need a gradient, named as in the caller's model."""
        result.figures["params_needing_grad"] = list(needs.params_needing_grad)
        result.figures["params_losing_grad"] = list(needs.params_losing_grad)
        result.figures["inputs_needing_grad"] = list(needs.inputs_needing_grad)


def _nbytes(node: fx.Node) -> int:
    val = tensor_meta(node)
    return val.numel() * val.element_size() if val is not None else 0


