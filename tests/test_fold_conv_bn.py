"""fold_conv_bn: every conv/linear form folds exactly where it is safe, and nowhere else.

Each foldable case is checked for structure (the BN is gone from the code), equivalence with the
original (outputs in inference; outputs, gradients and buffers in training with a frozen BN),
the report, and that the caller's model is left alone. Each refusal rule has its own test.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import assert_same_step, assert_state_unchanged, state_snapshot
from graph_forms import exported_graph
from torch.testing import FileCheck

import fxopt
from fxopt import _torch_private
from fxopt.measure import measure_saved_bytes
from fxopt.passes.base import PassContext
from fxopt.passes.fold_conv_bn import FoldConvBN

BATCH = 8  # a train-mode BN on a batch of 2 is ill-conditioned; 8 compares stably
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def randomize(model: nn.Module) -> nn.Module:
    """Give every BN non-trivial statistics and affine parameters, so a wrong fold shows."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BATCH_NORMS) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen))
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            if isinstance(m, BATCH_NORMS) and m.affine:
                m.weight.copy_(torch.randn(m.num_features, generator=gen))
                m.bias.copy_(torch.randn(m.num_features, generator=gen))
    return model


def freeze_bn(model: nn.Module) -> nn.Module:
    """The fine-tuning set-up: the model trains, its BatchNorms stay in eval mode."""
    model.train()
    for m in model.modules():
        if isinstance(m, BATCH_NORMS):
            m.eval()
    return model


def fold(model: nn.Module, inputs: tuple, mode: str) -> nn.Module:
    return fxopt.optimize(model, inputs, mode=mode, passes=["fold_conv_bn"])


def code(optimized: nn.Module) -> str:
    """The generated code of the optimized graph."""
    return optimized.graph_module.code


def stats(optimized: nn.Module) -> dict:
    return dict(optimized.fxopt_report["fold_conv_bn"].stats)


class LayerBN(nn.Module):
    def __init__(self, layer: nn.Module, bn: nn.Module):
        super().__init__()
        self.layer, self.bn = layer, bn

    def forward(self, x):
        return torch.relu(self.bn(self.layer(x)))


class Form(NamedTuple):
    id: str
    op: str  # the functional op the folded layer becomes
    layer: Callable[[], nn.Module]
    bn: Callable[[], nn.Module]
    shape: tuple[int, ...]  # input shape without the batch dimension


FORMS = [
    Form("conv1d", "conv1d", lambda: nn.Conv1d(4, 6, 3, padding=1), lambda: nn.BatchNorm1d(6), (4, 10)),
    Form("conv2d", "conv2d", lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1), lambda: nn.BatchNorm2d(6), (4, 9, 9)),
    Form("conv3d", "conv3d", lambda: nn.Conv3d(4, 6, 3, dilation=2, padding=2), lambda: nn.BatchNorm3d(6),
         (4, 5, 5, 5)),
    Form("conv_transpose1d", "conv_transpose1d", lambda: nn.ConvTranspose1d(4, 6, 3, stride=2),
         lambda: nn.BatchNorm1d(6), (4, 7)),
    Form("conv_transpose2d", "conv_transpose2d", lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, output_padding=1),
         lambda: nn.BatchNorm2d(6), (4, 5, 5)),
    Form("conv_transpose3d", "conv_transpose3d", lambda: nn.ConvTranspose3d(4, 6, 2, stride=2),
         lambda: nn.BatchNorm3d(6), (4, 3, 3, 3)),
    # C_in == C_out: a fold on the wrong weight axis would still have matching shapes.
    Form("conv_transpose2d_c_to_c", "conv_transpose2d", lambda: nn.ConvTranspose2d(6, 6, 3),
         lambda: nn.BatchNorm2d(6), (6, 5, 5)),
    Form("conv_transpose2d_c_to_c_grouped", "conv_transpose2d", lambda: nn.ConvTranspose2d(6, 6, 3, groups=3),
         lambda: nn.BatchNorm2d(6), (6, 5, 5)),
    Form("conv_transpose2d_grouped", "conv_transpose2d", lambda: nn.ConvTranspose2d(4, 6, 3, groups=2),
         lambda: nn.BatchNorm2d(6), (4, 5, 5)),
    Form("linear", "linear", lambda: nn.Linear(12, 6), lambda: nn.BatchNorm1d(6), (12,)),
    Form("bn_affine_false", "conv2d", lambda: nn.Conv2d(4, 6, 3), lambda: nn.BatchNorm2d(6, affine=False), (4, 7, 7)),
    Form("conv_bias_false", "conv2d", lambda: nn.Conv2d(4, 6, 3, bias=False), lambda: nn.BatchNorm2d(6), (4, 7, 7)),
    Form("linear_no_bias_bn_affine_false", "linear", lambda: nn.Linear(12, 6, bias=False),
         lambda: nn.BatchNorm1d(6, affine=False), (12,)),
    Form("grouped_conv", "conv2d", lambda: nn.Conv2d(4, 6, 3, groups=2), lambda: nn.BatchNorm2d(6), (4, 7, 7)),
    Form("depthwise_conv", "conv2d", lambda: nn.Conv2d(6, 6, 3, groups=6, bias=False), lambda: nn.BatchNorm2d(6),
         (6, 7, 7)),
]
FORM_IDS = [f.id for f in FORMS]


