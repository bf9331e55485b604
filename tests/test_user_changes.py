"""fxopt.optimize on TorchDynamo: every call a user makes next, and every change they make, computes what eager does.

One test per class of difference the review of the export-based front end found (issue #38): hooks,
Python side effects in `forward`, RNG calls in `forward`, changes after optimize(), repeated tensors,
shape facts the code branches on, library state, the caller's generators, threads, gradients of an
inference result, export/nesting/containers, inference mode, and the backend's dynamic and float64 cases.
Each compares with the same model run eagerly.
"""
from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import fxopt


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _x(batch=2, size=6):
    return torch.randn(batch, 3, size, size)


def test_hooks_registered_before_optimize_run_on_every_call():
    """A forward hook registered before optimize() runs on every call, and sees real tensors, not capture's fakes."""
    model = Small().eval()
    seen = []
    model.fc.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    fast = fxopt.optimize(model)  # no example call: the first call compiles
    x = _x()
    with torch.no_grad():
        fast(x)
        fast(x)
    assert len(seen) == 2
    assert all(type(t) is torch.Tensor for t in seen)
    torch.testing.assert_close(seen[-1], model(x).detach())


def test_hook_registered_after_the_first_call_runs_and_torch_setting_is_kept():
    """A hook registered on a submodule after the result compiled runs on the next call (torch skips guards on
    empty hook dicts; fxopt's frames guard them), and torch's own setting is as it was afterwards."""
    import torch._dynamo.config as dynamo_config

    setting = dynamo_config.skip_nnmodule_hook_guards
    model = Small().eval()
    fast = fxopt.optimize(model, _x())
    seen = []
    fast.fc.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))  # the result's own modules
    x = _x()
    with torch.no_grad():
        fast(x)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], model(x).detach())
    assert dynamo_config.skip_nnmodule_hook_guards == setting


def test_hook_removed_goes_back_to_the_optimized_graph():
    """Once a hook added after compiling is removed, the next call runs the graph fxopt optimized before it (no new
    compile), not the model as written."""
    model = Small().eval()
    fast = fxopt.optimize(model, _x(), freeze=False)  # unfrozen: the graph module itself is what runs
    optimized, runs = fast.graph_modules[0], []
    forward = optimized.forward
    optimized.forward = lambda *args: (runs.append(1), forward(*args))[1]  # the backend looks it up on every call
    handle = fast.fc.register_forward_hook(lambda m, i, o: None)
    x = _x()
    with torch.no_grad():
        fast(x)
        handle.remove()
        compiled, runs[:] = len(fast.fxopt_reports), []
        out = fast(x)
    assert runs == [1] and len(fast.fxopt_reports) == compiled
    torch.testing.assert_close(out, model(x))


def test_python_side_effects_in_forward_happen_on_every_call():
    """Appending to a list attribute, a module-level list and warnings.warn in forward happen per call, as in eager;
    an example call's changes to the model are put back (outside it, such as a global list, they stay)."""
    log = []

    class Chatty(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.history = []

        def forward(self, x):
            self.history.append(x.shape[0])
            log.append("called")
            warnings.warn("forward ran")
            return self.lin(x)

    model = Chatty()
    with pytest.warns(UserWarning, match="forward ran"):  # the example call runs the forward too
        fxopt.optimize(model, torch.randn(2, 3), mode="training")
    assert model.history == []  # the example call put back what it changed on the model
    log.clear()
    fast = fxopt.optimize(model, mode="training")  # no example: nothing runs before the user's calls
    with pytest.warns(UserWarning, match="forward ran"):
        fast(torch.randn(2, 3))
    with pytest.warns(UserWarning, match="forward ran"):
        fast(torch.randn(5, 3))
    assert model.history == [2, 5]
    assert log == ["called", "called"]


def test_rng_state_calls_in_forward_are_kept():
    """torch.manual_seed and fork_rng inside forward act as in eager: the same noise, the caller's stream as eager leaves it."""

    class Seeded(nn.Module):
        def forward(self, x):
            torch.manual_seed(7)
            a = x + torch.randn_like(x)
            with torch.random.fork_rng():
                b = torch.rand_like(x)
            return a + b

    model = Seeded()
    fast = fxopt.optimize(model, torch.zeros(3))
    torch.manual_seed(0)
    expected, after_eager = model(torch.zeros(3)), torch.rand(2)
    torch.manual_seed(0)
    got, after_fast = fast(torch.zeros(3)), torch.rand(2)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(after_fast, after_eager)


def test_changes_after_optimize_are_seen():
    """A replaced function attribute, a patched forward, a changed class attribute and an appended layer all take effect."""

    class Net(nn.Module):
        scale = 1.0

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(3, 3)])
            self.act = torch.tanh

        def forward(self, x):
            for layer in self.layers:
                x = self.act(layer(x))
            return x * self.scale

    model = Net()
    fast = fxopt.optimize(model, torch.randn(2, 3), mode="training")
    x = torch.randn(2, 3)
    model.act = torch.sigmoid
    torch.testing.assert_close(fast(x), model(x))
    Net.scale = 3.0
    try:
        torch.testing.assert_close(fast(x), model(x))
    finally:
        Net.scale = 1.0
    model.layers.append(nn.Linear(3, 3))
    torch.testing.assert_close(fast(x), model(x))
    model.forward = lambda x: x - 1  # patched on the instance
    torch.testing.assert_close(fast(x), x - 1)


