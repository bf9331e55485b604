"""torch.compile(backend="fxopt"): the same results as eager, per Dynamo graph, with the debugging hand-offs.

The Inductor hand-off is tested in test_backend_inductor.py (slow-marked). Every test compiles a
deep copy of a model and compares it with the untouched original: outputs, every parameter's
gradient and every buffer (BatchNorm running statistics) after one step.
"""
from __future__ import annotations

import copy
import warnings
import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt import _torch_private
from fxopt.measure import measure_saved_bytes
from fxopt.pipeline.verify import max_difference

FAST_INNERS = ("eager", "aot_eager")
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class SeedNet(nn.Module):
    """The seed example's Conv-BN-ReLU-Linear network, at 16x16."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(self.relu(self.bn1(self.conv1(x))).flatten(1))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return torch.relu(out + identity)


class ResNetStyle(nn.Module):
    """A torchvision-style ResNet in miniature: stem, two basic blocks (one downsampling), head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


@torch.compiler.disable
def _outside_the_graph(x):
    return x * 2


class GraphBreakNet(nn.Module):
    """Two Conv-BN-ReLU stages with a call Dynamo cannot trace between them: two graphs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = _outside_the_graph(self.a(x))
        return self.fc(self.b(x).mean((2, 3)))


MODELS = {"seed": (SeedNet, 1), "resnet": (ResNetStyle, 6), "graph_break": (GraphBreakNet, 2)}  # class, BN folds


def make(name: str) -> nn.Module:
    """A model with non-trivial BN statistics and affine parameters, so a wrong fold shows."""
    torch.manual_seed(0)
    model = MODELS[name][0]()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model


def example() -> torch.Tensor:
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def step(call, module: nn.Module, x: torch.Tensor, grad: bool) -> dict[str, torch.Tensor]:
    """One forward (and backward with a fixed loss when `grad`): outputs, grads and buffers after."""
    with torch.set_grad_enabled(grad):
        out = call(x)
    tensors = {"output": out.detach().clone()}
    if grad:
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        tensors.update({f"grad:{n}": p.grad.clone() for n, p in module.named_parameters()})
    tensors.update({f"buffer:{n}": b.clone() for n, b in module.named_buffers()})
    return tensors


def assert_same(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tol: float = 1e-4) -> None:
    assert set(ref) == set(got)
    worst, name, ok = max_difference(ref, got, tol, tol)
    assert ok, f"{name} differs by {worst:.3g}"


def compiled_step(name: str, backend, train: bool, grad: bool, steps: int = 2):
    """(eager results, compiled results) of `steps` steps on identical copies of model `name`."""
    original = make(name).train(train)
    candidate = copy.deepcopy(original)
    compiled = torch.compile(candidate, backend=backend)
    x = example()
    for _ in range(steps):
        ref, got = step(original, original, x, grad), step(compiled, candidate, x, grad)
    return ref, got


@pytest.mark.parametrize("inner", FAST_INNERS)
@pytest.mark.parametrize("name", MODELS)
def test_inference_matches_eager_and_folds_every_bn(name, inner):
    """Eval mode without grad: same outputs and buffers as eager, and every Conv-BN pair folded."""
    backend = fxopt.backend(inner=inner)
    ref, got = compiled_step(name, backend, train=False, grad=False)
    assert_same(ref, got)
    assert sum(r["fold_conv_bn"].stats["folded"] for r in backend.reports) == MODELS[name][1]
    assert all(r.mode == "inference" for r in backend.reports)


@pytest.mark.parametrize("inner", FAST_INNERS)
@pytest.mark.parametrize("name", MODELS)
def test_training_step_matches_eager(name, inner):
    """Train mode: outputs, every gradient and the BN running statistics match eager over two steps."""
    backend = fxopt.backend(inner=inner)
    ref, got = compiled_step(name, backend, train=True, grad=True)
    assert_same(ref, got)
    assert all(r.mode == "training" for r in backend.reports)
    assert all(r["fold_conv_bn"].stats["refused_bn_training"] >= 1 for r in backend.reports)


@pytest.mark.parametrize("inner", FAST_INNERS)
def test_frozen_bn_fine_tuning_folds_with_gradients(inner):
    """Eval-mode BN with autograd on: the fold is emitted as graph ops, and gradients still match."""
    backend = fxopt.backend(inner=inner)
    ref, got = compiled_step("resnet", backend, train=False, grad=True)
    assert_same(ref, got)
    assert backend.reports[0].mode == "training"
    assert backend.reports[0]["fold_conv_bn"].stats["folded"] == MODELS["resnet"][1]


def test_graph_break_optimizes_each_graph_independently():
    """A graph break gives two Dynamo graphs; each gets its own pipeline run and report."""
    backend = fxopt.backend(inner="eager")
    compiled_step("graph_break", backend, train=False, grad=False, steps=1)
    assert len(backend.reports) == 2
    assert [r["fold_conv_bn"].stats["folded"] for r in backend.reports] == [1, 1]
    assert backend.reports[0].graphs != backend.reports[1].graphs


@pytest.mark.parametrize("inner", FAST_INNERS)
def test_fold_follows_parameters_changed_after_compiling(inner):
    """Unfrozen, folded weights are graph ops on the parameter inputs: in-place updates and new Parameters are used
    (frozen, see test_eager_path_frozen_fold_is_computed_once_and_never_stale)."""
    model = make("seed").eval()
    compiled = torch.compile(model, backend=fxopt.backend(inner=inner, freeze=False))
    x = example()
    with torch.no_grad():
        compiled(x)
        model.conv1.weight.mul_(1.5)
        model.bn1.running_var.add_(0.25)
        assert_same({"output": model(x)}, {"output": compiled(x)})
        model.bn1.weight = nn.Parameter(model.bn1.weight * -1)
        assert_same({"output": model(x)}, {"output": compiled(x)})


def test_caller_model_is_not_modified():
    """Compiling and running in inference leaves the caller's parameters and buffers as they were."""
    model = make("resnet").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        torch.compile(model, backend=fxopt.backend(inner="eager"))(example())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_string_backend_with_options_and_report_callback():
    """backend="fxopt" with options={...} reaches the backend; the report callback sees each graph."""
    reports = []
    compiled = torch.compile(make("seed").eval(), backend="fxopt", options={"inner": "eager", "report": reports.append})
    with torch.no_grad():
        compiled(example())
    assert len(reports) == 1 and reports[0]["fold_conv_bn"].stats["folded"] == 1