def build(form: Form) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return randomize(LayerBN(form.layer(), form.bn())), (torch.randn(BATCH, *form.shape),)


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_inference_fold_matches_and_removes_bn(form):
    """In inference every form folds into one conv/linear on folded tensors computed in the graph, with the same outputs."""
    model, inputs = build(form)
    model.eval()
    snapshot = state_snapshot(model)
    optimized = fold(model, inputs, "inference")
    assert stats(optimized) == {"folded": 1}
    FileCheck().check("folded_conv_bn_params(").check(f"aten.{form.op}").check_not("aten.batch_norm") \
        .run(code(optimized))
    assert_same_step(model, optimized, inputs, training=False)
    assert_state_unchanged(model, snapshot)


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_training_with_frozen_bn_folds_on_the_fly(form):
    """With a frozen BN in a training model the fold is graph ops, so outputs, grads and buffers match."""
    model, inputs = build(form)
    freeze_bn(model)
    optimized = fold(model, inputs, "training")
    assert stats(optimized) == {"folded": 1}
    FileCheck().check("folded_conv_bn_params(").check("getitem").check_not("aten.batch_norm").run(code(optimized))
    assert_same_step(model, optimized, inputs, training=True)
    assert set(optimized.state_dict()) == set(model.state_dict())


def test_training_fold_keeps_fewer_activations_for_backward():
    """The folded training graph no longer saves the BN input for backward (arXiv 2305.11624)."""
    model, inputs = build(FORMS[1])
    freeze_bn(model)
    optimized = fold(model, inputs, "training")
    before = measure_saved_bytes(lambda: model(*inputs), model)
    after = measure_saved_bytes(lambda: optimized(*inputs), model)
    assert after < before


class Functional(nn.Module):
    """Functional calls on parameters and buffers; `torch_ops` picks torch.conv2d + torch.batch_norm."""

    def __init__(self, torch_ops: bool):
        super().__init__()
        self.torch_ops = torch_ops
        self.weight = nn.Parameter(torch.randn(6, 4, 3, 3) * 0.2)
        self.bias = nn.Parameter(torch.randn(6))
        self.gamma, self.beta = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6))
        self.register_buffer("mean", torch.randn(6))
        self.register_buffer("var", torch.rand(6) + 0.5)

    def forward(self, x):
        if self.torch_ops:
            y = torch.conv2d(x, self.weight, self.bias, 1, 1)
            return torch.batch_norm(y, self.gamma, self.beta, self.mean, self.var, False, 0.1, 1e-3, False)
        y = F.conv2d(x, self.weight, bias=self.bias, padding=1)
        return F.batch_norm(y, self.mean, self.var, self.gamma, self.beta, training=False, eps=1e-3)


