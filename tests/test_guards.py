"""Guards (issue #11): after the user changes the model's state, the optimized model computes what eager does.

Each test changes something a user is entitled to change after `fxopt.optimize` — train/eval,
requires_grad, hooks, torch.nn.utils.prune, load_state_dict, weights — and compares the result
with an eager copy that went through the same changes: outputs, gradients, buffers. Nothing
may raise, nothing may be silently stale; a change is announced by one warning.
"""
from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune

import fxopt
from fxopt.guards import SAME_VALUE, Guard, GuardSet, model_state_guards


class ConvBNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(4 * 8 * 8, 2)

    def forward(self, x):
        return self.fc(self.drop(self.relu(self.bn(self.conv(x)))).flatten(1))


def conv_bn_net(seed: int = 0) -> ConvBNNet:
    torch.manual_seed(seed)
    net = ConvBNNet()
    with torch.no_grad():  # non-trivial statistics, so eval and train mode differ
        net.bn.running_mean.uniform_(-1, 1)
        net.bn.running_var.uniform_(0.5, 2)
        net.bn.weight.uniform_(0.5, 2)
    return net


X = torch.randn(4, 3, 8, 8)


def step(model: nn.Module, x: torch.Tensor = X, seed: int = 7, backward: bool = True) -> dict[str, torch.Tensor]:
    """One forward (and backward) from a fixed RNG seed: output, every gradient, every buffer."""
    x = x.detach().clone().requires_grad_(backward)
    torch.manual_seed(seed)
    out = model(x)
    got = {"output": out.detach().clone()}
    if backward:
        out.pow(2).sum().backward()
        got["grad:input"] = x.grad
        got.update({f"grad:{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    got.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
    return got


def assert_same(expected: dict, got: dict, tol: float = 1e-5) -> None:
    assert sorted(expected) == sorted(got), f"different tensors: {sorted(set(expected) ^ set(got))}"
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def optimize_quietly(model, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxopt.optimize(model, *args, **kwargs)


def test_inference_result_switched_to_train_computes_train_mode():
    """result.train() on an inference result means batch statistics and active dropout, as eager."""
    model = conv_bn_net().eval()
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X)
    assert_same(step(reference, backward=False), step(result, backward=False))
    result.train()
    reference.train()
    with pytest.warns(UserWarning, match="eval mode"):
        got = step(result, backward=False)
    assert_same(step(reference, backward=False), got)
    assert not model.training and not model.bn.training, "the caller's model was switched too"


def messages_over_changes(change, calls: int) -> tuple[list[str], fxopt.OptimizedModule]:
    """Optimize a training ConvBNNet; before each call i, `change(i, m)` both the result and an eager copy, whose
    steps must then be the same. Returns the warnings' messages and the result."""
    model = conv_bn_net().train()
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X, mode="training")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(calls):
            change(i, result)
            change(i, reference)
            assert_same(step(reference), step(result))
    return [str(w.message) for w in caught], result


def test_alternating_train_eval_optimizes_each_state_once():
    """Switching train()/eval() every call reuses the variant optimized for each state, warning once."""
    messages, result = messages_over_changes(lambda i, m: m.train(i % 2 == 0), calls=6)
    assert sum("optimized the model again" in m for m in messages) == 1, messages
    events = result.fxopt_report.guard_events
    assert sum(n for what, n in events.items() if "optimized the model again" in what) == 1


@pytest.mark.usefixtures("budget_may_be_unmet")
def test_frozen_bn_unfrozen_later_updates_statistics_once():
    """BN eval (frozen) at optimize time, train later, with a memory budget: statistics advance once per step."""
    model = conv_bn_net().train()
    model.bn.eval()
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X, mode="training", memory_budget=0.5)
    assert_same(step(reference), step(result))
    model.bn.train()
    reference.bn.train()
    with pytest.warns(UserWarning, match=r"assumed bn in eval mode .*optimized the model again"):
        got = step(result, seed=0)
    assert_same(step(reference, seed=0), got)
    for seed in (1, 2):
        assert_same(step(reference, seed=seed), step(result, seed=seed))
    assert int(model.bn.num_batches_tracked) == 3