def test_report_path_gets_one_json_line_per_graph(tmp_path):
    """report=<path> appends each graph's report as one JSON object per line."""
    path = tmp_path / "reports.jsonl"
    compiled = torch.compile(make("graph_break").eval(), backend=fxopt.backend(inner="eager", report=str(path)))
    with torch.no_grad():
        compiled(example())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2
    assert all(d["passes"][0]["name"] == "fold_conv_bn" and d["passes"][0]["stats"]["folded"] == 1 for d in lines)


def test_inplace_relu_is_skipped_with_the_reason():
    """inplace_relu would be undone by functionalization, so the backend skips it and says why."""
    backend = fxopt.backend(inner="aot_eager", passes=["fold_conv_bn", "inplace_relu"])
    compiled_step("seed", backend, train=True, grad=True, steps=1)
    entry = backend.reports[0]["inplace_relu"]
    assert "functionalizes" in entry.skipped and not entry.sites


def test_a_pass_of_the_other_mode_reports_itself_skipped():
    """Passes are named once for every graph: checkpoint_activations (training only) says so on an inference graph."""
    backend = fxopt.backend(inner="eager", passes=["fold_conv_bn", "checkpoint_activations"])
    compiled_step("seed", backend, train=False, grad=False, steps=1)
    entry = backend.reports[0]["checkpoint_activations"]
    assert "runs only in training" in entry.skipped and not entry.sites
    assert backend.reports[0]["fold_conv_bn"].stats["folded"] == 1


def test_verify_compares_each_pass_with_the_dynamo_graph():
    """verify=True runs the graph before and after each pass (outputs, grads, buffers) and records the diff."""
    backend = fxopt.backend(inner="eager", verify=True)
    compiled_step("resnet", backend, train=False, grad=True, steps=1)
    diff = backend.reports[0]["fold_conv_bn"].max_abs_diff
    assert diff is not None and diff < 1e-4


class DeepMLP(nn.Module):
    """Linear-LayerNorm-GELU blocks: many cheap activations for the partitioner to recompute."""

    def __init__(self, width=128, depth=6):
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                                    for _ in range(depth)])

    def forward(self, x):
        return self.body(x)


