"""saved_for_backward: the table says what autograd really keeps, checked with saved_tensors_hooks.

Each case is captured in both forms fxopt's passes see: torch functions and methods (the form
TorchDynamo hands the torch.compile backend; traced here with torch.fx through every module) and
ATen (torch.export's training IR, what `fxopt.optimize` captures). It is run with every input and
parameter requiring grad, and the storages packed by autograd while each node runs are compared
with the storages of the nodes the table names (the node itself when it `saves_output`, and its
`saved_inputs`). Parameters and buffers are left out of the comparison.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxopt.analysis.saved_tensors import saved_bytes, saved_for_backward
from fxopt.op_names import op_name
from fxopt.passes._relu_mask import relu_mask, relu_mask_
from graph_forms import function_form

fx.wrap("relu_mask")
fx.wrap("relu_mask_")


def opaque(x, y):
    """A function fxopt knows nothing about (kept as one call by the tracer)."""
    return x * y


fx.wrap("opaque")


class Case(nn.Module):
    """`fn(modules, x, y)` on non-leaf copies of the inputs (so in-place ops are allowed)."""

    def __init__(self, fn, *modules: nn.Module):
        super().__init__()
        self.fn = fn
        self.mods = nn.ModuleList(modules)

    def forward(self, x, y):
        return self.fn(self.mods, x * 1.0, y * 1.0)


def unary(fn, *modules: nn.Module) -> Case:
    return Case(lambda m, x, y: fn(m, x), *modules)


def _square(shape=(4, 6)):
    return (torch.randn(*shape),)


IMAGE = (torch.randn(2, 3, 6, 6),)
CASES = {
    # activations and pointwise ops, every form
    "relu": (unary(lambda m, x: torch.relu(x)), _square() + _square()),
    "F.relu": (unary(lambda m, x: F.relu(x)), _square() + _square()),
    "x.relu()": (unary(lambda m, x: x.relu()), _square() + _square()),
    "nn.ReLU": (unary(lambda m, x: m[0](x), nn.ReLU()), _square() + _square()),
    "relu_": (unary(lambda m, x: torch.relu_(x)), _square() + _square()),
    "nn.ReLU(inplace)": (unary(lambda m, x: m[0](x), nn.ReLU(inplace=True)), _square() + _square()),
    "relu6": (unary(lambda m, x: F.relu6(x)), _square() + _square()),
    "relu6_": (unary(lambda m, x: F.relu6(x, inplace=True)), _square() + _square()),
    "hardtanh": (unary(lambda m, x: m[0](x), nn.Hardtanh(-0.5, 0.5)), _square() + _square()),
    "leaky_relu": (unary(lambda m, x: F.leaky_relu(x, 0.2)), _square() + _square()),
    "leaky_relu_": (unary(lambda m, x: F.leaky_relu(x, 0.2, True)), _square() + _square()),
    "elu": (unary(lambda m, x: F.elu(x)), _square() + _square()),
    "elu_": (unary(lambda m, x: F.elu(x, inplace=True)), _square() + _square()),
    "hardswish": (unary(lambda m, x: F.hardswish(x)), _square() + _square()),
    "hardswish_": (unary(lambda m, x: F.hardswish(x, inplace=True)), _square() + _square()),
    "silu": (unary(lambda m, x: m[0](x), nn.SiLU()), _square() + _square()),
    "silu_": (unary(lambda m, x: F.silu(x, inplace=True)), _square() + _square()),
    "gelu": (unary(lambda m, x: F.gelu(x)), _square() + _square()),
    "sigmoid": (unary(lambda m, x: torch.sigmoid(x)), _square() + _square()),
    "tanh": (unary(lambda m, x: x.tanh()), _square() + _square()),
    "exp": (unary(lambda m, x: torch.exp(x)), _square() + _square()),
    "softmax": (unary(lambda m, x: F.softmax(x, -1)), _square() + _square()),
    "log_softmax": (unary(lambda m, x: x.log_softmax(-1)), _square() + _square()),
    "abs": (unary(lambda m, x: x.abs()), _square() + _square()),
    "relu_mask": (unary(lambda m, x: relu_mask(x)), _square() + _square()),
    "relu_mask_": (unary(lambda m, x: relu_mask_(x)), _square() + _square()),
    # binary ops and layers
    "add": (Case(lambda m, x, y: x + y), _square() + _square()),
    "sub": (Case(lambda m, x, y: torch.sub(x, y)), _square() + _square()),
    "mul": (Case(lambda m, x, y: x * y), _square() + _square()),
    "div": (Case(lambda m, x, y: x / y), _square() + _square()),
    "mul/div by a scalar": (unary(lambda m, x: (x * 2) / 3), _square() + _square()),
    "square by mul": (unary(lambda m, x: x * x), _square() + _square()),
    "matmul": (Case(lambda m, x, y: x @ y.t()), _square() + _square()),
    "addmm (an activation added)": (Case(lambda m, x, y: torch.addmm(x * 2, y, (y * 3).t())),
                                    _square((4, 4)) + _square()),
    "baddbmm (an activation added)": (Case(lambda m, x, y: torch.baddbmm(x * 2, y, (y * 3).transpose(1, 2), alpha=0.5)),
                                      (torch.randn(2, 4, 4), torch.randn(2, 4, 6))),
    "linear": (unary(lambda m, x: m[0](x), nn.Linear(6, 5)), _square() + _square()),
    "F.linear": (Case(lambda m, x, w: F.linear(x, w)), _square() + _square((5, 6))),
    "conv2d": (unary(lambda m, x: m[0](x), nn.Conv2d(3, 4, 3)), IMAGE + _square()),
    # nn.BatchNorm2d's forward branches on the input's rank, which torch.fx cannot trace: its call
    "batch_norm": (unary(lambda m, x: F.batch_norm(x, m[0].running_mean, m[0].running_var, m[0].weight, m[0].bias,
                                                   True), nn.BatchNorm2d(3)), IMAGE + _square()),
    "batch_norm (eval)": (unary(lambda m, x: F.batch_norm(x, m[0].running_mean, m[0].running_var, m[0].weight,
                                                          m[0].bias, False), nn.BatchNorm2d(3)), IMAGE + _square()),
    "batch_norm (float64)": (unary(lambda m, x: F.batch_norm(x, m[0].running_mean, m[0].running_var, m[0].weight,
                                                             m[0].bias, True), nn.BatchNorm2d(3).double()),
                             (IMAGE[0].double(),) + _square()),
    "layer_norm": (unary(lambda m, x: m[0](x), nn.LayerNorm(6)), _square() + _square()),
    "max_pool2d": (unary(lambda m, x: F.max_pool2d(x, 2)), IMAGE + _square()),
    "avg_pool2d": (unary(lambda m, x: m[0](x), nn.AvgPool2d(2)), IMAGE + _square()),
    "adaptive_avg_pool2d": (unary(lambda m, x: m[0](x), nn.AdaptiveAvgPool2d(1)), IMAGE + _square()),
    "dropout (train)": (unary(lambda m, x: m[0](x), nn.Dropout(0.5)), _square() + _square()),
    "dropout (train, p=0)": (unary(lambda m, x: F.dropout(x, 0.0, True)), _square() + _square()),
    "pow (scalar exponent)": (unary(lambda m, x: x ** 3), _square() + _square()),
    "pow (tensor exponent)": (Case(lambda m, x, y: torch.pow(x, y)), _square() + _square()),
    "scaled_dot_product_attention": (Case(lambda m, q, k: F.scaled_dot_product_attention(q, k, k)),
                                     (torch.randn(2, 4, 6),) * 2),
    "pad": (unary(lambda m, x: F.pad(x, (1, 1, 1, 1), mode="reflect")), IMAGE + _square()),
    # in-place updates and copies (buffer updates, export's writebacks)
    "add_": (Case(lambda m, x, y: x.add_(y)), _square() + _square()),
    "sub_": (Case(lambda m, x, y: x.sub_(y)), _square() + _square()),
    "copy_": (Case(lambda m, x, y: x.copy_(y)), _square() + _square()),
    # copies, reductions and views
    "cat": (Case(lambda m, x, y: torch.cat([x, y])), _square() + _square()),
    "sum/mean": (unary(lambda m, x: x.sum(0) + x.mean(0)), _square() + _square()),
    "views": (unary(lambda m, x: x.view(6, 4).t().flatten().reshape(4, 6)[1:].transpose(0, 1)), _square() + _square()),
    "clone/contiguous": (unary(lambda m, x: x.t().contiguous().clone()), _square() + _square()),
}
# Ops whose kernel, and so what autograd keeps, depends on shapes and backend (attention: the math
# path keeps internals, flash kernels keep query, key, value and output): the table names a superset.
_KERNEL_DEPENDENT = {"scaled_dot_product_attention"}


class _Recorder(fx.Interpreter):
    """Runs the graph, remembering each node's value and the tensors packed while it ran."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict[fx.Node, object] = {}
        self.packed: dict[fx.Node, list[torch.Tensor]] = {}

    def run_node(self, n):
        packed = self.packed.setdefault(n, [])
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            out = super().run_node(n)
        self.values[n] = out
        return out


