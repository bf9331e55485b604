"""Custom autograd Functions captured as one op that runs the Function itself (fxopt.capture.autograd_functions)."""
from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn as nn

import fxopt
from equivalence import assert_same_step, assert_same_training_steps
from fxopt.capture.autograd_functions import OP


class RoundStraightThrough(torch.autograd.Function):
    """Rounds; its gradient passes through unchanged (quantization-aware training's straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaledPair(torch.autograd.Function):
    """Returns (x * scale, x.sin()) with a deliberately unusual backward: gradients are scaled by `factor`, and
    `mode` "negate" flips the sign; the saved input is what the backward reads."""

    @staticmethod
    def forward(ctx, x, scale: float, mode: str, factor: tuple):
        ctx.save_for_backward(x)
        ctx.scale, ctx.sign, ctx.factor = scale, -1.0 if mode == "negate" else 1.0, factor[0]
        return x * scale, x.sin()

    @staticmethod
    def backward(ctx, grad_scaled, grad_sin):
        (x,) = ctx.saved_tensors
        return ctx.sign * ctx.factor * (grad_scaled * ctx.scale + grad_sin * x.cos()), None, None, None


class CallsInner(torch.autograd.Function):
    """A Function whose forward calls another Function (which is then part of it) and whose backward is its own."""

    @staticmethod
    def forward(ctx, x):
        return RoundStraightThrough.apply(x) * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class ViewOf(torch.autograd.Function):
    """The identity as a view, its gradient negated (a gradient-reversal layer)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class WritesItsInput(torch.autograd.Function):
    """Doubles its input in place (ctx.mark_dirty)."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class TakesAnything(torch.autograd.Function):
    """Doubles its input; its second argument is only carried along."""

    @staticmethod
    def forward(ctx, x, anything):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


class ReturnsAFloat(torch.autograd.Function):
    """Returns a tensor and a float."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, 1.5

    @staticmethod
    def backward(ctx, grad, _):
        return grad * 2


class WithFunction(nn.Module):
    """linear -> `call(h)` -> GELU -> linear, where `call` applies the Function under test."""

    def __init__(self, call):
        super().__init__()
        self.call, self.first, self.last = call, nn.Linear(8, 16), nn.Linear(16, 4)
        self.scale = 0.5

    def forward(self, x):
        return self.last(torch.nn.functional.gelu(self.call(self, self.first(x))))


def straight_through(module, h):
    return RoundStraightThrough.apply(h * 4)


def scaled_pair(module, h):
    scaled, sine = ScaledPair.apply(h, module.scale, "negate", (3.0,))
    return scaled + sine


