"""Direct attribute reads: the optimized forward reads parameters and buffers through the module
dicts, reads the same objects `getattr` would at every call, and keeps torch.fx's readable code."""
from __future__ import annotations

import copy
import io

import torch
import torch.nn as nn

import fxopt

X = torch.randn(3, 4, dtype=torch.float64)


def nested_model() -> nn.Module:
    return nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), nn.Linear(4, 2)).double().eval()


def reads_dicts(gm: torch.fx.GraphModule) -> bool:
    return "_parameters" in gm.forward.__code__.co_names


def test_forward_reads_dicts_and_code_stays_readable():
    """The compiled forward reads `_modules[...]._parameters[...]`; `gm.code` keeps torch.fx's text."""
    model = nested_model()
    optimized = fxopt.optimize(model, (X,), mode="inference")
    gm = optimized.graph_module
    assert reads_dicts(gm)
    assert "_parameters" not in gm.code
    torch.testing.assert_close(optimized(X), model(X), rtol=0, atol=0)


def test_a_replaced_parameter_is_read_at_the_next_call():
    """A parameter replaced in the graph module's tree is read anew, as `getattr` would read it."""
    gm = fxopt.optimize(nested_model(), (X,), mode="inference").graph_module
    owner = gm.get_submodule(next(n.target for n in gm.graph.find_nodes(op="get_attr")).rpartition(".")[0])
    name = next(n.target for n in gm.graph.find_nodes(op="get_attr")).rpartition(".")[2]
    before = gm(X)
    setattr(owner, name, nn.Parameter(torch.zeros_like(getattr(owner, name))))
    after = gm(X)
    gm.recompile()  # torch.fx's own code, reading through getattr
    torch.testing.assert_close(after, gm(X), rtol=0, atol=0)
    assert not torch.equal(before, after)


def test_deep_copies_and_loaded_results_read_dicts_too():
    """A deep copy and a `torch.load`ed result keep the direct reads and compute the same outputs."""
    model = nested_model()
    optimized = fxopt.optimize(model, (X,), mode="inference")
    copied = copy.deepcopy(optimized.graph_module)
    buffer = io.BytesIO()
    torch.save(optimized, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert reads_dicts(copied) and reads_dicts(loaded.graph_module)
    for other in (copied, loaded):
        torch.testing.assert_close(other(X), model(X), rtol=0, atol=0)


def test_converted_result_reads_the_converted_buffers():
    """After `.to(float32)` (which replaces buffer objects) the graph reads the new buffers."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    images = torch.randn(2, 3, 8, 8)
    optimized = fxopt.optimize(copy.deepcopy(model), (images,), mode="inference", passes=[])
    optimized.double()
    # the graph itself, run on float64: a call through the result runs the original (a dtype unlike the example)
    torch.testing.assert_close(optimized.graph_module(images.double()), model.double()(images.double()))
