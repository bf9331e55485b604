"""Passes around `with torch.no_grad():` and `with torch.autocast(...):` blocks of a forward.

TorchDynamo's graph, traced to ATen, records such a block as calls that switch global state
(`torch._C._set_grad_enabled`, `_enter_autocast` / `_exit_autocast`) around the block's ops. A pass
may rewrite the ops inside (they keep running between the switches, with the block's grad mode and
dtype); it never moves or drops a switch. Each case compares outputs, gradients and buffers with
eager, in both modes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import assert_same_step

import fxopt
from fxopt import _torch_private
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


def blocks(optimized) -> dict[str, str]:
    """Each call node of the optimized graph that runs inside a block, with the block's kind ("no_grad", "autocast")."""
    switches, inside, grad, autocast = _torch_private.grad_and_autocast_state_calls(), {}, True, 0
    for node in optimized.graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch._C._set_grad_enabled:
            grad = node.args[0]
        elif node.target in switches:
            autocast += 1 if node.target is torch.amp.autocast_mode._enter_autocast else -1
        elif not grad or autocast:
            inside[node.name] = "autocast" if autocast else "no_grad"
    return inside


def switch_calls(optimized) -> list[str]:
    """The graph's grad-mode and autocast switches, in order."""
    switches = _torch_private.grad_and_autocast_state_calls()
    return [n.target.__name__ for n in optimized.graph_module.graph.nodes if n.op == "call_function"
            and n.target in switches]


def captured_switch_calls(model, inputs, mode) -> list[str]:
    """The switches of `model`'s graph as captured, before any pass."""
    return switch_calls(fxopt.optimize(model, inputs, mode=mode, passes=[]))


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("region", list(REGIONS))
def test_fold_rewrites_outside_and_inside_a_block(region, mode):
    """Both conv+BN pairs fold; the one inside the block still runs between the block's switches (its grad mode and
    dtype), which stay as captured."""
    torch.manual_seed(0)
    model = frozen_bn(randomize_bn(Blocks(REGIONS[region])), mode)
    optimized = fxopt.optimize(model, IMAGE, mode=mode, passes=["fold_conv_bn"])
    assert dict(optimized.fxopt_report["fold_conv_bn"].stats) == {"folded": 2}
    assert "aten.batch_norm" not in optimized.graph_module.code
    assert switch_calls(optimized) == captured_switch_calls(model, IMAGE, mode)
    if switch_calls(optimized):  # (in inference the whole graph runs without grad: a no_grad block switches nothing)
        assert {k for name, k in blocks(optimized).items() if name.startswith("conv2d")} == {region}
    tolerance = 2e-2 if region == "autocast" else 1e-4  # bfloat16 inside: the folded conv rounds otherwise
    assert_same_step(model, optimized, IMAGE, training=mode == "training", rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("region", list(REGIONS))
def test_inplace_relu_never_writes_what_autograd_keeps_for_the_block(region, mode):
    """The ReLU whose input the block's linear also reads stays out of place in training (that linear keeps it for
    its weight's gradient); the block's own ReLU stays inside the block; eager's step either way."""

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
    assert switch_calls(optimized) == captured_switch_calls(model, x, mode)
    code = optimized.graph_module.code
    if mode == "training":
        assert "relu_1 = torch.ops.aten.relu.default(linear)" in code
        assert optimized.fxopt_report["inplace_relu"].stats["refused_saved_by_other_op"] == 1
        assert blocks(optimized)["relu"] == region
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
def test_dead_code_elimination_keeps_a_block_that_writes_a_buffer(mode):
    """A block nobody reads still runs when it writes a buffer: the EMA advances exactly as in eager."""
    torch.manual_seed(0)
    model = EmaInNoGrad().train(mode == "training")
    x = (torch.randn(8, 16),)
    optimized = fxopt.optimize(model, x, mode=mode, passes=["prune_dead_grads"])
    gm = optimized.graph_module
    assert sum(MUTATION in effects(n, gm) for n in gm.graph.nodes if n.op == "call_function") >= 2  # mul_, add_
    assert "aten.mul.Tensor" not in gm.code  # the dead `y * 3` is gone
    assert switch_calls(optimized) == captured_switch_calls(model, x, mode)
    assert_same_step(model, optimized, x, training=mode == "training")


def test_dead_code_elimination_removes_a_pure_unused_block():
    """What a block computes and nobody reads, writing nothing, is dead code like any other."""

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
    optimized = fxopt.optimize(model, x, mode="training", passes=["prune_dead_grads"])
    assert "aten.mul" not in optimized.graph_module.code and not blocks(optimized)
    assert_same_step(model, optimized, x, training=True)


def test_prune_runs_an_autocast_block_outside_the_loss_without_grad():
    """An autocast block feeding only an undeclared output runs without grad, still in bfloat16, as eager computes it."""

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
    assert switch_calls(optimized) == captured_switch_calls(model, x, "training")
    out = optimized(*x)
    ref = model(*x)
    torch.testing.assert_close(out[1], ref[1].detach(), rtol=1e-2, atol=1e-2)
    assert out[0].requires_grad and not out[1].requires_grad
