"""prepack_conv_weights: channels-last CPU convolutions run oneDNN's convolution on weights reordered once.

Each case compares the result with the original in float32 (oneDNN's op takes no float64; both run the same
oneDNN convolution, so the tolerance is 1e-5), outputs and their strides, and the model's buffers; it checks the
report, including each case where the pass must leave a convolution alone.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.errors import FxoptError
from fxopt.passes.prepack_conv_weights import onednn_conv2d
from fxopt.pipeline.pipelines import DEFAULT_PIPELINES

pytestmark = [pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")]

IMAGES = (torch.randn(2, 3, 12, 12),)
PASSES = ["fold_conv_bn", "channels_last", "inplace_relu", "prepack_conv_weights"]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


class ConvNet(nn.Module):
    """Conv-BN-ReLU, a depthwise conv with a residual add, a strided 1x1 conv and a flatten (a view needing
    eager's contiguous strides back)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pointwise = nn.Conv2d(8, 16, 1, stride=2)
        self.fc = nn.Linear(16 * 6 * 6, 4)

    def forward(self, x):
        y = F.relu(self.bn(self.conv1(x)))
        y = y + self.depthwise(y)
        return self.fc(self.pointwise(y).view(y.shape[0], -1))


def _model(cls=ConvNet) -> nn.Module:
    torch.manual_seed(0)
    model = cls().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return model


def _optimized(model: nn.Module, passes=PASSES, inputs=IMAGES) -> nn.Module:
    options = {"channels_last": "always"} if "channels_last" in passes else {}
    return fxopt.optimize(copy.deepcopy(model), inputs, mode="inference", passes=passes, **options)


def _assert_like_eager(model: nn.Module, optimized: nn.Module, inputs) -> None:
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    with torch.no_grad():
        expected, got = model(*inputs), optimized(*inputs)
    torch.testing.assert_close(got, expected, **TOLERANCE)
    assert got.stride() == expected.stride()
    for name, value in model.named_buffers():
        torch.testing.assert_close(value, buffers[name], rtol=0, atol=0)


def _onednn_convolutions(optimized) -> int:
    """oneDNN convolutions in an optimized model's graph, or in a GraphModule."""
    graph = optimized.graph if isinstance(optimized, torch.fx.GraphModule) else optimized.graph_module.graph
    return sum(n.target is onednn_conv2d for n in graph.nodes)


def test_every_channels_last_convolution_is_prepacked_and_computes_eagers_values():
    """All three convolutions (the folded one, a depthwise and a strided 1x1) run oneDNN's convolution on a
    reordered weight, the first with its ReLU inside, the depthwise one with the residual add; outputs and their
    strides equal eager's, and no buffer changes."""
    model = _model()
    optimized = _optimized(model)
    report = optimized.fxopt_report["prepack_conv_weights"]
    assert report.stats == {"prepacked": 3, "fused": 2} and _onednn_convolutions(optimized) == 3
    assert not any(n.target in (torch.ops.aten.relu_.default, torch.ops.aten.add.Tensor)
                   for n in optimized.graph_module.graph.nodes)
    _assert_like_eager(model, optimized, IMAGES)


class Activations(nn.Module):
    """ReLU6 (hardtanh between 0 and 6) and hardtanh(-1, 1) after convolutions, each the output's one reader; a
    ReLU whose input is also read by the add after it."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, 8, 3, padding=1) for c in (3, 8, 8))

    def forward(self, x):
        x = F.relu6(self.convs[0](x.contiguous(memory_format=torch.channels_last)), inplace=True)
        x = F.hardtanh(self.convs[1](x), -1.0, 1.0)
        y = self.convs[2](x)
        return F.relu(y) + y


def test_relu6_and_hardtanh_run_inside_the_convolution_where_nothing_else_reads_it():
    """ReLU6 and hardtanh with their bounds are fused into the convolution before them; a ReLU whose input the add
    also reads is not (the add must see the values before it): outputs equal eager's."""
    torch.manual_seed(0)
    model = Activations().eval()
    optimized = fxopt.optimize(copy.deepcopy(model), IMAGES, mode="inference", passes=["prepack_conv_weights"])
    assert optimized.fxopt_report["prepack_conv_weights"].stats == {"prepacked": 3, "fused": 2}
    _assert_like_eager(model, optimized, (IMAGES[0] * 4,))


class Residuals(nn.Module):
    """Additions after convolutions: ResNet's (the downsampling convolution added, then a ReLU), one into the
    convolution's output in place (`out += x`), one the other way round (`x += conv(x)`: it writes into `x`), one
    with alpha 2, one of a broadcast tensor, and one whose other operand is written in place between the convolution
    and the addition."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(7))
        self.stem = nn.Conv2d(3, 8, 1)

    def forward(self, x):
        x = self.stem(x.contiguous(memory_format=torch.channels_last)) * 1
        x = F.relu(self.convs[0](x) + self.convs[1](x))
        y = self.convs[2](x)
        y += x
        x = x * 1
        x += self.convs[3](y)
        y = torch.add(self.convs[4](x), y, alpha=2)
        y = self.convs[5](y) + self.stem.bias.view(1, 8, 1, 1)
        z = self.convs[6](y)
        y.relu_()
        return z + y


def test_a_residual_addition_and_its_relu_run_inside_the_convolution_where_that_gives_eagers_values():
    """ResNet's addition (with the ReLU after it) and an in-place `out += x` into the convolution's output run
    inside the oneDNN convolution; additions into another tensor, with alpha 2, of a broadcast tensor, or of a tensor
    written between the convolution and the addition stay, and the values equal eager's."""
    torch.manual_seed(0)
    model = Residuals().eval()
    optimized = fxopt.optimize(copy.deepcopy(model), IMAGES, mode="inference", passes=["prepack_conv_weights"])
    fused = [s.detail for s in optimized.fxopt_report["prepack_conv_weights"].sites if s.action == "fused"]
    assert len(fused) == 3, fused
    additions = [n for n in optimized.graph_module.graph.nodes
                 if n.target in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)]
    assert len(additions) == 4
    _assert_like_eager(model, optimized, IMAGES)
    _assert_like_eager(model, optimized, (torch.randn(3, 3, 10, 14),))


