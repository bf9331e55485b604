"""The pass registry: every pass fxopt has, by name, in one explicit table."""
from __future__ import annotations

from .base import Pass
from .channels_last import ChannelsLast
from .checkpoint_activations import CheckpointActivations
from .drop_eval_dropout import DropEvalDropout
from .drop_zero_pads import DropZeroPads
from .fold_conv_bn import FoldConvBN
from .inplace_relu import InplaceReLU
from .prune_dead_grads import PruneDeadGrads

PASSES: dict[str, type[Pass]] = {p.name: p for p in (FoldConvBN, DropEvalDropout, DropZeroPads, InplaceReLU,
                                                      CheckpointActivations, PruneDeadGrads, ChannelsLast)}
