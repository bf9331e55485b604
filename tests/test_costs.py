"""fxopt.analysis.costs: fake-tensor estimates agree with real measurements and touch nothing."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import fxopt
from fxopt.analysis.costs import estimate_costs, placeholder_values
from fxopt.analysis.shapes import propagate_shapes
from fxopt.measure import measure_saved_bytes


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 10))


def _exported(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    """The ATen graph fxopt.optimize captures (torch.export, non-strict), sharing `model`'s parameters."""
    return torch.export.export(model, (x,), strict=False).module()


def test_training_estimate_matches_real_step():
    """Training FLOPs equal FlopCounterMode on a real forward+backward; saved bytes equal measure_saved_bytes."""
    model, x = _net().train(), torch.randn(4, 3, 8, 8)
    gm = _exported(model, x)
    costs = estimate_costs(gm, (x,), training=True)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    assert costs.flops == counter.get_total_flops() > 0
    assert costs.saved_bytes == measure_saved_bytes(lambda: model(x), model) > 0


def test_inference_estimate_is_forward_only():
    """Inference counts forward FLOPs and reports no saved bytes."""
    model, x = _net().eval(), torch.randn(4, 3, 8, 8)
    costs = estimate_costs(_exported(model, x), (x,), training=False)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x)
    assert costs.flops == counter.get_total_flops() and costs.saved_bytes is None


def test_estimate_touches_nothing():
    """Estimating never changes parameters, gradients, BatchNorm statistics or the RNG stream."""
    model, x = _net().train(), torch.randn(4, 3, 8, 8)
    gm = _exported(model, x)
    propagate_shapes(gm, (x,))
    state = {k: v.clone() for k, v in gm.state_dict().items()}
    rng = torch.get_rng_state()
    assert estimate_costs(gm, placeholder_values(gm), training=True) is not None
    assert all(torch.equal(state[k], v) for k, v in gm.state_dict().items())
    assert all(p.grad is None for p in gm.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def _branch(x):
    return x * 2 if x.sum() > 0 else x


def test_data_dependent_graph_has_no_estimate():
    """A graph calling opaque code that branches on tensor values cannot run on fake tensors: the estimate is None."""
    model, x = nn.Linear(3, 3), torch.randn(2, 3)
    gm = _exported(model, x)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    linear = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    with gm.graph.inserting_after(linear):
        branch = gm.graph.call_function(_branch, (linear,))
    output.replace_input_with(linear, branch)
    gm.recompile()
    assert estimate_costs(gm, (x,), training=True) is None


def _conv_stack() -> nn.Module:
    layers = []
    for _ in range(4):
        layers += [nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU()]
    return nn.Sequential(*layers).train()


@pytest.mark.usefixtures("budget_may_be_unmet")
@pytest.mark.parametrize("second", ["reoptimize", "prune_after_checkpoint"])
def test_estimates_leave_no_fake_grads_on_checkpointed_parameters(second):
    """A cost estimate runs backward through checkpointed regions, which recompute with the real parameters:
    their `.grad` must stay as it was, or the next training step accumulates into fake tensors."""
    model = _conv_stack()
    inputs = (torch.randn(2, 4, 6, 6),)
    if second == "reoptimize":
        fxopt.optimize(fxopt.optimize(model, inputs, memory_budget=0.3), inputs, memory_budget=0.3)
    else:
        fxopt.optimize(model, inputs, passes=["checkpoint_activations", "prune_dead_grads"], memory_budget=0.3)
    assert [n for n, p in model.named_parameters() if p.grad is not None] == []
