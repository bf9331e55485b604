"""checkpoint_activations: same training step, a measured peak under the budget, monotonic in it."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.testing import FileCheck
from torch.utils.checkpoint import checkpoint

import fxopt
from equivalence import assert_same_step
from graph_forms import exported_graph, function_form
from fxopt.passes.base import PassContext
from fxopt.passes.checkpoint_activations import CheckpointActivations

from fxopt.measure import measure_allocator_peak as allocator_peak

pytestmark = pytest.mark.usefixtures("budget_may_be_unmet")  # budgets tiny models may not reach


def deep_mlp(depth: int, width: int, p: float = 0.1) -> torch.nn.Sequential:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU(), torch.nn.Dropout(p)]
    return torch.nn.Sequential(*layers)


def _optimize(model, inputs, budget):
    return fxopt.optimize(model, inputs, mode="training", passes=["checkpoint_activations"], memory_budget=budget)


def _graph(opt: torch.nn.Module) -> torch.nn.Module:
    """The optimized GraphModule inside fxopt.optimize's result."""
    return getattr(opt, "graph_module", opt)


def _regions(opt: torch.nn.Module) -> list[str]:
    return [name for name, _ in _graph(opt).named_children() if name.startswith("checkpointed_")]


class ResBlock(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c)
        self.conv2, self.bn2 = torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


def conv_net():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               ResBlock(8), ResBlock(8), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(8, 10))


class TransformerBlock(torch.nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = self.drop(torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def test_mlp_step_is_unchanged():
    """Deep MLP with dropout and LayerNorm: outputs, every gradient equal; dropout recomputes the same mask."""
    torch.manual_seed(0)
    model, x = deep_mlp(depth=6, width=64), torch.randn(32, 64)
    opt = _optimize(model, (x,), 0.3)
    assert _regions(opt) and "checkpointed_" in _graph(opt).code
    assert_same_step(model, opt, (x,), training=True)
    assert opt.state_dict().keys() == model.state_dict().keys()


def test_dropout_replayed_from_its_mask_draws_the_same_stream():
    """A region replaying its dropouts from kept masks: in float64 two steps give eager's outputs and input
    gradients exactly, and the RNG ends where eager's does."""
    from fxopt.checkpointing.eager_region import extract_region

    torch.manual_seed(0)
    model, x = deep_mlp(depth=3, width=64, p=0.3).double(), torch.randn(32, 64, dtype=torch.float64)
    gm = exported_graph(model, (x,))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    extract_region(gm, calls, "checkpointed_all", save_compute_intensive=False, replay_dropout=True)
    gm.recompile()
    assert "dropout_once" in gm.checkpointed_all.body.code
    results = []
    for m in (model, gm):
        torch.manual_seed(1)
        got = []
        for _ in range(2):
            xi = x.clone().requires_grad_()
            out = m(xi)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.pow(2).sum().backward()
            got += [out.detach(), xi.grad]
        results.append((got, torch.get_rng_state()))
    (eager, rng), (replayed, rng_replayed) = results
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed)) and torch.equal(rng, rng_replayed)


class _DropoutThenAttentionDropout(torch.nn.Module):
    """A dropout, then attention with its own dropout (SDPA's dropout_p): two random draws in one region."""

    def __init__(self, d: int = 16, attention_p: float = 0.3):
        super().__init__()
        self.drop, self.qkv, self.attention_p = torch.nn.Dropout(0.3), torch.nn.Linear(d, 3 * d), attention_p

    def forward(self, x):
        q, k, v = self.qkv(self.drop(x)).unsqueeze(1).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.attention_p if self.training else 0.0)


