"""channels_last: an inference graph's convolutions run on NHWC activations, and nothing else sees it.

Each case compares the result with the original in float64 (outputs, and the strides of every
output), and checks the report, including each case where the pass must leave the graph alone.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import assert_same_step

import fxopt
from fxopt.errors import FxoptError
from fxopt.pipeline.pipelines import DEFAULT_PIPELINES

IMAGES = (torch.randn(2, 3, 12, 12, dtype=torch.float64),)
PASSES = ["channels_last"]


class ConvNet(nn.Module):
    def __init__(self, head: str = "flatten"):
        super().__init__()
        self.head = head
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        y = y + self.conv2(y)
        if self.head == "flatten":  # a view: needs eager's contiguous strides
            return self.fc(y.view(y.shape[0], -1)), y
        if self.head == "nhwc":  # returned with non-contiguous strides in eager
            return y.permute(0, 2, 3, 1)
        if self.head == "input_back":
            return y, x
        raise ValueError(self.head)


class WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        x.mul_(2)
        return self.conv(x)


class InplaceInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.conv2 = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.conv1(x)
        F.relu(y, inplace=True)
        return self.conv2(y) + y


class WritesThroughAView(nn.Module):
    """(fuzz seed 60060443) A view of a conv output is read after the output is written in place."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv1(x)
        view = y.flatten(2).unflatten(2, y.shape[2:])
        F.hardtanh(y, 0.0, 6.0, inplace=True)  # what nn.ReLU6(inplace=True) calls: aten.hardtanh_, pointwise
        return self.conv2(view), view


