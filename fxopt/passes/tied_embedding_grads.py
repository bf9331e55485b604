"""tied_embedding_grads: a lookup of a weight the graph also reads elsewhere hands back its gradient as the rows it read.

What it rewrites (a weight read twice: BART's encoder and decoder share their embedding)::

    e = aten.embedding(shared, encoder_ids, 1)      (kept: its gradient is the dense one)
    d = aten.embedding(shared, decoder_ids, 1)  ->  d = embedding_row_grads(shared, decoder_ids, 1)

Autograd adds up a weight's gradients before it accumulates them into `.grad`. ATen's embedding backward makes a
dense gradient the size of the whole weight, so the decoder lookup's (made first in backward) waits, vocabulary-sized,
through the encoder's whole backward, and meets the encoder lookup's dense one: two at once at the end of backward
(51.5 MB each for BART's 50,265 x 256 float32 table: that held BART's step at 0.71x of eager's peak under
`memory_budget=0.5`). `embedding_row_grads` (fxopt.passes._row_grads) hands back a sparse gradient, one row per
distinct index read, which autograd adds in place into the dense one: one dense gradient in all. Run before
checkpoint_activations, whose memory model prices the sparse gradient (fxopt.checkpointing.profile).

Why it is safe: the sum autograd accumulates is bit for bit ATen's (fxopt.passes._row_grads: same rows, same order,
same additions), in the order it arrives, so `.grad`, hooks on the weight and gradient accumulation across steps see
the same dense tensor. A lookup is rewritten only where a dense gradient of the same weight is sure to come in the
same backward: another reader of the weight (the anchor: the one whose value reaches the most outputs) reaches
every output this lookup's value reaches, through ops autograd records, so whichever output a loss differentiates,
the anchor's dense gradient comes too, and `.grad` is never left sparse.

When it refuses (reason in the report):
  gradient_may_come_alone  an output this lookup reaches is not reached by the anchor (GPT-2's key/value cache
                           with `use_cache=True` depends on the lookup, not on the LM head)
  unclear_gradient_path    the way from the lookup to the outputs writes in place or runs opaque code
  not_cpu                  the weight is not on the CPU: the compact rows are checked bit for bit against CPU
                           kernels only
  not_a_plain_tensor       the weight is a tensor subclass (DTensor) or not strided
  sparse_embedding         the embedding already makes sparse gradients (`nn.Embedding(sparse=True)`)
It does nothing in inference mode or where AOTAutograd takes the graph next (torch.compile: it plans its own backward).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private
from ..analysis.grad_needs import GradNeeds
from ..analysis.ops import state_input
from ..analysis.side_effects import MUTATION, OPAQUE, effects
from ..op_names import call_arguments
from ._row_grads import embedding_row_grads
from .base import TRAINING, Pass, PassContext, PassResult, eager_backward_facts, site_name

_EMBEDDING = torch.ops.aten.embedding.default


class TiedEmbeddingGrads(Pass):
    name = "tied_embedding_grads"
    summary = "A lookup of a weight also read elsewhere gives its gradient as the rows it read: one dense gradient."
    modes = (TRAINING,)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        facts = eager_backward_facts(gm, ctx, result)
        if facts is None:
            return result
        outputs, needs = facts
        outputs = frozenset(outputs)
        for weight in gm.graph.nodes:
            state = state_input(weight, gm) if weight.op in ("get_attr", "placeholder") else None
            readers = [u for u in weight.users if needs.recorded(u)]
            if state is None or state[0] not in needs.params_needing_grad or len(readers) < 2:
                continue
            reach = {r: _reach(r, outputs, needs, gm) for r in readers}
            anchor = max(readers, key=lambda r: len(reach[r][0]))
            for lookup in readers:
                if lookup is anchor or lookup.target is not _EMBEDDING or lookup.args[0] is not weight:
                    continue
                arguments = call_arguments(lookup)  # weight, indices, padding_idx, scale_grad_by_freq, sparse
                reason = _refusal(arguments, state[1], reach[lookup], reach[anchor][0])
                if reason:
                    result.record("refused", site_name(lookup), reason, f"its gradient stays dense ({lookup.name})")
                    continue
                with gm.graph.inserting_before(lookup):
                    rows = gm.graph.call_function(embedding_row_grads, tuple(arguments.values())[:4])
                rows.meta = dict(lookup.meta)
                lookup.replace_all_uses_with(rows)
                gm.graph.erase_node(lookup)
                result.record("rows", site_name(rows), detail=f"{state[0]}'s gradient: the rows it read, added into "
                                                              f"{anchor.name}'s dense one")
        if result.changed:
            gm.recompile()
        return result


def _reach(start: fx.Node, outputs: frozenset[fx.Node], needs: GradNeeds,
           gm: fx.GraphModule) -> tuple[frozenset[fx.Node], bool]:
    """The `outputs` `start`'s value reaches through recorded ops, and whether that way is plain (no in-place
    write, no opaque code: the walk stops there, so the first is what surely reaches the outputs)."""
    reached, seen, todo, plain = set(), {start}, [start], True
    while todo:
        node = todo.pop()
        if node in outputs:
            reached.add(node)
        for user in node.users:
            if user in seen or user.op == "output" or not needs.recorded(user):
                continue
            seen.add(user)
            if effects(user, gm) & {MUTATION, OPAQUE}:
                plain = False
                continue
            todo.append(user)
    return frozenset(reached), plain


def _refusal(arguments: dict, weight: torch.Tensor, reach: tuple[frozenset, bool], anchor_reach: frozenset) -> str:
    if _torch_private.is_tensor_subclass(weight) or weight.layout != torch.strided:
        return "not_a_plain_tensor"
    if weight.device.type != "cpu":
        return "not_cpu"
    if arguments["sparse"]:
        return "sparse_embedding"
    reached, plain = reach
    if not plain:
        return "unclear_gradient_path"
    if not reached <= anchor_reach:
        return "gradient_may_come_alone"
    return ""