class SumsInPlace(nn.Module):
    """Additions fused into convolutions whose added tensor: nothing reads after (a downsampling convolution's
    output: written in place), is the forward's input, is returned as well, or is read again later."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 3, 3, padding=1) for _ in range(6))

    def forward(self, x):
        y = F.relu(self.convs[0](x) + self.convs[1](x))
        z = self.convs[2](y) + x
        kept = self.convs[3](z) * 1
        w = self.convs[4](z) + kept
        again = self.convs[5](w) + z
        return again + z.mean(), kept


def test_a_sum_is_written_into_the_added_tensor_only_where_nothing_reads_it_after():
    """One of four fused additions writes its sum into the added tensor's memory: not into the caller's input, an
    output, or a tensor read later; the caller's input keeps its values, outputs equal eager's, and the eager path
    still freezes (the in-place write reaches no parameter)."""
    torch.manual_seed(0)
    model = SumsInPlace().eval()
    x = torch.randn(2, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    optimized = fxopt.optimize(copy.deepcopy(model), (x,), mode="inference", passes=["prepack_conv_weights"])
    assert optimized.fxopt_report["prepack_conv_weights"].stats == {"prepacked": 6, "fused": 5, "summed_in_place": 1}
    before = x.clone()
    with torch.no_grad():
        got, expected = optimized(x), model(x)
    torch.testing.assert_close(got, expected, **TOLERANCE)
    torch.testing.assert_close(x, before, rtol=0, atol=0)


def test_summing_in_place_keeps_the_weights_frozen(monkeypatch):
    """Frozen with a sum written in place, calls reorder no weight: the write is seen to reach no parameter."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    optimized = fxopt.optimize(SumsInPlace().eval(), (x,), mode="inference", passes=["prepack_conv_weights"])
    reorders = _counting_reorders(monkeypatch)
    with torch.no_grad():
        for _ in range(3):
            optimized(x)
    assert not reorders