@pytest.mark.parametrize("attention_p", [0.3, 0.0])
def test_dropout_before_another_random_op_is_drawn_again(attention_p):
    """A region whose dropout is followed by another random op (SDPA's dropout) draws the dropout again rather than
    replaying it, so the later op reads the generator where the forward did (attention without dropout draws
    nothing: the dropout is replayed); either way gradients equal eager in float64."""
    from fxopt.checkpointing.eager_region import extract_region

    torch.manual_seed(0)
    model = _DropoutThenAttentionDropout(attention_p=attention_p).double()
    x = torch.randn(4, 6, 16, dtype=torch.float64)
    gm = exported_graph(model, (x,))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    extract_region(gm, calls, "checkpointed_all", save_compute_intensive=False, replay_dropout=True)
    gm.recompile()
    assert ("dropout_once" in gm.checkpointed_all.body.code) == (attention_p == 0)
    grads = []
    for m in (model, gm):
        torch.manual_seed(1)
        xi = x.clone().requires_grad_()
        out = m(xi)
        (out[0] if isinstance(out, tuple) else out).pow(2).sum().backward()
        grads.append(xi.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_conv_net_with_train_bn_is_unchanged():
    """Train-mode BatchNorm recomputed in a region: running stats update once, gradients match."""
    torch.manual_seed(0)
    model, x = conv_net(), torch.randn(4, 3, 16, 16)
    opt = _optimize(model, (x,), 0.3)
    bodies = [getattr(_graph(opt), name).body.code for name in _regions(opt)]
    assert any("batch_norm_once" in code for code in bodies)
    assert_same_step(model, opt, (x,), training=True)  # buffers include running stats and num_batches_tracked


def test_functional_train_batch_norm_is_recomputed_once():
    """F.batch_norm in training inside a region: a recomputation updates throwaway copies, so stats move once."""
    class Functional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.register_buffer("mean", torch.zeros(8))
            self.register_buffer("var", torch.ones(8))

        def forward(self, x):
            for _ in range(3):
                y = F.batch_norm(torch.tanh(self.conv(x)), self.mean, self.var, training=True)
                x = torch.tanh(torch.sigmoid(y))[:, :3] + x
            return x

    torch.manual_seed(0)
    model, x = Functional(), torch.randn(4, 3, 16, 16)
    opt = _optimize(model, (x,), 0.3)
    assert not opt.fxopt_report["checkpoint_activations"].stats["refused_bn_training"]
    assert any("batch_norm_once" in getattr(_graph(opt), name).body.code for name in _regions(opt))
    assert_same_step(model, opt, (x,), training=True)  # the buffers mean and var match eager's


def test_transformer_block_is_unchanged():
    """Attention with dropout, residuals and an MLP: same outputs and gradients with regions in place."""
    torch.manual_seed(0)
    model, x = TransformerBlock(), torch.randn(4, 16, 32)
    opt = _optimize(model, (x,), 0.4)
    assert _regions(opt)
    assert_same_step(model, opt, (x,), training=True)


def test_measured_peak_honours_budget_and_falls_with_it():
    """The allocator's peak stays under the budget (10% slack for the estimate) and never rises as the budget falls."""
    torch.manual_seed(0)
    model, x = deep_mlp(depth=8, width=128), torch.randn(64, 128)
    eager = allocator_peak(model, (x,))
    peaks = []
    for budget in (1.0, 0.75, 0.5, 0.25, 0.1):
        opt = _optimize(model, (x,), budget)
        peak = allocator_peak(opt, (x,))
        if not opt.fxopt_report["checkpoint_activations"].stats["refused_budget_unreachable"]:
            assert peak <= 1.1 * budget * eager, (budget, peak / eager)
        peaks.append(peak)
    assert all(b <= a for a, b in zip(peaks, peaks[1:])), [p / eager for p in peaks]
    assert peaks[-1] < 0.5 * eager


def test_plan_below_the_floor_does_not_depend_on_timing(monkeypatch):
    """Every budget below the floor gets the same plan, however the measured op times come out."""
    import random
    import fxopt.checkpointing.profile as memory
    measured, draw = memory.node_seconds, random.Random(0)
    monkeypatch.setattr(memory, "node_seconds",
                        lambda gm: {k: v * draw.uniform(0.2, 5.0) for k, v in measured(gm).items()})
    torch.manual_seed(0)
    model, x = deep_mlp(depth=6, width=64), torch.randn(32, 64)
    plans = []
    for budget in (0.2, 0.1, 0.05, 0.1):
        with pytest.warns(UserWarning, match="NOT met"):
            opt = _optimize(model, (x,), budget)
        assert opt.fxopt_report["checkpoint_activations"].stats["refused_budget_unreachable"]
        plans.append(_regions(opt))
    assert plans[0] and all(p == plans[0] for p in plans), plans


def test_estimates_match_measurement():
    """The step-peak model is within 20% of the allocator's peak, before and after checkpointing."""
    torch.manual_seed(0)
    model, x = deep_mlp(depth=8, width=128), torch.randn(64, 128)
    opt = _optimize(model, (x,), 0.4)
    figures = opt.fxopt_report["checkpoint_activations"].figures
    assert figures["peak_estimate_before"] == pytest.approx(allocator_peak(model, (x,)), rel=0.2)
    assert figures["peak_estimate_after"] == pytest.approx(allocator_peak(opt, (x,)), rel=0.2)


def test_report_figures():
    """The report gives saved bytes before/after, recomputed FLOPs and the regions it made."""
    torch.manual_seed(0)
    model, x = deep_mlp(depth=4, width=64), torch.randn(128, 64)  # batch 128: the weights' gradients leave room under 0.5
    opt = _optimize(model, (x,), 0.5)
    report = opt.fxopt_report["checkpoint_activations"]
    figures = report.figures
    assert figures["saved_bytes_after"] < figures["saved_bytes_before"]
    assert figures["peak_estimate_after"] <= figures["budget_bytes"] < figures["peak_estimate_before"]
    assert figures["regions"] == _regions(opt)
    assert report.stats["checkpointed"] == len(figures["regions"])
    assert figures["recomputed_flops"] >= 0


def test_full_budget_recomputes_nothing():
    """Budget 1.0 is met by the graph as it is: no region."""
    model, x = deep_mlp(depth=4, width=64), torch.randn(32, 64)
    assert not _regions(_optimize(model, (x,), 1.0))


def test_second_run_changes_nothing():
    """Idempotence: a graph holding its regions is left alone by a second run."""
    torch.manual_seed(0)
    model, x = deep_mlp(depth=4, width=64), torch.randn(32, 64)
    opt = _optimize(model, (x,), 0.3)
    code = _graph(opt).code
    result = CheckpointActivations().run(_graph(opt), PassContext("training", {"memory_budget": 0.3}))
    assert not result.changed and result.skipped
    assert _graph(opt).code == code


class Mutating(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.a(torch.tanh(x)) + 1.0  # add saves nothing, so eager lets h be written
        h.mul_(2)
        return self.b(torch.tanh(h))


@pytest.mark.filterwarnings("ignore:fxopt. the predicted step peak rests on")  # an in-place write the memory model guesses
def test_inplace_op_joins_only_a_region_that_made_what_it_writes():
    """An in-place op is recomputed only with the op that made its target: never writing a region input twice."""
    from fxopt.checkpointing.profile import Region, step_profile
    from fxopt.checkpointing.kept_writes import KeptWrites

    gm = _graph(fxopt.optimize(Mutating(), (torch.randn(32, 64),), mode="training", passes=[]))
    profile = step_profile(gm)
    at = {s.node.name: p for p, s in enumerate(profile.steps)}
    writes = KeptWrites(gm, profile)
    assert writes.write_inside(Region(at["mul_"], at["mul_"] + 1)) is not None  # add made h outside
    assert writes.write_inside(Region(at["add"], at["mul_"] + 1)) is None  # the region makes h itself
    assert writes.write_inside(Region(at["linear"], at["mul_"] + 1, save_compute_intensive=True)) is None  # h: not cached
    torch.manual_seed(0)
    model, x = Mutating(), torch.randn(32, 64)
    opt = _optimize(model, (x,), 0.2)
    assert not opt.fxopt_report["checkpoint_activations"].stats["refused_mutation"]
    for name in _regions(opt):
        body = getattr(_graph(opt), name).body.code
        assert "mul_" not in body or "add" in body
    assert_same_step(model, opt, (x,), training=True)


def test_selective_region_never_writes_its_cached_output():
    """`h = linear(x); h.mul_(2)`: a selective region caches h, so it may not hold the write; a whole one may, and so
    may a selective one ending at the linear, which does not keep h."""
    from fxopt.checkpointing.profile import Region, step_profile
    from fxopt.checkpointing.kept_writes import KeptWrites

    class WritesMatmulOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64)

        def forward(self, x):
            h = self.a(torch.tanh(x))
            h.mul_(2)
            return torch.tanh(h)

    gm = _graph(fxopt.optimize(WritesMatmulOutput(), (torch.randn(32, 64),), mode="training", passes=[]))
    profile = step_profile(gm)
    at = {s.node.name: p for p, s in enumerate(profile.steps)}
    writes = KeptWrites(gm, profile)
    assert writes.write_inside(Region(at["linear"], at["mul_"] + 1)) is None
    value, writer = writes.write_inside(Region(at["linear"], at["mul_"] + 1, save_compute_intensive=True))
    assert (value.name, writer.name) == ("linear", "mul_")
    # ending at the linear, which checkpoint's early stop never recomputes, it keeps nothing of h: no conflict
    assert writes.conflict(Region(at["tanh"], at["linear"] + 1, save_compute_intensive=True)) is None


@torch.library.custom_op("fxopt_test_checkpoint::scale", mutates_args=())
def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_scale.register_fake
def _(x):
    return torch.empty_like(x)


def test_unknown_call_stays_outside_regions():
    """A call fxopt cannot see into (a custom op) may mutate state or draw random numbers: never recomputed."""
    class Opaque(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.a(torch.tanh(_scale(torch.tanh(x))))

    model, x = Opaque(), torch.randn(32, 64)
    opt = _optimize(model, (x,), 0.2)
    assert opt.fxopt_report["checkpoint_activations"].stats["refused_unknown_op"] == 1
    assert "fxopt_test_checkpoint.scale" in _graph(opt).code


@pytest.mark.filterwarnings("ignore:fxopt. the predicted step peak rests on")  # an in-place write the memory model guesses
def test_user_checkpoint_is_left_alone():
    """A region the user checkpointed by hand stays one call, outside every region the pass makes."""
    class HandCheckpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            h = torch.tanh(self.a(torch.tanh(x)))
            return self.b(torch.tanh(checkpoint(self.b, h, use_reentrant=False)))

    # fxopt's capture traces through checkpoint(); a tracer that keeps it as a call shows what the pass does with it
    model, x = HandCheckpointed(), torch.randn(32, 64)
    gm = function_form(model, (x,), autowrap_functions=(checkpoint,))
    result = CheckpointActivations().run(gm, PassContext("training", {"memory_budget": 0.1}))
    gm.recompile()
    assert result.stats["refused_already_checkpointed"] == 1 and result.stats["checkpointed"] >= 1
    FileCheck().check("torch.utils.checkpoint.checkpoint(b, ").run(gm.code)
    for name in _regions(gm):
        assert "checkpoint.checkpoint" not in getattr(gm, name).body.code
    assert_same_step(model, gm, (x,), training=True)


@pytest.mark.parametrize("budget", [0.0, 1.5, -3, float("nan"), True, "lots", "0MB", "12 parsecs", [0.5]])
def test_bad_budget_is_a_clear_error(budget):
    """Out-of-range or malformed budgets raise FxoptError naming memory_budget."""
    model, x = deep_mlp(depth=2, width=16), torch.randn(4, 16)
    with pytest.raises(fxopt.FxoptError, match="memory_budget"):
        _optimize(model, (x,), budget)


@pytest.mark.parametrize("budget", ["200000B", "200KB", "0.2MiB"])
def test_absolute_budget(budget):
    """An absolute size bounds the estimated peak in bytes."""
    torch.manual_seed(0)
    model, x = deep_mlp(depth=6, width=64), torch.randn(64, 64)  # batch 64: 200 KB stays above the weights' gradients
    figures = _optimize(model, (x,), budget).fxopt_report["checkpoint_activations"].figures
    assert figures["budget_bytes"] in (200_000, 209_715)
    assert figures["peak_estimate_after"] <= figures["budget_bytes"]


def test_default_training_pipeline_runs_it_only_with_a_budget():
    """Without memory_budget the default training pipeline does not checkpoint; with one it does."""
    model, x = deep_mlp(depth=4, width=64), torch.randn(32, 64)
    plain = fxopt.optimize(model, (x,), mode="training")
    assert "checkpoint_activations" not in [p.name for p in plain.fxopt_report.passes]
    budgeted = fxopt.optimize(model, (x,), mode="training", memory_budget=0.3)
    assert budgeted.fxopt_report["checkpoint_activations"].changed


def test_node_flops_match_flop_counter():
    """Per-node FLOPs add up to what FlopCounterMode counts for the real forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from fxopt.analysis.flops import node_flops

    model, x = deep_mlp(depth=2, width=32), torch.randn(8, 32)
    opt = fxopt.optimize(model, (x,), mode="training", passes=[])
    flops = node_flops(_graph(opt))
    assert flops["linear"] == flops["linear_1"] == 2 * 8 * 32 * 32 and flops["layer_norm"] == 0
    with FlopCounterMode(display=False) as counter:
        model(x)
    assert sum(flops.values()) == counter.get_total_flops()


def test_unreachable_budget_is_loud():
    """A budget below what any plan reaches warns with the budget and the floor, the report's headline says so, and
    every region made frees bytes."""
    torch.manual_seed(0)
    model, x = deep_mlp(depth=4, width=64), torch.randn(32, 64)
    with pytest.warns(UserWarning, match=r"memory_budget 0\.01 .* NOT met: lowest reachable 0\.\d\dx"):
        opt = _optimize(model, (x,), 0.01)
    report = opt.fxopt_report
    assert "NOT met" in str(report).splitlines()[1]
    figures = report["checkpoint_activations"].figures
    assert not figures["budget_met"] and "lowest reachable" in figures["headline"]
    freed = [re.search(r"frees (\S+) MB", s.detail) for s in report["checkpoint_activations"].sites]
    assert all(float(m.group(1)) > 0 for m in freed if m) and any(freed)


def test_unreachable_budget_names_the_peak_and_what_to_change():
    """An unmet budget's warning names where the peak is held and the budget that is met, at the caller's line."""
    torch.manual_seed(0)
    model, x = deep_mlp(depth=4, width=64), torch.randn(32, 64)
    with pytest.warns(UserWarning, match="NOT met") as caught:
        opt = fxopt.optimize(model, x, mode="training", memory_budget=0.01)
    message = str(caught[0].message)
    assert re.search(r"its peak is in (backward|forward), held by .*: give memory_budget=0\.\d+ or more, or a smaller "
                     r"batch$", message), message
    assert caught[0].filename == __file__, caught[0].filename
    floor = float(re.search(r"give memory_budget=(\S+) or more", message).group(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the budget it suggests is met: no warning
        fxopt.optimize(model, x, mode="training", memory_budget=floor)
    assert opt.fxopt_report["checkpoint_activations"].figures["headline"] in message


def test_unreachable_budget_is_a_budget_unreachable_refusal_and_keeps_the_step():
    """No plan fits: one `budget_unreachable` refusal at `<graph>`, and the lowest plan applied computes the same step."""
    torch.manual_seed(0)
    model, x = deep_mlp(depth=4, width=64), torch.randn(32, 64)
    with pytest.warns(UserWarning, match="NOT met"):
        opt = _optimize(model, (x,), 0.01)
    report = opt.fxopt_report["checkpoint_activations"]
    assert report.stats["refused_budget_unreachable"] == 1
    assert [s.node.rpartition(":")[2] for s in report.sites if s.reason == "budget_unreachable"] == ["<graph>"]
    assert _regions(opt)
    assert_same_step(model, opt, (x,), training=True)


def test_training_pipeline_checkpoints_before_inplace_relu():
    """Default order: ReLUs are no `mutation` refusals for the planner; inplace_relu still runs after it."""
    torch.manual_seed(0)
    model, x = conv_net(), torch.randn(4, 3, 16, 16)
    opt = fxopt.optimize(model, (x,), mode="training", memory_budget=0.4)
    names = [p.name for p in opt.fxopt_report.passes]
    assert names.index("checkpoint_activations") < names.index("inplace_relu")
    assert not opt.fxopt_report["checkpoint_activations"].stats["refused_mutation"]
    assert _regions(opt)
    assert_same_step(model, opt, (x,), training=True)


def test_fractional_budget_is_of_the_step_as_captured():
    """A fraction is of the captured step's peak, so bytes an earlier pass frees (prune_dead_grads on a frozen
    layer) count towards the budget instead of shrinking it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
                                torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.Tanh(), torch.nn.Conv2d(16, 4, 1)).train()
    model[2].weight.requires_grad_(False)  # eager still keeps its input; prune_dead_grads drops that
    x = (torch.randn(8, 3, 16, 16),)
    figures = []
    for passes in (["prune_dead_grads", "checkpoint_activations"], ["checkpoint_activations"]):
        optimized = fxopt.optimize(model, x, passes=passes, memory_budget=0.9)
        figures.append(optimized.fxopt_report["checkpoint_activations"].figures)
    assert figures[0]["saved_bytes_before"] < figures[1]["saved_bytes_before"]
    assert figures[0]["peak_estimate_before"] < figures[1]["peak_estimate_before"]
    assert figures[0]["budget_bytes"] == figures[1]["budget_bytes"]
