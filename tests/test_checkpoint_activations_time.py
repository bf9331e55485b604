"""checkpoint_activations' time model: measured per-op times, predictions checked against measurement."""
from __future__ import annotations

import statistics
import time

import pytest
import torch

import fxopt
from fxopt.checkpointing._batch_norm_replay import replayed_batch_norm
from fxopt.checkpointing._dropout_replay import replayed_dropout_p
from fxopt.checkpointing._replay_times import node_seconds, replay_key
from fxopt.measure import measure_allocator_peak

from graph_forms import exported_graph
from named_regions import extract_regions, named_regions
from test_checkpoint_activations import deep_mlp


def _bn_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Dropout(0.5)).train()


def test_timing_leaves_no_trace():
    """Timing the graph returns a positive time per call node (and per replay: a dropout's from its mask, a train-mode
    BatchNorm's from its statistics) and leaves BatchNorm statistics and the RNG as they were."""
    model, x = _bn_net(), torch.randn(2, 3, 8, 8)
    gm = exported_graph(model, (x,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    seconds = node_seconds(gm)
    calls = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    replays = [replay_key(n.name) for n in gm.graph.nodes if replayed_dropout_p(n) is not None or replayed_batch_norm(n)]
    assert replays and sorted(seconds) == sorted(calls + replays) and all(s > 0 for s in seconds.values())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_region_overhead_is_measured_once():
    """The per-region overhead is measured (positive, a selective region's per-op cost above a whole one's) and
    cached."""
    from fxopt.checkpointing._region_overhead import region_overhead

    first = region_overhead("cpu")
    assert first is region_overhead("cpu")
    assert first.per_region > 0 and first.selective_per_op >= first.per_op


def test_region_overhead_draws_nothing_from_the_callers_generator():
    """Measuring the overhead leaves torch's generator where it was (its chain's input is not drawn)."""
    from fxopt.checkpointing import _region_overhead as region_overhead

    region_overhead._measured.cache_clear()
    rng = torch.get_rng_state()
    region_overhead.region_overhead("cpu")
    assert torch.equal(rng, torch.get_rng_state())


def test_region_overhead_chain_saves_a_tensor_per_op():
    """The chain region_overhead times saves one tensor per op, so a region's per-op saved-tensor hooks are priced."""
    from fxopt.checkpointing._region_overhead import CHAIN, _chain

    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        _chain(torch.randn(8, requires_grad=True), CHAIN)
    assert len(packed) >= CHAIN


def test_predicted_peak_within_ten_percent():
    """The predicted step peak is within 10% of the allocator's, before and after checkpointing at 0.5."""
    torch.manual_seed(0)
    model, x = deep_mlp(depth=8, width=128), torch.randn(128, 128)
    opt = fxopt.optimize(model, (x,), mode="training", passes=["checkpoint_activations"], memory_budget=0.5)
    figures = opt.fxopt_report["checkpoint_activations"].figures
    assert figures["peak_estimate_before"] == pytest.approx(measure_allocator_peak(model, (x,)), rel=0.1)
    assert figures["peak_estimate_after"] == pytest.approx(measure_allocator_peak(opt, (x,)), rel=0.1)


def test_a_met_budget_is_not_reported_unreachable():
    """A budget some plan fits warns of nothing, records no `budget_unreachable` and has no NOT met headline."""
    import warnings

    torch.manual_seed(0)
    model, x = deep_mlp(depth=8, width=128), torch.randn(128, 128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxopt.optimize(model, (x,), mode="training", passes=["checkpoint_activations"], memory_budget=0.5)
    result = opt.fxopt_report["checkpoint_activations"]
    assert result.figures["budget_met"] and result.figures["regions"]
    assert not result.stats["refused_budget_unreachable"] and "headline" not in result.figures
    assert not [w for w in caught if "NOT met" in str(w.message)]


@pytest.mark.parametrize("replay_dropout", [True, False], ids=["masks_kept", "drawn_again"])
def test_predicted_peak_of_a_plan_from_the_first_op(replay_dropout):
    """A plan whose first region starts at the first linear (the planner may pick it) is predicted within 10%."""
    from fxopt.checkpointing.profile import estimate, step_profile

    torch.manual_seed(0)
    model, x = deep_mlp(depth=8, width=128), torch.randn(128, 128)
    opt = fxopt.optimize(model, (x,), mode="training", passes=[])
    profile = step_profile(opt.graph_module)
    regions = named_regions(profile, (("linear", "dropout_2"), ("linear_3", "gelu_5")), replay_dropout=replay_dropout)
    predicted = estimate(profile, regions).peak  # dropout_2's backward: its noise and mask were counted twice
    extract_regions(opt.graph_module, profile, regions)
    assert predicted == pytest.approx(measure_allocator_peak(opt, (x,)), rel=0.1)


class _PaddedDepthwise(torch.nn.Module):
    """MobileNetV2's block as Hugging Face writes it: explicit constant padding before a depthwise conv."""

    def __init__(self, c: int):
        super().__init__()
        self.expand, self.bn1 = torch.nn.Conv2d(c, 4 * c, 1), torch.nn.BatchNorm2d(4 * c)
        self.depthwise, self.bn2 = torch.nn.Conv2d(4 * c, 4 * c, 3, groups=4 * c), torch.nn.BatchNorm2d(4 * c)
        self.project, self.bn3 = torch.nn.Conv2d(4 * c, c, 1), torch.nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.nn.functional.relu6(self.bn1(self.expand(x)))
        y = torch.nn.functional.relu6(self.bn2(self.depthwise(torch.nn.functional.pad(y, (1, 1, 1, 1)))))
        return x + self.bn3(self.project(y))


def test_predicted_peak_within_ten_percent_with_constant_padding():
    """Constant padding keeps nothing for backward: on padded depthwise blocks the predicted peak is within 10%."""
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(*[_PaddedDepthwise(8) for _ in range(4)]).train(), torch.randn(4, 8, 32, 32)
    opt = fxopt.optimize(model, (x,), mode="training", passes=["checkpoint_activations"], memory_budget=0.5)
    figures = opt.fxopt_report["checkpoint_activations"].figures
    assert figures["peak_estimate_before"] == pytest.approx(measure_allocator_peak(model, (x,)), rel=0.1)
    assert figures["peak_estimate_after"] == pytest.approx(measure_allocator_peak(opt, (x,)), rel=0.1)


def test_predicted_peak_within_ten_percent_on_transformer_blocks():
    """Attention, GELU MLPs and dropout replayed from masks: predicted peaks within 10% at budgets 0.5 and 0.3."""
    from test_checkpoint_activations import TransformerBlock

    torch.manual_seed(0)
    model, x = torch.nn.Sequential(*[TransformerBlock(64, 4) for _ in range(3)]).train(), torch.randn(8, 32, 64)
    measured_before = measure_allocator_peak(model, (x,))
    for budget in (0.5, 0.3):
        opt = fxopt.optimize(model, (x,), mode="training", passes=["checkpoint_activations"], memory_budget=budget)
        figures = opt.fxopt_report["checkpoint_activations"].figures
        assert figures["peak_estimate_before"] == pytest.approx(measured_before, rel=0.1)
        assert figures["peak_estimate_after"] == pytest.approx(measure_allocator_peak(opt, (x,)), rel=0.1), budget


def _step_seconds(model, x, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        model(x).sum().backward()
        times.append(time.perf_counter() - start)
    return times


@pytest.mark.usefixtures("budget_may_be_unmet")
def test_predicted_recompute_time_orders_plans_as_measured():
    """Of two plans (a loose and a tight budget), the one predicted to recompute longer measures slower."""
    torch.manual_seed(0)
    model, x = deep_mlp(depth=6, width=512, p=0.0), torch.randn(256, 512)
    plans = [fxopt.optimize(model, (x,), mode="training", passes=["checkpoint_activations"], memory_budget=b)
             for b in (0.8, 0.3)]
    predicted = [p.fxopt_report["checkpoint_activations"].figures["predicted_recompute_s"] for p in plans]
    assert predicted[0] < predicted[1]
    measured = [[], []]
    for _ in range(5):  # interleaved, so the machine's load falls on both alike
        for i, plan in enumerate(plans):
            measured[i] += _step_seconds(plan, x, 1)
    medians = [statistics.median(m) for m in measured]
    assert medians[0] < medians[1], (predicted, medians)


def _conv_bn_dropout_blocks() -> torch.nn.Module:
    blocks = [torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                  torch.nn.Dropout(0.2)) for _ in range(4)]
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 1), *blocks).train()


def _calibration_block():
    """(graph, its timed profile, the block calibration would time) of four Conv-BN-ReLU-Dropout blocks."""
    from fxopt.checkpointing.profile import step_profile
    from fxopt.checkpointing.planner import region_boundaries
    from fxopt.checkpointing.calibration import calibration_span

    torch.manual_seed(0)
    model, x = _conv_bn_dropout_blocks(), torch.randn(2, 3, 32, 32)
    gm = exported_graph(model, (x,))
    profile = step_profile(gm, timed=True)
    span = calibration_span(profile, sorted(region_boundaries(profile)), [True] * len(profile.steps),
                            lambda region: True)
    assert span is not None
    return gm, profile, span


def test_region_calibration_leaves_no_trace():
    """Timing regions on a block of the graph itself gives each kind a per-region overhead (at least the chain's) and
    leaves parameters, their gradients, BatchNorm statistics and the RNG as they were."""
    from fxopt.checkpointing.calibration import calibrated_overhead

    gm, profile, span = _calibration_block()
    state = {k: v.clone() for k, v in gm.state_dict().items()}
    rng = torch.get_rng_state()
    overhead = calibrated_overhead(gm, profile, span)
    assert overhead is not None
    assert overhead.per_region >= profile.overhead.per_region > 0
    assert overhead.selective_per_region >= profile.overhead.selective_per_region > 0
    assert (overhead.per_op, overhead.selective_per_op) == (profile.overhead.per_op, profile.overhead.selective_per_op)
    assert all(torch.equal(state[k], v) for k, v in gm.state_dict().items())
    assert all(p.grad is None for p in gm.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_region_calibration_differentiates_the_weights():
    """Every block the calibration times computes its convolutions' weight gradients, as a training step does: a
    region's kept convolution always does, so a block differentiating its inputs alone priced it too dear."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fxopt.checkpointing.calibration import calibrated_overhead

    class WeightGradients(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.masks = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution_backward.default:
                self.masks.append(args[-1][1])
            return func(*args, **(kwargs or {}))

    gm, profile, span = _calibration_block()
    with WeightGradients() as recorded:
        assert calibrated_overhead(gm, profile, span) is not None
    assert recorded.masks and all(recorded.masks)


def test_a_timed_plan_reports_the_region_overhead_it_measured():
    """checkpoint_activations prices regions by a block of the graph and reports what it measured, in ms a region."""
    torch.manual_seed(0)
    model, x = _conv_bn_dropout_blocks(), torch.randn(2, 3, 32, 32)
    optimized = fxopt.optimize(model, (x,), mode="training", passes=["checkpoint_activations"], memory_budget=0.5)
    measured = optimized.fxopt_report["checkpoint_activations"].figures["region_overhead_ms"]
    assert set(measured) == {"whole", "selective"} and all(v >= 0 for v in measured.values())
