"""What replaying a step from what a region keeps costs: node times with the replays timed beside them.

A region may recompute a CPU dropout from its kept mask (fxopt.checkpointing._dropout_replay) and a train-mode
BatchNorm from its kept statistics (fxopt.checkpointing._batch_norm_replay). `node_seconds(gm)` is
fxopt.analysis.op_times's, with each such replay timed on the node's own inputs under `replay_key(name)`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis import op_times
from ..analysis.ops import match_batch_norm
from . import _batch_norm_replay as batch_norm_replay, _dropout_replay as dropout_replay


def replay_key(name: str) -> str:
    """Where node_seconds puts the time of replaying node `name` from what a region keeps."""
    return f"{name}:replay"


def _replays(node: fx.Node, env: dict):
    """The replay of `node` a region may run instead of recomputing it, as (key, thunk); none if it has none."""
    p = dropout_replay.replayed_dropout_p(node)
    if p is not None:
        x = env[node.all_input_nodes[0]]
        mask = torch.ones_like(x, dtype=torch.bool)
        yield replay_key(node.name), lambda: dropout_replay.replay(x, mask, p)
    if batch_norm_replay.replayed_batch_norm(node):
        bn = match_batch_norm(node)
        x, weight, bias = (env[a] if a is not None else None for a in (bn.input, bn.weight, bn.bias))
        channels = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
        kept = batch_norm_replay.KeptStatistics.of(weight, channels, channels)
        yield replay_key(node.name), lambda: batch_norm_replay.replay(x, bias, kept)


def node_seconds(gm: fx.GraphModule) -> dict[str, float] | None:
    """Each call node's forward seconds on real tensors and each replay's (module docstring), or None."""
    return op_times.node_seconds(gm, also=_replays)