@pytest.mark.parametrize("torch_ops", [False, True], ids=["F", "torch"])
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_functional_form_folds(torch_ops, mode):
    """F.conv2d/torch.conv2d on parameters + F.batch_norm/torch.batch_norm on buffers fold like modules."""
    torch.manual_seed(0)
    model = Functional(torch_ops).train(mode == "training")
    inputs = (torch.randn(BATCH, 4, 7, 7),)
    optimized = fold(model, inputs, mode)
    assert stats(optimized) == {"folded": 1}
    FileCheck().check("aten.conv2d").check_not("aten.batch_norm").run(code(optimized))
    assert_same_step(model, optimized, inputs, training=mode == "training")


def dynamo_graph(model: nn.Module, inputs: tuple):
    """The graph TorchDynamo hands a backend: parameters and buffers arrive as placeholders."""
    captured = {}

    def backend(gm, example_inputs):  # Dynamo drops the placeholders' sources once this returns
        constants = _torch_private.dynamo_parameter_placeholders(gm, example_inputs)
        captured.update(gm=gm, inputs=list(example_inputs), constants=constants)
        return gm.forward

    _torch_private.reset_dynamo()
    torch.compile(model, backend=backend)(*inputs)
    state = {id(t) for t in [*model.parameters(), *model.buffers()]}
    placeholders = [n for n in captured["gm"].graph.nodes if n.op == "placeholder"]
    assert captured["constants"] == {n.name for n, v in zip(placeholders, captured["inputs"]) if id(v) in state}
    return captured["gm"], captured["inputs"], captured["constants"]


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_dynamo_graph_folds_as_graph_ops_that_follow_parameter_updates(mode):
    """On a Dynamo graph the fold is ops on the parameter placeholders, so it stays right when parameters change."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(),
                          nn.Linear(6 * 5 * 5, 4), nn.BatchNorm1d(4))
    freeze_bn(randomize(model)) if mode == "training" else randomize(model).eval()
    x = torch.randn(BATCH, 3, 7, 7)
    gm, graph_inputs, constants = dynamo_graph(model, (x,))
    result = FoldConvBN().run(gm, PassContext(mode, constant_inputs=constants))
    gm.recompile()
    assert dict(result.stats) == {"folded": 2}
    FileCheck().check("folded_conv_bn_params(l_fn_modules_0_parameters_weight_").check("conv2d(") \
        .check("folded_conv_bn_params(").check("linear(").check_not("batch_norm(").run(gm.code)

    def compare():
        (got,) = gm(*graph_inputs)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)
        return got

    if mode == "training":
        params = list(model.parameters())
        grads = torch.autograd.grad(model(x).square().sum(), params)
        got_grads = torch.autograd.grad(compare().square().sum(), params)
        for want, got in zip(grads, got_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    compare()
    with torch.no_grad():
        model[0].weight.mul_(-2.0)
        model[1].running_mean.add_(1.0)
        model[5].weight.mul_(3.0)
    compare()


def test_graph_for_torch_compile_folds_as_graph_ops_even_on_attributes():
    """A graph handed on to torch.compile keeps the fold as ops, so later parameter updates are never stale."""
    torch.manual_seed(0)
    model = randomize(nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6))).eval()
    x = torch.randn(2, 3, 7, 7)
    gm = exported_graph(model, (x,))  # shares the conv and BN tensors with `model`
    result = FoldConvBN().run(gm, PassContext("inference"))
    gm.recompile()
    assert dict(result.stats) == {"folded": 1}
    FileCheck().check("folded_conv_bn_params(").check("conv2d").check_not("batch_norm").run(gm.code)
    with torch.no_grad():
        model[0].weight.mul_(-2.0)
        model[1].running_var.mul_(3.0)
    (got,) = gm(x)
    torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)


def test_dynamo_placeholder_not_named_constant_is_refused():
    """A placeholder not listed in constant_inputs may be any tensor, so the fold cannot assume it is a parameter."""
    torch.manual_seed(0)
    model = randomize(nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6))).eval()
    gm, _, _ = dynamo_graph(model, (torch.randn(2, 3, 7, 7),))
    result = FoldConvBN().run(gm, PassContext("inference"))
    assert dict(result.stats) == {"refused_not_constant": 1}


class OneBNManyConvs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_a, self.conv_b = nn.Conv2d(4, 6, 3, padding=1), nn.Conv2d(4, 6, 1, bias=False)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        return self.bn(self.conv_a(x)) + self.bn(self.conv_b(x))


class SharedConv(nn.Module):
    """One conv module, two call sites, two different BNs (pytorch issue 104593)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn1, self.bn2 = nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn1(self.conv(x)) + self.bn2(self.conv(x))


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("make, shape", [(OneBNManyConvs, (4, 6, 6)), (SharedConv, (3, 8, 8))],
                         ids=["one_bn_after_two_convs", "shared_conv"])