class RandomResidualNet(nn.Module):
    """Random convolutions (alone, or added to an earlier value on either side, with or without a ReLU after),
    additions, ReLUs and in-place scalings over earlier values (seeded): the places where an addition may or may not
    be fused into a convolution, or written into the added tensor."""

    KINDS = ("conv", "conv+", "+conv", "conv+relu", "add", "relu", "scale_")

    def __init__(self, seed: int):
        super().__init__()
        rng = random.Random(seed)
        self.convs = nn.ModuleList(nn.Conv2d(4, 4, k, padding=k // 2) for k in rng.choices([1, 3], k=8))
        self.steps = []  # (kind, conv index, input, other)
        for count in range(1, len(self.convs) + 1):
            kind = rng.choice(self.KINDS)
            scaled = rng.randrange(1, count) if count > 1 else 0  # never the caller's input
            self.steps.append((kind, count - 1, rng.randrange(count), scaled if kind == "scale_" else rng.randrange(count)))
        last = len(self.steps)
        self.outputs = sorted({last, *rng.sample(range(1, last + 1), k=rng.randint(0, 2))})

    def forward(self, x):
        values = [x]
        for kind, conv, a, b in self.steps:
            if kind == "conv":
                values.append(self.convs[conv](values[a]))
            elif kind == "conv+":
                values.append(self.convs[conv](values[a]) + values[b])
            elif kind == "+conv":
                values.append(values[b] + self.convs[conv](values[a]))
            elif kind == "conv+relu":
                values.append(F.relu(self.convs[conv](values[a]) + values[b]))
            elif kind == "add":
                values.append(values[a] + values[b])
            elif kind == "relu":
                values.append(F.relu(values[a]))
            else:  # scaled in place: later readers see the new values, in eager as in fxopt
                values.append(values[b].mul_(0.5) if b > 0 else values[b] * 0.5)
        return tuple(values[i] for i in self.outputs)


@pytest.mark.parametrize("seed", range(40))
def test_random_residual_networks_compute_eagers_values_and_leave_the_input_alone(seed):
    """Over random networks of convolutions, additions, ReLUs and in-place writes (channels-last float32), the
    prepacked graph with its fused and in-place sums gives eager's outputs and leaves the caller's input as it was."""
    torch.manual_seed(seed)
    model = RandomResidualNet(seed).eval()
    x = torch.randn(2, 4, 6, 6).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        optimized = fxopt.optimize(copy.deepcopy(model), (x,), mode="inference", passes=["prepack_conv_weights"])
        before = x.clone()
        got, expected = optimized(x), model(x.clone())
    torch.testing.assert_close(got, expected, **TOLERANCE)
    torch.testing.assert_close(x, before, rtol=0, atol=0)


def _counting_reorders(monkeypatch) -> list:
    """Count the weight reorders the graphs run from now on."""
    from fxopt import _torch_private

    ops = _torch_private.onednn_convolution_ops()
    calls = []

    def counted(*args):
        calls.append(1)
        return ops.reorder(*args)
    monkeypatch.setattr(_torch_private, "onednn_convolution_ops", lambda: ops._replace(reorder=counted))
    return calls


def test_the_eager_paths_freezing_reorders_each_weight_once(monkeypatch):
    """Frozen at compile time, the calls after it reorder no weight; once a parameter changes, each call reorders
    the three weights anew (as ATen's convolution does inside)."""
    model = _model()
    optimized = _optimized(model)
    reorders = _counting_reorders(monkeypatch)
    with torch.no_grad():
        for _ in range(3):
            optimized(*IMAGES)
        assert not reorders
        next(optimized.parameters()).add_(0.1)
        with pytest.warns(UserWarning, match="changed after fxopt froze it"):
            optimized(*IMAGES)
    assert len(reorders) == 3


def test_new_sizes_run_the_same_packed_weights():
    """Weights reordered for the example's sizes serve every batch and resolution (oneDNN's convolution takes any
    input for a reordered weight), with eager's values."""
    model = _model()
    optimized = _optimized(model)
    for shape in ((5, 3, 12, 12), (1, 3, 12, 12), (3, 3, 12, 12)):
        _assert_like_eager(model, optimized, (torch.randn(shape),))


def test_a_parameter_changed_after_optimizing_is_followed():
    """A step on the result's parameters after optimize() (an inference result stands for a private copy): the
    frozen, reordered weights are no longer used and the graph reorders the current weights on each call, so
    outputs follow the new parameters, with fxopt's one warning."""
    model = _model()
    optimized = _optimized(model)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        optimized(*IMAGES)
        for p, q in zip(optimized.parameters(), reference.parameters()):
            p.add_(0.1)
            q.add_(0.1)
    with pytest.warns(UserWarning, match="changed after fxopt froze it"):
        _assert_like_eager(reference, optimized, IMAGES)


def test_in_the_default_pipeline_it_runs_last_and_not_in_training():
    """The default inference pipeline ends with it (the passes before it see ATen's convolutions); the training
    pipeline has none of it; naming it for training is a clear error."""
    assert DEFAULT_PIPELINES["inference"][-1] == "prepack_conv_weights"
    assert "prepack_conv_weights" not in DEFAULT_PIPELINES["training"]
    with pytest.raises(FxoptError, match="does not run in training mode"):
        fxopt.optimize(_model().train(), IMAGES, mode="training", passes=["prepack_conv_weights"])


def test_a_result_switched_to_training_gets_eagers_gradients():
    """Optimized in eval mode, then trained: the training graph has no oneDNN convolution (it has no derivative),
    and the loss and every gradient equal eager's."""
    model = _model()
    optimized = _optimized(model)
    reference = copy.deepcopy(model)
    optimized.train(), reference.train()
    optimized(*IMAGES).sum().backward()
    reference(*IMAGES).sum().backward()
    assert _onednn_convolutions(optimized) == 0
    for (name, p), q in zip(optimized.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOLERANCE, msg=name)


def test_a_contiguous_input_is_refused():
    """Without channels_last before it, the convolution's input is contiguous: oneDNN's op would return
    channels-last where ATen returns contiguous, so the pass refuses."""
    model = _model()
    optimized = _optimized(model, passes=["prepack_conv_weights"])
    assert optimized.fxopt_report["prepack_conv_weights"].stats == {"refused_not_channels_last": 3}
    assert _onednn_convolutions(optimized) == 0
    _assert_like_eager(model, optimized, IMAGES)


def test_float64_is_refused():
    """oneDNN's convolution takes no float64: a float64 model keeps ATen's convolutions."""
    model = _model().double()
    inputs = (IMAGES[0].double(),)
    optimized = _optimized(model, inputs=inputs)
    assert optimized.fxopt_report["prepack_conv_weights"].stats == {"refused_not_float32_cpu": 3}
    _assert_like_eager(model, optimized, inputs)


class InputWeight(nn.Module):
    """A convolution whose weight is the caller's tensor: nothing to reorder once."""

    def forward(self, x, weight):
        return F.conv2d(x.contiguous(memory_format=torch.channels_last), weight, padding=1)


def test_a_weight_from_an_input_is_refused():
    """The weight is a graph input, not a parameter: it cannot be reordered once, so the pass refuses."""
    model = InputWeight().eval()
    inputs = (IMAGES[0], torch.randn(4, 3, 3, 3))
    optimized = fxopt.optimize(model, inputs, mode="inference", passes=["prepack_conv_weights"])
    assert optimized.fxopt_report["prepack_conv_weights"].stats == {"refused_weight_not_constant": 1}
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs), rtol=0, atol=0)


