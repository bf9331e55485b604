"""Guards on the torch.compile path (issue #11): frozen weights never stale, aot_eager draws eager's random numbers."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt import _torch_private


def _dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4)).train()


def test_aot_eager_draws_the_same_dropout_masks_as_eager():
    """inner="aot_eager": a train-mode dropout gives eager's outputs and gradients from the same seed."""
    _torch_private.reset_dynamo()
    model = _dropout_net()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxopt.backend(inner="aot_eager"))
    x = torch.randn(8, 16)
    for seed in (1, 2):
        torch.manual_seed(seed)
        got = compiled(x)
        got.sum().backward()
        torch.manual_seed(seed)
        expected = reference(x)
        expected.sum().backward()
        torch.testing.assert_close(got, expected)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    _torch_private.reset_dynamo()


@pytest.mark.slow
def test_inductor_freezing_detects_replaced_storage():
    """`p.data = t` after a frozen compile: the compiled model uses the new weights (never stale)."""
    _torch_private.reset_dynamo()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    compiled = torch.compile(model, backend=fxopt.backend())
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        model[0].weight.data = torch.randn_like(model[0].weight)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = compiled(x)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)
    assert any("froze" in str(w.message) for w in caught)
    _torch_private.reset_dynamo()