def test_each_site_gets_its_own_fold_and_nothing_is_mutated(make, shape, mode):
    """One BN after two convs folds into both, and each site of a shared conv gets its own folded tensors (torch.fx's fuse reuses the first fold there); the caller's tensors stay as they were."""
    torch.manual_seed(0)
    model = randomize(make())
    freeze_bn(model) if mode == "training" else model.eval()
    inputs = (torch.randn(BATCH, *shape),)
    snapshot, params = state_snapshot(model), list(model.parameters())
    optimized = fold(model, inputs, mode)
    assert stats(optimized) == {"folded": 2}
    assert "aten.batch_norm" not in code(optimized)
    assert all(p is q for p, q in zip(model.parameters(), params))
    assert_state_unchanged(model, snapshot)
    assert_same_step(model, optimized, inputs, training=mode == "training")


def test_report_lists_folded_and_refused_sites_with_reasons():
    """The report counts folds and refusals per reason and names each site."""
    torch.manual_seed(0)

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 1)
            self.bn_a, self.bn_b, self.bn_c = nn.BatchNorm2d(4), nn.BatchNorm2d(4), nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.bn_a(self.a(x))
            z = self.b(y)
            return self.bn_c(self.c(self.bn_b(z) + z))

    model = randomize(Mixed()).eval()
    optimized = fold(model, (torch.randn(2, 3, 9, 9),), "inference")
    entry = optimized.fxopt_report["fold_conv_bn"]
    assert dict(entry.stats) == {"folded": 2, "refused_conv_has_other_users": 1}
    assert [(s.node, s.action, s.reason) for s in entry.sites] == [
        ("bn_a", "folded", ""), ("bn_b", "refused", "conv_has_other_users"), ("bn_c", "folded", "")]
    # per fold: -conv -bn +folded_conv_bn_params +its 2 getitems +folded conv (parameters are graph inputs)
    assert (entry.nodes_before, entry.nodes_after) == (27, 31)
    text = str(optimized.fxopt_report)
    assert "refused_conv_has_other_users: 1" in text and "b is also read by add" in text
    assert optimized.fxopt_report.to_dict()["passes"][0]["stats"] == dict(entry.stats)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_second_run_changes_nothing(mode):
    """Running the pass again on its own output finds nothing left to fold and leaves the code as it is."""
    torch.manual_seed(0)
    model = randomize(OneBNManyConvs())
    freeze_bn(model) if mode == "training" else model.eval()
    optimized = fold(model, (torch.randn(BATCH, 4, 6, 6),), mode)
    gm = optimized.graph_module
    before = gm.code
    again = FoldConvBN().run(gm, PassContext(mode))
    gm.recompile()
    assert not again.changed and not again.sites
    assert gm.code == before


