"""A convolution backward's scratch (fxopt.analysis.conv_scratch, measured) in the eager memory model, against the
allocator."""
from __future__ import annotations

import pytest
import torch

from fxopt.analysis.conv_scratch import conv_backward_scratch
from fxopt.checkpointing.profile import estimate, step_profile
from fxopt.analysis.ops import match_conv
from fxopt.measure import measure_allocator_peak

from graph_forms import exported_graph


class _ConvNet(torch.nn.Module):
    """A small stem, then the convolution whose backward holds the step's peak."""

    def __init__(self, channels: int, kernel: int, groups: int, channels_last: bool):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, channels, 1)
        self.conv = torch.nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=groups)
        self.channels_last = channels_last

    def forward(self, x):
        y = self.stem(x)
        if self.channels_last:
            y = y.contiguous(memory_format=torch.channels_last)
        return self.conv(y.relu())


CASES = {
    # HF ResNet-50's last stage in small: oneDNN's weight gradient and the dense one, both weight-sized
    "plain_3x3_weight_sized": (_ConvNet(256, 3, 1, channels_last=False), torch.randn(2, 3, 4, 4)),
    # HF ConvNeXt's depthwise 7x7 on channels-last strides: oneDNN's partial sums of the weight gradient
    "channels_last_depthwise_7x7": (_ConvNet(64, 7, 64, channels_last=True), torch.randn(2, 3, 8, 8)),
    # the same on plain strides, as HF ConvNeXt runs it (a rule of oneDNN's phases predicted this peak 25% high)
    "plain_depthwise_7x7": (_ConvNet(96, 7, 96, channels_last=False), torch.randn(2, 3, 28, 28)),
}


@pytest.mark.parametrize("case", CASES)
def test_predicted_peak_counts_the_convolution_backward_scratch(case):
    """Where a step's peak lies in a convolution's backward, the predicted peak is within 10% of the allocator's."""
    torch.manual_seed(0)
    model, x = CASES[case]
    model.train()
    profile = step_profile(exported_graph(model, (x,)))
    conv = max(profile.steps, key=lambda s: s.backward_scratch or 0)
    measured = measure_allocator_peak(model, (x,))
    assert conv.backward_scratch > 0.2 * measured  # without the scratch the test fails
    assert estimate(profile).peak == pytest.approx(measured, rel=0.1)


LAYERS = {  # (conv, input): the phases that hold the most differ
    "weight_sized": (torch.nn.Conv2d(256, 256, 3, padding=1, bias=False), torch.randn(2, 256, 4, 4)),
    "activation_sized": (torch.nn.Conv2d(16, 16, 3, padding=1, bias=False), torch.randn(2, 16, 32, 32)),
    "strided_1x1": (torch.nn.Conv2d(32, 64, 1, stride=2, bias=False), torch.randn(2, 32, 32, 32)),
    "channels_last_3x3": (torch.nn.Conv2d(16, 16, 3, padding=1, bias=False),
                          torch.randn(2, 16, 16, 16).contiguous(memory_format=torch.channels_last)),
}


@pytest.mark.parametrize("layer", LAYERS)
def test_scratch_of_the_matched_call_matches_the_allocator(layer):
    """The scratch measured for the call built from the graph's convolution is exactly what the allocator sees
    autograd's `convolution_backward` hold beyond the gradients it returns."""
    from fxopt._torch_private import allocation_peak, allocation_profile

    conv, x = LAYERS[layer]
    node = next(n for n in exported_graph(conv, (x,)).graph.nodes if n.op == "call_function")
    y = conv(x).detach()
    grad_y = torch.randn_like(y)

    def backward():
        return torch.ops.aten.convolution_backward(grad_y, x, conv.weight.detach(), None, list(conv.stride),
                                                   list(conv.padding), list(conv.dilation), False, [0, 0],
                                                   conv.groups, [True, True, False])

    backward()  # oneDNN builds its primitives once
    with allocation_profile() as prof:
        grads = backward()
    peak, _ = allocation_peak(prof)
    returned = sum(g.untyped_storage().nbytes() for g in grads if g is not None)
    assert conv_backward_scratch(match_conv(node), True, True) == peak - returned


def test_float64_convolution_scratch_is_measured_too():
    """A float64 convolution runs ATen's Slow2d, not oneDNN; its backward's column buffer is measured like oneDNN's
    scratch, so the predicted step peak is the allocator's (a rule modelling oneDNN alone counted 0: 9.4 MB under)."""
    torch.manual_seed(0)
    model, x = _ConvNet(64, 3, 1, channels_last=False).double().train(), torch.randn(2, 3, 32, 32, dtype=torch.float64)
    profile = step_profile(exported_graph(model, (x,)))
    assert estimate(profile).peak == pytest.approx(measure_allocator_peak(model, (x,)), rel=0.001)


def test_scratch_follows_the_thread_count():
    """An unstrided 1x1 convolution on a small batch runs ATen's Slow2d (no scratch) single-threaded and oneDNN
    (scratch) with two threads: each thread count gets its own measurement, not the first one cached."""
    conv, x = torch.nn.Conv2d(32, 64, 1, bias=False), torch.randn(2, 32, 16, 16)
    call = match_conv(next(n for n in exported_graph(conv, (x,)).graph.nodes if n.op == "call_function"))
    threads = torch.get_num_threads()
    try:
        scratch = []
        for count in (1, 2):
            torch.set_num_threads(count)
            scratch.append(conv_backward_scratch(call, True, True))
    finally:
        torch.set_num_threads(threads)
    assert scratch[0] == 0 < scratch[1], scratch