class StringPaddings(nn.Module):
    """padding='valid', 'same' with an odd kernel (one width on both sides) and 'same' with an even one (one more on
    the right and bottom than on the left and top)."""

    def __init__(self):
        super().__init__()
        self.valid = nn.Conv2d(3, 4, 1, padding="valid")
        self.same_odd = nn.Conv2d(4, 4, 3, padding="same", dilation=2)
        self.same_even = nn.Conv2d(4, 4, 4, padding="same")

    def forward(self, x):
        return self.same_even(self.same_odd(self.valid(x.contiguous(memory_format=torch.channels_last))))


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # eager's own, on the even kernel
def test_string_paddings_are_made_explicit_where_one_width_serves_both_sides():
    """'valid' and an odd 'same' become explicit widths oneDNN takes; an even 'same', which pads one side more, is
    left to ATen: outputs equal eager's."""
    torch.manual_seed(0)
    model = StringPaddings().eval()
    optimized = fxopt.optimize(copy.deepcopy(model), IMAGES, mode="inference", passes=["prepack_conv_weights"])
    assert optimized.fxopt_report["prepack_conv_weights"].stats == {"prepacked": 2, "refused_unsupported_conv": 1}
    _assert_like_eager(model, optimized, IMAGES)


def test_under_torch_compile_it_is_skipped():
    """Through AOTAutograd (Inductor's freezing packs weights itself) the pass does nothing and says why."""
    reports = []
    model = _model()
    compiled = torch.compile(copy.deepcopy(model), backend="fxopt",
                             options={"inner": "aot_eager", "report": reports.append})
    with torch.no_grad():
        torch.testing.assert_close(compiled(*IMAGES), model(*IMAGES), **TOLERANCE)
    assert "Inductor's freezing packs the weights itself" in reports[0]["prepack_conv_weights"].skipped


