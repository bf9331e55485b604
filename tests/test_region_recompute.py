"""What a region's recomputation runs: checkpoint stops it once the last saved tensor is saved again (its early
stop), and the memory model prices exactly those steps (fxopt.checkpointing.profile.StepProfile.recomputed_steps)."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxopt
from fxopt.checkpointing.profile import step_profile

from named_regions import extract_regions, named_regions
from test_memory_attention import _ResidualMLP

FORWARD_OPS = {"aten.native_layer_norm.default": "layer_norm", "aten.addmm.default": "linear",
               "aten.gelu.default": "gelu"}  # each only in a forward (backward kernels are others)


class _ForwardOpsRun(TorchDispatchMode):
    """Counts the forward ops of FORWARD_OPS it sees, by the op name of the node that issues them."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in FORWARD_OPS:
            self.counts[FORWARD_OPS[str(func)]] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bounds,recomputed", [
    ((("layer_norm", "add"),), ["layer_norm", "linear", "gelu"]),  # the last linear saves its input: never runs
    ((("layer_norm", "gelu"),), ["layer_norm", "linear"]),  # GELU saves its input only
    ((("linear", "linear_1"),), ["linear", "gelu"]),
    ((("gelu", "linear_2"),), ["gelu", "linear_1", "add", "layer_norm_1"]),  # across two blocks
    ((("add", "add_1"),), ["add", "layer_norm_1", "linear_2", "gelu_1"]),
])
def test_recomputed_steps_are_what_checkpoint_runs(bounds, recomputed):
    """The steps the model says a region recomputes are the forward ops its backward runs again, no more."""
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(*[_ResidualMLP(64) for _ in range(2)]).train(), torch.randn(2, 8, 64)
    opt = fxopt.optimize(model, (x,), mode="training", passes=[])
    profile = step_profile(opt.graph_module)
    (region,) = named_regions(profile, list(bounds))
    assert [profile.steps[q].node.name for q in profile.recomputed_steps(region)] == recomputed
    extract_regions(opt.graph_module, profile, [region])
    loss = opt(x).pow(2).sum()
    with _ForwardOpsRun() as run:
        loss.backward()
    expected = collections.Counter(name.rstrip("_0123456789") for name in recomputed if not name.startswith("add"))
    assert run.counts == expected


def test_region_cost_counts_what_it_recomputes():
    """A region's FLOPs and cost (here untimed: FLOPs, an element per output for GELU) are those of its recomputed
    steps: the same over a block whether or not it reaches the block's last linear and residual add."""
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(*[_ResidualMLP(64) for _ in range(2)]).train(), torch.randn(2, 8, 64)
    profile = step_profile(fxopt.optimize(model, (x,), mode="training", passes=[]).graph_module)
    (to_gelu,), (to_add,) = named_regions(profile, [("layer_norm", "gelu")]), named_regions(profile, [("layer_norm", "add")])
    assert profile.region_cost(to_add) > profile.region_cost(to_gelu) > 0  # the add's region also recomputes GELU
    (to_linear,) = named_regions(profile, [("layer_norm", "linear_1")])
    assert profile.region_flops(to_linear) == profile.region_flops(to_add)
    assert profile.region_cost(to_linear) == profile.region_cost(to_add)
