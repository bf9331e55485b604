"""inplace_relu: activations run in place exactly where that is proven safe, relu keeps a bool mask
where that frees memory; one test per refusal rule (eval-mode dropout: tests/test_drop_eval_dropout.py).

Every rewrite is checked for structure (gm.code), equivalence with the original (outputs; in
training also gradients and BatchNorm buffers), the report, idempotence, the caller's tensors,
and, with hypothesis, over random graphs with sharing and views.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import assert_same_step, assert_state_unchanged, state_snapshot
from graph_forms import function_form
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing import FileCheck

import fxopt
from fxopt.measure import measure_peak, measure_saved_bytes
from fxopt.passes._relu_mask import relu_mask, relu_mask_
from fxopt.passes.base import PassContext
from fxopt.passes.inplace_relu import InplaceReLU
from fxopt.pipeline.pipelines import DEFAULT_PIPELINES

IMAGE = (torch.randn(4, 3, 8, 8),)
FEATURES = (torch.randn(8, 16),)


def optimize(model: nn.Module, inputs: tuple, mode: str, **options) -> nn.Module:
    return fxopt.optimize(model, inputs, mode=mode, passes=["inplace_relu"], **options)


# An activation rewritten in place in the ATen graph: `aten.relu_.default(...)` and its family.
IN_PLACE = r"aten\.(relu|relu6|hardtanh|leaky_relu|elu|hardswish|silu)_\.default"


def code(optimized: nn.Module) -> str:
    """The generated code of the optimized graph."""
    return optimized.graph_module.code


def in_place_count(optimized: nn.Module) -> int:
    return len(re.findall(IN_PLACE, code(optimized)))


def report(optimized: nn.Module):
    return optimized.fxopt_report["inplace_relu"]


def reasons(optimized: nn.Module) -> set[str]:
    return {s.reason for s in report(optimized).sites if s.refused}


def check_same(model: nn.Module, inputs: tuple, mode: str) -> nn.Module:
    """Optimize `model` and assert it computes what the original computes in `mode`."""
    model.train(mode == "training")
    optimized = optimize(model, inputs, mode)
    assert_same_step(model, optimized, inputs, training=mode == "training")
    return optimized


class ConvAct(nn.Module):
    """conv -> activation -> pooled head; `act` is a module or a function of the conv output."""

    def __init__(self, act):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = act
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.act(self.conv(x)).mean((2, 3)))


ACTIVATIONS = {
    "nn.ReLU": nn.ReLU(), "F.relu": F.relu, "torch.relu": torch.relu, "x.relu()": lambda x: x.relu(),
    "nn.ReLU6": nn.ReLU6(), "F.relu6": F.relu6, "nn.Hardtanh": nn.Hardtanh(-0.5, 2.0),
    "F.hardtanh": lambda x: F.hardtanh(x, -0.5, 2.0), "nn.LeakyReLU": nn.LeakyReLU(0.2),
    "F.leaky_relu": lambda x: F.leaky_relu(x, 0.2), "nn.ELU": nn.ELU(0.5), "F.elu": F.elu,
    "nn.Hardswish": nn.Hardswish(), "F.hardswish": F.hardswish, "nn.SiLU": nn.SiLU(), "F.silu": F.silu,
}
# Where autograd's in-place backward reads the result, so in place is also safe and useful in training.
TRAINABLE_IN_PLACE = {"nn.ReLU", "F.relu", "torch.relu", "x.relu()", "nn.LeakyReLU", "F.leaky_relu", "nn.ELU", "F.elu"}


@pytest.mark.parametrize("form", list(ACTIVATIONS))
def test_every_form_runs_in_place_in_inference(form):
    """Each member of the family, in each form, becomes `aten.<kind>_(...)` and computes the same."""
    optimized = check_same(ConvAct(ACTIVATIONS[form]), IMAGE, "inference")
    FileCheck().check("aten.conv2d").check_regex(IN_PLACE).check("aten.linear").run(code(optimized))
    assert report(optimized).stats["inplaced"] == 1


@pytest.mark.parametrize("form", sorted(TRAINABLE_IN_PLACE))
def test_training_in_place_matches_gradients(form):
    """In training, relu/leaky_relu/elu after a conv run in place and give the same gradients."""
    optimized = check_same(ConvAct(ACTIVATIONS[form]), IMAGE, "training")
    assert report(optimized).stats["inplaced"] == 1
    assert in_place_count(optimized) == 1 or "relu_mask_" in code(optimized)


class BasicBlock(nn.Module):
    """A ResNet basic block written with inplace=False everywhere."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu2 = nn.ReLU()

    def forward(self, x):
        out = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(out)) + x)


class SmallResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(), BasicBlock())
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_resnet_equivalence_and_report(mode):
    """Every ReLU of a ResNet runs in place; outputs, gradients and BN running stats are unchanged."""
    model = SmallResNet()
    snapshot = state_snapshot(model)
    optimized = check_same(model, IMAGE, mode)
    assert report(optimized).stats["inplaced"] == 5
    assert not any(s.refused and not s.reason.startswith("mask_") for s in report(optimized).sites)
    assert "aten.relu.default" not in code(optimized)
    assert_state_unchanged(model, snapshot)


def test_second_run_changes_nothing():
    """Running the pass again on its own output finds nothing left to do and records the same refusals."""
    model = SmallResNet().train()
    optimized = optimize(model, IMAGE, "training")
    gm = optimized.graph_module
    before = gm.code
    again = InplaceReLU().run(gm, PassContext("training"))
    assert not again.changed
    assert gm.code == before


def test_inputs_and_model_are_not_mutated():
    """The caller's input tensors and model state are the same after calling the optimized model."""
    model = SmallResNet().eval()
    snapshot = state_snapshot(model)
    x = IMAGE[0].clone()
    optimized = optimize(model, (x,), "inference")
    with torch.no_grad():
        optimized(x)
    assert torch.equal(x, IMAGE[0])
    assert_state_unchanged(model, snapshot)


def test_inference_peak_drops():
    """Under no_grad, an in-place relu that is the peak of a step removes one activation from it."""
    model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 4)).eval()
    optimized = optimize(model, FEATURES, "inference")
    with torch.no_grad():
        before = measure_peak(lambda: model(*FEATURES), model, FEATURES)
        after = measure_peak(lambda: optimized(*FEATURES), optimized, FEATURES)
    hidden, logits = 8 * 512 * 4, 8 * 4 * 4
    assert (before, after) == (2 * hidden, hidden + logits)


def test_view_of_a_fresh_tensor_runs_in_place():
    """relu of a view of a conv output (nothing else reads the conv output) runs in place."""
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return torch.relu(self.conv(x).flatten(1)).sum(1)

    for mode in ("inference", "training"):
        optimized = check_same(Flat(), IMAGE, mode)
        assert report(optimized).stats["inplaced"] == 1


# ---- refusals: one test per rule ----

