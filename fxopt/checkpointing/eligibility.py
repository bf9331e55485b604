"""Which steps a region may recompute: one rule for both lowerings (eager regions and partitioner tags)."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils.checkpoint

from ..analysis.aliasing import is_inplace_op
from ..analysis.ops import match_batch_norm
from ..analysis.side_effects import MUTATION, effects
from ..op_names import op_name
from .eager_region import CheckpointedRegion, can_recompute_batch_norm, is_lone_state_update


def refusal(node: fx.Node, gm: fx.GraphModule) -> str:
    """Why `node` may not be recomputed inside a region (the reasons: fxopt.passes.checkpoint_activations), or ""."""
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), CheckpointedRegion):
        return "already_checkpointed"
    if node.op == "call_function" and node.target is torch.utils.checkpoint.checkpoint:
        return "already_checkpointed"
    bn = match_batch_norm(node)
    if bn is not None and bn.training is not False and not can_recompute_batch_norm(node):
        return "bn_training"
    if is_lone_state_update(node):
        return ""
    name = op_name(node)
    if name is None:
        return "unknown_op"
    if MUTATION in effects(node, gm) and not can_recompute_batch_norm(node) and not is_inplace_op(name):
        return "mutation"  # in-place ops may join a region that made what they write (KeptWrites.write_inside)
    return ""
