"""A selective region whose kept ops are all convolutions keeps their outputs itself, without torch's selective
checkpoint dispatch mode (fxopt.analysis.kept_convolutions), and computes exactly what eager does."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.checkpointing._kept_outputs import kept_convolution, kept_product
from fxopt.checkpointing.profile import Region, step_profile
from fxopt.checkpointing._region_overhead import RegionOverhead
from fxopt.checkpointing.eager_region import CheckpointedRegion, extract_region
from fxopt.checkpointing._kept_outputs_run import product_once

from equivalence import assert_same_step
from graph_forms import exported_graph, function_form
from named_regions import extract_regions


class _Convolutions(nn.Module):
    """Two convolutions of one kind (`layer(channels)` builds one), a BatchNorm and a ReLU after each."""

    def __init__(self, layer, norm=nn.BatchNorm2d, tail: nn.Module | None = None):
        super().__init__()
        self.first, self.second = layer(), layer()
        self.norms = nn.ModuleList([norm(8), norm(8)])
        self.tail = tail

    def forward(self, x):
        x = F.relu(self.norms[0](self.first(x)))
        x = F.relu(self.norms[1](self.second(x))) + x
        return x if self.tail is None else self.tail(x.mean(dim=(2, 3)))


LAYERS = {
    "conv2d": (lambda: nn.Conv2d(8, 8, 3, padding=1), (2, 8, 10, 10), nn.BatchNorm2d),
    "strided_dilated_no_bias": (lambda: nn.Conv2d(8, 8, 3, padding=2, dilation=2, bias=False), (2, 8, 11, 9),
                                nn.BatchNorm2d),
    "depthwise": (lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8), (2, 8, 10, 10), nn.BatchNorm2d),
    "transposed": (lambda: nn.ConvTranspose2d(8, 8, 3, padding=1), (2, 8, 7, 7), nn.BatchNorm2d),
    "conv1d": (lambda: nn.Conv1d(8, 8, 5, padding=2), (2, 8, 20), nn.BatchNorm1d),
    "conv3d": (lambda: nn.Conv3d(8, 8, 3, padding=1), (2, 8, 4, 5, 6), nn.BatchNorm3d),
}


def _as_model(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    """`model`'s captured graph on its own tensors (graph_forms.exported_graph), returning what the model returns (one
    tensor where the graph returns a tuple of one): called, deep-copied and stepped as the model is, and never
    compiled again (fxopt.optimize's result recompiles, without a hand-made region, for an input that needs grad)."""
    gm = exported_graph(model, (x,))
    (output,) = gm.graph.find_nodes(op="output")
    (values,) = output.args
    if len(values) == 1:
        output.args = (values[0],)
        gm.recompile()
    return gm


def _one_selective_region(model: nn.Module, x: torch.Tensor, keep_costly_only: bool = False
                          ) -> torch.fx.GraphModule:
    """`model` captured (_as_model), all its nodes in one selective region that keeps what the memory model counts."""
    gm = _as_model(model, x)
    profile = step_profile(gm)
    extract_regions(gm, profile, [Region(0, len(profile.steps), save_compute_intensive=True, keep_costly_only=keep_costly_only)])
    return gm


def _region(opt) -> CheckpointedRegion:
    (region,) = [m for m in getattr(opt, "graph_module", opt).modules() if isinstance(m, CheckpointedRegion)]
    return region


def _steps(model: nn.Module, x: torch.Tensor, n: int = 2, input_grad: bool = True) -> dict:
    """Output, input and parameter gradients and buffers after `n` steps on a copy of `model`."""
    model, x = copy.deepcopy(model), x.clone().requires_grad_(input_grad)
    for _ in range(n):
        out = model(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return {"output": out.detach(), "grad:input": x.grad, **{f"grad:{k}": p.grad for k, p in model.named_parameters()},
            **{f"buffer:{k}": b for k, b in model.named_buffers()}}


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_step_is_bit_exact_in_float32(kind, channels_last):
    """Two training steps through the region give eager's outputs, gradients and running statistics bit for bit, for
    every kind of convolution, in either memory format."""
    layer, shape, norm = LAYERS[kind]
    if channels_last and len(shape) != 4:
        pytest.skip("channels_last is a 4-d layout")
    torch.manual_seed(0)
    model, x = _Convolutions(layer, norm).train(), torch.randn(shape)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    opt = _one_selective_region(model, x)
    assert _region(opt).kind == "selective (matmul/conv outputs kept by the region)"  # no dispatch mode
    expected, got = _steps(model, x), _steps(opt, x)
    assert [k for k, v in expected.items() if not torch.equal(got[k], v)] == []


def _backward_nodes(out: torch.Tensor) -> set[str]:
    """The type names of the autograd nodes `out`'s backward runs."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


def test_backward_is_aten_nodes_only():
    """The region's first run records ATen's own nodes for its convolutions and replayed BatchNorms, no Python
    Function: the backward runs no Python for them (only the recomputation does)."""
    torch.manual_seed(0)
    model, x = _Convolutions(LAYERS["conv2d"][0]).train(), torch.randn(2, 8, 10, 10)
    opt = _one_selective_region(model, x)
    nodes = _backward_nodes(opt(x.requires_grad_()))
    assert {"ConvolutionBackward0", "NativeBatchNormBackward0"} <= nodes
    assert [n for n in nodes if n.endswith("Backward") and not n.endswith("0Backward")] == []  # a Function's node


@pytest.mark.parametrize("trainable", ["first.bias", "norms.0.bias"])
def test_only_a_bias_trainable_is_bit_exact(trainable):
    """With the input and every parameter but one bias frozen, autograd records the op whose bias it is and so saves
    its tensors: the recomputation saves them too (checkpoint failed on the count before), and the step is eager's."""
    torch.manual_seed(0)
    model, x = _Convolutions(LAYERS["conv2d"][0]).train(), torch.randn(2, 8, 10, 10)
    for name, p in model.named_parameters():
        p.requires_grad_(name == trainable)
    opt = _one_selective_region(model, x)
    expected, got = _steps(model, x, input_grad=False), _steps(opt, x, input_grad=False)
    assert [k for k, v in expected.items() if v is not None and not torch.equal(got[k], v)] == []


def test_autocast_matches_eager():
    """Called under bfloat16 autocast, the region's convolutions run as the model's did (autocast casts their inputs),
    so two steps give eager's outputs, gradients and statistics bit for bit."""
    torch.manual_seed(0)
    model, x = _Convolutions(LAYERS["conv2d"][0]).train(), torch.randn(2, 8, 10, 10)
    opt = _one_selective_region(model, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = _steps(model, x), _steps(opt, x)
    assert expected["output"].dtype == torch.bfloat16
    assert [k for k, v in expected.items() if not torch.equal(got[k], v)] == []


def test_eval_mode_matches_in_float64():
    """With its BatchNorms in eval mode the region still gives eager's outputs and gradients."""
    torch.manual_seed(0)
    model, x = _Convolutions(LAYERS["conv2d"][0]).double().eval(), torch.randn(2, 8, 10, 10, dtype=torch.float64)
    opt = _one_selective_region(model, x)  # eval-mode BatchNorms, gradients still wanted
    expected, got = _steps(model, x), _steps(opt, x)
    # an eval-mode BatchNorm never reads num_batches_tracked (eager leaves it alone), so the graph holds none
    assert all(k.endswith(".num_batches_tracked") for k in expected.keys() - got.keys())
    assert max((got[k] - v).abs().max().item() for k, v in expected.items() if k in got) == 0


class _EinsumHead(nn.Module):
    """A linear head written as an einsum, then a sigmoid: a product the region cannot keep itself (kept_output is
    None), which its recomputation runs (the sigmoid saves what it makes; an einsum saves only its operands, as its
    measurement shows, so alone at the end checkpoint's early stop would never reach it)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 8))

    def forward(self, x):
        return torch.einsum("bc,dc->bd", x, self.weight).sigmoid()


def test_other_kept_ops_use_the_selective_policy():
    """A region that also keeps a product it cannot keep itself (an einsum) runs under torch's selective checkpoint
    policy, and still matches eager."""
    torch.manual_seed(0)
    model = _Convolutions(LAYERS["conv2d"][0], tail=_EinsumHead()).double().train()
    x = torch.randn(2, 8, 10, 10, dtype=torch.float64)
    opt = _one_selective_region(model, x)
    assert _region(opt).policy is not None
    assert "selective checkpoint policy" in _region(opt).extra_repr()
    expected, got = _steps(model, x), _steps(opt, x)
    assert max((got[k] - v).abs().max().item() for k, v in expected.items()) < 1e-12


def test_double_backward_is_a_clear_error():
    """Gradients of gradients through kept convolutions, which the region has handed to its first recomputation, fail
    with a message saying why, as through torch's selective checkpoint."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64, requires_grad=True)
    opt = _one_selective_region(_Convolutions(LAYERS["conv2d"][0]).double().train(), x)
    (g,) = torch.autograd.grad(opt(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="backward through it only once"):
        torch.autograd.grad(g.pow(2).sum(), x)


def _convolution_output_model():
    """A graph whose last op, a convolution, is its output: a selective region over it keeps the first convolution's
    output. (model, its optimized form, an input)"""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Conv2d(8, 4, 1)).double().train(), torch.randn(
        2, 3, 8, 8, dtype=torch.float64)
    return model, _one_selective_region(model, x), x


class _ReturnedAndRead(nn.Module):
    """`op`'s output returned, and read by a tanh (which saves its own result) in the same region."""

    def __init__(self, op: nn.Module):
        super().__init__()
        self.op = op

    def forward(self, x):
        y = self.op(x)
        return y, y.tanh()


def _written_then_backward(model: nn.Module, x: torch.Tensor) -> None:
    """`model`'s returned output written in place, then a backward through both outputs."""
    out, read = model(x.clone().requires_grad_())
    out.mul_(2)
    (out.sum() + read.sum()).backward()


def test_output_written_in_place_is_a_clear_error():
    """Writing a kept convolution output in place before the backward fails with a message naming it, never a
    gradient computed from the changed values."""
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    opt = _one_selective_region(_ReturnedAndRead(nn.Conv2d(3, 4, 3)).double().train(), x)
    with pytest.raises(RuntimeError, match="written in place after the region's forward"):
        _written_then_backward(opt, x)


def test_second_backward_is_a_clear_error():
    """A second backward through the region (retain_graph) says why it fails, as torch's selective checkpoint does:
    the kept output went to the first backward's recomputation, so that memory is freed as early as the policy's."""
    _, opt, x = _convolution_output_model()
    loss = opt(x.clone().requires_grad_()).pow(2).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through a selective checkpointed region"):
        loss.backward()


def test_which_convolutions_are_kept():
    """Batched convolutions with numeric padding are kept by the region; padding "same" and an unbatched input are
    left to the selective policy."""
    def calls(fn, *inputs):
        opt = fxopt.optimize(fn, inputs, mode="training", passes=[])
        return [kept_convolution(n) for n in opt.graph_module.graph.nodes if n.op == "call_function"]

    w = torch.randn(4, 3, 3)
    (kept,) = calls(_Functional(lambda x: F.conv1d(x, w, stride=2, padding=1)), torch.randn(2, 3, 9))
    assert kept is not None
    assert (kept.arguments.stride, kept.arguments.padding, kept.arguments.dilation) == ([2], [1], [1])
    assert calls(_Functional(lambda x: F.conv1d(x, w, padding="same")), torch.randn(2, 3, 9)) == [None]
    assert calls(_Functional(lambda x: F.conv1d(x, w)), torch.randn(3, 9)) == [None]


class _Functional(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_region_price_per_op():
    """A selective region that keeps only convolutions and linears is priced per op as a whole region (no dispatch
    mode); one that keeps an einsum at the selective policy's price per op."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 10, 10)
    linear = fxopt.optimize(_Convolutions(LAYERS["conv2d"][0], tail=nn.Linear(8, 3)).train(), (x,), mode="training",
                            passes=[])
    head = fxopt.optimize(_Convolutions(LAYERS["conv2d"][0], tail=_EinsumHead()).train(), (x,), mode="training",
                          passes=[])
    overhead = RegionOverhead(per_region=0.0, per_op=1e-6, selective_per_region=0.0, selective_per_op=3e-5)
    for opt, expected in ((linear, 1e-6), (head, 3e-5)):
        profile = step_profile(opt.graph_module)
        profile.overhead = overhead
        assert profile.overhead_per_op(Region(0, len(profile.steps), save_compute_intensive=True)) == expected
        assert profile.overhead_per_op(Region(0, len(profile.steps))) == 1e-6


def test_extract_without_counted_uses_the_policy():
    """Called without the ops it keeps, a selective region falls back on torch's selective checkpoint policy."""
    opt = fxopt.optimize(_Convolutions(LAYERS["conv2d"][0]).train(), (torch.randn(2, 8, 6, 6),), mode="training",
                         passes=[])
    gm = opt.graph_module
    extract_region(gm, [n for n in gm.graph.nodes if n.op == "call_function"], "checkpointed_all", True)
    gm.recompile()
    assert _region(opt).policy is not None


class _Products(nn.Module):
    """Two matrix products of one kind (`product(self, x)` computes one) with a GELU after each and a residual."""

    def __init__(self, product, weights: dict):
        super().__init__()
        self.product = product
        self.weights = nn.ParameterDict({k: nn.Parameter(torch.randn(shape) / 3) for k, shape in weights.items()})

    def forward(self, x):
        h = F.gelu(self.product(self, x))
        return self.product(self, h).tanh() + h


def _attention(m, x):
    """Multi-head self-attention on permuted heads, as Hugging Face's eager attention computes it."""
    b, t, _ = x.shape
    q, k, v = (F.linear(x, m.weights[n]).view(b, t, 2, 4).transpose(1, 2) for n in "qkv")
    weights = torch.matmul(q, k.transpose(-1, -2)).softmax(-1)
    return torch.matmul(weights, v).transpose(1, 2).reshape(b, t, 8)


PRODUCTS = {  # (product, its weights' shapes, the input's shape, the input made from a contiguous tensor by)
    "linear_2d": (lambda m, x: F.linear(x, m.weights["w"], m.weights["b"]), {"w": (8, 8), "b": (8,)}, (6, 8), None),
    "linear_3d": (lambda m, x: F.linear(x, m.weights["w"], m.weights["b"]), {"w": (8, 8), "b": (8,)}, (2, 5, 8), None),
    "linear_4d_no_bias": (lambda m, x: F.linear(x, m.weights["w"]), {"w": (8, 8)}, (2, 3, 5, 8), None),
    "linear_transposed_input": (lambda m, x: F.linear(x.transpose(0, 1), m.weights["w"], m.weights["b"]).transpose(
        0, 1), {"w": (8, 8), "b": (8,)}, (2, 5, 8), None),
    "addmm": (lambda m, x: torch.addmm(m.weights["b"], x.reshape(-1, 8), m.weights["w"]).view(x.shape),
              {"w": (8, 8), "b": (8,)}, (2, 5, 8), None),  # Hugging Face GPT-2's Conv1D
    "addmm_transposed_weight": (lambda m, x: torch.addmm(m.weights["b"], x, m.weights["w"].t()),
                                {"w": (8, 8), "b": (8,)}, (6, 8), None),
    "mm": (lambda m, x: torch.mm(x, m.weights["w"]), {"w": (8, 8)}, (6, 8), None),
    "bmm": (lambda m, x: torch.bmm(x, m.weights["w"].expand(2, 8, 8)), {"w": (8, 8)}, (2, 5, 8), None),
    "matmul_broadcast": (lambda m, x: torch.matmul(x.unsqueeze(0), m.weights["w"].unsqueeze(0).unsqueeze(0))[0],
                         {"w": (8, 8)}, (2, 5, 8), None),
    "attention": (_attention, {n: (8, 8) for n in "qkv"}, (2, 5, 8), None),
}


@pytest.mark.parametrize("kind", list(PRODUCTS))
def test_products_step_is_bit_exact_in_float32(kind):
    """Two training steps through a region that keeps a product's outputs itself give eager's outputs and gradients
    bit for bit, for every product and operand layout it keeps."""
    product, weights, shape, _ = PRODUCTS[kind]
    torch.manual_seed(0)
    model, x = _Products(product, weights).train(), torch.randn(shape)
    opt = _one_selective_region(model, x)
    assert _region(opt).kind == "selective (matmul/conv outputs kept by the region)"  # no dispatch mode
    assert _region(opt).policy is None
    expected, got = _steps(model, x), _steps(opt, x)
    assert [k for k, v in expected.items() if not torch.equal(got[k], v)] == []


def test_region_keeping_costly_products_only_is_bit_exact():
    """A region over attention with four narrow heads that keeps its costly products only recomputes the score
    matmul (light: StepProfile.cheap_to_recompute) and keeps the rest, and two training steps give eager's outputs and gradients
    bit for bit."""
    torch.manual_seed(0)
    model, x = _Products(_narrow_heads_attention, {n: (16, 16) for n in "qkv"}).train(), torch.randn(2, 24, 16)
    opt = _one_selective_region(model, x, keep_costly_only=True)
    kept = [n.args[2] for n in _region(opt).body.graph.nodes if n.target is product_once]
    assert kept == ["linear", "linear_1", "linear_2", "matmul_1", "linear_3", "linear_4", "linear_5", "matmul_3"]
    expected, got = _steps(model, x), _steps(opt, x)
    assert [k for k, v in expected.items() if not torch.equal(got[k], v)] == []


def _narrow_heads_attention(m, x):
    """Self-attention over four heads a quarter of the width wide: the score matmul is light."""
    b, t, width = x.shape
    q, k, v = (F.linear(x, m.weights[n]).view(b, t, 4, width // 4).transpose(1, 2) for n in "qkv")
    return torch.matmul(torch.matmul(q, k.transpose(-1, -2)).softmax(-1), v).transpose(1, 2).reshape(b, t, width)


def test_products_under_autocast_match_eager():
    """Under bfloat16 autocast the region's products run as the model's did (recomputed with the rest), so two steps
    give eager's outputs and gradients bit for bit."""
    product, weights, shape, _ = PRODUCTS["attention"]
    torch.manual_seed(0)
    model, x = _Products(product, weights).train(), torch.randn(shape)
    opt = _one_selective_region(model, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = _steps(model, x), _steps(opt, x)
    assert expected["output"].dtype == torch.bfloat16
    assert [k for k, v in expected.items() if not torch.equal(got[k], v)] == []


def test_kept_product_written_in_place_is_a_clear_error():
    """Writing a kept product's output in place before the backward fails with a message naming it."""
    x = torch.randn(2, 4, dtype=torch.float64)
    opt = _one_selective_region(_ReturnedAndRead(nn.Linear(4, 8)).double().train(), x)
    with pytest.raises(RuntimeError, match="written in place after the region's forward"):
        _written_then_backward(opt, x)


def test_last_product_is_not_kept_and_may_be_written():
    """A region's last product, which checkpoint's early stop never recomputes, is not kept (the region holds no
    memory for it): its output written in place after the forward gives eager's gradients in float64."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double().train(), torch.randn(
        2, 4, dtype=torch.float64)
    opt = _one_selective_region(model, x)
    assert [n.args[2] for n in _region(opt).body.graph.nodes if n.target is product_once] == ["linear"]

    def grads(m):
        m.zero_grad(set_to_none=True)
        out = m(x)
        out.mul_(2)
        (out * out).sum().backward()
        return [p.grad for p in m.parameters()]

    assert [torch.equal(a, b) for a, b in zip(grads(opt), grads(model))] == [True] * 4


@pytest.mark.parametrize("name", ["BERT", "GPT-2", "ViT"])
def test_transformer_in_one_region_is_bit_exact(name):
    """A Hugging Face transformer (tiny config, float32, no dropout) as one selective region keeps every matmul
    itself, and two training steps give eager's outputs, gradients and buffers bit for bit."""
    from corpus_models import LastHiddenState, build  # noqa: PLC0415 - the corpus's builders, as its tests use them

    model, (x,) = build(name, training=True, dtype=torch.float32)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    model = LastHiddenState(model)
    opt = _one_selective_region(model, x)
    assert _region(opt).policy is None
    expected, got = _token_steps(model, x), _token_steps(opt, x)
    # the pooler's: no gradient (the captured graph, which never reads it, holds no pooler)
    assert [k for k, v in expected.items() if (v is None) != (got.get(k) is None)] == []
    assert [k for k, v in expected.items() if v is not None and not torch.equal(got[k], v)] == []


def _token_steps(model: nn.Module, x: torch.Tensor) -> dict:
    """_steps for an input that may be token ids (no gradient of its own)."""
    if x.is_floating_point():
        return _steps(model, x)
    model = copy.deepcopy(model)
    for _ in range(2):
        out = model(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return {"output": out.detach(), **{f"grad:{k}": p.grad for k, p in model.named_parameters()}}


def test_which_products_are_kept():
    """Plain products are kept by the region; an addmm that scales, a matmul of a batch by one matrix (ATen folds it
    into an mm) and one of vectors are left to the selective policy."""
    def kinds(fn, *inputs):
        opt = fxopt.optimize(_Functional(fn), inputs, mode="training", passes=[])
        return [getattr(kept_product(n), "kind", None) for n in opt.graph_module.graph.nodes if n.op == "call_function"]

    m, b = torch.randn(4, 4), torch.randn(4)
    assert kinds(lambda x: torch.addmm(b, x, m), torch.randn(3, 4)) == ["addmm"]
    assert kinds(lambda x: torch.addmm(b, x, m, beta=0.5), torch.randn(3, 4)) == [None]
    assert kinds(lambda x: F.linear(x, m), torch.randn(2, 3, 4)) == ["linear"]
    assert kinds(lambda x: x @ m.expand(2, 4, 4), torch.randn(2, 3, 4)) == [None, "matmul"]
    assert kinds(lambda x: x @ m, torch.randn(2, 3, 4)) == [None]
    assert kinds(lambda x: x @ m[0], torch.randn(3, 4)) == [None, None]


def test_torch_function_graph_keeps_its_products_and_convolutions():
    """In a graph of torch functions (the form TorchDynamo hands over: `F.conv2d`, `F.linear`), a selective region
    keeps its convolution's and linear's outputs itself, its code compiles (each function is held by name), and a
    training step matches eager in float64."""
    torch.manual_seed(0)
    model = _Convolutions(LAYERS["conv2d"][0], norm=lambda c: nn.Identity(), tail=nn.Linear(8, 3)).double().train()
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64)
    gm = function_form(model, (x,))
    profile = step_profile(gm)
    extract_regions(gm, profile, [Region(0, len(profile.steps), save_compute_intensive=True)])
    (region,) = [m for m in gm.modules() if isinstance(m, CheckpointedRegion)]
    assert region.kind == "selective (matmul/conv outputs kept by the region)"
    assert_same_step(model, gm, (x,), training=True, rtol=0, atol=1e-12)