@pytest.mark.usefixtures("budget_may_be_unmet")
def test_budget_result_switched_to_eval_still_differentiates():
    """Optimized for training with a budget, then eval (freezing BN, input gradients): backward works as eager."""
    model = conv_bn_net().train()
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X, mode="training", memory_budget=0.5)
    result.eval()
    reference.eval()
    with pytest.warns(UserWarning, match="assumed the model in train mode"):
        got = step(result)
    assert_same(step(reference), got)


def test_prune_dead_grads_frozen_bn_switched_to_train():
    """A frozen eval BN that prune_dead_grads turned into a fixed scale-and-shift follows bn.train()."""
    model = conv_bn_net().train()
    model.bn.eval()
    model.bn.requires_grad_(False)
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X, mode="training", passes=["prune_dead_grads"])
    assert_same(step(reference), step(result))
    model.bn.train()
    reference.bn.train()
    with pytest.warns(UserWarning, match=r"assumed bn in eval mode \(prune_dead_grads"):
        got = step(result)
    assert_same(step(reference), got)


def test_unfreezing_a_layer_gives_it_gradients():
    """Parameters frozen at optimize time and unfrozen later get the gradients eager gives them."""
    model = conv_bn_net().train()
    model.conv.requires_grad_(False)
    model.bn.requires_grad_(False)
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X, mode="training")
    assert_same(step(reference), step(result))
    model.conv.requires_grad_(True)
    reference.conv.requires_grad_(True)
    with pytest.warns(UserWarning, match="assumed conv.weight.requires_grad is False"):
        got = step(result)
    assert "grad:conv.weight" in got
    assert_same(step(reference), got)


def test_hook_added_after_optimize_runs():
    """A forward hook added to a folded conv/BN pair after optimize runs and changes the output, as in eager."""
    model = conv_bn_net().eval()
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X, mode="training")
    seen = []

    def double(module, args, output):
        seen.append(output.shape)
        return output * 2

    result.bn.register_forward_hook(double)
    reference.bn.register_forward_hook(double)
    with pytest.warns(UserWarning, match="hooks"):
        got = step(result)
    assert_same(step(reference), got)
    assert len(seen) == 2


def test_hook_removed_goes_back_to_the_optimized_graph(monkeypatch):
    """Once a temporary hook is removed, calls run the optimized graph again (not the original for good)."""
    model = conv_bn_net().eval()
    result = optimize_quietly(model, X)
    optimized, ran = result.graph_module, []
    forward = optimized.forward
    monkeypatch.setattr(optimized, "forward", lambda *a, **k: ran.append(True) or forward(*a, **k))
    handle = result.bn.register_forward_hook(lambda m, a, out: out)
    with pytest.warns(UserWarning, match="hooks added to or removed from bn.*so fxopt ran the original model"):
        result(X)
    assert not ran  # the hook had to run: the original model did
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no guard failure any more: no warning
        out = result(X)
    assert ran == [True] and result.graph_module is optimized
    torch.testing.assert_close(out, model(X))


def test_prune_applied_after_optimize():
    """torch.nn.utils.prune after optimize: the first step already uses the pruned weight; backward works."""
    model = conv_bn_net().train()
    model.bn.eval()
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X, mode="training")
    assert_same(step(reference), step(result))
    for m in (model, reference):
        torch.nn.utils.prune.l1_unstructured(m.conv, "weight", amount=0.5)
    with pytest.warns(UserWarning, match="no hooks added to or removed from conv .*ran the original model"):
        got = step(result, seed=0)
    assert_same(step(reference, seed=0), got)
    assert_same(step(reference, seed=1), step(result, seed=1))


def test_load_state_dict_into_inference_result():
    """Weights loaded into an inference result after optimize are used (folded weights are not stale)."""
    model = conv_bn_net(0).eval()
    result = optimize_quietly(model, X)
    other = conv_bn_net(1).eval()
    result.load_state_dict(other.state_dict())
    with pytest.warns(UserWarning, match="keeps its value"):
        got = step(result, backward=False)
    assert_same(step(other, backward=False), got)


