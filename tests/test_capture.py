"""Capture on torch.export: whole models as one graph, children where export refuses, nothing of the model's semantics lost.

Covers shape-dependent Python (one graph), value-dependent branches (the module stays opaque
with export's reason, its children are exported), the calls a graph may take (dynamic batch,
other calls run the original), what capture keeps (grad-mode and autocast regions, buffer and
attribute writes, ModelOutput types, user checkpointing), what it never changes on the
caller's side (parameters, buffers, plain tensor attributes, inputs), and errors.
Each test of a semantic case fails on the symbolic_trace capture this replaced.
"""
from __future__ import annotations

import copy
import random
import warnings

import numpy
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fxopt
from equivalence import assert_same_step, assert_same_training_steps, assert_state_unchanged, state_snapshot
from fxopt.capture import capture
from fxopt.capture.naming import module_path
from fxopt.capture.specialized import SpecializedCall
from test_autograd_functions import RoundStraightThrough, ViewOf
from test_guards import assert_same, step


def conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


def randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial running statistics, so a wrong fold shows in the outputs."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return model


def capture_only(model, inputs, **kw):
    """fxopt.optimize with no pass: whatever differs from eager is capture's doing."""
    return fxopt.optimize(model, inputs, passes=[], **kw)


def check_equivalent_in_both_modes(make_model, inputs, passes=("fold_conv_bn",)):
    """Eval: outputs equal; train: outputs, gradients and buffers equal."""
    torch.manual_seed(0)
    model = randomize_bn(make_model()).eval()
    optimized = fxopt.optimize(model, inputs, passes=list(passes))
    assert_same_step(model, optimized, inputs, training=False)
    model.train()
    trained = fxopt.optimize(model, inputs, passes=list(passes))
    assert_same_step(model, trained, inputs, training=True)
    return optimized, trained


def no_fallback():
    """Context failing the test if the result warns that it ran the original model."""
    caught = warnings.catch_warnings(record=True)

    class _Check:
        def __enter__(self):
            self.log = caught.__enter__()
            warnings.simplefilter("always")
            return self

        def __exit__(self, *exc):
            caught.__exit__(*exc)
            ran_original = [str(w.message) for w in self.log if "original" in str(w.message)]
            assert not ran_original, ran_original

    return _Check()


# --------------------------------------------------------------- shape-dependent and value-dependent Python

class ShapeBranchBlock(nn.Module):
    """Takes a different path depending on the input's width."""

    def __init__(self):
        super().__init__()
        self.body = conv_bn(4, 4)

    def forward(self, x):
        if x.shape[-1] > 6:
            return self.body(x) + x
        return self.body(x) * 2


class ShapeBranchModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 4)
        self.block = ShapeBranchBlock()

    def forward(self, x):
        return self.block(self.stem(x))


class IntShapeModel(nn.Module):
    """Computes a pooling size from `int(x.shape[-1])`, as Hugging Face padding code does."""

    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 8)

    def forward(self, x):
        y = self.stem(x)
        width = int(y.shape[-1])
        return nn.functional.avg_pool2d(y, width // 2)


class AsksEveryShapeQuestion(nn.Module):
    """Reads sizes every way Python code does: size(), size(i), shape, dim(), ndim, len(), dtype."""

    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 4)

    def forward(self, x):
        y = self.stem(x)
        if y.dim() != 4 or y.ndim != 4 or y.dtype != torch.float32:
            raise ValueError("expected a float32 image batch")
        batch, channels = len(y), y.size(1)
        return y.reshape(batch, channels, y.shape[2] * y.size()[3]).mean(-1)


class DataBranchModel(nn.Module):
    """Branches on the value of its input at the top, so no whole-model graph can exist."""

    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 4)
        self.positive_head = conv_bn(4, 4)
        self.negative_head = conv_bn(4, 2)

    def forward(self, x):
        y = self.stem(x)
        if x.sum() > 0:
            return self.positive_head(y)
        return self.negative_head(y)


