"""fxopt.optimize: what it returns, and a clear FxoptError (never a raw traceback) for every bad input."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxopt
from equivalence import assert_same_step, assert_same_training_steps
from fxopt.passes import PASSES


def small_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 8 * 8, 2))


X = torch.randn(2, 3, 8, 8)


def test_fully_traceable_model_comes_back_as_a_graph_module_with_a_report():
    """A model export accepts whole runs as one GraphModule; the guarded result carries the report."""
    model = small_net().eval()
    optimized = fxopt.optimize(model, X)
    assert isinstance(optimized, fxopt.OptimizedModule)
    assert isinstance(optimized.graph_module, fx.GraphModule)
    assert list(optimized.state_dict()) == list(model.state_dict())
    assert optimized.fxopt_report.mode == "inference"
    assert optimized.fxopt_report["fold_conv_bn"].stats["folded"] == 1
    assert_same_step(model, optimized, (X,), training=False)


@pytest.mark.parametrize("inputs", [X, (X,), [X]])
def test_example_inputs_forms(inputs):
    """A single tensor, a tuple and a list of tensors are all accepted."""
    fxopt.optimize(small_net().eval(), inputs)


@pytest.mark.parametrize("training, expected", [(True, "training"), (False, "inference")])
def test_auto_mode_follows_model_training(training, expected):
    """mode="auto" is training for a model in train mode, inference otherwise."""
    assert fxopt.optimize(small_net().train(training), X).fxopt_report.mode == expected


def test_available_passes_have_summaries():
    """Every registered pass is listed, with a one-line summary for the CLI."""
    names = fxopt.available_passes()
    assert {"fold_conv_bn", "inplace_relu", "checkpoint_activations", "prune_dead_grads"} <= set(names)
    assert all(PASSES[n].summary and "\n" not in PASSES[n].summary for n in names)


def test_unknown_pass_names_it_and_lists_the_valid_ones():
    """A misspelt pass is named, and the valid names are listed so the user can fix it."""
    with pytest.raises(fxopt.FxoptError) as info:
        fxopt.optimize(small_net().eval(), X, passes=["fold_conv_bm"])
    assert "'fold_conv_bm'" in str(info.value)
    assert all(name in str(info.value) for name in fxopt.available_passes())


def test_passes_must_be_names():
    """passes=<something that is not a list of names> is an FxoptError, not a TypeError from inside."""
    with pytest.raises(fxopt.FxoptError, match="list of pass names"):
        fxopt.optimize(small_net().eval(), X, passes=[PASSES["fold_conv_bn"]])


def test_option_no_selected_pass_takes():
    """An option that no selected pass declares is an error naming it (a typo would otherwise be ignored)."""
    with pytest.raises(fxopt.FxoptError, match="option 'memory_budget' is not taken by any selected pass"):
        fxopt.optimize(small_net().eval(), X, passes=["fold_conv_bn"], memory_budget=0.5)
    with pytest.raises(fxopt.FxoptError, match="option 'memory_budjet'"):
        fxopt.optimize(small_net().train(), X, memory_budjet=0.5)


def test_budget_on_an_eval_model_suggests_training_mode():
    """memory_budget on an eval model (inference by default) names the pass that takes it and says mode="training"."""
    with pytest.raises(fxopt.FxoptError, match="it is checkpoint_activations's, which runs in training mode: "
                                               "pass mode='training'"):
        fxopt.optimize(small_net().eval(), X, memory_budget=0.5)


def test_option_of_a_pass_left_out_says_to_add_it():
    """An option of a pass the caller's `passes` leave out says to add that pass."""
    with pytest.raises(fxopt.FxoptError, match="add checkpoint_activations to passes"):
        fxopt.optimize(small_net().train(), X, passes=["fold_conv_bn"], memory_budget=0.5)


def test_bad_mode():
    """An unknown mode lists the valid ones."""
    with pytest.raises(fxopt.FxoptError, match="unknown mode 'eval'.*auto, inference, training"):
        fxopt.optimize(small_net(), X, mode="eval")


