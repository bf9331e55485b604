"""Dynamo graphs the inference passes would leave as they are, told from Dynamo's graph without an ATen trace.

Tracing a Dynamo graph to ATen ops costs a second pass of torch's fake-tensor machinery over the model
(HF BERT, 4 layers: about 0.45 s, a third of Dynamo's own trace), paid again at every recompile, inside the
user's call. Where no inference pass has anything to rewrite, that trace buys nothing: the graph runs as
Dynamo captured it, calling the model's own torch functions, as `torch.compile(backend="eager")` runs it.

Under the default pipeline only (a caller naming passes wants them run and reported; the backend also traces
wherever instruments observe the passes), a graph is left as captured when every call in it is one fxopt knows no
default inference pass rewrites (`UNTOUCHED_FUNCTIONS`, `UNTOUCHED_METHODS`, Python's operators and symbolic-size
arithmetic), with two calls allowed on conditions:
- a dropout whose `training` flag is the constant False: it returns its input before any work (the ATen
  graph would lose it to drop_eval_dropout, for the same run time);
- `scaled_dot_product_attention` without a mask, or with one read from a graph input that is not a parameter
  (an `attention_mask`, a symbolic length): capture's `drop_constant_masks` only rewrites masks computed
  from constants alone;
and nothing computed from parameters without a graph input but views of them, lookups of a few rows (a
position embedding at a static length) and `.to()` calls that change nothing: not what freezing would fold for
gain (a weight normalized, cast or multiplied at every call), nor a mask built from constants alone.
Anything else (a convolution, a ReLU, a pad, a BatchNorm, a custom autograd Function, a grad-mode switch, a
function not listed) sends the graph through the ATen trace and the passes, as before: the list errs toward
tracing. tests/test_untouched_graphs.py checks, on real models, that the graphs it leaves as captured are
ones the traced passes change in no way that costs run time.
"""
from __future__ import annotations

import inspect
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F


UNTOUCHED_FUNCTIONS = frozenset({
    F.linear, torch._C._nn.linear, torch.matmul, torch.bmm, torch.baddbmm, torch.addmm, torch.mm, torch.einsum,
    F.gelu, torch._C._nn.gelu, torch.tanh, torch.sigmoid, torch.exp, torch.log, torch.rsqrt, torch.sqrt,
    torch.pow, torch.abs, torch.neg, torch.add, torch.sub, torch.mul, torch.div, torch.clamp, torch.erf,
    F.softmax, torch.softmax, F.log_softmax, torch.log_softmax, F.layer_norm, F.embedding, F.cross_entropy,
    torch.arange, torch.cat, torch.stack, torch.where, torch.min, torch.max, torch.gather, torch.cumsum,
    torch.zeros, torch.ones, torch.full, torch.zeros_like, torch.ones_like, torch.full_like, torch.tensor,
    torch.Size, torch.finfo, torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.unsqueeze,
    torch.squeeze, torch.chunk, torch.split, torch.narrow, torch.tril, torch.triu,
})
UNTOUCHED_METHODS = frozenset({
    "view", "reshape", "transpose", "permute", "contiguous", "expand", "expand_as", "flatten", "unsqueeze",
    "squeeze", "split", "chunk", "narrow", "size", "dim", "to", "float", "half", "bfloat16", "double", "long",
    "bool", "int", "type_as", "item", "mean", "sum", "pow", "new_ones", "new_zeros", "new_empty", "new_full",
    "masked_fill", "add", "sub", "mul", "div", "neg", "sqrt", "rsqrt", "exp", "tanh", "softmax", "matmul",
    "clone", "detach", "tril", "triu", "eq", "ne", "lt", "le", "gt", "ge", "all", "any", "cumsum", "max", "min",
})
_VIEW_METHODS = frozenset({"view", "expand", "expand_as", "transpose", "permute", "unsqueeze", "squeeze", "narrow"})
_DROPOUTS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout})
_ATTENTION = frozenset({F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention})


def left_as_captured(gm: fx.GraphModule, parameters: frozenset[str]) -> bool:
    """Whether Dynamo's graph `gm` holds nothing the default inference passes or capture would rewrite (module
    docstring), so that it may run as captured. `parameters`: its placeholders holding parameters or buffers."""
    # node -> whether it is computed from a graph input that is not a parameter; from a parameter
    reads_input, reads_parameter = {}, {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            reads_input[node], reads_parameter[node] = node.name not in parameters, node.name in parameters
            continue
        if node.op == "output":
            continue
        reads_input[node] = any(reads_input[i] for i in node.all_input_nodes)
        reads_parameter[node] = any(reads_parameter[i] for i in node.all_input_nodes)
        if reads_parameter[node] and not reads_input[node] and not _cheap_on_parameters(node):
            return False
        if not _untouched(node, reads_input):
            return False
    return True


def _cheap_on_parameters(node: fx.Node) -> bool:
    """A view of a parameter, a lookup of a few of its rows (an embedding, a gather), or a `.to()` that returns it
    as it is: nothing freezing would gain by computing once."""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS or (node.target == "to" and _returns_its_input(node))
    if node.target in (F.embedding, torch.gather):
        return True
    return node.target is operator.getitem and all(isinstance(i, (slice, int, type(None)))
                                                   for i in _as_tuple(node.args[1]))


def _returns_its_input(node: fx.Node) -> bool:
    """Whether a `.to()` keeps its tensor's dtype and device, by Dynamo's example values (so it copies nothing)."""
    source, result = node.args[0], node.meta.get("example_value")
    before = source.meta.get("example_value") if isinstance(source, fx.Node) else None
    return (isinstance(before, torch.Tensor) and isinstance(result, torch.Tensor)
            and (before.dtype, before.device) == (result.dtype, result.device))


def _as_tuple(index) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _untouched(node: fx.Node, reads_input: dict) -> bool:
    if node.op == "call_method":
        return node.target in UNTOUCHED_METHODS
    if node.op != "call_function":
        return False
    target = node.target
    if target in UNTOUCHED_FUNCTIONS or getattr(target, "__module__", None) in ("_operator", "math"):
        return True
    if target in _DROPOUTS:
        return _argument(node, "training") is False
    if target in _ATTENTION:
        mask = _argument(node, "attn_mask")
        return mask is None or (isinstance(mask, fx.Node) and reads_input[mask])
    return _is_size_arithmetic(target)


def _is_size_arithmetic(target) -> bool:
    """torch's functions on symbolic sizes (`torch.sym_max`, `torch._sym_sqrt`): Python numbers, no tensor op."""
    return (getattr(target, "__name__", "").startswith(("sym_", "_sym_"))
            and (getattr(target, "__module__", None) or "").startswith("torch"))


def _argument(node: fx.Node, name: str):
    """The value of argument `name` in a call of a Python function; for a builtin, by its documented position."""
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        positions = {"attn_mask": 3, "training": 2}
        if name in node.kwargs:
            return node.kwargs[name]
        return node.args[positions[name]] if len(node.args) > positions[name] else None
    bound.apply_defaults()
    return bound.arguments.get(name)
