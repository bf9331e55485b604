"""prune_dead_grads: no_grad for outputs outside the loss, frozen layers that keep no input, sound DCE."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from equivalence import assert_same_step
from graph_forms import exported_graph

import fxopt
from fxopt.analysis import grad_needs
from fxopt.analysis.saved_tensors import SavedForBackward
from fxopt.analysis.side_effects import IO, MUTATION, OPAQUE, RNG, STATS, effects
from fxopt.measure import measure_saved_bytes
from fxopt.passes.base import PassContext
from fxopt.passes.prune_dead_grads import PruneDeadGrads
from fxopt.pipeline.verify import max_difference
from fxopt.tree import flatten_tensors

PRUNE = ["prune_dead_grads"]


# ---- models ----

class AuxHead(nn.Module):
    """A trunk with a main head and a large auxiliary head (with dropout), plus the trunk features."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.aux = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.2), nn.Linear(128, 8))

    def forward(self, x):
        h = self.body(x)
        return self.head(h), self.aux(h).tanh(), h


class DictOut(AuxHead):
    def forward(self, x):
        logits, aux, h = super().forward(x)
        return {"logits": logits, "aux": aux, "features": h}


def conv_bn_relu(c: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())


class FrozenMiddle(nn.Module):
    """Trainable stem -> frozen Conv-BN(eval)-ReLU blocks -> trainable head."""

    def __init__(self, blocks: int = 2, c: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.body = nn.Sequential(*[conv_bn_relu(c) for _ in range(blocks)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 5))

    def forward(self, x):
        return self.head(self.body(self.stem(x)))


def freeze(module: nn.Module) -> nn.Module:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def frozen_middle(**kw) -> FrozenMiddle:
    torch.manual_seed(0)
    model = FrozenMiddle(**kw).train()
    freeze(model.body)
    for block in model.body:  # non-trivial running statistics
        block[1].running_mean.uniform_(-0.5, 0.5)
        block[1].running_var.uniform_(0.5, 2.0)
    return model


def aux_model(cls=AuxHead) -> nn.Module:
    torch.manual_seed(0)
    return cls().train()


X_VEC = torch.randn(6, 16)
X_IMG = torch.randn(2, 3, 8, 8)


# ---- a training step that differentiates only the declared outputs ----

def _step(model: nn.Module, x: torch.Tensor, differentiable) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    torch.manual_seed(1)
    out = model(x)
    values = list(out.values()) if isinstance(out, dict) else list(out)
    keys = list(out) if isinstance(out, dict) else range(len(values))
    gen = torch.Generator().manual_seed(2)
    loss = sum((v * torch.randn(v.shape, generator=gen)).sum() for k, v in zip(keys, values) if k in differentiable)
    loss.backward()
    got = {f"output[{i}]": t.detach() for i, t in enumerate(flatten_tensors(out))}
    got.update({f"grad:{n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    got.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    return got


def assert_same_declared_step(original, optimized, x, differentiable) -> None:
    ref, got = _step(original, x, differentiable), _step(optimized, x, differentiable)
    assert set(ref) == set(got), set(ref) ^ set(got)
    worst, name, ok = max_difference(ref, got, 1e-4, 1e-4)
    assert ok, f"{name} differs by {worst:.3g}"


def rerun(gm: fx.GraphModule, **options):
    """Run the pass once more on an already optimized graph (as the pipeline would)."""
    ctx = PassContext("training", options, graph_path="")
    return PruneDeadGrads().run(gm, ctx)


# ---- 1. outputs outside the loss ----

def test_aux_head_declared_non_differentiable_runs_without_grad():
    """The aux head runs under no_grad, the step is unchanged for the declared loss, its params lose grads."""
    model = aux_model()
    opt = fxopt.optimize(model, X_VEC, mode="training", passes=PRUNE, differentiable_outputs=[0])
    assert_same_declared_step(model, opt, X_VEC, {0})
    report = opt.fxopt_report["prune_dead_grads"]
    assert report.stats["no_grad"] == 5  # the 4 aux layers and tanh
    assert report.stats["detached"] == 1  # the trunk features, also read by the main head
    assert "aux.0.weight" in report.figures["params_losing_grad"]
    assert "head.weight" in report.figures["params_needing_grad"]
    assert report.figures["bytes_no_longer_saved"] > 0
    code = opt.graph_module.code
    assert "call_without_grad" in code and ".detach()" in code
    returned = opt.graph_module.graph.find_nodes(op="output")[0].args[0]
    assert any(n.target is torch.ops.aten.linear.default for n in returned)  # the main head stays recorded
    out = opt(X_VEC)
    assert [t.requires_grad for t in out] == [True, False, False]


def test_aux_head_keeps_less_for_backward():
    """Measured with saved_tensors_hooks, the optimized forward keeps less than eager."""
    model = aux_model()
    opt = fxopt.optimize(model, X_VEC, mode="training", passes=PRUNE, differentiable_outputs=[0])
    assert measure_saved_bytes(lambda: opt(X_VEC), opt) < measure_saved_bytes(lambda: model(X_VEC), model)


def test_dict_output_by_key():
    """Dict outputs are named by key; undeclared keys come back without grad."""
    model = aux_model(DictOut)
    opt = fxopt.optimize(model, X_VEC, mode="training", passes=PRUNE, differentiable_outputs="logits")
    assert_same_declared_step(model, opt, X_VEC, {"logits"})
    out = opt(X_VEC)
    assert out["logits"].requires_grad and not out["aux"].requires_grad and not out["features"].requires_grad


def test_backward_through_declared_non_differentiable_output_raises():
    """Backward from an output declared non-differentiable fails with autograd's clear error."""
    opt = fxopt.optimize(aux_model(), X_VEC, mode="training", passes=PRUNE, differentiable_outputs=[0])
    with pytest.raises(RuntimeError, match="does not require grad"):
        opt(X_VEC)[1].sum().backward()


def test_differentiated_aux_output_prunes_nothing():
    """When the aux output is in the loss, nothing may run without grad and the step is unchanged."""
    model = aux_model()
    for declared in (None, [0, 1, 2]):
        opt = fxopt.optimize(model, X_VEC, mode="training", passes=PRUNE, differentiable_outputs=declared)
        assert "call_without_grad" not in opt.graph_module.code and "detach" not in opt.graph_module.code
        assert not opt.fxopt_report["prune_dead_grads"].changed
        assert_same_step(model, opt, (X_VEC,), training=True)


def test_node_feeding_both_kinds_of_output_stays_recorded():
    """The trunk feeds the loss and a declared-non-differentiable output: it is detached, not unrecorded."""
    opt = fxopt.optimize(aux_model(), X_VEC, mode="training", passes=PRUNE, differentiable_outputs=[0, 1])
    code = opt.graph_module.code
    assert "call_without_grad" not in code and "relu_1.detach()" in code


class MutatesTrunk(AuxHead):
    def forward(self, x):
        h = self.body(x)
        a = self.aux(h)
        g = h.clone()
        g[:, :8].add_(a)  # the aux head writes into what the loss reads
        return self.head(g), a


def test_aux_head_writing_into_live_tensor_stays_recorded():
    """An aux value written in place into a tensor the loss reads must keep its gradient path (refusal)."""
    model = aux_model(MutatesTrunk)
    opt = fxopt.optimize(model, X_VEC, mode="training", passes=PRUNE, differentiable_outputs=[0])
    assert "call_without_grad" not in opt.graph_module.code
    assert_same_declared_step(model, opt, X_VEC, {0})
    assert "aux.0.weight" in opt.fxopt_report["prune_dead_grads"].figures["params_needing_grad"]


class InplaceAux(AuxHead):
    def __init__(self):
        super().__init__()
        self.aux = nn.Sequential(nn.Linear(32, 128), nn.ReLU(inplace=True), nn.Linear(128, 8))

    def forward(self, x):
        h = self.body(x)
        a = self.aux(h)
        a.mul_(2)  # in-place on the head's own output
        return self.head(h), a


def test_writes_inside_the_aux_head_do_not_keep_it_recorded():
    """In-place ops on the aux head's own activations touch nothing the loss reads: the head still prunes."""
    model = aux_model(InplaceAux)
    opt = fxopt.optimize(model, X_VEC, mode="training", passes=PRUNE, differentiable_outputs=[0])
    # the aux linears, their relu_ and the mul_ (form change: export returns mul_'s result, so it has a user)
    assert opt.fxopt_report["prune_dead_grads"].stats["no_grad"] == 4
    assert_same_declared_step(model, opt, X_VEC, {0})


class WritesIntoBuffer(AuxHead):
    def forward(self, x):
        h = self.body(x)
        stats = torch.zeros_like(h[:, :8])
        stats.add_(self.aux(h))  # a fresh tensor that now carries the aux head's graph
        return self.head(h), stats * 2


def test_output_recorded_through_an_in_place_write_is_detached():
    """A declared non-differentiable output that needs grad only through an in-place write still comes back detached."""
    model = aux_model(WritesIntoBuffer)
    opt = fxopt.optimize(model, X_VEC, mode="training", passes=PRUNE, differentiable_outputs=[0])
    assert not opt(X_VEC)[1].requires_grad
    assert_same_declared_step(model, opt, X_VEC, {0})


class AtenAux(AuxHead):
    def forward(self, x):
        h = self.body(x)
        return self.head(h), torch.ops.aten.mul.Tensor(self.aux(h), 2.0)


def test_aten_overload_outside_the_loss_runs_without_grad():
    """An ATen overload feeding only an undeclared output runs under no_grad too (the graph prints it by name)."""
    model = aux_model(AtenAux)
    opt = fxopt.optimize(model, X_VEC, mode="training", passes=PRUNE, differentiable_outputs=[0])
    report = opt.fxopt_report["prune_dead_grads"]
    assert report.stats["refused_not_importable"] == 0 and report.stats["no_grad"] == 5
    assert not opt(X_VEC)[1].requires_grad
    assert_same_declared_step(model, opt, X_VEC, {0})


class UntraceableRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = AuxHead()

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: Dynamo breaks the graph here, `inner` is captured on its own
            return self.inner(x)
        return self.inner(-x)


def test_graph_after_a_graph_break_refuses_differentiable_outputs():
    """A graph after a graph break returns a part of the model's work, not its outputs: differentiable_outputs must not apply there."""
    torch.manual_seed(0)
    model = UntraceableRoot().train()
    opt = fxopt.optimize(model, X_VEC, mode="training", passes=PRUNE, differentiable_outputs=[0])
    report = opt.fxopt_report["prune_dead_grads"]
    assert report.stats["refused_not_model_outputs"] == 1
    assert report.stats["no_grad"] == 0
    assert "inner.aux.0.weight" in report.figures["params_needing_grad"]  # named as in the caller's model
    assert all(t.requires_grad for t in opt(X_VEC))


@pytest.mark.parametrize("bad, message", [
    (3, "not an output of the model"),
    (-1, "not an output of the model"),
    ("aux", "positional output"),
    (1.5, "must be None"),
    (True, "must be None"),
    ([0, "aux"], "mixes indices and keys"),
])
def test_bad_differentiable_outputs_on_tuple_output(bad, message):
    """Out-of-range indices, keys for a tuple, and wrong types are clear FxoptErrors."""
    with pytest.raises(fxopt.FxoptError, match=message):
        fxopt.optimize(aux_model(), X_VEC, mode="training", passes=PRUNE, differentiable_outputs=bad)


@pytest.mark.parametrize("bad, message", [("logit", "not an output of the model.*'logits'"), (0, "use its keys")])
def test_bad_differentiable_outputs_on_dict_output(bad, message):
    """A missing key, or an index for a dict output, is a clear FxoptError listing the keys."""
    with pytest.raises(fxopt.FxoptError, match=message):
        fxopt.optimize(aux_model(DictOut), X_VEC, mode="training", passes=PRUNE, differentiable_outputs=bad)


def test_verify_differentiates_only_the_declared_outputs():
    """verify=True compares the step the caller will run: the loss reads only the declared outputs."""
    opt = fxopt.optimize(aux_model(), X_VEC, mode="training", differentiable_outputs=[0], verify=True)
    assert opt.fxopt_report["prune_dead_grads"].max_abs_diff == 0.0
    with pytest.raises(fxopt.FxoptError, match="not an output of the model"):
        fxopt.optimize(aux_model(), X_VEC, mode="training", differentiable_outputs=[5], verify=True)


def test_differentiable_outputs_in_inference_is_an_error():
    """Nothing is differentiated in inference, so declaring differentiable outputs there is a mistake."""
    with pytest.raises(fxopt.FxoptError, match="applies to training"):
        fxopt.optimize(aux_model().eval(), X_VEC, mode="inference", passes=PRUNE, differentiable_outputs=[0])


# ---- 2. frozen layers in the middle ----

def test_frozen_middle_with_eval_bn_alone():
    """Without folding, frozen convs keep no input and frozen eval BNs become x * scale + shift."""
    model = frozen_middle()
    opt = fxopt.optimize(model, X_IMG, mode="training", passes=PRUNE)
    assert_same_step(model, opt, (X_IMG,), training=True)
    report = opt.fxopt_report["prune_dead_grads"]
    assert report.stats["frozen_conv"] == 2 and report.stats["frozen_bn"] == 2
    code = opt.graph_module.code
    assert code.count("conv_saving_what_grads_need(") == 2 and "eval_batch_norm_scale_shift" in code
    assert report.figures["bytes_no_longer_saved"] > 0  # the BN inputs
    assert report.figures["params_needing_grad"] == ["head.2.bias", "head.2.weight", "stem.0.bias", "stem.0.weight"]


def test_frozen_middle_after_fold_in_default_pipeline():
    """In the default training pipeline the folded frozen convs keep no input and the step is unchanged."""
    model = frozen_middle()
    opt = fxopt.optimize(model, X_IMG, mode="training")
    assert_same_step(model, opt, (X_IMG,), training=True)
    assert opt.fxopt_report["prune_dead_grads"].stats["frozen_conv"] == 2
    assert measure_saved_bytes(lambda: opt(X_IMG), opt) < 0.5 * measure_saved_bytes(lambda: model(X_IMG), model)


def test_unfreezing_after_optimize_still_gives_weight_gradients():
    """The frozen conv decides at run time: unfreezing a layer later gives its gradient exactly."""
    model = frozen_middle()
    opt = fxopt.optimize(model, X_IMG, mode="training", passes=PRUNE)
    weight = model.body[0][0].weight
    assert opt.get_submodule("body.0.0").weight is weight  # parameters are shared with the caller's model
    weight.requires_grad_(True)
    assert_same_step(model, opt, (X_IMG,), training=True)


def test_frozen_conv_on_the_torch_compile_path():
    """As a torch.compile backend (parameters are graph inputs) the frozen convs are found and grads match."""
    model = frozen_middle()
    reports = []
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="fxopt", options={"inner": "aot_eager", "report": reports.append})
    torch.testing.assert_close(compiled(X_IMG), model(X_IMG))
    compiled(X_IMG).sum().backward()
    model(X_IMG).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert reports[0]["prune_dead_grads"].stats["frozen_conv"] == 2


def test_frozen_backbone_needs_no_rewrite():
    """A frozen backbone at the input is not recorded at all: nothing to rewrite, step unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()),
                          nn.Flatten(), nn.Linear(8 * 36, 4)).train()
    freeze(model[0])
    opt = fxopt.optimize(model, X_IMG, mode="training", passes=PRUNE)
    assert_same_step(model, opt, (X_IMG,), training=True)
    assert not opt.fxopt_report["prune_dead_grads"].changed
    assert opt.fxopt_report["prune_dead_grads"].figures["params_needing_grad"] == ["2.bias", "2.weight"]


def _reader_of(gm: fx.GraphModule, attribute: str) -> fx.Node:
    """The one call of an exported graph that reads the parameter `attribute` (a layer's call)."""
    (node,) = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == attribute).users
    return node


def test_linear_with_frozen_weight_is_left_alone():
    """Eager linear keeps no input when its weight is frozen: observed, and there is nothing to rewrite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), freeze(nn.Linear(16, 16)), nn.Linear(16, 2)).train()
    gm = exported_graph(model, (X_VEC,))
    needs = grad_needs.analyze_grad_needs(gm, list(gm.graph.nodes)[-2:-1])
    frozen = _reader_of(gm, "1.weight")
    assert frozen.args[0] not in grad_needs.really_saved(frozen, gm, needs.requires_grad).saved_inputs


def test_conv_with_frozen_weight_really_keeps_its_input():
    """The waste the pass removes is real: eager conv keeps its input though its weight is frozen."""
    model = frozen_middle()
    gm = exported_graph(model, (X_IMG,))
    needs = grad_needs.analyze_grad_needs(gm, [list(gm.graph.nodes)[-2]])
    conv = _reader_of(gm, "body.0.0.weight")
    assert conv.args[0] in grad_needs.really_saved(conv, gm, needs.requires_grad).saved_inputs


class HookedConv(FrozenMiddle):
    pass


def test_hooked_frozen_conv_keeps_its_hook():
    """export records a frozen conv's hook as graph ops, so the conv is rewritten and the hook still runs.

    (Form change: in the module form a hooked conv was a `module_has_hooks` refusal; a hook added
    after optimize is the guards' business.)"""
    model = frozen_middle(blocks=1)
    model.body[0][0].register_forward_hook(lambda module, args, out: out * 2)
    opt = fxopt.optimize(model, X_IMG, mode="training", passes=PRUNE)
    assert opt.fxopt_report["prune_dead_grads"].stats["frozen_conv"] == 1
    assert_same_step(model, opt, (X_IMG,), training=True)


def test_reflect_padded_frozen_conv_is_rewritten_after_its_pad():
    """export writes padding_mode='reflect' as an explicit `aten.pad`, so the frozen conv after it is rewritten.

    (Form change: in the module form this was an `unsupported_conv` refusal.)"""
    model = frozen_middle(blocks=1)
    model.body[0][0].padding_mode = "reflect"
    opt = fxopt.optimize(model, X_IMG, mode="training", passes=PRUNE)
    assert opt.fxopt_report["prune_dead_grads"].stats["frozen_conv"] == 1
    assert "aten.pad" in opt.graph_module.code
    assert_same_step(model, opt, (X_IMG,), training=True)


class Unbatched(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.frozen = nn.Conv2d(4, 4, 3)

    def forward(self, x):
        return self.frozen(self.stem(x))


def test_unbatched_frozen_conv_is_refused():
    """torch.convolution needs a batch dimension that F.conv2d adds itself: refuse unbatched inputs."""
    torch.manual_seed(0)
    model, x = Unbatched().train(), torch.randn(3, 8, 8)
    freeze(model.frozen)
    opt = fxopt.optimize(model, x, mode="training", passes=PRUNE)
    assert opt.fxopt_report["prune_dead_grads"].stats["refused_unbatched"] == 1
    assert_same_step(model, opt, (x,), training=True)


class HalfBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.stem(x).to(torch.bfloat16)).float()


def test_mixed_dtype_frozen_bn_is_refused():
    """An eval BN with float32 statistics on a bfloat16 input would change the output dtype: refuse."""
    torch.manual_seed(0)
    model = HalfBN().train()
    freeze(model.bn)
    opt = fxopt.optimize(model, X_IMG, mode="training", passes=PRUNE)
    assert opt.fxopt_report["prune_dead_grads"].stats["refused_mixed_dtype"] == 1


def test_op_keeping_no_input_is_not_rewritten(monkeypatch):
    """Where the op is observed to keep no input there is no waste, so nothing is rewritten."""
    monkeypatch.setattr("fxopt.passes.prune_dead_grads.really_saved",
                        lambda node, gm, rg: SavedForBackward(False, (), True))
    opt = fxopt.optimize(frozen_middle(), X_IMG, mode="training", passes=PRUNE)
    assert opt.fxopt_report["prune_dead_grads"].stats["refused_no_waste"] == 4
    assert "conv_saving_what_grads_need" not in opt.graph_module.code


# ---- 3. dead code and side effects ----

class DeadCode(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        unused = self.lin(x).sigmoid()  # pure and dead: removed
        self.bn(x)  # dead, but updates running statistics
        F.dropout(x, 0.3)  # dead, but draws random numbers
        y = self.drop(self.lin(x))
        return y + torch.rand_like(y)


def test_dead_code_is_removed_but_effects_survive():
    """Pure dead nodes go; a dead train-mode BN and a dead dropout stay (same stats, same RNG stream)."""
    torch.manual_seed(0)
    model = DeadCode().train()
    opt = fxopt.optimize(model, X_VEC, mode="training", passes=PRUNE)
    report = opt.fxopt_report["prune_dead_grads"]
    assert report.stats["removed"] == 2  # lin + sigmoid
    code = opt.graph_module.code
    assert "sigmoid" not in code and "aten.batch_norm" in code and "dropout" in code
    assert_same_step(model, opt, (X_VEC,), training=True)


class UnreadFunctionalBN(nn.Module):
    """A functional train-mode batch_norm whose result nobody reads: it still updates the running statistics."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("mean", torch.zeros(16))
        self.register_buffer("var", torch.ones(16))

    def forward(self, x):
        h = self.lin(x)
        F.batch_norm(h, self.mean, self.var, training=True)  # dead, but writes `mean` and `var`
        return h * 2


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_dead_functional_train_mode_batch_norm_survives(mode):
    """An unread train-mode F.batch_norm updates its running statistics: removing it would change the buffers."""
    model = UnreadFunctionalBN().train(mode == "training")
    opt = fxopt.optimize(model, X_VEC, mode=mode, passes=PRUNE)
    assert opt.fxopt_report["prune_dead_grads"].stats["removed"] == 0
    assert_same_step(model, opt, (X_VEC,), training=mode == "training")


class SharedStatsFrozenBN(nn.Module):
    """A frozen eval BatchNorm whose running statistics a train-mode batch_norm later updates in place."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.bn.weight.requires_grad_(False)
        self.bn.bias.requires_grad_(False)

    def forward(self, x):
        h = self.stem(x)
        y = F.batch_norm(h, self.bn.running_mean, self.bn.running_var, self.bn.weight, self.bn.bias, training=False)
        z = F.batch_norm(h, self.bn.running_mean, self.bn.running_var, training=True)  # writes the statistics
        return y * z


def test_frozen_bn_whose_statistics_the_graph_writes_is_refused():
    """Eager autograd reads an eval BN's running statistics at backward time, after the write: no scale-and-shift."""
    torch.manual_seed(0)
    model = SharedStatsFrozenBN().train()
    with torch.no_grad():
        model.bn.running_var.uniform_(0.5, 2.0)
    opt = fxopt.optimize(model, X_IMG, mode="training", passes=PRUNE)
    report = opt.fxopt_report["prune_dead_grads"]
    assert report.stats["refused_state_written"] == 1 and report.stats["frozen_bn"] == 0
    assert_same_step(model, opt, (X_IMG,), training=True)


def test_aux_dropout_and_bn_stats_run_the_same_without_grad():
    """Dropout and a train-mode BN inside a no_grad aux head draw the same numbers and update the same stats."""
    class AuxBN(AuxHead):
        def __init__(self):
            super().__init__()
            self.aux_bn = nn.BatchNorm1d(8)

        def forward(self, x):
            logits, aux, h = super().forward(x)
            return logits, self.aux_bn(aux)

    model = aux_model(AuxBN)
    opt = fxopt.optimize(model, X_VEC, mode="training", passes=PRUNE, differentiable_outputs=[0])
    assert "call_without_grad" in opt.graph_module.code
    assert_same_declared_step(model, opt, X_VEC, {0})


def test_inference_mode_only_eliminates_dead_code():
    """In inference the pass removes dead pure nodes and rewrites nothing else."""
    model = DeadCode().eval()
    opt = fxopt.optimize(model, X_VEC, mode="inference", passes=PRUNE)
    assert opt.fxopt_report["prune_dead_grads"].stats == {"removed": 3}  # lin, sigmoid, and the eval-mode BN
    torch.manual_seed(3)
    expected = model(X_VEC)
    torch.manual_seed(3)
    torch.testing.assert_close(opt(X_VEC), expected)


class Effects(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout()
        self.act = nn.ReLU(inplace=True)
        self.custom = AuxHead()

    def forward(self, x):
        torch._assert(x.dim() == 2, "2-D")
        a = self.bn(x)
        b = self.drop(a)
        c = self.act(b)
        c.add_(1)
        d = F.dropout(c, 0.1, training=False)
        return self.custom(torch.cat([d] * 4, 1))


def test_side_effect_classification():
    """Each kind of effect is named; eval-mode dropout and plain ops have none."""
    x = torch.randn(6, 4)
    gm = exported_graph(Effects().train(), (x,))
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(first):  # calls export would run instead of recording
        printed = gm.graph.call_function(print, (first,))
        noise = gm.graph.call_function(torch.randn, (2,))
        checked = gm.graph.call_function(torch._assert, (True, "2-D"))
    by_name = {n.name: effects(n, gm) for n in gm.graph.nodes}
    assert effects(printed, gm) == {IO} and effects(noise, gm) == {RNG} and IO in effects(checked, gm)
    assert by_name["batch_norm"] == {STATS} and by_name["dropout"] == {RNG} and by_name["relu_"] == {MUTATION}
    assert by_name["add_"] == by_name["add__1"] == {MUTATION}  # num_batches_tracked += 1, and c.add_(1)
    assert by_name["dropout_1"] == frozenset() and by_name["cat"] == frozenset()
    frozen = exported_graph(Effects().eval(), (x,))
    assert effects(next(n for n in frozen.graph.nodes if n.name == "batch_norm"), frozen) == frozenset()


def test_traced_argument_guard_survives():
    """fx's guard that a traced-away argument is None (`_assert_is_none`) is an assert: it stays."""
    class Guarded(nn.Module):
        def forward(self, x, mask=None):
            return x * 2 if mask is None else x * mask

    gm = fx.symbolic_trace(Guarded(), concrete_args={"mask": None})
    guard = next(n for n in gm.graph.nodes if "assert" in str(n.target))
    assert effects(guard, gm) == {IO}


def test_opaque_module_is_an_effect():
    """A module call (an opaque module, a region fxopt made) may do anything: never dropped, never unrecorded."""
    graph = fx.Graph()
    graph.output(graph.call_module("custom", (graph.placeholder("x"),)))
    gm = fx.GraphModule(Effects(), graph)
    assert OPAQUE in effects(next(n for n in gm.graph.nodes if n.target == "custom"), gm)


# ---- idempotence ----

@pytest.mark.parametrize("make, x, declared", [(aux_model, X_VEC, [0]), (frozen_middle, X_IMG, None)])
def test_second_run_changes_nothing(make, x, declared):
    """Running the pass again on its own output changes nothing."""
    opt = fxopt.optimize(make(), x, mode="training", passes=PRUNE, differentiable_outputs=declared)
    code = opt.graph_module.code
    again = rerun(opt.graph_module, differentiable_outputs=declared)
    assert not again.changed and opt.graph_module.code == code
