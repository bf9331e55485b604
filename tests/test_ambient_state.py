"""A forward that branches on torch's global modes (grad mode, autocast) is never run on a graph that baked the
other branch: the reads are recorded at capture (fxopt.capture.ambient_state) and checked per call.

Each test compares with eager, in float64 where values are compared, after the same calls.
"""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
import transformers

from test_guards import assert_same, optimize_quietly, step


class BranchesOnGradMode(nn.Module):
    """Doubles its features only when gradients are enabled, as some regularizers do."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        if torch.is_grad_enabled():
            h = h * 2
        return self.fc(h)


class BranchesOnAutocast(nn.Module):
    """Casts to autocast's dtype and scales when autocast is on, as attention integrations do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if torch.is_autocast_enabled("cpu"):
            h = h.to(torch.get_autocast_dtype("cpu")) * 3
        return h


class NoGradInside(nn.Module):
    """Uses no_grad inside its forward: torch's own read of the mode, which export keeps as a region."""

    def __init__(self):
        super().__init__()
        self.fc, self.frozen = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            y = self.frozen(x)
        return self.fc(x) + y


X = torch.randn(4, 3, 8, 8, dtype=torch.float64)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_grad_mode_branch_is_honoured_under_no_grad(mode):
    """Called under no_grad, a model that reads the grad mode computes eager's no_grad branch, with a warning naming
    the read; called with gradients again, it computes eager's outputs and buffers (and gradients, in training)."""
    torch.manual_seed(0)
    model = BranchesOnGradMode().double().train(mode == "training")
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X, mode=mode)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"torch\.is_grad_enabled\(\) == True"):
        got = step(result, X, backward=False)
    with torch.no_grad():
        assert_same(step(reference, X, backward=False), got, tol=0)
    training = mode == "training"
    assert_same(step(reference, X, backward=training), step(result, X, backward=training), tol=1e-12)
    assert sum(result.fxopt_report.guard_events.values()) == 1


def test_an_autocast_branch_is_honoured_under_autocast():
    """Under autocast, a model that reads autocast's state and dtype computes eager's autocast branch, bit for bit."""
    torch.manual_seed(0)
    model, x = BranchesOnAutocast(), torch.randn(2, 4)
    result = optimize_quietly(model, x)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match="is_autocast_enabled"):
        got, expected = result(x), model(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(result(x), model(x), rtol=0, atol=0)


def test_the_reads_survive_pickling():
    """A saved and loaded result still checks the modes its model read."""
    model = BranchesOnGradMode().double().eval()
    result = optimize_quietly(model, X)
    buffer = io.BytesIO()
    torch.save(result, buffer)
    buffer.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = torch.load(buffer, weights_only=False)
        with torch.no_grad():
            torch.testing.assert_close(loaded(X), model(X), rtol=0, atol=0)


@pytest.mark.parametrize("make", [NoGradInside, lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU())],
                         ids=["no_grad_inside", "no_read"])
def test_models_that_read_no_mode_check_none(make):
    """A forward with no_grad inside (torch's own read) or none at all records no read: under no_grad the optimized
    graph runs, without a warning."""
    model, x = make(), torch.randn(4, 4)
    result = optimize_quietly(model, x)
    call_guards = [g for g in result.fxopt_report.guards if g.kind == "call"]
    assert call_guards and all("torch.is_" not in g.describe() for g in call_guards)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        result(x)


def test_hugging_face_models_read_no_mode():
    """BERT (tiny config) reads no global mode while exported: calls under no_grad keep the optimized graph."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64)
    model, tokens = transformers.BertModel(config).eval(), torch.randint(0, 100, (2, 8))
    result = optimize_quietly(model, (tokens,))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = result(tokens).last_hidden_state
    with torch.no_grad():
        torch.testing.assert_close(got, model(tokens).last_hidden_state)
    assert not result.fxopt_report.guard_events


class CountsAndBranches(nn.Module):
    """An opaque parent (it counts its calls) around a child that branches on grad mode: the child's own graph."""

    def __init__(self):
        super().__init__()
        self.child, self.calls = BranchesOnGradMode(), 0

    def forward(self, x):
        self.calls += 1
        return self.child(x)


def test_a_child_graph_under_an_opaque_parent_checks_the_modes_it_read():
    """A captured child that read the grad mode runs as written under no_grad, and its graph again with gradients."""
    torch.manual_seed(0)
    model = CountsAndBranches().double().train()
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X, mode="training")
    assert [o.path for o in result.fxopt_report.opaque] == [""] and "child" in result.fxopt_report.graphs
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same(step(reference, X, backward=False), step(result, X, backward=False), tol=0)
    assert_same(step(reference, X), step(result, X), tol=1e-12)
