"""Capture: models plain `symbolic_trace` rejects are still captured, optimized and equivalent.

Covers the shape-specialized fallback (shape-dependent control flow, `int(x.shape[-1])`), the
opaque-leaf fallback (data-dependent control flow), the guards that send other calls to the
original module (SpecializedCall), Hugging Face models built from config, and what the result
shares with (training) or never changes in (inference) the caller's model.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import transformers
from torch.utils.checkpoint import checkpoint

import fxopt
from equivalence import assert_same_step, assert_state_unchanged, state_snapshot
from fxopt.capture import capture
from fxopt.capture.specialized import SpecializedCall


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


def optimize_fold(model, inputs, **kw):
    return fxopt.optimize(model, inputs, passes=["fold_conv_bn"], **kw)


def check_equivalent_in_both_modes(make_model, inputs, min_folds: int = 0):
    """Eval: outputs equal and at least `min_folds` folds; train: outputs, gradients and buffers equal."""
    torch.manual_seed(0)
    model = randomize_bn(make_model()).eval()
    optimized = optimize_fold(model, inputs)
    assert optimized.fxopt_report["fold_conv_bn"].stats["folded"] >= min_folds
    assert_same_step(model, optimized, inputs, training=False)
    model.train()
    trained = optimize_fold(model, inputs)
    assert_same_step(model, trained, inputs, training=True)
    return optimized, trained


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


def test_plain_symbolic_trace_rejects_the_test_models():
    """The fallback tests below are meaningful only if torch.fx alone gives up on these models."""
    for model in (ShapeBranchModel(), IntShapeModel(), DataBranchModel()):
        with pytest.raises(Exception):
            fx.symbolic_trace(model)


def test_shape_dependent_control_flow_in_a_submodule():
    """A submodule branching on a shape is traced with the example's shape and folded."""
    inputs = (torch.randn(2, 3, 8, 8),)
    optimized, _ = check_equivalent_in_both_modes(ShapeBranchModel, inputs, min_folds=2)
    assert optimized.fxopt_report.opaque == []


def test_every_shape_question_gets_the_examples_answer():
    """size(), size(i), shape, dim(), ndim, len() and dtype all answer concretely, so the model is one graph."""
    inputs = (torch.randn(2, 3, 8, 8),)
    with pytest.raises(Exception):
        fx.symbolic_trace(AsksEveryShapeQuestion())
    optimized, _ = check_equivalent_in_both_modes(AsksEveryShapeQuestion, inputs, min_folds=1)
    assert optimized.fxopt_report.graphs == [""] and optimized.fxopt_report.opaque == []
    assert ".reshape(2, 4, 64)" in optimized.graph_module.code  # the example's sizes, baked in and guarded


def test_shape_specialized_graph_runs_the_original_for_other_shapes():
    """A graph specialized to width 8 must not be used at width 4, where the model takes the other branch."""
    torch.manual_seed(0)
    model = randomize_bn(ShapeBranchModel()).eval()
    optimized = optimize_fold(model, (torch.randn(2, 3, 8, 8),))
    assert isinstance(optimized, SpecializedCall) and optimized.tensor_specs
    (specialization,) = optimized.fxopt_report.specialized
    assert specialization.path == "" and specialization.assumes == "x: (2, 3, 8, 8) float32"
    assert "Specialized graphs (any other call runs the original module)" in str(optimized.fxopt_report)
    narrow = torch.randn(2, 3, 8, 4)
    assert not optimized.matches({"x": narrow})
    torch.testing.assert_close(optimized(narrow), model(narrow))


def test_int_of_a_shape():
    """`int(y.shape[-1])` no longer stops tracing: the whole model is one graph and is folded."""
    inputs = (torch.randn(2, 3, 8, 8),)
    optimized, _ = check_equivalent_in_both_modes(IntShapeModel, inputs, min_folds=1)
    assert optimized.fxopt_report.graphs == [""]


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_data_dependent_control_flow_at_the_top_is_correct_on_both_branches(mode):
    """The top stays opaque (with the reason) while its submodules are folded, and both branches stay right."""
    torch.manual_seed(0)
    model = randomize_bn(DataBranchModel()).train(mode == "training")
    positive = torch.rand(2, 3, 8, 8) + 0.1
    optimized = optimize_fold(model, (positive,))
    report = optimized.fxopt_report
    assert [o.path for o in report.opaque] == [""]
    assert "control flow" in report.opaque[0].reason
    assert set(report.graphs) == {"stem", "positive_head"}
    if mode == "inference":
        assert report["fold_conv_bn"].stats["folded"] == 2
    for x in (positive, -positive):
        assert_same_step(model, optimized, (x,), training=mode == "training")


def test_nothing_traceable_is_a_clear_error():
    """A model that is one value-dependent branch raises FxoptError with the reason, not an fx traceback."""
    with pytest.raises(fxopt.FxoptError, match="nothing in OnlyDataBranch could be traced.*control flow"):
        fxopt.optimize(OnlyDataBranch(), (torch.randn(3),))


class FlaggedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = conv_bn(3, 3)

    def forward(self, x, double: bool = False):
        y = self.body(x)
        return y * 2 if double else y


def test_specialized_call_runs_the_original_for_other_flags():
    """Traced with double=False, the graph must not answer a call with double=True: the original does."""
    torch.manual_seed(0)
    model = randomize_bn(FlaggedBlock()).eval()
    x = torch.randn(2, 3, 8, 8)
    optimized = optimize_fold(model, (x,))
    assert isinstance(optimized, SpecializedCall) and optimized.specialized == {"double": False}
    original_calls = []  # in inference the result falls back to its own copy of the original
    optimized.original.register_forward_hook(lambda *_: original_calls.append(1))
    torch.testing.assert_close(optimized(x), model.body(x))
    assert original_calls == []  # the graph answered
    torch.testing.assert_close(optimized(x, double=True), model.body(x) * 2)
    assert original_calls == [1]  # the original answered


class Parent(nn.Module):
    """Opaque itself (value branch), calling a flagged child with a flag that depends on the data."""

    def __init__(self):
        super().__init__()
        self.child = FlaggedBlock()

    def forward(self, x):
        return self.child(x, double=bool(x.mean() > 0))


def test_specialized_child_inside_an_opaque_parent():
    """The child is captured for the flag seen in the example call; the other flag runs the original child."""
    torch.manual_seed(0)
    model = randomize_bn(Parent()).eval()
    x = torch.rand(2, 3, 8, 8)
    optimized = optimize_fold(model, (x,))
    assert isinstance(optimized.child, SpecializedCall)
    for inputs in ((x,), (-x,)):
        assert_same_step(model, optimized, inputs, training=False)


class ReadsTrainingFlag(nn.Module):
    """Tracing bakes `self.training` into the graph as a constant argument of F.dropout."""

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
    optimized = fxopt.optimize(model, (x,), mode="training")
    assert isinstance(optimized, SpecializedCall) and optimized.traced_training is True
    optimized.eval()
    assert not optimized.matches({"x": x})
    torch.testing.assert_close(optimized(x), copy.deepcopy(model).eval()(x))
    optimized.train()
    assert optimized.matches({"x": x})
    assert_same_step(model.train(), optimized, (x,), training=True)


def test_graph_independent_of_the_training_flag_stays_a_graph_module():
    """Layers that read their own flag at run time (BatchNorm, Dropout modules) need no guard."""
    model = nn.Sequential(conv_bn(3, 4), nn.Dropout(0.5)).train()
    optimized = fxopt.optimize(model, (torch.randn(2, 3, 8, 8),), mode="training")
    assert isinstance(optimized, fx.GraphModule)


def test_failing_module_is_named_when_the_model_rejects_the_inputs():
    """A shape the model rejects names the module that failed and the shapes it was given."""
    model = nn.Sequential(conv_bn(3, 4), nn.Flatten(), nn.Linear(4 * 8 * 8, 2))
    with pytest.raises(fxopt.FxoptError, match=r"module '2' \(Linear\) failed on inputs \[\(2, 144\) float32\]"):
        fxopt.optimize(model, (torch.randn(2, 3, 6, 6),))


# --------------------------------------------------------------- Hugging Face models from config

def hf_resnet():
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])
    return transformers.ResNetModel(config)


def hf_mobilenet_v2():
    return transformers.MobileNetV2Model(transformers.MobileNetV2Config(image_size=32, depth_multiplier=0.25))


def hf_convnext():
    return transformers.ConvNextModel(transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2))


def hf_bert():
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100, max_position_embeddings=32)
    return transformers.BertModel(config)


IMAGE = (torch.randn(2, 3, 32, 32),)
TOKENS = (torch.randint(0, 100, (2, 8)),)


@pytest.mark.parametrize("make_model, min_folds", [(hf_resnet, 8), (hf_mobilenet_v2, 20)])
def test_hugging_face_cnns_are_captured_and_folded(make_model, min_folds):
    """HF ResNet / MobileNetV2 (shape checks, `int()` of sizes, TF padding) are traced whole and their conv+BN folded."""
    with pytest.raises(Exception):
        fx.symbolic_trace(make_model())
    optimized, trained = check_equivalent_in_both_modes(make_model, IMAGE, min_folds=min_folds)
    assert optimized.fxopt_report.graphs == [""]


def test_hugging_face_resnet_fine_tuning_with_frozen_batch_norm_folds_on_the_fly():
    """Training with eval-mode BNs (fine-tuning) folds every pair in the graph; gradients and buffers still match."""
    torch.manual_seed(0)
    model = randomize_bn(hf_resnet()).train()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eval()
    optimized = optimize_fold(model, IMAGE)
    assert optimized.fxopt_report.mode == "training"
    assert optimized.fxopt_report["fold_conv_bn"].stats["folded"] == 8
    assert_same_step(model, optimized, IMAGE, training=True)