def test_measuring_and_estimating_a_prepacked_graph():
    """fxopt.measure's storage count takes the oneDNN weights an unfrozen graph reorders in the call (opaque: no
    storage to show), and the FLOP estimate runs the helpers on fake tensors as ATen's convolution: the same FLOPs
    as the graph before the pass."""
    from fxopt.analysis.costs import estimate_costs, placeholder_values
    from fxopt.measure import measure_peak

    model = _model()
    unpacked = _optimized(model, passes=PASSES[:-1])
    optimized = _optimized(model)
    with torch.no_grad(), pytest.warns(UserWarning, match="changed after fxopt froze it"):
        next(optimized.parameters()).add_(0.1)  # the graph now reorders the weights in every call
        assert measure_peak(lambda: optimized(*IMAGES), optimized, IMAGES) > 0
    flops = [estimate_costs(m.graph_module, placeholder_values(m.graph_module), training=False).flops
             for m in (unpacked, optimized)]
    assert flops[0] == flops[1] > 0


def test_channels_last_times_its_rewrite_as_prepacked_and_frozen(monkeypatch):
    """With prepack_conv_weights after it, channels_last times the converted graph with its convolutions prepacked
    and both graphs frozen (only channels-last convolutions skip oneDNN's weight reorder); without it, the graphs
    as they are."""
    import fxopt.passes.channels_last as channels_last

    timed = []

    def record(graphs, frozen=frozenset()):
        timed.append((graphs, frozen))
        return [2.0, 1.0]
    monkeypatch.setattr(channels_last, "graph_seconds", record)
    for passes, prepacked in ((["channels_last", "prepack_conv_weights"], True), (["channels_last"], False)):
        timed.clear()
        fxopt.optimize(copy.deepcopy(_model()), IMAGES, mode="inference", passes=passes)
        (original, converted), frozen = timed[0]
        assert bool(frozen) == prepacked
        assert _onednn_convolutions(converted) == (3 if prepacked else 0) and _onednn_convolutions(original) == 0


def test_the_command_line_reports_a_prepacked_graph(tmp_path, monkeypatch, capsys):
    """`fxopt inspect --channels-last always` on the seed example prepacks its convolution and fuses its ReLU, and the
    page is written (its memory figures measure the prepacked graph)."""
    import pathlib

    from fxopt.frontends.cli import main

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    page = tmp_path / "seed.html"
    assert main(["inspect", "examples/seed_net.py:SeedNet", "--input-shape", "2x3x32x32", "--channels-last", "always",
                 "--html", str(page)]) == 0
    printed = capsys.readouterr().out
    assert "fused: 1, prepacked: 1" in printed and "MFLOP → ?" not in printed
    assert "prepack_conv_weights" in page.read_text()
