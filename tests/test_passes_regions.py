"""Passes around and inside export's grad-mode and autocast regions: a region is a barrier.

torch.export records `with torch.no_grad():` and `with torch.autocast(...):` blocks of a forward
as `wrap_with_set_grad_enabled` / `wrap_with_autocast` calls of a submodule. No pass rewrites
across such a call: the ops inside keep the region's grad mode and dtype, and what is outside is
rewritten as usual. Each case compares outputs, gradients and buffers with eager, in both modes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import assert_same_step

import fxopt
from fxopt.analysis.ops import region_of
from fxopt.analysis.side_effects import MUTATION, effects

IMAGE = (torch.randn(8, 3, 8, 8),)


def randomize_bn(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen))
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    return model


def frozen_bn(model: nn.Module, mode: str) -> nn.Module:
    """Inference: eval; training: train with every BatchNorm in eval mode (fine-tuning)."""
    model.train(mode == "training")
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    return model


class Blocks(nn.Module):
    """conv-BN-ReLU outside, the same inside a region, then a head reading both."""

    def __init__(self, region):
        super().__init__()
        self.region = region
        self.conv_out, self.bn_out = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv_in, self.bn_in = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y = self.conv_out(x)
        y = F.relu(self.bn_out(y))
        with self.region():
            z = F.relu(self.bn_in(self.conv_in(y)))
        return self.head((y + z.float()).mean((2, 3)))


REGIONS = {
    "no_grad": torch.no_grad,
    "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
}


def regions(optimized) -> list:
    gm = optimized.graph_module
    return [r for r in (region_of(n, gm) for n in gm.graph.nodes) if r is not None]


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("region", list(REGIONS))
def test_fold_rewrites_outside_and_leaves_the_region_alone(region, mode):
    """The conv+BN outside folds; the pair inside the region stays as written (its grad mode and dtype)."""
    torch.manual_seed(0)
    model = frozen_bn(randomize_bn(Blocks(REGIONS[region])), mode)
    optimized = fxopt.optimize(model, IMAGE, mode=mode, passes=["fold_conv_bn"])
    assert dict(optimized.fxopt_report["fold_conv_bn"].stats) == {"folded": 1}
    (inside,) = regions(optimized)
    assert "aten.batch_norm" in inside.body.code and "aten.batch_norm" not in optimized.graph_module.code
    tolerance = 2e-2 if region == "autocast" else 1e-4  # bfloat16 inside: both run the same ops
    assert_same_step(model, optimized, IMAGE, training=mode == "training", rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("region", list(REGIONS))
def test_inplace_relu_never_writes_what_the_region_reads(region, mode):
    """The ReLU whose input the region also reads stays out of place; nothing inside the region is rewritten."""

    class ReadByRegion(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            h = self.fc1(x)
            with REGIONS[region]():
                side = torch.relu(self.fc2(h))
            return torch.relu(h) + side.float()

    torch.manual_seed(0)
    model = ReadByRegion().train(mode == "training")
    x = (torch.randn(8, 16),)
    optimized = fxopt.optimize(model, x, mode=mode, passes=["inplace_relu"], relu_mask=False)
    (inside,) = regions(optimized)
    assert "aten.relu.default" in inside.body.code and "relu_" not in inside.body.code
    assert "aten.relu_" not in optimized.graph_module.code
    assert_same_step(model, optimized, x, training=mode == "training", rtol=2e-2, atol=2e-2)


class EmaInNoGrad(nn.Module):
    """A no_grad block that updates a buffer in place and returns nothing the model uses."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(y.mean(0), alpha=0.1)
            unused = y * 3  # noqa: F841 - pure and dead inside the region
        return y


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_dead_code_elimination_keeps_a_region_that_writes_a_buffer(mode):
    """A region nobody reads still runs when it writes a buffer: the EMA advances exactly as in eager."""
    torch.manual_seed(0)
    model = EmaInNoGrad().train(mode == "training")
    x = (torch.randn(8, 16),)
    optimized = fxopt.optimize(model, x, mode=mode, passes=["prune_dead_grads"])
    (inside,) = regions(optimized)
    assert MUTATION in effects(inside.node, optimized.graph_module)
    assert_same_step(model, optimized, x, training=mode == "training")


def test_dead_code_elimination_removes_a_pure_unused_region():
    """A region that computes something nobody reads and writes nothing is dead code like any other."""

    class PureRegion(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            y = self.fc(x)
            with torch.no_grad():
                _ = y * 3
            return y

    model = PureRegion().train()
    x = (torch.randn(8, 16),)
    gm = torch.export.export(model, x, strict=False).module()
    assert any(region_of(n, gm) for n in gm.graph.nodes)  # export keeps the (dead) region
    optimized = fxopt.optimize(model, x, mode="training", passes=["prune_dead_grads"])
    assert not regions(optimized)
    assert_same_step(model, optimized, x, training=True)


def test_prune_leaves_a_region_outside_the_loss_as_written():
    """A region feeding only an undeclared output is not rewrapped (a barrier); what is around it runs without grad."""

    class AuxInAutocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head, self.aux = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 4)

        def forward(self, x):
            h = torch.relu(self.body(x))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                a = self.aux(h)
            return self.head(h), torch.tanh(a.float())

    torch.manual_seed(0)
    model = AuxInAutocast().train()
    x = (torch.randn(8, 16),)
    optimized = fxopt.optimize(model, x, mode="training", passes=["prune_dead_grads"], differentiable_outputs=[0])
    report = optimized.fxopt_report["prune_dead_grads"]
    assert report.stats["refused_region"] == 1 and report.stats["no_grad"] >= 1
    (inside,) = regions(optimized)
    assert inside.kind == "autocast" and inside.dtype == torch.bfloat16
    out = optimized(*x)
    assert out[0].requires_grad and not out[1].requires_grad
    ref = model(*x)
    torch.testing.assert_close(out[1], ref[1].detach(), rtol=1e-2, atol=1e-2)