def build(call, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return WithFunction(call).double().train(), torch.randn(6, 8, dtype=torch.double, requires_grad=True)


def ops_of(optimized) -> list:
    return [n for n in optimized.graph_module.graph.nodes if n.target is OP]


@pytest.mark.parametrize("call", [straight_through, scaled_pair, lambda m, h: CallsInner.apply(h)],
                         ids=["straight_through", "tuple_and_constants", "nested"])
@pytest.mark.parametrize("mode", ["training", "inference"])
def test_function_is_captured_with_its_own_backward(call, mode):
    """The whole model is one graph holding the Function as fxopt's op, and every step (outputs, input and parameter
    gradients, in float64) is eager's bit for bit: the Function's own backward ran, not the forward's derivative."""
    model, x = build(call)
    optimized = fxopt.optimize(model, (x,), mode=mode)
    assert optimized.fxopt_report.opaque == [] and optimized.fxopt_report.graphs == [""]
    assert len(ops_of(optimized)) == 1
    if mode == "training":
        assert_same_training_steps(model, optimized, (x,), steps=2, rtol=0, atol=0)
    else:
        assert_same_step(model.eval(), optimized, (x,), training=False, rtol=0, atol=0)


def test_inner_function_is_not_recorded_apart():
    """A Function called by a recorded Function's forward is part of it: one op, the outer backward's gradient."""
    model, x = build(lambda m, h: CallsInner.apply(h))
    optimized = fxopt.optimize(model, (x,), mode="training")
    (node,) = ops_of(optimized)
    assert "CallsInner" in node.args[1] and "RoundStraightThrough" not in node.args[1]


def test_a_constant_argument_read_from_the_module_is_guarded():
    """A constant passed to the Function from a module attribute is baked into the op: changing the attribute makes
    fxopt optimize again (with a warning), and the step is eager's for the new value."""
    model, x = build(scaled_pair)
    optimized = fxopt.optimize(model, (x,), mode="training")
    model.scale = 2.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same_step(model, optimized, (x,), training=True, rtol=0, atol=0)
    assert any("scale" in str(w.message) for w in caught)


def test_function_stays_out_of_checkpoint_regions_and_the_step_is_exact():
    """Under a memory budget the Function is never recomputed (refused as `autograd_function`), the regions around
    it are, and the training steps are eager's bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(WithFunction(straight_through), nn.Linear(4, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 4)).double().train()
    x = torch.randn(32, 8, dtype=torch.double, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the budget may be unreachable; what counts is the refusal and the bits
        optimized = fxopt.optimize(model, (x,), mode="training", memory_budget=0.5)
    sites = [s for p in optimized.fxopt_report.passes if p.name == "checkpoint_activations" for s in p.sites]
    (refused,) = [s for s in sites if s.reason == "autograd_function"]
    assert refused.detail.startswith("runs test_autograd_functions.RoundStraightThrough, kept out")
    assert any(s.action == "checkpointed" for s in sites)
    assert_same_training_steps(model, optimized, (x,), steps=2, rtol=0, atol=0)


def test_graph_with_the_op_copies_and_pickles():
    """The op names its Function by text: the optimized graph survives deepcopy and a pickle round trip."""
    model, x = build(straight_through)
    optimized = fxopt.optimize(model, (x,), mode="training")
    assert len(ops_of(optimized)) == 1
    expected = optimized(x)
    for clone in (copy.deepcopy(optimized.graph_module), pickle.loads(pickle.dumps(optimized.graph_module))):
        torch.testing.assert_close(clone(x), expected, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(optimized.graph_module, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False)(x), expected, rtol=0, atol=0)


def _defined_here():
    class Local(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad

    return lambda m, h: Local.apply(h)


@pytest.mark.parametrize(("call", "reason"), [
    (lambda m, h: ViewOf.apply(h), "returns a view of an argument"),
    (lambda m, h: WritesItsInput.apply(h * 1), "writes into an argument"),
    (lambda m, h: ReturnsAFloat.apply(h)[0], "not a tensor or a tuple of tensors"),
    (_defined_here(), "cannot be imported by its name"),
    (lambda m, h: TakesAnything.apply(h, m), "argument 1 (WithFunction) is neither a tensor"),
    (lambda m, h: TakesAnything.apply(h, float("nan")), "argument 1 (float) is neither"),
], ids=["view", "mark_dirty", "non_tensor_output", "local_class", "module_argument", "nan_argument"])
def test_function_the_op_cannot_stand_for_keeps_its_module_opaque(call, reason):
    """A Function the op cannot stand for exactly is refused with the reason: the module calling it runs as written
    while its sibling is captured, and the steps are eager's bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.GELU()), WithFunction(call)).double().train()
    x = torch.randn(6, 8, dtype=torch.double, requires_grad=True)
    optimized = fxopt.optimize(model, (x,), mode="training")
    opaque = {o.path: o.reason for o in optimized.fxopt_report.opaque}
    assert set(opaque) == {"", "1"} and reason in opaque["1"], opaque
    assert optimized.fxopt_report.graphs == ["0"]
    assert_same_training_steps(model, optimized, (x,), steps=2, rtol=0, atol=0)


def test_a_call_export_traced_into_keeps_its_module_opaque(monkeypatch):
    """Where torch.export does not keep the op for a recorded call (as a torch that traced into it would), the
    graph would differentiate the Function's forward: capture refuses the module, which runs as written."""
    import fxopt.capture.autograd_functions as recording

    monkeypatch.setattr(recording, "OP", recording._run)  # the Function's forward traced, not kept as the op
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.GELU()), WithFunction(straight_through)).double().train()
    x = torch.randn(6, 8, dtype=torch.double, requires_grad=True)
    optimized = fxopt.optimize(model, (x,), mode="training")
    opaque = {o.path: o.reason for o in optimized.fxopt_report.opaque}
    assert set(opaque) == {"", "1"} and "did not keep fxopt's op" in opaque["1"], opaque
    assert_same_training_steps(model, optimized, (x,), steps=2, rtol=0, atol=0)


def test_a_model_holding_the_op_is_optimized_again():
    """Optimizing an optimized model exports the op as it is: one graph holding it, and steps equal to eager's."""
    model, x = build(straight_through)
    again = fxopt.optimize(fxopt.optimize(model, (x,), mode="training"), (x,), mode="training")
    assert again.fxopt_report.opaque == [] and len(ops_of(again)) == 1
    assert_same_training_steps(model, again, (x,), steps=2, rtol=0, atol=0)


class NoisyScale(torch.autograd.Function):
    """Scales its input by fresh noise from torch's generator (as a custom dropout does); its gradient is the noise."""

    @staticmethod
    def forward(ctx, x):
        noise = torch.rand_like(x)
        ctx.save_for_backward(noise)
        return x * noise

    @staticmethod
    def backward(ctx, grad):
        (noise,) = ctx.saved_tensors
        return grad * noise


@pytest.mark.usefixtures("budget_may_be_unmet")
def test_optimizing_around_a_function_that_draws_leaves_the_generator_as_it_was():
    """What optimize() runs to measure the Function (its memory, its time) draws nothing from the caller's random
    stream: torch's generator is where it was, and the steps draw the noise eager draws."""
    model, x = build(lambda m, h: NoisyScale.apply(h))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    optimized = fxopt.optimize(model, (x,), mode="training", memory_budget=0.5)
    assert torch.equal(before, torch.get_rng_state())
    assert len(ops_of(optimized)) == 1
    assert_same_step(model, optimized, (x,), training=True, rtol=0, atol=0)  # each from the same seed
