"""checkpoint_activations with BatchNorm: statistics updated once per step, same RNG, every region kind, both modes.

The networks are the shapes that crashed in backward (`aten.clone.default encountered during
backward but not found in storage`): a ResNet-style net with BatchNorm on the residual branch,
a Conv-BN-ReLU-Dropout stack, depthwise-separable MobileNet blocks, Hugging Face MobileNetV2.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from corpus_models import LastHiddenState
from equivalence import assert_same_step
from fxopt.checkpointing.eager_region import extract_region
from fxopt.checkpointing.eligibility import refusal

pytestmark = pytest.mark.usefixtures("budget_may_be_unmet")  # budgets tiny models may not reach

# ---- the networks -----------------------------------------------------------------------------


class Bottleneck(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out)
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet_style():
    """Residual blocks whose shortcut is a conv + BatchNorm."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         Bottleneck(8, 16, 2), Bottleneck(16, 16, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10))


def conv_bn_relu_dropout():
    layers = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(3):
        layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2), nn.Conv2d(8, 8, 3, padding=1)]
    return nn.Sequential(*layers)


class DepthwiseSeparable(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dw, self.bn1 = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c)
        self.pw, self.bn2 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn2(self.pw(F.relu6(self.bn1(self.dw(x)))))


def mobilenet_blocks():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
                         DepthwiseSeparable(8), DepthwiseSeparable(8), DepthwiseSeparable(8))



def hf_mobilenet_v2():
    transformers = pytest.importorskip("transformers")
    config = transformers.MobileNetV2Config(image_size=32, depth_multiplier=0.25)
    return LastHiddenState(transformers.MobileNetV2Model(config))


NETWORKS = {"resnet_style": resnet_style, "conv_bn_relu_dropout": conv_bn_relu_dropout,
            "mobilenet_blocks": mobilenet_blocks, "hf_mobilenet_v2": hf_mobilenet_v2}


def _network(name):
    torch.manual_seed(0)
    return NETWORKS[name]().train(), torch.randn(4, 3, 32, 32)


# ---- one step, with what must match ------------------------------------------------------------


