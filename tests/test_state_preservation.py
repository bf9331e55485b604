"""fxopt.state_preservation: a run for information leaves no trace on the model or its inputs."""
from __future__ import annotations

import random

import numpy
import torch
import torch.nn as nn

import fxopt
from fxopt.state_preservation import preserved_state


def test_running_statistics_written_by_an_exported_graph_are_restored():
    """An exported train-mode BatchNorm updates running statistics without bumping their version; they are still put back."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    graph = torch.export.export(model, (torch.randn(2, 3, 8, 8),), strict=False).module()
    before = {name: b.clone() for name, b in graph.named_buffers()}
    with preserved_state(graph, (), parameters=False), torch.no_grad():
        graph(torch.randn(2, 3, 8, 8))
        assert any(not torch.equal(b, before[name]) for name, b in graph.named_buffers())
    for name, b in graph.named_buffers():
        torch.testing.assert_close(b, before[name], rtol=0, atol=0)


def test_parameters_inputs_and_rng_are_restored():
    """In-place writes to a parameter and to an input, and RNG draws, are all undone on exit."""
    model = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    weight, given = model.weight.detach().clone(), x.clone()
    state = torch.get_rng_state()
    with preserved_state(model, (x,)), torch.no_grad():
        model.weight.mul_(2)
        x.add_(1)
        torch.randn(5)
    assert torch.equal(model.weight, weight) and torch.equal(x, given)
    assert torch.equal(torch.get_rng_state(), state)


def test_nan_values_count_as_unchanged():
    """A buffer holding NaN that nothing wrote is left as it is (NaN != NaN must not look like a write)."""
    module = nn.Module()
    module.register_buffer("b", torch.tensor([float("nan"), 1.0]))
    buffer = module.b
    with preserved_state(module, ()):
        pass
    assert module.b is buffer and torch.isnan(module.b[0]) and module.b[1] == 1.0


class KeepsHistory(nn.Module):
    """Counts its calls in an int, keeps its last output and appends to a list and a dict: plain attributes."""

    def __init__(self):
        super().__init__()
        self.calls, self.last, self.history, self.seen = 0, None, [], {}

    def forward(self, x):
        self.calls += 1
        self.last = x * 2
        self.history.append(self.calls)
        self.seen[self.calls] = True
        self.added_on_the_fly = True
        return self.last


def test_plain_attributes_and_their_contents_are_restored():
    """A forward rebinding plain attributes, adding one and changing a list and a dict in place leaves no trace."""
    model = KeepsHistory()
    history, seen = model.history, model.seen
    with preserved_state(model, ()):
        model(torch.ones(2))
    assert model.calls == 0 and model.last is None and not hasattr(model, "added_on_the_fly")
    assert model.history is history and history == [] and model.seen is seen and seen == {}


def test_python_and_numpy_generators_are_restored():
    """A forward drawing from Python's and NumPy's global generators leaves both streams where they were."""
    random.seed(1)
    numpy.random.seed(1)
    expected = (random.random(), float(numpy.random.rand()))
    random.seed(1)
    numpy.random.seed(1)
    model = nn.Identity()
    model.forward = lambda x: x * random.random() * float(numpy.random.rand())
    with preserved_state(model, ()):
        model(torch.ones(1))
    assert (random.random(), float(numpy.random.rand())) == expected


def test_lists_and_dicts_holding_tensors_are_restored():
    """A forward replacing the tensor inside a list or dict attribute: the original objects come back (no tensor is
    compared with `==`, whose result is no bool)."""
    model = nn.Identity()
    kept, cached = torch.zeros(3), torch.ones(3)
    model.kept, model.cache = [kept], {"last": cached}

    def forward(x):
        model.kept[0] = x * 2
        model.cache["last"] = x * 3
        return x

    model.forward = forward
    with preserved_state(model, ()):
        model(torch.ones(3))
    assert model.kept[0] is kept and model.cache["last"] is cached


def test_an_example_input_the_model_writes_keeps_its_autograd_state():
    """A model that writes its input in place (`x.add_(y)`, y requiring grad) leaves the caller's example tensor
    as it was: same values, still a leaf that does not require grad (found by a generated network)."""
    class WritesItsInput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            x.add_(self.lin(x))
            return x * 2

    x = torch.randn(2, 4)
    before = x.clone()
    fxopt.optimize(WritesItsInput(), (x,), mode="training")
    assert torch.equal(x, before) and x.is_leaf and not x.requires_grad and x.grad_fn is None
