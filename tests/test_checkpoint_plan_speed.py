"""checkpoint_activations' planning shortcuts: the same plans and shapes as the long way, in less time."""
from __future__ import annotations

import pytest
import torch

from fxopt.analysis import shapes
from fxopt.checkpointing.profile import Estimate, estimate, step_profile
from fxopt.checkpointing import planner
from fxopt.passes.base import TRAINING, PassContext
from fxopt.passes.checkpoint_activations import CheckpointActivations

from graph_forms import exported_graph
from test_checkpoint_activations import deep_mlp


def _every_final(finals, profile, budget, objective):
    """The best final plan found by estimating every label (what `_best_final` avoids)."""
    full = [(cost, estimate(profile, regions).peak, regions) for _, cost, _, regions in finals]
    fits = [f for f in full if f[1] <= budget]
    if not fits:
        return None
    key = (lambda f: (f[0], f[1])) if objective == "cost" else (lambda f: (f[1], f[0]))
    return min(fits, key=key)[2]


def test_lazy_final_check_finds_the_plan_every_label_would(monkeypatch):
    """Estimating final labels in objective order until the answer is known picks a plan as good as estimating all."""
    torch.manual_seed(0)
    gm = exported_graph(deep_mlp(depth=6, width=64).train(), (torch.randn(32, 64),))
    profile = step_profile(gm)
    checkpointable = [True] * len(profile.steps)
    before = estimate(profile).peak
    lazy = {b: planner.plan_regions(profile, b * before, checkpointable) for b in (0.9, 0.7, 0.5, 0.35)}
    lazy["peak"] = planner.plan_regions(profile, float("inf"), checkpointable, objective="peak")
    monkeypatch.setattr(planner, "_best_final", _every_final)
    for budget, plan in lazy.items():
        if budget == "peak":
            full = planner.plan_regions(profile, float("inf"), checkpointable, objective="peak")
            assert estimate(profile, plan).peak == estimate(profile, full).peak
            continue
        full = planner.plan_regions(profile, budget * before, checkpointable)
        assert (plan is None) == (full is None), budget
        if plan is not None:
            assert sum(map(profile.region_cost, plan)) == sum(map(profile.region_cost, full)), budget
            assert estimate(profile, plan).peak <= budget * before


@pytest.mark.parametrize("objective", ["cost", "peak"])
def test_final_check_stops_at_labels_tied_with_the_best(objective, monkeypatch):
    """Labels tied with the best on the objective's first key, but no better on its second, are not estimated (HF
    MobileViT's lowest-peak plan estimated 30,641 such labels, 106 s)."""
    estimated = []

    def whole_estimate(profile, regions):  # a plan's whole peak is its walked peak here: regions = (peak,)
        estimated.append(regions)
        return Estimate(0, regions[0], regions[0], 0)

    monkeypatch.setattr(planner, "estimate", whole_estimate)
    tied = [(0, 5 if objective == "cost" else i, 7 if objective == "peak" else i, (7 if
            objective == "peak" else i,)) for i in range(1000)]
    best = planner._best_final(tied, None, budget=10_000, objective=objective)
    assert best == ((7,) if objective == "peak" else (0,)) and len(estimated) == 1


def test_regions_carry_their_shapes():
    """After checkpointing, every node's shape is already up to date (nothing to propagate again) and right."""
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    gm = exported_graph(deep_mlp(depth=6, width=64).train(), (x,))
    ctx = PassContext(mode=TRAINING, options={"memory_budget": 0.5})
    result = CheckpointActivations().run(gm, ctx)
    gm.recompile()
    assert result.figures["regions"]
    assert shapes.update_shapes(gm, (x,)) == 0
    carried = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op == "call_module"}
    shapes.propagate_shapes(gm, (x,))
    for name, val in carried.items():
        fresh = next(n for n in gm.graph.nodes if n.name == name).meta["val"]
        for a, b in zip(val if isinstance(val, tuple) else (val,), fresh if isinstance(fresh, tuple) else (fresh,)):
            assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()