@pytest.mark.parametrize("make_model, inputs", [(hf_convnext, IMAGE), (hf_bert, TOKENS)])
def test_hugging_face_partially_traceable_models(make_model, inputs):
    """ConvNext and BERT come back with their traceable blocks captured and every opaque module listed with a reason."""
    optimized, _ = check_equivalent_in_both_modes(make_model, inputs)
    report = optimized.fxopt_report
    assert report.graphs and report.opaque
    assert all(o.reason for o in report.opaque)
    assert "Opaque modules" in str(report)
    assert any(path.startswith("encoder.") for path in report.graphs)  # the blocks under an opaque encoder


# --------------------------------------------------------------- what the result shares with the caller

@pytest.mark.parametrize("make_model, inputs", [
    (ShapeBranchModel, (torch.randn(2, 3, 8, 8),)),
    (DataBranchModel, (torch.rand(2, 3, 8, 8),)),
    (hf_resnet, IMAGE),
    (hf_bert, TOKENS),
])
def test_training_result_shares_parameters_and_state_dict_keys(make_model, inputs):
    """Training mode: the same Parameter and buffer objects and the same state_dict keys, loadable both ways."""
    torch.manual_seed(0)
    model = make_model().train()
    optimized = fxopt.optimize(model, inputs, mode="training", passes=["fold_conv_bn"])
    assert [id(p) for p in optimized.parameters()] == [id(p) for p in model.parameters()]
    theirs, ours = model.state_dict(keep_vars=True), optimized.state_dict(keep_vars=True)
    assert list(ours) == list(theirs)
    assert all(ours[k] is theirs[k] for k in theirs)
    assert list(copy.deepcopy(optimized).state_dict()) == list(theirs)
    optimized.load_state_dict(copy.deepcopy(model.state_dict()))
    model.load_state_dict(copy.deepcopy(optimized.state_dict()))


def test_optimizer_built_before_optimize_trains_the_result():
    """An optimizer made from the caller's parameters updates what the optimized model computes with."""
    torch.manual_seed(0)
    model = nn.Sequential(conv_bn(3, 4), nn.Flatten(), nn.Linear(4 * 8 * 8, 2)).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3, 8, 8)
    optimized = fxopt.optimize(model, (x,), mode="training")
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
    (hf_mobilenet_v2, IMAGE),
    (hf_bert, TOKENS),
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


class _AccumulatesIntoAFreshTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        acc = torch.zeros(6, 8)  # fx runs this once at trace time and stores the result
        acc.add_(self.linear(x))
        return acc


def test_tensor_created_in_forward_and_written_stays_fresh_every_call():
    """A tensor made in forward and written in place must not accumulate across calls of the traced graph."""
    model = _AccumulatesIntoAFreshTensor().eval()
    x = torch.randn(6, 8)
    optimized = fxopt.optimize(model, x)
    for _ in range(3):
        torch.testing.assert_close(optimized(x), model(x))


def test_tracing_adds_no_attributes_to_the_callers_model():
    """fx stores trace-time constants on the traced module; fxopt must take them off the caller's model."""
    model = _AccumulatesIntoAFreshTensor().eval()
    before = set(vars(model))
    fxopt.optimize(model, torch.randn(6, 8))
    assert set(vars(model)) == before


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_optimized_module_survives_torch_save_and_load(mode, tmp_path):
    """torch.load rebuilds a GraphModule by tracing its code: fxopt's graph helpers must stay single calls."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 4))
    model.train(mode == "training")
    model[1].eval()
    x = torch.randn(2, 3, 8, 8)
    optimized = fxopt.optimize(model, x, mode=mode)
    torch.save(optimized, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert_same_step(optimized, loaded, (x,), training=mode == "training")


class _HandCheckpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False))


def test_users_checkpoint_calls_are_kept_not_inlined():
    """Tracing through torch.utils.checkpoint would silently drop the checkpointing the user asked for."""
    model = _HandCheckpointed().train()
    x = torch.randn(4, 8, requires_grad=True)
    optimized = fxopt.optimize(model, x)
    assert "checkpoint" in optimized.code and "wrap(" not in optimized.code
    assert_same_step(model, optimized, (x,), training=True)


class _CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        self.calls.add_(1)
        return self.linear(x) * self.calls


def test_in_place_buffer_update_reaches_the_graph():
    """`self.calls.add_(1)` must run on every call, not once at trace time on the caller's buffer."""
    model, twin = _CountsCalls().eval(), _CountsCalls().eval()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, 4)
    optimized = fxopt.optimize(twin, x)
    assert float(twin.calls) == 0  # optimizing ran nothing on the caller's buffer
    for _ in range(3):
        torch.testing.assert_close(optimized(x), model(x))


def test_hugging_face_model_output_keeps_its_type():
    """fx turns a returned ModelOutput into a plain dict; users index it by attribute and position."""
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])
    model = transformers.ResNetModel(config).eval()
    x = torch.randn(2, 3, 32, 32)
    expected, got = model(x), fxopt.optimize(model, x)(x)
    assert type(got) is type(expected)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state)
    torch.testing.assert_close(got[1], expected[1])
