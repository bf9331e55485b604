"""torch.compile(backend="fxopt") handing off to Inductor (the default): same results as eager.

Slow (each Inductor compile takes 20-30 s on CPU): deselected by default, run with `-m slow`.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_backend import MODELS, assert_frozen_fold_never_stale, assert_same, compiled_step, example, make

import fxopt

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]


@pytest.mark.parametrize("name", MODELS)
def test_inductor_inference_matches_eager(name):
    """Eval mode without grad (frozen parameters, guarded): same outputs and buffers as eager, every BN folded."""
    backend = fxopt.backend()
    ref, got = compiled_step(name, backend, train=False, grad=False)
    assert_same(ref, got)
    assert sum(r["fold_conv_bn"].stats["folded"] for r in backend.reports) == MODELS[name][1]


@pytest.mark.parametrize("name", MODELS)
def test_inductor_training_step_matches_eager(name):
    """Train mode through AOTAutograd and Inductor: outputs, gradients and BN running stats match eager."""
    backend = fxopt.backend()
    ref, got = compiled_step(name, backend, train=True, grad=True)
    assert_same(ref, got)


def test_inductor_frozen_bn_fine_tuning_matches_eager():
    """Eval-mode BN with autograd on: the fold is graph ops in the joint graph, gradients match."""
    ref, got = compiled_step("resnet", fxopt.backend(), train=False, grad=True)
    assert_same(ref, got)


def test_inductor_train_mode_batch_norm_without_grad_updates_running_stats():
    """Frozen inference with train-mode BN: the running statistics the graph updates are not frozen."""
    ref, got = compiled_step("resnet", fxopt.backend(), train=True, grad=False)
    assert_same(ref, got)


@pytest.mark.usefixtures("budget_may_be_unmet")
def test_inductor_memory_budget_training_step_matches_eager():
    """memory_budget through Inductor's min-cut partitioner: the training step still matches eager."""
    ref, got = compiled_step("resnet", fxopt.backend(memory_budget=0.5), train=True, grad=True)
    assert_same(ref, got)


def test_frozen_parameters_changed_after_compiling_are_never_stale():
    """An in-place update or a new Parameter after compiling switches to the non-frozen compile, with a warning."""
    model = make("seed").eval()
    assert_frozen_fold_never_stale(model, torch.compile(model, backend=fxopt.backend()))


def test_frozen_statistics_updated_by_eager_training_are_never_stale():
    """Train-mode steps of the module itself, outside the compiled graph, update its BatchNorm statistics in place
    without bumping their versions: the frozen graph sees the new values and falls back, with a warning."""
    model = make("seed").eval()
    compiled = torch.compile(model, backend=fxopt.backend())
    x = example()
    with torch.no_grad():
        compiled(x)
        model.train()
        model(x * 3 + 1)
        model.eval()
        with pytest.warns(UserWarning, match="changed after fxopt froze it"):
            got = compiled(x)
        assert_same({"output": model(x)}, {"output": got})


def test_statistics_the_frozen_graph_updates_itself_keep_it_frozen():
    """A train-mode BatchNorm without grad updates its statistics inside the frozen graph: that is no change from
    outside, so calls after the first stay frozen, without a warning, and match eager."""
    model = make("seed").train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxopt.backend())
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(3):
            x = example() + seed
            assert_same({"output": reference(x)}, {"output": compiled(x)})
    assert [str(w.message) for w in caught if "froze it" in str(w.message)] == []


def test_freeze_false_follows_parameters_without_recompiling():
    """freeze=False: the fold runs on the parameter inputs each call, so updates need no fallback."""
    model = make("seed").eval()
    compiled = torch.compile(model, backend=fxopt.backend(freeze=False))
    x = example()
    with torch.no_grad():
        compiled(x)
        model.conv1.weight.mul_(1.5)
        assert_same({"output": model(x)}, {"output": compiled(x)})