class _NormedHead(torch.nn.Module):
    """Pre-norm residual blocks, then a final LayerNorm and a wide head, as a language model ends."""

    def __init__(self, width: int = 32, depth: int = 3, vocab: int = 640):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width),
                                                              torch.nn.GELU()) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def _normed_head_profile(caller_loss: bool, depth: int = 3):
    torch.manual_seed(0)
    return step_profile(exported_graph(_NormedHead(depth=depth).train(), (torch.randn(4, 16, 32),)),
                        caller_loss=caller_loss)


def test_boundaries_offer_the_end_of_a_chain_crossing_as_few_bytes():
    """The final residual add and the layer norm reading only it cross as few bytes: both ends are offered, and the
    lowest-peak plan runs its region through the layer norm, keeping one tensor before the head, not two (deep
    enough that a window of the boundary search holds more than one step)."""
    profile = _normed_head_profile(caller_loss=False, depth=40)
    names = [s.node.name for s in profile.steps]
    after_add, after_norm = names.index("add_39") + 1, names.index("layer_norm_40") + 1
    assert len(names) > 2 * planner.MAX_BOUNDARIES
    assert {after_add, after_norm} <= planner.region_boundaries(profile)
    lowest = planner.plan_regions(profile, float("inf"), [True] * len(names), objective="peak")
    assert any(r.start < after_add and r.stop >= after_norm for r in lowest)


def test_lowest_peak_search_under_a_rising_limit_finds_the_unbounded_plan():
    """The lowest-peak search under limits rising from the floor returns the plan the unbounded search returns."""
    for profile in (_normed_head_profile(caller_loss=True), _normed_head_profile(caller_loss=False)):
        checkpointable = [True] * len(profile.steps)
        risen = planner.plan_regions(profile, float("inf"), checkpointable, objective="peak")
        unbounded = planner._search(profile, float("inf"), checkpointable, "peak", lambda region: True)
        assert risen == unbounded


def test_budget_under_the_callers_loss_is_refused_before_any_label_grows(monkeypatch):
    """A budget the caller's loss alone (its tensors and the head's output made last) exceeds drops every label at the
    first position: no plan, and no label survives to be extended."""
    profile = _normed_head_profile(caller_loss=True)
    loss = profile.loss_tensors * profile.bytes_of(profile.loss_outputs)
    assert planner._backward_floor(profile)[0] == max(loss + profile.bytes_of(profile.loss_outputs),
                                                      max(planner._backward_floor(profile)[1:]))
    surviving = []
    real_prune = planner._prune
    monkeypatch.setattr(planner, "_prune", lambda *args: surviving.extend(real_prune(*args)) or real_prune(*args))
    assert planner.plan_regions(profile, loss + profile.bytes_of(profile.loss_outputs) / 2,
                                [True] * len(profile.steps)) is None
    assert not surviving


class _EveryBlockOut(torch.nn.Module):
    """Residual blocks returning every block's output beside the last, as a model returning its hidden states or
    key/value cache does."""

    def __init__(self, width: int = 32, depth: int = 6):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                          for _ in range(depth))

    def forward(self, x):
        states = []
        for block in self.blocks:
            x = x + block(x)
            states.append(torch.tanh(x))  # an output no later step reads, kept by tanh for its backward
        return x, *states


@pytest.mark.parametrize("caller_loss", [False, True])
def test_outputs_no_step_reads_leave_the_held_tensors(caller_loss, monkeypatch):
    """A kept graph output that no later step reads stops telling labels apart once its readers have run (GPT-2's
    key/value cache split the labels into hundreds of held sets), also where the caller's loss reads it (its bytes
    summed): the plans are those of the full held sets, made with fewer distinct held sets."""
    torch.manual_seed(0)
    graph = exported_graph(_EveryBlockOut().train(), (torch.randn(64, 32),))
    profile = step_profile(graph, caller_loss=caller_loss)
    checkpointable = [True] * len(profile.steps)
    budgets = [f * estimate(profile).peak for f in (0.8, 0.7, 0.6, 0.5)]
    plans = [planner.plan_regions(profile, b, checkpointable) for b in budgets]
    assert any(plans), plans
    held_sets = len({held for held, _ in profile._deltas})
    full = step_profile(graph, caller_loss=caller_loss)
    monkeypatch.setattr(full, "_read_until", {})
    assert [planner.plan_regions(full, b, checkpointable) for b in budgets] == plans
    assert held_sets < len({held for held, _ in full._deltas})