def optimize(model: nn.Module, inputs=IMAGES, passes=PASSES, keep: str = "always") -> nn.Module:
    """`model` in float64 optimized with the pass kept as `keep` says (these nets are too small to gain from it)."""
    model = model.double().eval()
    optimized = fxopt.optimize(model, inputs, mode="inference", passes=passes, channels_last=keep)
    assert_same_step(model, optimized, inputs, training=False, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        for ours, eager in zip(_tensors(optimized(*inputs)), _tensors(model(*inputs))):
            assert ours.stride() == eager.stride()
    return optimized


def _tensors(out) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


def _clones(optimized: nn.Module, memory_format: torch.memory_format) -> int:
    return sum(n.target is torch.ops.aten.clone.default and n.kwargs.get("memory_format") is memory_format
               for n in optimized.graph_module.graph.nodes)


def test_convolutions_read_one_channels_last_copy():
    """The input is copied to channels-last once; the view before the linear layer and the returned
    feature map get eager's contiguous strides back, so outputs and their strides equal eager's."""
    optimized = optimize(ConvNet("flatten"))
    report = optimized.fxopt_report["channels_last"]
    assert report.stats == {"converted": 1}
    assert _clones(optimized, torch.channels_last) == 1
    assert _clones(optimized, torch.contiguous_format) == report.figures["copies_back"] == 1


def test_default_inference_pipeline_runs_it_before_inplace_relu():
    """In the default inference pipeline the pass runs before inplace_relu, whose in-place ReLU keeps NHWC."""
    assert DEFAULT_PIPELINES["inference"].index("channels_last") < DEFAULT_PIPELINES["inference"].index("inplace_relu")
    assert "channels_last" not in DEFAULT_PIPELINES["training"]
    optimized = optimize(ConvNet("flatten"), passes=None)
    assert optimized.fxopt_report["channels_last"].stats == {"converted": 1}


def test_non_contiguous_eager_strides_leave_the_graph_unchanged():
    """A permuted NHWC view returned to the caller has non-contiguous strides in eager, which a copy cannot
    give back, so the pass refuses and removes what it inserted."""
    optimized = optimize(ConvNet("nhwc"))
    report = optimized.fxopt_report["channels_last"]
    assert report.stats == {"refused_layout_not_restored": 1}
    assert _clones(optimized, torch.channels_last) == 0 and _clones(optimized, torch.contiguous_format) == 0


def test_returned_input_is_not_converted():
    """A model that returns its input gives the caller that tensor itself (Dynamo returns it outside the graph)."""
    optimized = optimize(ConvNet("input_back"))
    assert optimized.fxopt_report["channels_last"].stats == {"converted": 1}
    x = IMAGES[0].clone()
    assert optimized(x)[1] is x


def test_input_written_in_place_is_not_converted():
    """A forward that writes its input in place must still write the caller's tensor, not a copy of it."""
    model = WritesInput().double().eval()
    x = IMAGES[0].clone()
    optimized = fxopt.optimize(model, (x.clone(),), mode="inference", passes=PASSES)
    assert optimized.fxopt_report["channels_last"].stats == {"refused_input_aliased": 1}
    expected_input, mine = x.clone(), x.clone()
    torch.testing.assert_close(optimized(mine), copy.deepcopy(model)(expected_input), rtol=0, atol=1e-12)
    torch.testing.assert_close(mine, expected_input, rtol=0, atol=0)


def test_a_written_tensor_is_not_copied_back_for_a_view():
    """A view read after its base is written in place must see the write: copying the base back to eager's
    strides for the view would hide it, so the pass refuses."""
    optimized = optimize(WritesThroughAView())
    assert optimized.fxopt_report["channels_last"].stats == {"refused_layout_not_restored": 1}


def test_in_place_op_inside_keeps_channels_last():
    """A model's own in-place ReLU on an NHWC intermediate writes that tensor itself (it is pointwise)."""
    optimized = optimize(InplaceInside())
    assert optimized.fxopt_report["channels_last"].stats == {"converted": 1}


def test_networks_without_images_are_skipped():
    """A graph with no 4-D input reaching a convolution is skipped with the reason."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).double().eval()
    optimized = fxopt.optimize(model, (torch.randn(2, 4, dtype=torch.float64),), mode="inference", passes=PASSES)
    assert "no 4-D floating-point input" in optimized.fxopt_report["channels_last"].skipped


def test_training_mode_is_refused_by_name():
    """The pass runs in inference only: naming it for training is a clear error."""
    with pytest.raises(FxoptError, match="does not run in training mode"):
        fxopt.optimize(ConvNet().double(), IMAGES, mode="training", passes=PASSES)


def test_kept_only_when_faster():
    """By default the rewrite is timed against the original and kept only if faster: on a small net whose one
    convolution feeds a flatten the copies cost more, so it is refused with both times, and the graph is the
    original's; a bad value of the option is a clear error before anything is captured."""
    optimized = optimize(ConvNet("flatten"), keep="when_faster")
    report = optimized.fxopt_report["channels_last"]
    before, after = report.figures["forward_ms"]["before"], report.figures["forward_ms"]["after"]
    if after >= before:
        assert report.stats == {"refused_not_faster": 1} and _clones(optimized, torch.channels_last) == 0
    else:
        assert report.stats == {"converted": 1} and _clones(optimized, torch.channels_last) == 1
    with pytest.raises(FxoptError, match="channels_last='sometimes': expected one of 'when_faster', 'always'"):
        fxopt.optimize(ConvNet("flatten").double().eval(), IMAGES, mode="inference", passes=PASSES,
                       channels_last="sometimes")


def test_timing_chooses_the_faster_graph(monkeypatch):
    """Whatever the clock says decides: a rewrite timed slower is undone (the module runs the original code again),
    one timed faster is kept."""
    import fxopt.passes.channels_last as channels_last

    for times, stats in (([1.0, 2.0], {"refused_not_faster": 1}), ([2.0, 1.0], {"converted": 1})):
        monkeypatch.setattr(channels_last, "graph_seconds", lambda graphs, t=times: t)
        optimized = optimize(ConvNet("flatten"), keep="when_faster")
        assert optimized.fxopt_report["channels_last"].stats == stats
        assert ("channels_last" in optimized.graph_module.code) == ("converted" in stats)