def test_same_tensor_passed_twice_then_two_tensors():
    """An example passing one tensor twice does not make later calls read one argument for both."""

    class Two(nn.Module):
        def forward(self, a, b):
            return a * 2 + b

    fast = fxopt.optimize(Two(), (torch.ones(3), torch.ones(3)))
    a, b = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(fast(a, b), a * 2 + b)


def test_shape_facts_the_code_branches_on_hold_at_every_size():
    """A branch on a size equality and on a parity follows each call's sizes, also once the batch is dynamic."""

    class Branchy(nn.Module):
        def forward(self, x):
            y = x * 2 if x.shape[0] == x.shape[1] else x - 1
            return y + 1 if x.shape[0] % 2 == 0 else y

    fast = fxopt.optimize(Branchy(), torch.randn(4, 4))
    for rows, cols in [(4, 4), (6, 4), (5, 5), (7, 3), (8, 8)]:
        x = torch.randn(rows, cols)
        torch.testing.assert_close(fast(x), Branchy()(x))


def test_optimize_leaves_a_generator_the_model_owns_where_it_was():
    """The example call draws from the model's own torch.Generator, and optimize() puts it back."""

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.gen = torch.Generator().manual_seed(3)

        def forward(self, x):
            return x + torch.rand(x.shape, generator=self.gen)

    model = Noisy()
    state = model.gen.get_state()
    fxopt.optimize(model, torch.zeros(2))
    assert torch.equal(model.gen.get_state(), state)