@pytest.mark.usefixtures("budget_may_be_unmet")
def test_memory_budget_drives_the_partitioner_and_keeps_gradients():
    """memory_budget=0.1 makes AOTAutograd save fewer activations, with the same gradients as eager."""
    torch.manual_seed(0)
    original = DeepMLP()
    x = torch.randn(64, 128)
    ref = step(original, original, x, grad=True)
    saved = {}
    for budget in (None, 0.1):
        _torch_private.reset_dynamo()
        candidate = copy.deepcopy(original)
        backend = fxopt.backend(inner="aot_eager", **({} if budget is None else {"memory_budget": budget}))
        compiled = torch.compile(candidate, backend=backend)
        compiled(x)  # compile outside the measurement
        saved[budget] = measure_saved_bytes(lambda: compiled(x), candidate)
        assert_same(ref, step(compiled, candidate, x, grad=True))
    assert saved[0.1] < 0.6 * saved[None], saved
    figures = backend.reports[0]["checkpoint_activations"].figures
    assert figures["peak_bytes_after"] < figures["peak_bytes_before"], figures


@pytest.mark.usefixtures("budget_may_be_unmet")
def test_memory_budget_with_train_mode_batch_norm_matches_eager():
    """Recomputation chosen by the partitioner keeps train-mode BN exact: grads and running stats match."""
    ref, got = compiled_step("resnet", fxopt.backend(inner="aot_eager", memory_budget=0.5), train=True, grad=True)
    assert_same(ref, got)


def test_train_mode_batch_norm_without_grad_updates_running_stats():
    """Train-mode BN under no_grad: nothing folds, and the running statistics update as in eager."""
    ref, got = compiled_step("resnet", fxopt.backend(inner="aot_eager"), train=True, grad=False)
    assert_same(ref, got)


def test_autocast_matches_eager():
    """Under bfloat16 autocast the compiled network matches eager autocast (within bfloat16 rounding)."""
    original = make("resnet").eval()
    compiled = torch.compile(copy.deepcopy(original), backend=fxopt.backend(inner="aot_eager"))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = original(example()), compiled(example())
    assert got.dtype == ref.dtype
    torch.testing.assert_close(got.float(), ref.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("options, message", [
    ({"bogus": 1}, "unknown option 'bogus'"),
    ({"inner": "tvm"}, "unknown inner compiler 'tvm'"),
    ({"passes": ["no_such_pass"]}, "unknown pass 'no_such_pass'"),
    ({"passes": ["fold_conv_bn"], "memory_budget": 0.5}, "'memory_budget' is not taken by any selected pass"),
    ({"memory_budget": 1.5}, "fraction in \\(0, 1\\]"),
    ({"memory_budget": "512 parsecs"}, "is not a size"),
    ({"verify": "yes"}, "'verify' must be True or False"),
    ({"report": 42}, "'report' must be a callable or a file path"),
])
def test_bad_options_are_fxopt_errors(options, message):
    """Each malformed option is rejected with a FxoptError naming it, when the backend object is made."""
    with pytest.raises(fxopt.FxoptError, match=message):
        fxopt.backend(**options)


def test_bad_option_through_the_string_backend_is_a_fxopt_error():
    """With backend="fxopt" the options are checked at the first compile; Dynamo wraps the FxoptError."""
    compiled = torch.compile(make("seed"), backend="fxopt", options={"bogus": 1})
    with pytest.raises(Exception, match="FxoptError: unknown option 'bogus'") as info:
        compiled(example())
    assert isinstance(info.value.inner_exception, fxopt.FxoptError)


def test_entry_point_registers_the_backend_without_importing_fxopt():
    """A fresh interpreter finds "fxopt" through the torch_dynamo_backends entry point and can compile with it."""
    code = (
        "import sys, torch, torch._dynamo\n"
        "assert 'fxopt' in torch._dynamo.list_backends(), torch._dynamo.list_backends()\n"
        "assert 'fxopt' not in sys.modules\n"
        "m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()\n"
        "x = torch.randn(1, 3, 8, 8)\n"
        "with torch.no_grad():\n"
        "    out = torch.compile(m, backend='fxopt', options={'inner': 'eager'})(x)\n"
        "    torch.testing.assert_close(out, m(x))\n"
        "assert 'fxopt' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


class WideStack(nn.Module):
    """Four 128-channel Conv-BN-ReLU blocks (0.6 MB per conv, so DDP makes several 1 MB buckets).

    A user-defined forward: Dynamo starts no frame inside torch.nn, so a bare nn.Sequential
    under DDP would run eagerly.
    """

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Conv2d(128, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU())
                                    for _ in range(4)])

    def forward(self, x):
        return self.body(x)