def _step(model, x, steps=2, in_place=False):
    """`steps` forward + backward on a copy (on `model` itself if `in_place`: a result keeps the graphs it
    compiled); outputs, gradients, buffers and the RNG state after."""
    model = model if in_place else copy.deepcopy(model)
    x = x.clone().requires_grad_()
    torch.manual_seed(1)
    for _ in range(steps):
        out = model(x)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    result = {"output": out.detach(), "grad:input": x.grad, "rng": torch.get_rng_state()}
    result.update({f"grad:{n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    result.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    return result


def assert_same_steps(original, optimized, x, steps=2, in_place=False):
    """Two steps in a row match eager: outputs, gradients, buffers (num_batches_tracked included), RNG.
    `in_place`: the optimized model's steps run on it, not on a copy (it must not share state with `original`)."""
    ref, got = _step(original, x, steps), _step(optimized, x, steps, in_place)
    assert ref.keys() <= got.keys(), sorted(ref.keys() - got.keys())
    for name, expected in ref.items():
        if expected.is_floating_point():
            torch.testing.assert_close(got[name], expected, rtol=1e-4, atol=1e-4, msg=name)
        else:
            assert torch.equal(got[name], expected), name


def _regions(opt):
    return [m for name, m in getattr(opt, "graph_module", opt).named_modules()
            if name.rpartition(".")[2].startswith("checkpointed_")]


def _checkpoint_runs(gm, save_compute_intensive):
    """Every maximal run of nodes the pass may recompute becomes one region of the given kind."""
    root = getattr(gm, "graph_module", gm)  # fxopt.optimize's result holds its graph beside itself
    graphs = [g for m in root.modules() for g in (m, m.__dict__.get("graph_module"))  # and so does a child's
              if isinstance(g, torch.fx.GraphModule)]
    made = 0
    for graph in graphs:
        runs, run = [], []
        for node in list(graph.graph.nodes):
            if node.op in ("call_function", "call_method", "call_module") and not refusal(node, graph):
                run.append(node)
            elif run:
                runs.append(run)
                run = []
        for k, nodes in enumerate(r for r in runs + [run] if len(r) > 1):
            extract_region(graph, nodes, f"checkpointed_run{k}", save_compute_intensive)
            made += 1
        graph.recompile()
    assert made
    return gm


# ---- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("save_compute_intensive", [False, True], ids=["whole", "selective"])
@pytest.mark.parametrize("name", NETWORKS)
def test_batch_norm_in_every_region_kind(name, save_compute_intensive):
    """Regions holding train-mode BatchNorm (whole or selective) give eager's step: stats move once, same RNG."""
    model, x = _network(name)
    example = x.clone().requires_grad_()  # as the steps call it: no recompile, which would drop the regions
    captured = fxopt.optimize(copy.deepcopy(model), (example,), mode="training", passes=[])
    regions = _checkpoint_runs(captured, save_compute_intensive)
    assert not any("aten.add_" in r.body.code for r in _regions(regions))  # num_batches_tracked: in front of them
    assert_same_steps(model, regions, x, in_place=True)  # a copy would compile afresh, without the regions
    assert len(captured.fxopt_reports) == 1


@pytest.mark.parametrize("name,budget", [(name, budget) for name in NETWORKS for budget in (0.5, 0.2)
                                         if (name, budget) != ("hf_mobilenet_v2", 0.2)])  # a minute to plan
def test_default_pipeline_with_budget(name, budget):
    """The crash as a user met it: the default training pipeline with a budget, on train-mode BN networks."""
    model, x = _network(name)
    opt = fxopt.optimize(model, (x,), mode="training", memory_budget=budget)
    assert_same_steps(model, opt, x)


@pytest.mark.parametrize("save_compute_intensive", [False, True], ids=["whole", "selective"])
def test_exported_graph_batch_norm(save_compute_intensive):
    """torch.export's ATen form (aten.batch_norm with its stats, aten.add_ on num_batches_tracked) in a region."""
    model, x = _network("conv_bn_relu_dropout")
    gm = torch.export.export(model, (x,), strict=False).module()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    extract_region(gm, calls, "checkpointed_all", save_compute_intensive)
    gm.recompile()
    assert "batch_norm_once" in gm.checkpointed_all.body.code
    assert "add_" not in gm.checkpointed_all.body.code  # num_batches_tracked moves in front of the region
    assert_same_steps(model, gm, x)


@pytest.mark.parametrize("save_compute_intensive", [False, True], ids=["whole", "selective"])
def test_batch_norm_frozen_at_optimize_then_unfrozen(save_compute_intensive):
    """A BN in eval mode when regions were made, switched to train later, still updates its stats once a step."""
    model, x = _network("mobilenet_blocks")
    model.eval()
    example = x.clone().requires_grad_()  # as the steps call it: no recompile, which would drop the regions
    regions = _checkpoint_runs(fxopt.optimize(copy.deepcopy(model), (example,), mode="training", passes=[]),
                               save_compute_intensive)
    assert_same_steps(model, regions, x, in_place=True)  # eval-mode BN inside regions: no statistics move
    assert len(regions.fxopt_reports) == 1
    opt = fxopt.optimize(copy.deepcopy(model), (x,), mode="training", memory_budget=0.2)
    compiled = len(opt.fxopt_reports)
    model.train(), opt.train()
    assert_same_steps(model, opt, x, in_place=True)  # a graph baked eval: Dynamo's guards compile the train-mode one
    assert len(opt.fxopt_reports) > compiled


def test_budgeted_model_switched_to_eval():
    """A result budgeted in train mode, then eval() (input gradients, or a frozen BN phase): backward matches eager."""
    model, x = _network("conv_bn_relu_dropout")
    opt = fxopt.optimize(copy.deepcopy(model), (x,), mode="training", memory_budget=0.2)
    compiled = len(opt.fxopt_reports)
    model.eval(), opt.eval()
    assert_same_steps(model, opt, x, in_place=True)  # Dynamo's guards compile the eval-mode graph
    assert len(opt.fxopt_reports) > compiled


def test_report_checkpoints_batch_norm():
    """At a tight budget the pass puts train-mode BN inside regions (not refusals) on the ResNet-style net."""
    model, x = _network("resnet_style")
    opt = fxopt.optimize(model, (x,), mode="training", passes=["checkpoint_activations"], memory_budget=0.3)
    report = opt.fxopt_report["checkpoint_activations"]
    assert report.stats["checkpointed"] and not report.stats["refused_bn_training"]
    assert any("batch_norm" in r.body.code for r in _regions(opt))
    assert_same_step(model, opt, (x,), training=True)
