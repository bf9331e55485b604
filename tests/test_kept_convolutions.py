"""A selective region whose kept ops are all convolutions keeps their outputs itself, without torch's selective
checkpoint dispatch mode (fxopt.analysis.kept_convolutions), and computes exactly what eager does."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.analysis.kept_convolutions import kept_convolution
from fxopt.analysis.memory import Region, step_profile
from fxopt.analysis.region_overhead import RegionOverhead
from fxopt.capture.saving import keep_graph_when_pickled
from fxopt.passes._checkpoint_region import CheckpointedRegion, extract_region

from named_regions import extract_regions


class _Convolutions(nn.Module):
    """Two convolutions of one kind (`layer(channels)` builds one), a BatchNorm and a ReLU after each."""

    def __init__(self, layer, norm=nn.BatchNorm2d, tail: nn.Module | None = None):
        super().__init__()
        self.first, self.second = layer(), layer()
        self.norms = nn.ModuleList([norm(8), norm(8)])
        self.tail = tail

    def forward(self, x):
        x = F.relu(self.norms[0](self.first(x)))
        x = F.relu(self.norms[1](self.second(x))) + x
        return x if self.tail is None else self.tail(x.mean(dim=(2, 3)))


LAYERS = {
    "conv2d": (lambda: nn.Conv2d(8, 8, 3, padding=1), (2, 8, 10, 10), nn.BatchNorm2d),
    "strided_dilated_no_bias": (lambda: nn.Conv2d(8, 8, 3, padding=2, dilation=2, bias=False), (2, 8, 11, 9),
                                nn.BatchNorm2d),
    "depthwise": (lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8), (2, 8, 10, 10), nn.BatchNorm2d),
    "transposed": (lambda: nn.ConvTranspose2d(8, 8, 3, padding=1), (2, 8, 7, 7), nn.BatchNorm2d),
    "conv1d": (lambda: nn.Conv1d(8, 8, 5, padding=2), (2, 8, 20), nn.BatchNorm1d),
    "conv3d": (lambda: nn.Conv3d(8, 8, 3, padding=1), (2, 8, 4, 5, 6), nn.BatchNorm3d),
}


def _one_selective_region(model: nn.Module, x: torch.Tensor) -> fxopt.OptimizedModule:
    """`model` captured, all its nodes in one selective region that keeps what the memory model counts."""
    opt = fxopt.optimize(model, (x,), mode="training", passes=[])
    profile = step_profile(opt.graph_module)
    extract_regions(opt.graph_module, profile, [Region(0, len(profile.steps), save_counted=True)])
    return opt


def _region(opt) -> CheckpointedRegion:
    (region,) = [m for m in opt.graph_module.modules() if isinstance(m, CheckpointedRegion)]
    return region


def _steps(model: nn.Module, x: torch.Tensor, n: int = 2) -> dict:
    """Output, input and parameter gradients and buffers after `n` steps on a copy of `model`."""
    model, x = copy.deepcopy(model), x.clone().requires_grad_()
    for _ in range(n):
        out = model(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return {"output": out.detach(), "grad:input": x.grad, **{f"grad:{k}": p.grad for k, p in model.named_parameters()},
            **{f"buffer:{k}": b for k, b in model.named_buffers()}}


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_step_is_bit_exact_in_float32(kind, channels_last):
    """Two training steps through the region give eager's outputs, gradients and running statistics bit for bit, for
    every kind of convolution, in either memory format."""
    layer, shape, norm = LAYERS[kind]
    if channels_last and len(shape) != 4:
        pytest.skip("channels_last is a 4-d layout")
    torch.manual_seed(0)
    model, x = _Convolutions(layer, norm).train(), torch.randn(shape)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    opt = _one_selective_region(model, x)
    assert _region(opt).kind == "selective (convolution outputs kept by the region)"  # no dispatch mode
    expected, got = _steps(model, x), _steps(opt, x)
    assert [k for k, v in expected.items() if not torch.equal(got[k], v)] == []


def test_autocast_matches_eager():
    """Called under bfloat16 autocast, the region's convolutions run as the model's did (autocast casts their inputs),
    so two steps give eager's outputs, gradients and statistics bit for bit."""
    torch.manual_seed(0)
    model, x = _Convolutions(LAYERS["conv2d"][0]).train(), torch.randn(2, 8, 10, 10)
    opt = _one_selective_region(model, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = _steps(model, x), _steps(opt, x)
    assert expected["output"].dtype == torch.bfloat16
    assert [k for k, v in expected.items() if not torch.equal(got[k], v)] == []


def test_survives_torch_save_and_load(tmp_path):
    """A model whose region keeps convolutions (each call names its own operator) saves and loads with its graphs
    intact, and the loaded copy steps as eager does."""
    torch.manual_seed(0)
    model, x = _Convolutions(LAYERS["conv2d"][0]).train(), torch.randn(2, 8, 10, 10)
    opt = _one_selective_region(model, x)
    keep_graph_when_pickled(opt.graph_module)  # as fxopt.optimize leaves every graph it made
    torch.save(opt, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert _region(loaded).kind == "selective (convolution outputs kept by the region)"
    expected, got = _steps(model, x), _steps(loaded, x)
    assert [k for k, v in expected.items() if not torch.equal(got[k], v)] == []


def test_eval_mode_matches_in_float64():
    """With its BatchNorms in eval mode the region still gives eager's outputs and gradients."""
    torch.manual_seed(0)
    model, x = _Convolutions(LAYERS["conv2d"][0]).double().eval(), torch.randn(2, 8, 10, 10, dtype=torch.float64)
    opt = fxopt.optimize(model, (x,), mode="training", passes=[])  # eval-mode BatchNorms, gradients still wanted
    profile = step_profile(opt.graph_module)
    extract_regions(opt.graph_module, profile, [Region(0, len(profile.steps), save_counted=True)])
    expected, got = _steps(model, x), _steps(opt, x)
    assert max((got[k] - v).abs().max().item() for k, v in expected.items()) == 0


def test_other_kept_ops_use_the_selective_policy():
    """A region that also keeps a matmul (a linear head) runs under torch's selective checkpoint policy, and still
    matches eager."""
    torch.manual_seed(0)
    model = _Convolutions(LAYERS["conv2d"][0], tail=nn.Linear(8, 3)).double().train()
    x = torch.randn(2, 8, 10, 10, dtype=torch.float64)
    opt = _one_selective_region(model, x)
    assert _region(opt).policy is not None
    assert "selective checkpoint policy" in _region(opt).extra_repr()
    expected, got = _steps(model, x), _steps(opt, x)
    assert max((got[k] - v).abs().max().item() for k, v in expected.items()) < 1e-12


def test_double_backward_is_a_clear_error():
    """Gradients of gradients through kept convolutions, which the region has handed to its first recomputation, fail
    with a message saying why, as through torch's selective checkpoint."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64, requires_grad=True)
    opt = _one_selective_region(_Convolutions(LAYERS["conv2d"][0]).double().train(), x)
    (g,) = torch.autograd.grad(opt(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="backward through it only once"):
        torch.autograd.grad(g.pow(2).sum(), x)


def _convolution_output_model():
    """A graph whose last op, a convolution, is its output: a selective region over it keeps the tensor returned.
    (model, its optimized form, an input)"""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Conv2d(8, 4, 1)).double().train(), torch.randn(
        2, 3, 8, 8, dtype=torch.float64)
    return model, _one_selective_region(model, x), x


def test_output_written_in_place_is_a_clear_error():
    """Writing a kept convolution output in place before the backward fails with a message naming it, never a
    gradient computed from the changed values."""
    _, opt, x = _convolution_output_model()
    out = opt(x.clone().requires_grad_())
    out.mul_(2)
    with pytest.raises(RuntimeError, match="written in place after the region's forward"):
        out.sum().backward()


def test_second_backward_is_a_clear_error():
    """A second backward through the region (retain_graph) says why it fails, as torch's selective checkpoint does:
    the kept output went to the first backward's recomputation, so that memory is freed as early as the policy's."""
    _, opt, x = _convolution_output_model()
    loss = opt(x.clone().requires_grad_()).pow(2).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through a selective checkpointed region"):
        loss.backward()


def test_which_convolutions_are_kept():
    """Batched convolutions with numeric padding are kept by the region; padding "same" and an unbatched input are
    left to the selective policy."""
    def calls(fn, *inputs):
        opt = fxopt.optimize(fn, inputs, mode="training", passes=[])
        return [kept_convolution(n) for n in opt.graph_module.graph.nodes if n.op == "call_function"]

    w = torch.randn(4, 3, 3)
    (kept,) = calls(_Functional(lambda x: F.conv1d(x, w, stride=2, padding=1)), torch.randn(2, 3, 9))
    assert kept is not None and (kept.stride, kept.padding, kept.dilation) == ([2], [1], [1])
    assert calls(_Functional(lambda x: F.conv1d(x, w, padding="same")), torch.randn(2, 3, 9)) == [None]
    assert calls(_Functional(lambda x: F.conv1d(x, w)), torch.randn(3, 9)) == [None]


class _Functional(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_region_price_per_op():
    """A selective region that keeps only convolutions is priced per op as a whole region (no dispatch mode); one
    that keeps a matmul at the selective policy's price per op."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 10, 10)
    convs = fxopt.optimize(_Convolutions(LAYERS["conv2d"][0]).train(), (x,), mode="training", passes=[])
    head = fxopt.optimize(_Convolutions(LAYERS["conv2d"][0], tail=nn.Linear(8, 3)).train(), (x,), mode="training",
                          passes=[])
    overhead = RegionOverhead(per_region=0.0, per_op=1e-6, selective_per_region=0.0, selective_per_op=3e-5)
    for opt, expected in ((convs, 1e-6), (head, 3e-5)):
        profile = step_profile(opt.graph_module)
        profile.overhead = overhead
        assert profile.overhead_per_op(Region(0, len(profile.steps), save_counted=True)) == expected
        assert profile.overhead_per_op(Region(0, len(profile.steps))) == 1e-6


def test_extract_without_counted_uses_the_policy():
    """Called without the ops it keeps, a selective region falls back on torch's selective checkpoint policy."""
    opt = fxopt.optimize(_Convolutions(LAYERS["conv2d"][0]).train(), (torch.randn(2, 8, 6, 6),), mode="training",
                         passes=[])
    gm = opt.graph_module
    extract_region(gm, [n for n in gm.graph.nodes if n.op == "call_function"], "checkpointed_all", True)
    gm.recompile()
    assert _region(opt).policy is not None
