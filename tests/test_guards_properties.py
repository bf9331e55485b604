"""Property (issue #11): random state changes between steps never make an optimized model differ from eager.

A seeded random walk over what users do between training steps — train()/eval() of the model
or of one BatchNorm or Dropout, freezing or unfreezing a layer, adding or removing a forward
hook — applied alike to an optimized model and to an eager copy; every step compares outputs,
input gradients and buffers, and parameter gradients for training results (an inference result
in eval mode may fold weights into constants: it promises outputs and input gradients only).
"""
from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
import torch.nn as nn
from test_guards import assert_same, conv_bn_net, step

import fxopt

X = torch.randn(4, 3, 8, 8)


def _toggle(rng: random.Random, models: list[nn.Module], handles: list[list]) -> str:
    """Apply one random user action to every model alike; return its name."""
    action = rng.choice(["model_mode", "bn_mode", "dropout_mode", "freeze", "hook", "unhook"])
    flag = rng.random() < 0.5
    layer = rng.choice(["conv", "bn", "fc"])
    for m, hs in zip(models, handles):
        if action == "model_mode":
            m.train(flag)
        elif action == "bn_mode":
            m.bn.train(flag)
        elif action == "dropout_mode":
            m.drop.train(flag)
        elif action == "freeze":
            getattr(m, layer).requires_grad_(flag)
        elif action == "hook":
            hs.append(getattr(m, layer).register_forward_hook(lambda mod, a, out: out * 1.5))
        elif hs:
            hs.pop(0).remove()
    return f"{action}({layer if action in ('freeze', 'hook') else ''}{flag})"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["training", "inference"])
def test_random_state_changes_match_eager(seed, mode):
    """Every step after any sequence of train/eval, requires_grad and hook changes equals eager."""
    rng = random.Random(seed)
    model = conv_bn_net(seed).train(mode == "training")
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fxopt.optimize(model, X, mode=mode)
        eager_twin = reference if mode == "training" else copy.deepcopy(reference)
        models = [result, eager_twin]
        handles: list[list] = [[], []]
        history = []
        for i in range(8):
            history.append(_toggle(rng, models, handles))
            expected = step(eager_twin, X, seed=i)
            got = step(result, X, seed=i)
            if mode == "inference" and not eager_twin.training:
                expected = {k: v for k, v in expected.items() if not k.startswith("grad:") or k == "grad:input"}
                got = {k: v for k, v in got.items() if not k.startswith("grad:") or k == "grad:input"}
            try:
                assert_same(expected, got)
            except AssertionError as e:
                raise AssertionError(f"after {history}: {e}") from None
