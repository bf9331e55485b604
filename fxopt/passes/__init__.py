"""The pass registry: every pass fxopt has, by name, in one explicit table (and the joint graphs' own, apart)."""
from __future__ import annotations

from .base import Pass
from .channels_last import ChannelsLast
from .checkpoint_activations import CheckpointActivations
from .drop_eval_dropout import DropEvalDropout
from .drop_zero_pads import DropZeroPads
from .dropout_from_mask import DropoutFromMask
from .fold_conv_bn import FoldConvBN
from .inplace_log_softmax_grad import InplaceLogSoftmaxGrad
from .inplace_relu import InplaceReLU
from .pointwise_before_expand import PointwiseBeforeExpand
from .prepack_conv_weights import PrepackConvWeights
from .prune_dead_grads import PruneDeadGrads
from .tied_embedding_grads import TiedEmbeddingGrads

PASSES: dict[str, type[Pass]] = {p.name: p for p in (FoldConvBN, DropEvalDropout, DropZeroPads, InplaceReLU,
                                                      TiedEmbeddingGrads, InplaceLogSoftmaxGrad, CheckpointActivations,
                                                      PruneDeadGrads, ChannelsLast, PrepackConvWeights)}

# Rewrites of AOTAutograd's joint forward-backward graph, run by fxopt.pipeline.compile_budget under memory_budget:
# they keep values bitwise and let a recomputed region keep less. Not a model's passes: never chosen by name.
JOINT_PASSES: tuple[type[Pass], ...] = (DropoutFromMask, PointwiseBeforeExpand)