def _storage(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


def _assert_table_matches_autograd(gm: fx.GraphModule, inputs: tuple, check_bytes: bool) -> None:
    """Every node past the inputs' copies: the storages autograd packs are those the table names
    (parameters and buffers, the `get_attr` nodes, left out); with `check_bytes`, so is saved_bytes."""
    recorder = _Recorder(gm)
    recorder.run(*[x.clone().requires_grad_() for x in inputs])
    prelude = {n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    constants = {_storage(recorder.values[n]) for n in prelude if n.op == "get_attr"}  # parameters, buffers
    prelude |= {u for p in prelude if p.op == "placeholder" for u in p.users}  # the `x * 1.0` copies
    checked = 0
    for node in gm.graph.nodes:
        if node in prelude or node.op == "output":
            continue
        saved = saved_for_backward(node)
        assert saved.known, f"{node.name} ({op_name(node)}) is not in the table"
        expected = {_storage(recorder.values[n]) for n in saved.saved_inputs}
        if saved.saves_output:
            expected.add(_storage(recorder.values[node]))
        packed = recorder.packed[node]
        node_storages = {_storage(v) for v in recorder.values.values()}
        actual = {_storage(t) for t in packed} & node_storages - constants
        checked += 1
        if op_name(node) in _KERNEL_DEPENDENT:
            assert actual <= expected - constants, f"{node.name}: autograd keeps {actual}, table says {expected}"
            continue
        assert actual == expected - constants, f"{node.name}: autograd keeps {actual}, table says {expected}"
        if check_bytes:
            sizes = {_storage(t): t.untyped_storage().nbytes() for t in packed}  # each storage once
            extra = sum(n for key, n in sizes.items() if key not in node_storages | constants)
            mine = sum(n for key, n in sizes.items() if key in actual)
            assert saved_bytes(node) == mine + extra, f"{node.name}: saved_bytes is off"
    assert checked


@pytest.mark.parametrize("name", list(CASES))
def test_table_matches_autograd(name):
    """For every op of the torch-function graph of each case, the storages autograd packs (and their bytes) are those the table names."""
    module, inputs = CASES[name]
    module.train(True)
    gm = function_form(module, inputs)
    _assert_table_matches_autograd(gm, inputs, check_bytes=True)


def test_unknown_op_is_assumed_to_keep_everything():
    """An op outside the table is `known=False`, keeping its output and every tensor input."""
    gm = function_form(Case(lambda m, x, y: opaque(x, y)))
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is opaque)
    saved = saved_for_backward(node)
    assert (saved.known, saved.saves_output, len(saved.saved_inputs)) == (False, True, 2)


def test_eval_dropout_keeps_nothing():
    """A dropout with training=False keeps no mask, so saved_bytes is 0."""
    module = unary(lambda m, x: m[0](x), nn.Dropout(0.5)).eval()
    gm = function_form(module, _square() + _square())
    node = next(n for n in gm.graph.nodes if op_name(n) == "dropout")
    assert saved_bytes(node) == 0


def test_module_call_is_unknown():
    """A call_module (an opaque module, or a region fxopt made) could compute anything: it has no op name."""
    graph = fx.Graph()
    node = graph.call_module("act", (graph.placeholder("x"),))
    graph.output(node)
    assert op_name(node) is None and not saved_for_backward(node).known


# ---- the ATen form (torch.export's training IR, what fxopt.optimize captures) ----

_NOT_EXPORTED = {"relu_mask", "relu_mask_"}  # fxopt's own autograd Functions: placed by passes, never captured


@pytest.mark.parametrize("name", [n for n in CASES if n not in _NOT_EXPORTED])
def test_table_matches_autograd_on_exported_graphs(name):
    """For every op of the exported (ATen) graph of each case, the storages autograd packs are those the table names."""
    module, inputs = CASES[name]
    module.train(True)
    _assert_table_matches_autograd(torch.export.export(module, inputs, strict=False).module(), inputs,
                                   check_bytes=False)


@pytest.mark.parametrize("op, expected", [
    (lambda x: torch.relu(x), "relu"), (lambda x: torch.relu_(x), "relu_"), (lambda x: x.add_(1), "add_"),
    (lambda x: F.leaky_relu(x, 0.2, inplace=True), "leaky_relu_"), (lambda x: x.view(-1), "view"),
])
def test_op_name_of_aten_overloads(op, expected):
    """An ATen overload is named by its op, without namespace or overload: `aten.relu_.default` is "relu_"."""
    gm = torch.export.export(Case(lambda m, x, y: op(x)), _square() + _square(), strict=False).module()
    names = [op_name(n) for n in gm.graph.nodes if n.op == "call_function"]
    assert names[-1] == expected


def test_aten_view_not_in_the_table_keeps_nothing():
    """An ATen op whose schema says it returns a view (`aten.alias`) keeps nothing, though the table omits it."""
    gm = torch.export.export(Case(lambda m, x, y: torch.ops.aten.alias(x)), _square() + _square(),
                             strict=False).module()
    node = next(n for n in gm.graph.nodes if op_name(n) == "alias")
    saved = saved_for_backward(node)
    assert (saved.known, saved.saves_output, saved.saved_inputs) == (True, False, ())