@pytest.mark.parametrize("write", ["in_place", "data_assignment", "new_parameter"])
def test_weights_written_after_optimize(write):
    """Writing a conv weight in place, through `.data =`, or replacing the Parameter: never stale."""
    model = conv_bn_net().eval()
    result = optimize_quietly(model, X)
    result(X)
    reference = copy.deepcopy(result.original if hasattr(result, "original") else result)
    new = torch.randn_like(model.conv.weight)
    for m in (result, reference):
        if write == "in_place":
            with torch.no_grad():
                m.conv.weight.copy_(new)
        elif write == "data_assignment":
            m.conv.weight.data = new.clone()
        else:
            m.conv.weight = nn.Parameter(new.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = step(result, backward=False)
    assert_same(step(reference, backward=False), got)


def test_inference_result_reads_weights_written_in_place_without_optimizing_again():
    """An in-place write into a weight no pass baked in is read by the graph itself: no guard fails, eager's result."""
    model = conv_bn_net().eval()
    result = optimize_quietly(model, X)
    reference = copy.deepcopy(result.original)
    for m in (result, reference):
        with torch.no_grad():
            m.fc.weight.mul_(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step(result, backward=False)
    assert_same(step(reference, backward=False), got)
    assert not result.fxopt_report.guard_events


class CastsToWeightDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x.to(self.fc.weight.dtype))


def test_inference_result_after_data_assignment_of_another_dtype():
    """`p.data = t` of another dtype on a weight the graph reads: export specialized to float32, so fxopt optimizes again."""
    model = CastsToWeightDtype().eval()
    x = torch.randn(3, 4)
    result = optimize_quietly(model, x)
    reference = copy.deepcopy(result.original)
    for m in (result, reference):
        m.fc.weight.data = m.fc.weight.data.double()
        m.fc.bias.data = m.fc.bias.data.double()
    with pytest.warns(UserWarning, match="same storage"):
        got = result(x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, reference(x))


class WithLock(ConvBNNet):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


def _weight_normed() -> nn.Module:
    net = conv_bn_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net.fc = torch.nn.utils.weight_norm(net.fc)
    return net


@pytest.mark.parametrize("make", [WithLock, _weight_normed], ids=["threading_lock", "old_weight_norm"])
def test_inference_result_of_a_model_deepcopy_refuses_shares_nothing(make):
    """A model deepcopy cannot copy still gets its own copy: .half()/.train() on the result leave it alone."""
    torch.manual_seed(0)
    model = make().eval()
    with pytest.raises(Exception):
        copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = optimize_quietly(model, X)
    torch.testing.assert_close(result(X), model(X))
    result.train()
    result.double()
    assert not model.training and not any(m.training for m in model.modules())
    assert all(v.dtype == before[k].dtype and torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float64 for p in result.parameters())


def test_dtype_change_applies_to_whatever_the_result_may_run():
    """result.double() converts the optimized graph and the original it may fall back to: float64 calls work."""
    model = conv_bn_net().eval()
    reference = copy.deepcopy(model).double()
    result = optimize_quietly(model, X).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = result(X.double())
        other_batch = result(torch.randn(1, 3, 8, 8, dtype=torch.float64))
    torch.testing.assert_close(got, reference(X.double()))
    assert other_batch.dtype == torch.float64


def test_guards_are_listed_in_the_report():
    """fxopt_report lists the facts the result relies on, with who relies on them and why."""
    result = optimize_quietly(conv_bn_net().eval(), X)
    report = result.fxopt_report
    kinds = {g.kind for g in report.guards}
    assert {"train_mode", "hooks", "requires_grad", "same_value"} <= kinds
    assert all(g.owner and g.reason for g in report.guards)
    assert "guards" in report.to_dict() and "Guards" in str(report)


def test_guard_check_is_cheap():
    """The per-call check reads flat lists: well under a millisecond for a 100-module model (benchmark has figures)."""
    import timeit

    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU()) for _ in range(33)])
    baked = [Guard(SAME_VALUE, name, None, "test") for name, _ in model.state_dict(keep_vars=True).items()]
    bound = GuardSet(model_state_guards(model, "test", storage=True) + baked).bind(model)
    assert bound.first_failure((), {}) is None
    seconds = min(timeit.repeat(lambda: bound.first_failure((), {}), number=50, repeat=3)) / 50
    assert seconds < 5e-3  # generous: a shared CI core; the benchmark measures ~0.1 ms