class OnlyDataBranch(nn.Module):
    """Nothing but a value-dependent branch: there is no graph to capture."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


@pytest.mark.parametrize("make_model", [ShapeBranchModel, IntShapeModel, AsksEveryShapeQuestion])
def test_shape_dependent_python_is_one_graph(make_model):
    """Branches on sizes, `int()` of a size, every shape question: export answers them, so the whole model is one graph."""
    inputs = (torch.randn(2, 3, 8, 8),)
    optimized, trained = check_equivalent_in_both_modes(make_model, inputs, passes=())
    for result in (optimized, trained):
        assert result.fxopt_report.graphs == [""] and result.fxopt_report.opaque == []


def test_other_width_takes_the_other_branch():
    """A graph exported at width 8 must not answer width 4, where the model takes the other branch."""
    torch.manual_seed(0)
    model = randomize_bn(ShapeBranchModel()).eval()
    optimized = capture_only(model, (torch.randn(2, 3, 8, 8),))
    narrow = torch.randn(2, 3, 8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(optimized(narrow), model(narrow))


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_data_dependent_control_flow_at_the_top_is_correct_on_both_branches(mode):
    """The top stays opaque (with export's reason and the line of the user's code) while its children are exported."""
    torch.manual_seed(0)
    model = randomize_bn(DataBranchModel()).train(mode == "training")
    positive = torch.rand(2, 3, 8, 8) + 0.1
    optimized = capture_only(model, (positive,))
    report = optimized.fxopt_report
    assert [o.path for o in report.opaque] == [""]
    reason = report.opaque[0].reason
    assert "data-dependent" in reason and f"test_capture.py:{DataBranchModel.forward.__code__.co_firstlineno + 2}" in reason
    assert set(report.graphs) == {"stem", "positive_head"}
    for x in (positive, -positive):
        assert_same_step(model, optimized, (x,), training=mode == "training")


def test_nothing_capturable_is_a_clear_error():
    """A model that is one value-dependent branch raises FxoptError with export's reason, not a torch traceback."""
    with pytest.raises(fxopt.FxoptError, match="nothing in OnlyDataBranch could be captured.*data-dependent"):
        fxopt.optimize(OnlyDataBranch(), (torch.randn(3),))


def test_opaque_reason_is_never_cut_mid_word():
    """A long export message is shortened at a word boundary and still ends with where it happened."""
    torch.manual_seed(0)
    optimized = capture_only(DataBranchModel().eval(), (torch.rand(2, 3, 8, 8),))
    reason = optimized.fxopt_report.opaque[0].reason
    message, _, where = reason.rpartition(" (at ")
    assert where.endswith(")") and ":" in where
    assert len(message) <= 300 and (message.endswith(" ...") or message.endswith((")", ".")))


# --------------------------------------------------------------- calls that differ from the example

