"""drop_eval_dropout: a dropout that returns its input unchanged is removed, any other stays.

(These cases were inplace_relu's until the removal became its own pass.) Each is checked for
structure, equivalence with the original (outputs; in training also gradients and buffers), the
report, and idempotence.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import assert_same_step
from test_inplace_relu import MLPWithDropout  # Linear -> ReLU -> Dropout -> Linear

import fxopt
from fxopt.passes.base import PassContext
from fxopt.passes.drop_eval_dropout import DropEvalDropout
from fxopt.pipeline.pipelines import DEFAULT_PIPELINES

FEATURES = (torch.randn(8, 16),)
PASSES = ["drop_eval_dropout", "inplace_relu"]


class FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(F.dropout(self.fc(x), 0.5, training=False))


def check_same(model: nn.Module, inputs: tuple, mode: str) -> nn.Module:
    """Optimize `model` and assert it computes what the original computes in `mode`."""
    model.train(mode == "training")
    optimized = fxopt.optimize(model, inputs, mode=mode, passes=PASSES)
    assert_same_step(model, optimized, inputs, training=mode == "training")
    return optimized


def code(optimized: nn.Module) -> str:
    return optimized.graph_module.code


def test_eval_dropout_is_dropped():
    """In inference, an eval-mode dropout returns its input, so it is removed (and relu then runs in place)."""
    optimized = check_same(MLPWithDropout(), FEATURES, "inference")
    assert optimized.fxopt_report["drop_eval_dropout"].stats["dropped"] == 1
    assert "dropout" not in code(optimized)


def test_training_drops_only_eval_dropout():
    """In training, `F.dropout(training=False)` is dropped; the train-mode dropout module stays.

    (Form change: export bakes each dropout's flag into `aten.dropout(x, p, train)` and capture
    guards the module's mode, so a dropout is dropped exactly when its flag is False.)"""
    optimized = check_same(FunctionalDropout(), FEATURES, "training")
    assert optimized.fxopt_report["drop_eval_dropout"].stats["dropped"] == 1
    dropouts = re.findall(r"aten\.dropout\.default\([^)]*\)", code(optimized))
    assert dropouts == ["aten.dropout.default(linear, 0.5, True)"]


class ZeroProbabilityDropout(nn.Module):
    """A p=0 dropout module (ViT's default configuration) beside a p=0.5 one."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.still = nn.Dropout(0.0)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.still(self.fc(x))))


def test_training_drops_zero_probability_dropout():
    """In training, a p=0 dropout returns its input (ATen draws nothing for it), so it is removed; p=0.5 stays."""
    optimized = check_same(ZeroProbabilityDropout(), FEATURES, "training")
    assert optimized.fxopt_report["drop_eval_dropout"].stats["dropped"] == 1
    dropouts = re.findall(r"aten\.dropout\.default\([^)]*\)", code(optimized))
    assert dropouts == ["aten.dropout.default(relu, 0.5, True)"]


def test_zero_probability_dropout_draws_nothing():
    """The premise of removing it: in training, ATen's p=0 dropout returns its input itself and leaves the RNG alone."""
    x = torch.randn(4, 4, requires_grad=True)
    state = torch.get_rng_state()
    assert torch.dropout(x, 0.0, True) is x and F.dropout(x, 0.0, training=True) is x
    assert torch.equal(torch.get_rng_state(), state)


def test_second_run_changes_nothing():
    """Running the pass again on its own output finds no dropout left to drop."""
    gm = check_same(MLPWithDropout(), FEATURES, "inference").graph_module
    before = gm.code
    assert not DropEvalDropout().run(gm, PassContext("inference")).changed
    assert gm.code == before


def test_default_pipelines_drop_before_inplace_relu():
    """Both default pipelines run the pass before inplace_relu (which then sees the real producers), with
    at most the layout pass, tied_embedding_grads and inplace_log_softmax_grad (which touch only lookups and
    log-softmaxes) and checkpoint_activations (which then plans without those steps) between them."""
    for pipeline in DEFAULT_PIPELINES.values():
        between = pipeline[pipeline.index("drop_eval_dropout") + 1:pipeline.index("inplace_relu")]
        assert set(between) <= {"channels_last", "tied_embedding_grads", "inplace_log_softmax_grad",
                                "checkpoint_activations"}