@pytest.mark.parametrize("inputs, message", [
    ((X, 3), r"\[1\] is a int"),
    (["image.png"], r"\[0\] is a str"),
    ((), "non-empty tuple of tensors"),
    ({"x": X}, "got dict"),
])
def test_example_inputs_that_are_not_tensors(inputs, message):
    """Non-tensor example inputs are refused up front, saying which one is wrong."""
    with pytest.raises(fxopt.FxoptError, match=message):
        fxopt.optimize(small_net().eval(), inputs)


def test_model_that_is_not_a_module():
    """A function or other object is refused with its type."""
    with pytest.raises(fxopt.FxoptError, match="expected a torch.nn.Module, got function"):
        fxopt.optimize(lambda x: x, X)


def test_shape_the_model_rejects_names_the_layer_and_the_shapes():
    """Inputs of the wrong shape say which layer failed, on which shapes, and why."""
    with pytest.raises(fxopt.FxoptError) as info:
        fxopt.optimize(small_net().eval(), torch.randn(2, 5, 8, 8))
    message = str(info.value)
    assert "module '0' (Conv2d)" in message
    assert "(2, 5, 8, 8) float32" in message
    assert "expected input[2, 5, 8, 8] to have 3 channels" in message
    assert isinstance(info.value.__cause__, RuntimeError)  # the original error is kept for debugging


def test_shape_error_deep_in_a_nested_model_names_the_innermost_module():
    """The innermost failing module is named with its full path, not just the model."""
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(nn.Linear(8, 8))))
    with pytest.raises(fxopt.FxoptError, match=r"module '0.1.0' \(Linear\) failed on inputs \[\(2, 4, 8, 9\) float32\]"):
        fxopt.optimize(model, torch.randn(2, 3, 8, 9))


class FlaggedNet(nn.Module):
    """A forward with a Python flag: Dynamo specializes the graph on it."""

    def __init__(self):
        super().__init__()
        self.net = small_net()

    def forward(self, x, double: bool = False):
        y = self.net(x)
        return y * 2 if double else y


@pytest.mark.parametrize("make_model", [small_net, FlaggedNet])
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_optimizing_a_result_again_changes_nothing(make_model, mode):
    """optimize(optimize(m)) optimizes the model the result stands for again, as the first did, and steps as eager."""
    torch.manual_seed(0)
    model = make_model().train(mode == "training")
    once = fxopt.optimize(model, X, mode=mode)
    twice = fxopt.optimize(once, X, mode=mode)
    # decided by measuring both layouts (either answer may come out on a loaded machine), and what follows from it
    timed = {"channels_last", "prepack_conv_weights"}
    assert [p.stats for p in twice.fxopt_report.passes if p.name not in timed] == \
        [p.stats for p in once.fxopt_report.passes if p.name not in timed]
    assert_same_step(model, twice, (X,), training=mode == "training")


def test_inference_result_is_independent_of_the_callers_model():
    """Moving or switching the inference result (`.double()`, `.train()`) must not touch the caller's model."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3)).eval()
    optimized = fxopt.optimize(model, torch.randn(1, 3, 8, 8))
    optimized.double().train()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not any(m.training for m in model.modules())


@pytest.mark.usefixtures("budget_may_be_unmet")
def test_optimizing_a_checkpointed_training_result_again_steps_like_eager():
    """A training result holding checkpointed regions, optimized again, still checkpoints and matches eager over 2 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.GELU()) for _ in range(4)])
    model = model.double().train()
    inputs = (torch.randn(64, 64, dtype=torch.float64),)  # large enough that regions meet the budget
    reference = copy.deepcopy(model)
    once = fxopt.optimize(model, inputs, mode="training", memory_budget=0.5)
    assert once.fxopt_report["checkpoint_activations"].changed
    twice = fxopt.optimize(once, inputs, mode="training", memory_budget=0.5)
    assert twice.fxopt_report["checkpoint_activations"].changed  # the regions are there again, not dropped
    assert_same_training_steps(reference, twice, inputs)