def test_ddp_split_graphs_each_reach_the_backend(monkeypatch):
    """Under DistributedDataParallel, Dynamo's DDP optimizer splits at 1 MB buckets; each piece is optimized."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29517")
    torch.manual_seed(0)
    original = WideStack().eval()
    x = torch.randn(2, 128, 8, 8)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(copy.deepcopy(original), bucket_cap_mb=1)
        backend = fxopt.backend(inner="aot_eager")
        ref, got = step(original, original, x, grad=True), step(torch.compile(ddp, backend=backend), ddp.module, x,
                                                                 grad=True)
    finally:
        dist.destroy_process_group()
    assert_same(ref, got)
    assert len(backend.reports) > 1
    assert sum(r["fold_conv_bn"].stats["folded"] for r in backend.reports) == 4


def assert_frozen_fold_never_stale(model: nn.Module, call) -> None:
    """`call` runs frozen inference graphs of `model`: an in-place update and moved statistics make it fall back
    with one warning, a new Parameter is used after that, and every output is eager's."""
    x = example()
    with torch.no_grad():
        assert_same({"output": model(x)}, {"output": call(x)})
        model.conv1.weight.mul_(1.5)
        model.bn1.running_var.add_(0.25)
        with pytest.warns(UserWarning, match="changed after fxopt froze it"):
            got = call(x)
        assert_same({"output": model(x)}, {"output": got})
        model.bn1.weight = nn.Parameter(model.bn1.weight * -1)
        assert_same({"output": model(x)}, {"output": call(x)})


def test_eager_path_frozen_fold_is_computed_once_and_never_stale():
    """Inference on the eager path folds the scaled weights once; an in-place update, a new Parameter or moved
    BatchNorm statistics after it fall back, with one warning, and match eager."""
    optimized = fxopt.optimize(make("seed").eval(), (example(),))
    assert_frozen_fold_never_stale(optimized.original, optimized)  # the private copy the result runs


def test_eager_path_freeze_false_recomputes_the_fold_each_call():
    """freeze=False: the fold runs on the current parameters each call, so an update needs no fallback or warning."""
    model = make("seed").eval()
    optimized = fxopt.optimize(model, (example(),), freeze=False)
    x = example()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        optimized(x)
        optimized.original.conv1.weight.mul_(1.5)
        assert_same({"output": optimized.original(x)}, {"output": optimized(x)})


def test_eager_path_train_mode_batch_norm_without_grad_is_not_frozen():
    """A graph that updates BatchNorm statistics itself (train mode under no_grad) is not frozen: its statistics
    move as eager's, call after call."""
    model = make("seed").train()
    reference = copy.deepcopy(model)
    optimized = fxopt.optimize(model, (example(),), mode="inference")
    with torch.no_grad():
        for seed in range(3):
            x = example() + seed
            assert_same(step(reference, reference, x, False), step(optimized, optimized.original, x, False))


def test_a_graph_whose_only_constants_are_views_is_not_frozen():
    """A constant subgraph of views alone (a token expanded to the batch) saves no work: the graph runs unfrozen,
    without the frozen graph's checks; one that computes (an eval BatchNorm's scale from its statistics) is frozen."""
    class Token(nn.Module):
        def __init__(self):
            super().__init__()
            self.token = nn.Parameter(torch.randn(1, 1, 4))

        def forward(self, x):
            return torch.cat([self.token.expand(x.shape[0], -1, -1), x], dim=1)

    def attributes_graph(model, x):
        gm = torch.fx.symbolic_trace(model)
        return torch.fx.experimental.proxy_tensor.make_fx(gm)(x)

    x = torch.randn(2, 3, 4)
    assert _torch_private.fold_constant_subgraphs(attributes_graph(Token(), x)) is None
    scaled = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    assert _torch_private.fold_constant_subgraphs(attributes_graph(scaled, torch.randn(1, 3, 8, 8))) is not None