def test_capture_exports_the_example_sizes_or_a_dynamic_batch():
    """capture() exports the example's sizes (the cheapest export); with dynamic_batch, dimension 0 is symbolic, >= 2."""
    model = nn.Sequential(conv_bn(3, 4), nn.Flatten(), nn.Linear(4 * 64, 2)).eval()
    (static,) = capture(model, (torch.randn(2, 3, 8, 8),)).graphs
    assert static.call.describe() == "input_1: (2, 3, 8, 8) float32"
    (dynamic,) = capture(model, (torch.randn(2, 3, 8, 8),), dynamic_batch=True).graphs
    assert ">= 2" in dynamic.call.describe()  # e.g. "input_1: (s77, 3, 8, 8) float32; s77 >= 2"


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_another_batch_size_optimizes_again_once_with_a_dynamic_batch(mode, monkeypatch):
    """Exported at batch 2, a call at batch 5 re-optimizes once with a dynamic batch (eager's outputs and gradients,
    one warning, one guard event); batch 7 then runs that cached variant, with no new export."""
    import fxopt.capture as capture_module

    torch.manual_seed(0)
    training = mode == "training"
    model = randomize_bn(nn.Sequential(conv_bn(3, 4), nn.Flatten(), nn.Linear(4 * 64, 2))).double().train(training)
    reference = copy.deepcopy(model)
    optimized = fxopt.optimize(model, torch.randn(2, 3, 8, 8, dtype=torch.float64), mode=mode)
    exports = []
    real_export = capture_module.export_module
    monkeypatch.setattr(capture_module, "export_module",
                        lambda *args, **kwargs: exports.append(kwargs["dynamic_batch"]) or real_export(*args, **kwargs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (5, 7):
            x = torch.randn(batch, 3, 8, 8, dtype=torch.float64)
            if training:
                assert_same_training_steps(reference, optimized, (x,), steps=1)
            else:
                torch.testing.assert_close(optimized(x), reference(x), rtol=1e-9, atol=1e-9)
    assert exports == [True]
    messages = [str(w.message) for w in caught if str(w.message).startswith("fxopt")]
    assert len(messages) == 1 and "(2, 3, 8, 8)" in messages[0] and "dynamic batch dimension" in messages[0]
    events = optimized.fxopt_report.guard_events
    assert sum(events.values()) == 1 and "dynamic batch dimension" in next(iter(events))
    assert len(optimized.variants) == 2


def test_a_batch_of_one_gets_its_own_variant_once(monkeypatch):
    """Export fixes batch sizes 0 and 1: a batch-1 call, before or after the dynamic variant exists, is optimized
    for its size once (eager's outputs, one warning), and later batch-1 calls reuse that variant with no new export."""
    import fxopt.capture as capture_module

    torch.manual_seed(0)
    model = randomize_bn(nn.Sequential(conv_bn(3, 4), nn.Flatten(), nn.Linear(4 * 64, 2))).double().eval()
    optimized = fxopt.optimize(model, torch.randn(2, 3, 8, 8, dtype=torch.float64))
    exports = []
    real_export = capture_module.export_module
    monkeypatch.setattr(capture_module, "export_module",
                        lambda *args, **kwargs: exports.append(args[1][0].shape[0]) or real_export(*args, **kwargs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (1, 5, 1, 2, 7, 1):
            x = torch.randn(batch, 3, 8, 8, dtype=torch.float64)
            torch.testing.assert_close(optimized(x), model(x), rtol=1e-9, atol=1e-9)
    assert exports == [1, 5]
    messages = [str(w.message) for w in caught if str(w.message).startswith("fxopt")]
    assert any("for this batch size" in m for m in messages) and any("dynamic batch" in m for m in messages)
    assert all(v.module is not optimized.original for v in optimized.variants) and len(optimized.variants) == 3


def test_calls_the_graph_was_not_exported_for_run_the_original_without_assertion_errors():
    """Batch 1 (export specializes 0/1) or another image size: the result re-optimizes or runs the original, never an AssertionError."""
    torch.manual_seed(0)
    model = randomize_bn(nn.Sequential(conv_bn(3, 4), nn.AdaptiveAvgPool2d(1), nn.Flatten())).eval()
    optimized = capture_only(model, (torch.randn(2, 3, 8, 8),))
    for x in (torch.randn(1, 3, 8, 8), torch.randn(2, 3, 6, 6)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(optimized(x), model(x))


class FlaggedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = conv_bn(3, 3)

    def forward(self, x, double: bool = False):
        y = self.body(x)
        return y * 2 if double else y


class Parent(nn.Module):
    """Opaque itself (value branch), calling a flagged child with a flag that depends on the data."""

    def __init__(self):
        super().__init__()
        self.child = FlaggedBlock()

    def forward(self, x):
        return self.child(x, double=bool(x.mean() > 0))


def test_exported_child_runs_the_original_for_other_flags():
    """The child is exported for the flag of the example call; the other flag runs the original child."""
    torch.manual_seed(0)
    model = randomize_bn(Parent()).eval()
    x = torch.rand(2, 3, 8, 8)
    optimized = capture_only(model, (x,))
    child = optimized.graph_module.child
    assert isinstance(child, SpecializedCall)
    assert child.mismatch((x,), {"double": True}) is None
    assert "double" in child.mismatch((x,), {"double": False})
    for inputs in ((x,), (-x,)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert_same_step(model, optimized, inputs, training=False)


class ReadsTrainingFlag(nn.Module):
    """Export bakes `self.training` into the graph as dropout's `train` argument."""

    def __init__(self):
        super().__init__()
        self.body = conv_bn(3, 3)

    def forward(self, x):
        return nn.functional.dropout(self.body(x), 0.5, self.training)


def test_graph_that_baked_the_training_flag_is_not_used_in_the_other_mode():
    """Optimized for training, then switched to eval (a validation loop): the result must not keep dropping out."""
    torch.manual_seed(0)
    model = ReadsTrainingFlag().train()
    x = torch.randn(2, 3, 8, 8)
    optimized = capture_only(model, (x,), mode="training")
    optimized.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(optimized(x), copy.deepcopy(model).eval()(x))
    optimized.train()
    with pytest.warns(UserWarning, match="switched to the variant it had already optimized"):
        assert_same_step(model.train(), optimized, (x,), training=True)


def test_failing_module_is_named_when_the_model_rejects_the_inputs():
    """A shape the model rejects names the module that failed and the shapes it was given."""
    model = nn.Sequential(conv_bn(3, 4), nn.Flatten(), nn.Linear(4 * 8 * 8, 2))
    with pytest.raises(fxopt.FxoptError, match=r"module '2' \(Linear\) failed on inputs \[\(2, 144\) float32\]"):
        fxopt.optimize(model, (torch.randn(2, 3, 6, 6),))


def test_converted_result_runs_converted_everywhere():
    """After `result.double()` a float64 call gives float64 eager results, whatever the result runs."""
    torch.manual_seed(0)
    model = randomize_bn(ShapeBranchModel()).eval()
    optimized = capture_only(model, (torch.randn(2, 3, 8, 8),))
    optimized.double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = optimized(x)
    torch.testing.assert_close(got, copy.deepcopy(model).double()(x))
    assert got.dtype == torch.float64


# --------------------------------------------------------------- semantics capture must keep

class NoGradRegions(nn.Module):
    """Stops gradients three ways: a `no_grad` block, `set_grad_enabled(False)`, a `@torch.no_grad()` helper."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    @torch.no_grad()
    def frozen(self, x):
        return self.c(x)

    def forward(self, x):
        with torch.no_grad():
            y = self.a(x)
        with torch.set_grad_enabled(False):
            z = self.b(x)
        return self.head(x + y + z + self.frozen(x))


def test_no_grad_regions_are_kept():
    """Inside no_grad, set_grad_enabled(False) or a no_grad helper, no gradient may flow (eager leaves those weights at None)."""
    torch.manual_seed(0)
    model = NoGradRegions().train()
    x = torch.randn(3, 4)
    optimized = capture_only(model, (x,), mode="training")
    optimized(x).sum().backward()
    assert model.a.weight.grad is None and model.b.weight.grad is None and model.c.weight.grad is None
    model.zero_grad(set_to_none=True)
    assert_same_step(model, optimized, (x,), training=True)
    assert "wrap_with_set_grad_enabled" in optimized.graph_module.code


class AutocastRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.inner(x)
        return y, self.outer(x)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_autocast_region_is_kept(mode):
    """A bfloat16 autocast block inside forward still computes in bfloat16; code after it in float32."""
    torch.manual_seed(0)
    model = AutocastRegion().train(mode == "training")
    x = torch.randn(4, 8)
    optimized = capture_only(model, (x,), mode=mode)
    inside, after = optimized(x)
    assert inside.dtype == torch.bfloat16 and after.dtype == torch.float32
    assert_same_step(model, optimized, (x,), training=mode == "training")


class CountsCalls(nn.Module):
    """Writes state on every call: a registered buffer (`+=`), a plain tensor attribute, an EMA parameter."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.plain_calls = torch.zeros(())
        self.ema = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x):
        self.calls += 1
        self.plain_calls.add_(1)
        with torch.no_grad():
            self.ema.mul_(0.5).add_(x.mean(0))
        return self.linear(x) * self.calls + self.plain_calls + self.ema


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_writes_to_state_happen_once_per_call_and_never_during_optimize(mode):
    """optimize() advances no counter or EMA of the caller's; each call advances them exactly as eager does."""
    torch.manual_seed(0)
    model = CountsCalls().train(mode == "training")
    twin = copy.deepcopy(model)
    x = torch.randn(2, 4)
    optimized = capture_only(model, (x,), mode=mode)
    assert float(model.calls) == 0 and float(model.plain_calls) == 0 and torch.equal(model.ema, torch.zeros(4))
    for _ in range(3):
        torch.testing.assert_close(optimized(x), twin(x))
    state = optimized.original if mode == "inference" else model
    assert float(state.calls) == 3 and float(state.plain_calls) == 3
    torch.testing.assert_close(state.ema, twin.ema)


class AssignsAttributes(nn.Module):
    """Counts its calls in an int and keeps its blocks' features in a list: plain attributes its forward assigns."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.calls, self.features, self.scale = 0, [], 1.0

    def forward(self, x):
        self.calls += 1
        h = self.a(x)
        self.features = [h.detach()]
        return self.b(h) * self.calls * self.scale


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_forward_assigning_plain_attributes_runs_as_written(mode):
    """A forward assigning plain attributes is not exported (export would drop the writes): it runs as written around
    its captured children, its attributes advance call by call as eager's, optimize() leaves them alone, and a value
    the caller sets later is read, without optimizing again."""
    torch.manual_seed(0)
    model = AssignsAttributes().double().train(mode == "training")
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    optimized = capture_only(model, (x,), mode=mode)
    assert model.calls == 0 and model.features == []
    state = optimized.original if mode == "inference" else model
    opaque = {o.path: o.reason for o in optimized.fxopt_report.opaque}
    assert "calls, features" in opaque[""] and set(optimized.fxopt_report.graphs) >= {"a", "b"}
    for call in range(3):
        if call == 2:
            state.scale = twin.scale = 0.5
        assert_same(step(twin, x, backward=mode == "training"), step(optimized, x, backward=mode == "training"), tol=1e-12)
        assert state.calls == twin.calls == call + 1 and torch.equal(state.features[0], twin.features[0])
    assert not optimized.fxopt_report.guard_events


class DropsBlocksWithPythonsGenerator(nn.Module):
    """Stochastic depth drawn from Python's and NumPy's global generators, not torch's."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            draw = random.random() if i % 2 else float(numpy.random.rand())
            if not self.training or draw > 0.5:
                x = x + block(x)
        return x


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_forward_drawing_from_python_or_numpy_randomness_runs_as_written(mode):
    """A forward drawing from `random` or `numpy.random` is not exported (the graph would repeat one draw): it runs as
    written around its captured blocks, takes eager's branch on every call, and optimize() leaves both streams alone."""
    torch.manual_seed(0)
    model = DropsBlocksWithPythonsGenerator().double().train(mode == "training")
    twin, x = copy.deepcopy(model), torch.randn(2, 8, dtype=torch.float64)
    random.seed(0)
    numpy.random.seed(0)
    python_state, numpy_state = random.getstate(), numpy.random.get_state()[1].copy()
    optimized = capture_only(model, (x,), mode=mode)
    assert random.getstate() == python_state and (numpy.random.get_state()[1] == numpy_state).all()
    assert "draws from random and numpy.random" in {o.path: o.reason for o in optimized.fxopt_report.opaque}[""]
    for seed in range(4):
        got, expected = [], []
        for model_, out in ((optimized, got), (twin, expected)):
            random.seed(seed)
            numpy.random.seed(seed)
            out.append(step(model_, x, backward=mode == "training"))
        assert_same(expected[0], got[0], tol=1e-12)


class ScalesByItsMaximum(nn.Module):
    """Multiplies by a Python number read from a tensor (`.item()`): export keeps it symbolic, read per call."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * x.abs().max().item()


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_number_read_with_item_is_read_on_every_call(mode):
    """`.item()` in forward exports (its range is unbounded, unlike an input's size) and each call reads its own value:
    outputs and gradients as eager's on inputs of other magnitudes."""
    torch.manual_seed(0)
    model = ScalesByItsMaximum().double().train(mode == "training")
    optimized = capture_only(model, (torch.randn(3, 4, dtype=torch.float64),), mode=mode)
    assert not optimized.fxopt_report.opaque
    for scale in (1.0, 5.0, 0.1):
        x = torch.randn(3, 4, dtype=torch.float64) * scale
        assert_same_step(model, optimized, (x,), training=mode == "training", rtol=1e-12, atol=1e-12)


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        return self.linear(x.mul_(2).add_(1))


def test_optimize_leaves_the_example_inputs_alone():
    """A forward writing its input in place: optimize() must not modify the caller's example tensor."""
    model = WritesItsInput().eval()
    x = torch.ones(2, 3)
    optimized = capture_only(model, (x,))
    assert torch.equal(x, torch.ones(2, 3))
    expected = model(torch.ones(2, 3))
    torch.testing.assert_close(optimized(x), expected)
    assert torch.equal(x, torch.full((2, 3), 3.0))  # the call itself writes it, as eager does


class InputGradient(nn.Module):
    """Computes d(energy)/d(input) inside forward (force fields, gradient penalties)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.energy = nn.Linear(8, 1)

    def forward(self, x):
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            energy = self.energy(self.encoder(x)).sum()
            (force,) = torch.autograd.grad(energy, x, create_graph=self.training)
        return force


def test_gradient_inside_forward_runs_as_written_with_the_true_reason():
    """export cannot capture autograd.grad: the module runs its own forward (correct), the report says why, its children are exported."""
    torch.manual_seed(0)
    model = InputGradient().eval()
    x = torch.randn(3, 4)
    optimized = capture_only(model, (x,))
    (opaque,) = optimized.fxopt_report.opaque
    assert opaque.path == "" and "gradients inside" in opaque.reason
    assert optimized.fxopt_report.graphs == ["encoder"]
    torch.testing.assert_close(optimized(x), model(x))


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_uninitialized_lazy_module_is_a_clear_error(mode):
    """A LazyBatchNorm2d that never ran has no shapes yet: say that, not that the model rejects its inputs."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyBatchNorm2d()).train(mode == "training")
    with pytest.raises(fxopt.FxoptError, match=r"'1' \(LazyBatchNorm2d\) has uninitialized parameters"):
        fxopt.optimize(model, (torch.randn(2, 3, 8, 8),), mode=mode)


class PlainCounter(nn.Module):
    """Counts calls in a plain tensor attribute (not a buffer), which the output reads."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen = torch.zeros(())

    def forward(self, x):
        self.seen.add_(1)
        return self.linear(x) * self.seen


@pytest.mark.parametrize("make_model", [NoGradRegions, PlainCounter])
def test_verify_does_not_blame_a_pass_for_capture(make_model):
    """verify=True: capture computes what the model does, so no pass (here one that changes nothing) is blamed."""
    torch.manual_seed(0)
    model = make_model().train()
    fxopt.optimize(model, (torch.randn(3, 4),), mode="training", passes=["inplace_relu"], verify=True)


def test_internal_capture_failure_is_reported_as_captures(monkeypatch):
    """A bug inside capture is an FxoptError saying so, and the model is left as it was."""
    import fxopt.capture as capture_module

    def broken(*args, **kwargs):
        raise KeyError("oops")

    monkeypatch.setattr(capture_module, "export_module", broken)
    model = CountsCalls().train()
    snapshot = state_snapshot(model)
    with pytest.raises(fxopt.FxoptError, match="fxopt's capture failed.*internal error"):
        capture(model, (torch.randn(2, 4),))
    assert_state_unchanged(model, snapshot)


def saved_tensor_count(fn, x) -> int:
    """How many tensors autograd keeps for backward during one forward of `fn`."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(x)
    return len(saved)


class HandCheckpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False))


def test_users_checkpoint_calls_are_kept_not_inlined():
    """Export would inline torch.utils.checkpoint and drop the checkpointing: the caller runs as written, the block is exported."""
    model = HandCheckpointed().train()
    x = torch.randn(4, 8, requires_grad=True)
    optimized = capture_only(model, x)
    (opaque,) = optimized.fxopt_report.opaque
    assert opaque.path == "" and "checkpoint" in opaque.reason
    assert optimized.fxopt_report.graphs == ["block"]
    inlined = lambda x: model.head(model.block(x))  # noqa: E731 - what export alone would have captured
    assert saved_tensor_count(optimized, x) == saved_tensor_count(model, x) < saved_tensor_count(inlined, x)
    assert_same_step(model, optimized, (x,), training=True)


class _Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return ViewOf.apply(RoundStraightThrough.apply(self.linear(x) * 4))


class CustomGradients(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.quantized = _Quantized()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.quantized(self.encoder(x)))


def test_custom_autograd_function_returning_a_view_keeps_its_module_as_written():
    """A module calling a custom autograd Function fxopt cannot record as an op (a gradient reversal returning a view
    of its input) runs as written, so the Functions' own backward runs (export would differentiate their forward: the
    straight-through gradient became 0); its siblings are still exported (tests/test_autograd_functions.py: the
    Functions it records)."""
    torch.manual_seed(0)
    model = CustomGradients().train()
    x = torch.randn(4, 8, requires_grad=True)
    optimized = fxopt.optimize(model, (x,), mode="training")
    opaque = {o.path: o.reason for o in optimized.fxopt_report.opaque}
    assert set(opaque) == {"", "quantized"} and "ViewOf" in opaque["quantized"]
    assert "returns a view of an argument" in opaque["quantized"]
    assert optimized.fxopt_report.graphs == ["encoder"]
    assert_same_step(model, optimized, (x,), training=True, rtol=0, atol=0)


class _ScalesItsGradient(nn.Module):
    """Multiplies the gradient of its hidden features by 10 with a hook registered in forward, or (`offload`) keeps
    what autograd saves through saved-tensor hooks that double it."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.linear = kind, nn.Linear(8, 8)

    def forward(self, x):
        if self.kind == "saved_tensors_hooks":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t):
                return torch.sin(self.linear(x))
        h = self.linear(x)
        if self.kind == "register_hook":
            h.register_hook(lambda grad: grad * 10)
        else:
            h.retain_grad()
        return h


@pytest.mark.parametrize("kind", ["register_hook", "retain_grad", "saved_tensors_hooks"])
def test_hooks_a_forward_sets_on_autograd_are_kept(kind):
    """A module whose forward registers a tensor hook, retains a gradient or enters saved-tensor hooks runs as
    written (export would drop them: the hook's scaled gradients came out unscaled); its siblings are still exported."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.GELU()), _ScalesItsGradient(kind), nn.Linear(8, 2)).train()
    x = torch.randn(4, 8, requires_grad=True)
    optimized = fxopt.optimize(model, (x,), mode="training")
    opaque = {o.path: o.reason for o in optimized.fxopt_report.opaque}
    assert set(opaque) == {"", "1"} and ("hook" in opaque["1"] or "retain_grad" in opaque["1"])
    assert optimized.fxopt_report.graphs == ["0"]
    assert_same_step(model, optimized, (x,), training=True, rtol=0, atol=0)
    assert "retain_grad" not in vars(torch.Tensor)  # inherited from TensorBase: torch's classes left as they were


class _AccumulatesIntoAFreshTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        acc = torch.zeros(6, 8)
        acc.add_(self.linear(x))
        return acc


def test_tensor_created_in_forward_and_written_stays_fresh_every_call():
    """A tensor made in forward and written in place must not accumulate across calls of the graph."""
    model = _AccumulatesIntoAFreshTensor().eval()
    x = torch.randn(6, 8)
    optimized = capture_only(model, x)
    for _ in range(3):
        torch.testing.assert_close(optimized(x), model(x))


def test_capture_adds_no_attributes_to_the_callers_model():
    """Capturing leaves the caller's module objects exactly as they were: no attribute added or rebound."""
    model = CountsCalls().train()
    before = {id(m): dict(vars(m)) for m in model.modules()}
    capture_only(model, torch.randn(2, 4), mode="training")
    assert {id(m): dict(vars(m)) for m in model.modules()} == before


def test_capture_runs_none_of_the_models_state_dict_hooks():
    """Capture never calls the model's state_dict() (FSDP2's state_dict hook frees the parameters the graph reads)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).train()
    calls = []
    for m in model.modules():
        m.register_state_dict_pre_hook(lambda module, prefix, keep_vars: calls.append(prefix))
    optimized = fxopt.optimize(model, (torch.randn(3, 4),), mode="training")
    assert calls == []
    assert optimized.state_dict().keys() == model.state_dict().keys()


def test_module_path_names_the_innermost_module():
    """Sites are named by the module that computed them, as the user's model names it."""
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    graph = capture(model, (torch.randn(2, 4),)).graphs[0].gm.graph
    assert [module_path(n) for n in graph.nodes if n.op == "call_function"] == ["0.0", "0.1", "1"]


# --------------------------------------------------------------- what the result shares with the caller

@pytest.mark.parametrize("make_model, inputs", [
    (ShapeBranchModel, (torch.randn(2, 3, 8, 8),)),
    (DataBranchModel, (torch.rand(2, 3, 8, 8),)),
])
def test_training_result_shares_parameters_and_state_dict_keys(make_model, inputs):
    """Training mode: the same Parameter and buffer objects and the same state_dict keys, loadable both ways."""
    torch.manual_seed(0)
    model = make_model().train()
    optimized = capture_only(model, inputs, mode="training")
    check_shares_parameters(model, optimized)


def check_shares_parameters(model, optimized):
    assert [id(p) for p in optimized.parameters()] == [id(p) for p in model.parameters()]
    theirs, ours = model.state_dict(keep_vars=True), optimized.state_dict(keep_vars=True)
    assert list(ours) == list(theirs)
    assert all(ours[k] is theirs[k] for k in theirs)
    graph_state = optimized.graph_module.state_dict(keep_vars=True)
    assert list(graph_state) == list(theirs) and all(graph_state[k] is theirs[k] for k in theirs)
    optimized.load_state_dict(copy.deepcopy(model.state_dict()))
    model.load_state_dict(copy.deepcopy(optimized.state_dict()))


def test_optimizer_built_before_optimize_trains_the_result():
    """An optimizer made from the caller's parameters updates what the optimized model computes with."""
    torch.manual_seed(0)
    model = nn.Sequential(conv_bn(3, 4), nn.Flatten(), nn.Linear(4 * 8 * 8, 2)).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3, 8, 8)
    optimized = capture_only(model, (x,), mode="training")
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step_model, step_optimizer in ((optimized, optimizer), (reference, reference_optimizer)):
        step_optimizer.zero_grad()
        step_model(x).square().sum().backward()
        step_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    torch.testing.assert_close(optimized(x), reference(x))


@pytest.mark.parametrize("make_model, inputs", [
    (ShapeBranchModel, (torch.randn(2, 3, 8, 8),)),
    (DataBranchModel, (torch.rand(2, 3, 8, 8),)),
    (CountsCalls, (torch.randn(2, 4),)),
])
def test_inference_never_modifies_the_callers_model(make_model, inputs):
    """Optimizing and then running the result leaves the caller's state, modules and flags as they were."""
    torch.manual_seed(0)
    model = randomize_bn(make_model()).eval()
    snapshot = state_snapshot(model)

    def structure():  # every module, its flags and plain attributes (ReLU's `inplace`, ...)
        return [(name, m, {k: v for k, v in vars(m).items() if not k.startswith("_")}, dict(m._modules))
                for name, m in model.named_modules()]

    before = structure()
    inputs_before = [x.clone() for x in inputs]
    optimized = fxopt.optimize(model, inputs, mode="inference")
    optimized(*inputs)
    assert_state_unchanged(model, snapshot)
    assert structure() == before
    for before, after in zip(inputs_before, inputs):
        assert torch.equal(before, after)


def test_capture_leaves_plain_attributes_on_graph_modules():
    """Code around a captured block may read its attributes (HF reads `conv.stride`): they survive, deep copies too."""
    block = FlaggedBlock()
    block.scale_name = "double"
    parent = Parent()
    parent.child = block
    captured = capture(parent.eval(), (torch.rand(2, 3, 8, 8),))
    assert captured.module.child.graph_module.scale_name == "double"
    assert copy.deepcopy(captured.module.child.graph_module).scale_name == "double"


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_optimized_module_survives_torch_save_and_load(mode, tmp_path):
    """A saved result loads with its grad-mode and autocast regions and buffer writes intact (torch.fx's retrace drops them)."""
    torch.manual_seed(0)
    model = NoGradRegions().train(mode == "training")
    x = torch.randn(3, 4)
    optimized = fxopt.optimize(model, x, mode=mode)
    torch.save(optimized, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert "wrap_with_set_grad_enabled" in loaded.graph_module.code
    assert_same_step(optimized, loaded, (x,), training=mode == "training")
    autocast = fxopt.optimize(AutocastRegion().train(mode == "training"), torch.randn(4, 8), mode=mode)
    torch.save(autocast, tmp_path / "a.pt")
    inside, _ = torch.load(tmp_path / "a.pt", weights_only=False)(torch.randn(4, 8))
    assert inside.dtype == torch.bfloat16


@pytest.mark.usefixtures("budget_may_be_unmet")
@pytest.mark.parametrize("memory_budget", [None, 0.5])
def test_cumulative_average_batchnorm_is_captured_and_steps_like_eager(memory_budget):
    """A train-mode BatchNorm(momentum=None) exports whole (no data-dependent guard) and matches eager over 2 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).double().train()
    inputs = (torch.randn(4, 3, 6, 6, dtype=torch.float64),)
    reference = copy.deepcopy(model)
    optimized = fxopt.optimize(model, inputs, mode="training", memory_budget=memory_budget)
    assert capture(model, inputs).opaque == []
    assert_same_training_steps(reference, optimized, inputs)
    assert int(optimized.state_dict()["1.num_batches_tracked"]) == 2