def test_training_result_shares_parameters_and_keeps_up_with_optimizer_steps():
    """In training the result holds the caller's parameter objects, so an optimizer built before keeps both in step."""
    torch.manual_seed(0)
    model = freeze_bn(randomize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(BATCH, 3, 6, 6)
    optimized = fold(model, (x,), "training")
    assert list(optimized.state_dict()) == list(model.state_dict())
    mine = dict(optimized.named_parameters())
    assert all(mine[name] is p for name, p in model.named_parameters())
    optimized(x).square().sum().backward()
    sgd.step()
    torch.testing.assert_close(optimized(x), model(x), rtol=1e-4, atol=1e-4)


# ---- refusals: one rule each ----

def assert_refused(model: nn.Module, inputs: tuple, reason: str, mode: str = "inference") -> nn.Module:
    optimized = fold(model, inputs, mode)
    assert stats(optimized) == {f"refused_{reason}": 1}
    (site,) = optimized.fxopt_report["fold_conv_bn"].sites
    assert site.reason == reason and site.detail
    assert_same_step(model, optimized, inputs, training=mode == "training")
    return optimized


def test_refuses_when_conv_output_has_another_user():
    """The conv output is still needed unnormalised by another user, so the conv cannot be replaced."""

    class Residual(LayerBN):
        def forward(self, x):
            y = self.layer(x)
            return self.bn(y) + y

    model = randomize(Residual(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))).eval()
    optimized = assert_refused(model, (torch.randn(2, 4, 5, 5),), "conv_has_other_users")
    assert "aten.batch_norm" in code(optimized)


def test_refuses_train_mode_bn():
    """A train-mode BN normalises with batch statistics and updates its running stats, which no fold reproduces."""
    model = randomize(LayerBN(nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6))).train()
    assert_refused(model, (torch.randn(BATCH, 4, 6, 6),), "bn_training", mode="training")


def test_refuses_bn_without_running_stats():
    """A BN with track_running_stats=False uses batch statistics even in eval mode: no constant affine map."""
    model = randomize(LayerBN(nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6, track_running_stats=False))).eval()
    assert_refused(model, (torch.randn(BATCH, 4, 6, 6),), "bn_training")


def test_refuses_weight_computed_in_the_graph():
    """A conv weight computed in the graph is not a constant the fold could precompute or track."""

    class Scaled(LayerBN):
        def forward(self, x):
            return self.bn(F.conv2d(x, self.layer.weight * 2.0, self.layer.bias))

    model = randomize(Scaled(nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6))).eval()
    assert_refused(model, (torch.randn(2, 4, 6, 6),), "not_constant")


def test_reflect_padding_folds_after_its_explicit_pad():
    """export writes padding_mode='reflect' as an `aten.pad` before an unpadded conv, so the fold keeps the padding.

    (Form change: in the module form this was an `unsupported_conv` refusal.)"""
    model = randomize(LayerBN(nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(6))).eval()
    inputs = (torch.randn(2, 4, 6, 6),)
    optimized = fold(model, inputs, "inference")
    assert stats(optimized) == {"folded": 1}
    FileCheck().check("aten.pad").check("reflect").check("aten.conv2d").run(code(optimized))
    assert_same_step(model, optimized, inputs, training=False)


def test_conv_transpose_called_with_output_size_folds():
    """export turns ConvTranspose's output_size into the output_padding of the call, so the fold keeps it exactly.

    (Form change: in the module form this was an `unsupported_conv` refusal.)"""

    class Sized(LayerBN):
        def forward(self, x):
            return self.bn(self.layer(x, output_size=[12, 12]))

    model = randomize(Sized(nn.ConvTranspose2d(4, 6, 3, stride=2), nn.BatchNorm2d(6))).eval()
    inputs = (torch.randn(2, 4, 5, 5),)
    optimized = fold(model, inputs, "inference")
    assert stats(optimized) == {"folded": 1}
    assert_same_step(model, optimized, inputs, training=False)


def test_refuses_linear_with_3d_output():
    """On a 3-D Linear output BatchNorm1d normalises dim 1, not the Linear's output features."""
    model = randomize(LayerBN(nn.Linear(6, 6), nn.BatchNorm1d(4))).eval()
    assert_refused(model, (torch.randn(BATCH, 4, 6),), "channel_axis_mismatch")


def test_refuses_conv_on_unbatched_input():
    """On an unbatched conv output BN's dim 1 is a spatial axis, even when its size equals the channel count."""
    model = randomize(LayerBN(nn.Conv1d(3, 5, 1), nn.BatchNorm1d(5))).eval()
    assert_refused(model, (torch.randn(3, 5),), "channel_axis_mismatch")