def test_two_threads_calling_at_once_compute_what_eager_does():
    """Two threads calling the result with new sizes at once both get eager's outputs."""
    model = Small().eval()
    fast = fxopt.optimize(model, _x())
    results, errors = {}, []

    def call(size):
        try:
            with torch.no_grad():
                x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size))
                results[size] = (fast(x), model(x))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(s,)) for s in (5, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got, expected in results.values():
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_inference_result_gives_input_and_parameter_gradients():
    """Called with grad enabled, an inference result differentiates like the model: input and parameter gradients."""

    class Squash(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return torch.relu(torch.tanh(self.lin(x))) + torch.relu(torch.exp(x))

    model = Squash().eval()
    fast = fxopt.optimize(model, torch.randn(2, 3))
    x = torch.randn(2, 3, requires_grad=True)
    fast(x).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    model(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert fast.lin.weight.grad is not None
    torch.testing.assert_close(fast.lin.weight.grad, model.lin.weight.grad)


def test_export_nesting_and_containers_of_a_result():
    """torch.export of a result, optimizing a result again, and indexing/len/iteration of a Sequential all work."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2)).eval()
    x = torch.randn(4, 3)
    fast = fxopt.optimize(model, x)
    assert len(fast) == 3 and isinstance(fast[0], nn.Linear) and len(list(fast)) == 3
    exported = torch.export.export(fast, (x,))
    torch.testing.assert_close(exported.module()(x), model(x))
    again = fxopt.optimize(fast, x)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))


def test_optimize_under_inference_mode():
    """optimize() called inside torch.inference_mode() compiles and computes eager's outputs."""
    model = Small().eval()
    x = _x()
    with torch.inference_mode():
        fast = fxopt.optimize(model, x)
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)


def test_train_eval_switch_and_unfreezing_recompile():
    """Switching train()/eval() and unfreezing a layer after optimize() gives eager's outputs, gradients and statistics."""
    model = Small().train()
    reference = copy.deepcopy(model)
    fast = fxopt.optimize(model, _x(4), mode="training")
    for step in range(3):
        if step == 1:
            for m in (model, reference):
                m.conv.weight.requires_grad_(False)
        if step == 2:
            fast.eval(), reference.eval()
        x = _x(4)
        fast(x).sum().backward()
        reference(x).sum().backward()
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            assert (a.grad is None) == (b.grad is None), name
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)
        model.zero_grad(), reference.zero_grad()


def test_converted_to_float64_runs_optimized_in_float64():
    """.double() on a conv-net result recompiles for float64 and matches the float64 model exactly in spirit (1e-10)."""
    model = Small().eval()
    fast = fxopt.optimize(model, _x())
    fast.double()
    x = _x().double()
    with torch.no_grad():
        expected = copy.deepcopy(model).double()(x)
        torch.testing.assert_close(fast(x), expected, rtol=1e-10, atol=1e-10)
    assert fast.fxopt_report["fold_conv_bn"].stats["folded"] == 1


def test_backend_dynamic_with_eval_conv_bn():
    """torch.compile(backend="fxopt", dynamic=True) on an eval Conv+BN folds it and computes eager's outputs."""
    model = Small().eval()
    compiled = torch.compile(model, backend=fxopt.backend(inner="aot_eager"), dynamic=True)
    with torch.no_grad():
        for size in (5, 7):
            x = _x(size=size)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_report_names_recompiles_and_graph_breaks():
    """A new length records Dynamo's failed guard; a graph break records Dynamo's reason and the user's line."""

    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            y = self.lin(x)
            torch._dynamo.graph_break()
            return y * 2

    fast = fxopt.optimize(Breaks(), torch.randn(2, 3))
    fast(torch.randn(5, 3))
    reports = fast.fxopt_reports
    assert any(r.graph_breaks for r in reports)
    assert any("test_user_changes.py" in where for r in reports for _, where in r.graph_breaks)
    assert any(r.recompile_reason and "size mismatch" in r.recompile_reason for r in reports)


class _ScaledSquare(torch.autograd.Function):
    """A Function whose backward is not autograd's derivative of its forward: losing it would show."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * grad


def test_custom_autograd_function_keeps_its_backward():
    """A custom autograd.Function stays one op in the optimized graph and runs its own backward, as in eager."""

    class WithFunction(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return _ScaledSquare.apply(self.lin(x)).relu()

    model = WithFunction()
    reference = copy.deepcopy(model)
    fast = fxopt.optimize(model, torch.randn(2, 3), mode="training", passes=["prune_dead_grads", "inplace_relu"])
    x = torch.randn(4, 3)
    fast(x).sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(model.lin.weight.grad, reference.lin.weight.grad)
    assert not fast.fxopt_report.not_optimized
    assert "fxopt.autograd_function" in fast.graph_module.code


def test_numpy_random_draws_in_forward_come_from_numpy_as_in_eager():
    """A forward drawing from NumPy's global generator (HF Wav2Vec2's SpecAugment) draws NumPy's numbers, not torch's."""
    import numpy

    class NumpyMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            keep = torch.from_numpy(numpy.random.rand(x.shape[-1]) > 0.5).to(x.dtype)
            return self.lin(x) * keep

    model = NumpyMask()
    fast = fxopt.optimize(model, torch.randn(2, 6), mode="training")
    x = torch.randn(3, 6)
    numpy.random.seed(5)
    got = fast(x)
    numpy.random.seed(5)
    torch.testing.assert_close(got, model(x))


def test_float_attribute_changed_after_compiling_is_used():
    """A float the forward reads (a scale, a dropout probability, a BatchNorm momentum) changed later is used at once."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.scale = nn.Linear(4, 4), 0.5

        def forward(self, x):
            return self.lin(x) * self.scale

    model = Scaled().eval()
    fast = fxopt.optimize(model, torch.randn(2, 4))
    x = torch.randn(2, 4)
    for scale in (2.0, -1.5):
        fast.scale = scale
        with torch.no_grad():
            torch.testing.assert_close(fast(x), fast.original(x))


def test_many_models_of_one_class_are_each_optimized():
    """Torch's process-wide cap on compiles of one `forward` (a sweep, a fuzzer) does not leave later results
    unoptimized: each result's recompiles are bounded by its own limit (here the cap is lowered to 2)."""
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(accumulated_recompile_limit=2):
        for seed in range(4):
            torch.manual_seed(seed)
            model = Small().eval()
            fast = fxopt.optimize(model, _x())
            assert fast.fxopt_report is not None, seed
            x = _x()
            torch.testing.assert_close(fast(x), model(x))