class OnInput(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


def test_refuses_graph_input():
    """An activation on a graph input would overwrite the caller's tensor, so it must stay out of place."""
    optimized = check_same(OnInput(), FEATURES, "inference")
    assert reasons(optimized) == {"graph_input"}
    assert in_place_count(optimized) == 0


class OnParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        return F.relu(self.weight.t()) @ x.t()


def test_refuses_view_of_parameter():
    """An activation on a view of a parameter would overwrite the model's weights."""
    optimized = check_same(OnParameter(), FEATURES, "inference")
    assert reasons(optimized) == {"graph_input"}


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return torch.relu(h) + h


def test_refuses_input_used_later():
    """`relu(h) + h` reads h after the relu, so overwriting h would change the sum."""
    optimized = check_same(Residual(), FEATURES, "inference")
    assert reasons(optimized) == {"used_later"}


class ViewedLater(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        flat = h.view(-1)
        return torch.relu(h).sum() + flat[:5].sum()


def test_refuses_aliased_view_used_later():
    """A view of the input taken before the relu and read after it would see the overwritten values."""
    optimized = check_same(ViewedLater(), FEATURES, "inference")
    assert reasons(optimized) == {"aliased"}


class Chunked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        a, b = self.fc(x).chunk(2, dim=1)
        return torch.relu(a) * 2, b


class Expanded(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 1)

    def forward(self, x):
        return torch.relu(self.fc(x).expand(8, 16)).sum(0)


@pytest.mark.parametrize("model", [Chunked, Expanded])
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_refuses_views_that_cannot_be_written(model, mode):
    """Autograd forbids writing one of chunk's views in place, and an expanded view overlaps itself."""
    optimized = check_same(model(), FEATURES, mode)
    assert "aliased" in reasons(optimized)
    with torch.enable_grad():
        optimized(*FEATURES)  # no "modified inplace" error even with grad enabled


class SigmoidThenRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return F.leaky_relu(torch.sigmoid(self.fc(x)), 0.1)


def test_refuses_producer_that_saves_output():
    """sigmoid keeps its output for backward; overwriting it would corrupt sigmoid's gradient."""
    optimized = check_same(SigmoidThenRelu(), FEATURES, "training")
    assert reasons(optimized) == {"producer_saves_output"}
    assert in_place_count(check_same(SigmoidThenRelu(), FEATURES, "inference")) == 1


class AlsoMultiplied(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.randn(16))

    def forward(self, x):
        h = self.fc(x)
        scaled = h * self.scale
        return F.leaky_relu(h, 0.1) + scaled


def test_refuses_input_saved_by_other_op():
    """A `mul` that read the input keeps it for backward; overwriting it would corrupt mul's gradient."""
    optimized = check_same(AlsoMultiplied(), FEATURES, "training")
    assert reasons(optimized) == {"saved_by_other_op"}
    assert report(check_same(AlsoMultiplied(), FEATURES, "inference")).stats["inplaced"] == 1


@torch.library.custom_op("fxopt_tests::opaque_scale", mutates_args=())
def opaque_scale(x: torch.Tensor) -> torch.Tensor:
    """An op fxopt does not know (a custom op; export keeps it as one call): it might return a view of what it keeps."""
    return x * 2


opaque_scale.register_fake(lambda x: torch.empty_like(x))
opaque_scale.register_autograd(lambda ctx, grad: grad * 2)


class AfterUnknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(opaque_scale(self.fc(x)))


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_refuses_unknown_producer(mode):
    """The input comes from an op fxopt does not know, so it cannot prove nothing else holds it."""
    optimized = check_same(AfterUnknown(), FEATURES, mode)
    assert "unknown_op" in reasons(optimized)
    assert in_place_count(optimized) == 0


@pytest.mark.parametrize("act", [nn.SiLU(), nn.Hardswish(), nn.ReLU6(), nn.LeakyReLU(-0.1)])
def test_refuses_when_backward_needs_the_input(act):
    """In training, in-place silu/hardswish/relu6 make autograd copy the input (no gain), negative slopes fail."""
    optimized = check_same(ConvAct(act), IMAGE, "training")
    assert reasons(optimized) == {"backward_needs_input"}


class OutputWrittenLater(nn.Module):
    """An activation whose output the model then writes in place (`y.add_(1)`)."""

    def __init__(self, act):
        super().__init__()
        self.fc, self.act, self.head = nn.Linear(16, 16), act, nn.Linear(16, 4)

    def forward(self, x):
        y = self.act(self.fc(x))
        y.add_(1.0)
        return self.head(y)


@pytest.mark.parametrize("act", [nn.LeakyReLU(0.1), nn.ELU(0.5)], ids=["leaky_relu", "elu"])
def test_refuses_when_the_output_is_written_in_place_later(act):
    """leaky_relu_/elu_ keep their output for backward, so a later in-place write of it would break backward."""
    optimized = check_same(OutputWrittenLater(act), FEATURES, "training")
    assert reasons(optimized) == {"output_written_later"}
    assert report(check_same(OutputWrittenLater(act), FEATURES, "inference")).stats["inplaced"] == 1


# ---- relu keeps a bool mask in training ----

class MLPWithDropout(nn.Module):
    """Linear -> ReLU -> Dropout -> Linear: dropout keeps its own mask, not relu's output."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 256)
        self.relu = nn.ReLU()
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(256, 4)

    def forward(self, x):
        return self.fc2(self.drop(self.relu(self.fc1(x))))


def test_relu_keeps_a_mask_where_nothing_else_keeps_its_output():
    """relu before dropout keeps a bool mask; the bytes kept for backward drop by exactly the reported figure."""
    model = MLPWithDropout().train()
    optimized = check_same(model, FEATURES, "training")
    assert report(optimized).stats["masked"] == 1
    FileCheck().check("aten.linear").check("relu_mask_(linear)").check("aten.dropout").run(code(optimized))
    freed = report(optimized).figures["mask_saved_bytes"]
    assert freed == 8 * 256 * 3
    torch.manual_seed(0)
    before = measure_saved_bytes(lambda: model(*FEATURES), model)
    torch.manual_seed(0)
    after = measure_saved_bytes(lambda: optimized(*FEATURES), optimized)
    assert before - after == freed


def test_mask_gradients_are_bit_identical():
    """The masked relu's gradients equal autograd's relu gradients bit for bit."""
    model = MLPWithDropout().train()
    optimized = optimize(model, FEATURES, "training")
    grads = []
    for m in (model, optimized):
        torch.manual_seed(0)
        m.zero_grad()
        m(*FEATURES).square().sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("inplace", [False, True])
def test_mask_passes_gradients_where_the_input_is_nan(inplace):
    """A NaN input (so a NaN output) passes its gradient through the masked relu as through ATen's, and a NaN or
    infinite gradient where the mask is set becomes +0: the same bits as ATen's, in float32 and bfloat16."""
    x = torch.tensor([float("nan"), -1.0, 0.0, 2.0, float("inf"), float("-inf"), -3.0, 5.0])
    grad = torch.tensor([1.0, 2.0, float("nan"), float("inf"), 3.0, float("-inf"), -0.0, -0.0])
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        grads = []
        for relu in (torch.relu, relu_mask_ if inplace else relu_mask):
            leaf = x.to(dtype, copy=True).requires_grad_()
            relu(leaf * 1).backward(grad.to(dtype))
            grads.append(leaf.grad.view(bits))  # bit for bit: NaN, infinities and the sign of zero
        assert torch.equal(grads[1], grads[0])


def test_no_mask_where_next_layer_keeps_the_output():
    """relu -> linear: the linear keeps relu's output for backward, so a mask would free nothing."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimized = check_same(model, FEATURES, "training")
    assert reasons(optimized) == {"mask_kept_by_other_op"}
    assert "relu_mask" not in code(optimized)


def test_no_mask_for_graph_output():
    """A relu whose output is returned stays alive anyway, so a mask would free nothing."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    optimized = check_same(model, FEATURES, "training")
    assert reasons(optimized) == {"mask_graph_output"}


def test_mask_option_off():
    """With relu_mask=False the pass only rewrites in place."""
    optimized = optimize(MLPWithDropout().train(), FEATURES, "training", relu_mask=False)
    assert "relu_mask" not in code(optimized) and in_place_count(optimized) == 1


# ---- front ends ----

def test_default_pipelines_include_the_pass():
    """inplace_relu runs by default in both modes."""
    assert "inplace_relu" in DEFAULT_PIPELINES["inference"] and "inplace_relu" in DEFAULT_PIPELINES["training"]


def test_does_nothing_under_torch_compile():
    """As a torch.compile backend the pass does nothing: AOTAutograd functionalizes in-place ops."""
    gm = function_form(ConvAct(nn.ReLU()), IMAGE)
    result = InplaceReLU().run(gm, PassContext("inference", aot_autograd_next=True))
    assert result.skipped and not result.sites


# ---- property: random graphs with sharing and views ----

VIEWS = {
    "t": lambda v: v.t().t(),
    "view": lambda v: v.view(-1).view(4, 8),
    "reshape": lambda v: v.reshape(8, 4).reshape(4, 8),
    "slice": lambda v: v[:, :],
    "transpose": lambda v: v.transpose(0, 1).transpose(0, 1),
}
ACT_MODULES = {"relu": nn.ReLU, "leaky": lambda: nn.LeakyReLU(0.1), "relu6": nn.ReLU6, "silu": nn.SiLU}
ACT_FUNCTIONS = {"F.relu": F.relu, "method": lambda v: v.relu(), "elu": F.elu, "hardswish": F.hardswish}
ACTS = sorted([*ACT_MODULES, *ACT_FUNCTIONS])
OTHERS = {
    "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    # relu of one of chunk's views, and of an expanded view: both must stay out of place
    "chunk_relu": lambda v: torch.cat([torch.relu(v.chunk(2, 0)[0]), v.chunk(2, 0)[1]], 0),
    "expand_relu": lambda v: torch.relu(v[:1].expand(4, 8)),
}
BINARY = {"add": torch.add, "mul": torch.mul, "sub": torch.sub}


class RandomGraph(nn.Module):
    """Interprets a program of (op, args) over a list of values; tracing unrolls it into a graph."""

    def __init__(self, program: list[tuple]):
        super().__init__()
        self.program = program
        self.fcs = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.param = nn.Parameter(torch.randn(4, 8))
        self.drop = nn.Dropout(0.3)
        self.acts = nn.ModuleDict({name: make() for name, make in ACT_MODULES.items()})

    def act(self, name: str, v):
        return self.acts[name](v) if name in self.acts else ACT_FUNCTIONS[name](v)

    def forward(self, x):
        values = [x, self.param]
        for op, *args in self.program:
            if op == "fc":
                values.append(self.fcs[args[1]](values[args[0]]))
            elif op == "act":
                values.append(self.act(args[1], values[args[0]]))
            elif op == "other":
                values.append(OTHERS[args[1]](values[args[0]]))
            elif op == "view":
                values.append(VIEWS[args[1]](values[args[0]]))
            elif op == "binary":
                values.append(BINARY[args[2]](values[args[0]], values[args[1]]))
            elif op == "dropout":
                values.append(self.drop(values[args[0]]))
        outputs = [values[i] for i in self.program_outputs(len(values))]
        return tuple(outputs)

    def program_outputs(self, n: int) -> list[int]:
        return sorted({n - 1, *[i % n for i in getattr(self, "extra_outputs", [])]})


@st.composite
def programs(draw):
    program = []
    for _ in range(draw(st.integers(1, 10))):
        n = len(program) + 2
        i = n - 1 - draw(st.integers(0, n - 1))  # shrinks towards the latest value
        op = draw(st.sampled_from(["fc", "act", "act", "act", "other", "view", "view", "binary", "dropout"]))
        if op == "fc":
            program.append(("fc", i, draw(st.integers(0, 2))))
        elif op == "act":
            program.append(("act", i, draw(st.sampled_from(ACTS))))
        elif op == "other":
            program.append(("other", i, draw(st.sampled_from(sorted(OTHERS)))))
        elif op == "view":
            program.append(("view", i, draw(st.sampled_from(sorted(VIEWS)))))
        elif op == "binary":
            program.append(("binary", i, draw(st.integers(0, n - 1)), draw(st.sampled_from(sorted(BINARY)))))
        else:
            program.append(("dropout", i))
    extra = draw(st.lists(st.integers(0, 20), max_size=3))
    return program, extra


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.sampled_from(["inference", "training"]))
def test_random_graphs_match_eager(case, mode):
    """On random graphs with shared values, views and outputs, the pass never changes outputs or
    gradients and never triggers autograd's "modified by an inplace operation" error."""
    program, extra = case
    model = RandomGraph(program)
    model.extra_outputs = extra
    x = torch.randn(4, 8, requires_grad=mode == "training")
    check_same(model, (x,), mode)
