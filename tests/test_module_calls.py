"""Module calls (`call_module`) in a graph the backend receives are opaque: no pass rewrites or drops one.

TorchDynamo under torch 2.6-2.12 with `torch._dynamo.config.inline_inbuilt_nn_modules = False`
hands the backend nn layers as `call_module` nodes, their parameters as module attributes (the
form `torch.fx.symbolic_trace` gives). fxopt's analyses recognise no layer in that form: each call
is an opaque module that reads its own parameters and may write its own state.
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn

from fxopt.frontends.backend import BackendOptions, compile_graph


def _step(run, params: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x = x.clone().requires_grad_()
    out = run(x)
    return [out.detach(), *torch.autograd.grad(out.square().sum(), [x, *params])]


def test_module_calls_train_like_eager_and_stay_as_they_are():
    """A frozen eval conv + BN and a trainable head, all module calls: the training pipeline keeps each call, the step matches eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 4)).train()
    model[:2].requires_grad_(False)
    model[1].eval()
    gm = fx.symbolic_trace(copy.deepcopy(model))
    calls = [(n.op, n.target) for n in gm.graph.nodes]
    x = torch.randn(2, 3, 8, 8)
    reports = []
    compiled = compile_graph(gm, [x.clone().requires_grad_()], BackendOptions.parse({"inner": "eager"}),
                             reports.append)
    assert [(n.op, n.target) for n in gm.graph.nodes] == calls
    assert not any(entry.changed for entry in reports[0].passes)
    expected = _step(model, list(model[5].parameters()), x)
    got = _step(compiled, list(gm.get_submodule("5").parameters()), x)
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want)