class _Explode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


def explode_in_backward(x):
    return _Explode.apply(x)


@pytest.mark.parametrize("stage", ["pass", "capture"])
def test_verify_names_the_stage_where_a_failure_appeared(stage, monkeypatch):
    """verify=True: a backward that raises after a pass is an FxoptError naming that pass; a capture bug names capture."""
    from fxopt.passes import PASSES

    def explode_graph(gm):
        for node in gm.graph.nodes:
            if node.op == "output":
                with gm.graph.inserting_before(node):
                    out = node.args[0]
                    first = out[0] if isinstance(out, (tuple, list)) else out
                    new = gm.graph.call_function(explode_in_backward, (first,))
                node.args = ((new, *out[1:]) if isinstance(out, (tuple, list)) else new,)
        gm.recompile()

    if stage == "pass":
        original_run = PASSES["inplace_relu"].run

        def broken_run(self, gm, ctx):
            result = original_run(self, gm, ctx)
            explode_graph(gm)
            return result

        monkeypatch.setattr(PASSES["inplace_relu"], "run", broken_run)
        match = "after pass 'inplace_relu'.*boom in backward"
    else:
        import fxopt.pipeline.run as run

        real_capture = run.capture

        def broken_capture(*args, **kwargs):
            captured = real_capture(*args, **kwargs)
            for g in captured.graphs:
                explode_graph(g.gm)
            return captured

        monkeypatch.setattr(run, "capture", broken_capture)
        match = "after capture.*boom in backward"
    with pytest.raises(fxopt.FxoptError, match=match):
        fxopt.optimize(conv_bn_net().train(), X, mode="training", passes=["inplace_relu"], verify=True)


def test_a_guard_naming_a_missing_module_is_reported_not_checked():
    """A guard whose target the model lacks would fail every call: it is found at bind time instead."""
    from fxopt.guards import TRAIN_MODE

    model = conv_bn_net().eval()
    guards = GuardSet([Guard(TRAIN_MODE, "no.such.bn", False, "some_pass", "why")] + model_state_guards(model, "t"))
    assert [g.target for g in guards.bind(model).untrue_now()] == ["no.such.bn"]


def test_inference_result_back_in_eval_after_training_steps_uses_the_new_statistics():
    """eval() after train-mode steps on an inference result does not reuse the fold of the old BN statistics: ATen
    updates them in place without bumping their versions, so the fold also guards the BN's batch counter."""
    model = conv_bn_net().eval()
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X)
    assert_same(step(reference, backward=False), step(result, backward=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each switch is announced
        for target in (result, reference):
            target.train()
        for seed in range(2):
            assert_same(step(reference, seed=seed), step(result, seed=seed))
        for target in (result, reference):
            target.eval()
        assert_same(step(reference, backward=False), step(result, backward=False))


class _FunctionalBatchNorm(nn.Module):
    """A convolution, then a BatchNorm written as `F.batch_norm` over the module's own statistics: no batch counter."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))

    def forward(self, x):
        return F.batch_norm(self.conv(x), self.mean, self.var, training=self.training, momentum=0.5)


def test_functional_batch_norm_back_in_eval_after_training_steps_uses_the_new_statistics():
    """Statistics ATen updates in place (no version bump) with no batch counter to guard: the fold is computed in the
    graph, so eval() after training steps uses the new statistics rather than a fold of the old ones."""
    torch.manual_seed(0)
    model = _FunctionalBatchNorm().eval()
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X)
    (site,) = result.fxopt_report.passes[0].sites
    assert site.action == "folded" and "as graph ops: no batch counter" in site.detail
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each switch is announced
        for target in (result, reference):
            target.train()
        for seed in range(2):
            assert_same(step(reference, X * 3 + 1, seed=seed), step(result, X * 3 + 1, seed=seed))
        for target in (result, reference):
            target.eval()
        assert_same(step(reference, backward=False), step(result, backward=False))