def test_bn_forward_hook_is_kept_and_a_later_hook_is_honoured():
    """export records a BN hook's ops in the graph, so the fold keeps them; a hook added later is caught by the guards.

    (Form change: in the module form a hooked BN was a `module_hooks` refusal.)"""
    model = randomize(LayerBN(nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6))).eval()
    model.bn.register_forward_hook(lambda module, args, out: out * 2)
    inputs = (torch.randn(2, 4, 6, 6),)
    optimized = fold(model, inputs, "inference")
    assert stats(optimized) == {"folded": 1}
    assert_same_step(model, optimized, inputs, training=False)
    optimized.bn.register_forward_hook(lambda module, args, out: out + 3)  # the result's own copy of the BN
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = optimized(inputs[0])
    want = optimized.original(inputs[0])
    torch.testing.assert_close(got, want)


def test_refuses_weight_normed_conv():
    """weight_norm recomputes the conv weight in a pre-hook each call, so the stored weight is not the one used."""
    model = randomize(LayerBN(nn.utils.weight_norm(nn.Conv2d(4, 6, 3)), nn.BatchNorm2d(6)))
    freeze_bn(model)
    inputs = (torch.randn(BATCH, 4, 6, 6),)
    optimized = fold(model, inputs, "training")
    assert stats(optimized) == {"refused_not_constant": 1}  # form change: export computes the weight in the graph
    x = inputs[0]
    torch.testing.assert_close(optimized(x), model(x))


def test_bn_subclass_with_own_forward_folds_only_the_batch_norm_it_computes():
    """export records what an overridden forward computes, so only its batch_norm folds and the rest stays.

    (Form change: in the module form such a subclass was an opaque leaf left alone.)"""

    class ShiftedBN(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) + 1.0

    model = randomize(LayerBN(nn.Conv2d(4, 6, 3), ShiftedBN(6))).eval()
    inputs = (torch.randn(2, 4, 6, 6),)
    optimized = fold(model, inputs, "inference")
    assert stats(optimized) == {"folded": 1}
    FileCheck().check("aten.conv2d").check("aten.add").check_not("aten.batch_norm").run(code(optimized))
    assert_same_step(model, optimized, inputs, training=False)


def test_switching_a_folded_bn_to_train_mode_never_gives_a_stale_result():
    """A BN folded in eval mode and later switched to train mode needs batch statistics: Dynamo's guard on the mode
    compiles again, without the fold."""
    torch.manual_seed(0)
    model = freeze_bn(randomize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))))
    reference = copy.deepcopy(model)
    x = torch.randn(BATCH, 3, 6, 6)
    optimized = fold(model, (x,), "training")
    model[1].train(), reference[1].train()  # the result shares the BN module with the caller's model
    torch.testing.assert_close(optimized(x), reference(x), rtol=1e-4, atol=1e-4)
    assert optimized.fxopt_report["fold_conv_bn"].stats["refused_bn_training"] == 1


def test_refuses_statistics_the_graph_updates_in_place():
    """Running stats the forward itself updates change every call, so a fold computed once would go stale."""
    class UpdatesStats(LayerBN):
        def forward(self, x):
            y = F.batch_norm(self.layer(x), self.bn.running_mean, self.bn.running_var, training=False)
            self.bn.running_mean.mul_(0.5)  # a hand-written statistics update, after the BN reads them
            return y

    model = randomize(UpdatesStats(nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6))).eval()
    gm = exported_graph(model, (torch.randn(2, 4, 6, 6),))
    result = FoldConvBN().run(gm, PassContext("inference"))
    assert dict(result.stats) == {"refused_state_written": 1}


def test_refuses_statistics_a_train_mode_bn_updates_later():
    """Eager autograd reads an eval BN's running stats at backward time, after a train-mode BN on the same buffers wrote them."""

    class SharedStats(LayerBN):
        def forward(self, x):
            y = F.batch_norm(self.layer(x), self.bn.running_mean, self.bn.running_var, training=False)
            return y + self.bn(x)

    model = randomize(SharedStats(nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6, affine=False))).train()
    assert_refused(model, (torch.randn(BATCH, 6, 5, 5),), "state_written", mode="training")
