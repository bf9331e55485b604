"""drop_zero_pads: a padding of width zero is a copy; its users read the input instead, with the same
outputs, gradients and buffers (float64, train and eval), and each refusal rule holds."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import assert_same_step

import fxopt
from fxopt.measure import measure_saved_bytes
from fxopt.pipeline.pipelines import DEFAULT_PIPELINES

IMAGE = (torch.randn(2, 3, 10, 10, dtype=torch.float64),)


def optimize(model: nn.Module, inputs: tuple, mode: str) -> nn.Module:
    model.train(mode == "training")
    optimized = fxopt.optimize(model, inputs, mode=mode, passes=["drop_zero_pads"])
    assert_same_step(model, optimized, inputs, training=mode == "training")
    return optimized


def report(optimized: nn.Module):
    return optimized.fxopt_report["drop_zero_pads"]


def reasons(optimized: nn.Module) -> set[str]:
    return {s.reason for s in report(optimized).sites if s.refused}


class SamePadded(nn.Module):
    """TensorFlow-style padding before each conv (as HF MobileNetV2): zero width before the 1x1 conv."""

    def __init__(self):
        super().__init__()
        self.conv3 = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)
        self.conv1 = nn.Conv2d(6, 4, 1)

    def forward(self, x):
        y = F.relu6(self.bn(self.conv3(F.pad(x, (1, 1, 1, 1)))))
        return self.conv1(F.pad(y, (0, 0, 0, 0)))


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_zero_pad_dropped_and_step_unchanged(mode):
    """The zero-width pad goes, the width-one pad stays, and the step equals eager's in float64."""
    optimized = optimize(SamePadded().double(), IMAGE, mode)
    assert report(optimized).stats["dropped"] == 1
    assert optimized.graph_module.code.count("aten.pad") == 1


def test_backward_no_longer_keeps_the_copy():
    """relu keeps its output for backward and the 1x1 conv kept a copy of it: after the rewrite it keeps
    relu's output too, so the copy's bytes are no longer held for backward."""

    class ReluThenPad(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv3 = nn.Conv2d(3, 6, 3, padding=1)
            self.conv1 = nn.Conv2d(6, 4, 1)

        def forward(self, x):
            return self.conv1(F.pad(torch.relu(self.conv3(x)), (0, 0, 0, 0)))

    model = ReluThenPad().double().train()
    optimized = optimize(model, IMAGE, "training")
    copy_bytes = 2 * 6 * 10 * 10 * 8
    assert measure_saved_bytes(lambda: model(*IMAGE), model) - measure_saved_bytes(lambda: optimized(*IMAGE),
                                                                                    optimized) == copy_bytes


def test_refuses_when_strides_differ():
    """A strided slice pads into a dense copy: kernels would see other strides, so the copy stays."""

    class Strided(nn.Module):
        def forward(self, x):
            return F.pad(x[..., ::2], (0, 0, 0, 0)) * 2

    assert reasons(optimize(Strided(), IMAGE, "inference")) == {"layout_differs"}


def test_refuses_when_the_input_is_written_later():
    """The input is written in place after the padding: only the copy still holds the old values."""

    class WrittenLater(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            y = self.conv(x)
            copy = F.pad(y, (0, 0, 0, 0))
            y.mul_(2)
            return copy + y

    assert reasons(optimize(WrittenLater().double(), IMAGE, "training")) == {"written_later"}


def test_refuses_when_the_copy_is_returned():
    """A returned copy would hand the caller the input's storage."""

    class Returned(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            y = self.conv(x)
            return y.sum(), F.pad(y, (0, 0, 0, 0))

    assert reasons(optimize(Returned().double(), IMAGE, "inference")) == {"graph_output"}


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_padding_of_a_view_of_a_dropped_padding(mode):
    """A zero padding of a view of another, which goes first: the second is judged on the graph as it is then
    (it crashed on the first's erased node, fuzz seed 5122831), both go, and the step equals eager's."""

    class PadOfAView(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            copy = F.pad(self.conv(x), (0, 0, 0, 0))
            return F.pad(copy.flatten(2), (0, 0)).sum(-1)

    assert report(optimize(PadOfAView().double(), IMAGE, mode)).stats["dropped"] == 2


def test_in_both_default_pipelines():
    """Both default pipelines drop zero pads, in training before the checkpoint planner prices the step."""
    assert all("drop_zero_pads" in names for names in DEFAULT_PIPELINES.values())
    training = DEFAULT_PIPELINES["training"]
    assert training.index("drop_zero_pads") < training.index("checkpoint_activations")