def test_a_call_past_the_recompile_limit_runs_as_eager_with_one_warning():
    """Where Dynamo would compile anew past its recompile limit, the call computes eager's result at eager's cost,
    one warning names the limit, and calls matching the graph compiled before stay optimized."""
    import torch._dynamo.config as dynamo_config

    torch.manual_seed(0)
    model, x = Small().eval(), _x()
    with dynamo_config.patch(recompile_limit=1):
        fast = fxopt.optimize(model, x)  # compiled under no_grad
        with pytest.warns(UserWarning, match=r"part or all of a call of Small ran as eager runs it: TorchDynamo "
                                             r"reached its recompile limit \(torch\._dynamo\.config\.recompile_limit = 1\)"):
            got = fast(x)  # grad mode on: a new graph Dynamo may not compile
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = fast(x)
            with torch.no_grad():
                fast(x)
    torch.testing.assert_close(got, model(x))
    torch.testing.assert_close(again, got)
    assert got.requires_grad and len(fast.fxopt_reports) == 1


class _DisabledForDynamo(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    @torch._dynamo.disable
    def forward(self, x):
        return self.conv(x).relu()


def test_a_model_dynamo_captures_nothing_of_runs_as_eager_with_one_warning():
    """A forward Dynamo never enters (disabled for it) gives fxopt no graph: its calls compute eager's result, and one
    warning says nothing was optimized and why."""
    torch.manual_seed(0)
    model, x = _DisabledForDynamo().eval(), _x()
    with pytest.warns(UserWarning, match=r"nothing in this call of _DisabledForDynamo was optimized: TorchDynamo "
                                         r"captured no graph from it"):
        fast = fxopt.optimize(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fast(x)
    torch.testing.assert_close(got, model(x))
    assert fast.fxopt_reports == []


@torch._dynamo.disable
def _conv_relu_unseen(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return conv(x).relu()


class _Switchable(nn.Module):
    """Dynamo captures nothing while `opaque` is set (the work runs in a function disabled for it), a graph after."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.opaque = True

    def forward(self, x):
        return _conv_relu_unseen(self.conv, x) if self.opaque else self.conv(x).relu()


def _count_dynamo_calls(fast, monkeypatch) -> list:
    """Count the calls of `fast` that go through Dynamo's compiled module from now on."""
    compiled, calls = fast.__dict__["_compiled"], []
    through_dynamo = compiled.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return through_dynamo(*args, **kwargs)
    monkeypatch.setattr(compiled, "forward", counted)
    return calls


def test_calls_that_run_no_graph_call_the_model_itself_and_dynamo_is_tried_again_now_and_then(monkeypatch):
    """After EAGER_AFTER calls in a row that ran none of fxopt's graphs, the result calls the model itself (eager's
    cost, not Dynamo's frame callback), one call in RETRY_EVERY still through Dynamo; every call computes eager's
    result and runs the hooks."""
    from fxopt.frontends.result import EAGER_AFTER, RETRY_EVERY

    torch.manual_seed(0)
    model, x = _Switchable().eval(), _x()
    with pytest.warns(UserWarning, match="nothing in this call"):
        fast = fxopt.optimize(model, x)
    through_dynamo, hooked = _count_dynamo_calls(fast, monkeypatch), []
    fast.conv.register_forward_hook(lambda *_: hooked.append(1))
    calls = 3 * RETRY_EVERY
    for _ in range(calls):
        torch.testing.assert_close(fast(x), model(x))
    assert len(hooked) == calls  # the result stands for its own copy of an inference model
    assert len(through_dynamo) == EAGER_AFTER - 1 + 3  # the example's call was the first; then calls 16, 32 and 48
    assert fast.fxopt_reports == []


def test_once_a_graph_fits_again_every_call_goes_through_dynamo(monkeypatch):
    """A model that Dynamo could not capture, changed so that it can: within RETRY_EVERY calls a graph is compiled
    and runs, and from then on every call goes through Dynamo, with eager's results."""
    from fxopt.frontends.result import EAGER_AFTER, RETRY_EVERY

    torch.manual_seed(0)
    model, x = _Switchable().eval(), _x()
    with pytest.warns(UserWarning, match="nothing in this call"):
        fast = fxopt.optimize(model, x)
    for _ in range(EAGER_AFTER):
        fast(x)
    fast.opaque = False
    for _ in range(RETRY_EVERY):
        torch.testing.assert_close(fast(x), model(x))
    assert len(fast.fxopt_reports) == 1
    through_dynamo = _count_dynamo_calls(fast, monkeypatch)
    for _ in range(5):
        torch.testing.assert_close(fast(x), model(x))
    assert len(through_dynamo) == 5
