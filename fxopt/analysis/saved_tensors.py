"""What autograd keeps for each node's backward, from one table kept in this file.

`saved_for_backward(node)` answers, for one graph node, whether its backward keeps the node's
own output and which input nodes it keeps; `saved_bytes(node)` turns that into bytes from
`node.meta["val"]`. Passes ask these questions instead of re-deriving them: `inplace_relu` (may an
activation overwrite its input? may relu save a mask instead of its output?), and the memory passes
(what does a region keep alive?).

The table is keyed by op name, the same for every form a graph holds an op in (`fxopt.op_names.op_name`):
`aten.relu.default` (torch.export), `F.relu` / `torch.relu` calls and `x.relu()` methods
(TorchDynamo) are all "relu"; a module call has no name, so it is not in the table. fxopt's own
graph helpers declare what they keep (`fxopt.graph_functions`: `saves`, or a `name` this table knows). An ATen op whose schema says it returns a view of an argument
(`aten.slice`, `aten.alias`, ...) keeps nothing, like the views listed here.
Entries are what autograd saves when every tensor input requires grad (checked against
`torch.autograd.graph.saved_tensors_hooks` by tests/test_saved_tensors.py); with some inputs
frozen autograd may save less, so the table is a safe over-approximation. Where no table can say, what the op keeps
is what running it once shows (`measurement`, fxopt.analysis.opaque_memory): an op declared opaque (a user's
autograd Function), an op whose kernel torch picks at run time (`RUNTIME_KERNEL_OPS`: attention), and an ATen op
the table does not know. An op neither in the table nor measured is `known=False` and assumed to save its output
and every tensor input (attention: the flash kernel's inputs and output).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection

import torch
import torch.fx as fx

from .. import _torch_private
from ..graph_functions import declared
from ..op_names import op_name
from .ops import match_batch_norm
from .call_peaks import ATTENTION_FORWARD_OPS
from .opaque_memory import OpaqueMemory, measured, measured_call
from .replayed_calls import call_input_nodes
from .shapes import tensor_meta

# Which tensor inputs a backward keeps: none, the first, all, (products) each operand for the
# other's gradient, so all of them when there are two or more and none beside a Python scalar, or
# (`addmm(input, mat1, mat2)`, `baddbmm(input, batch1, batch2)`) the two multiplied, not the added term.
NONE, FIRST, ALL, OPERANDS, FACTORS = "none", "first", "all", "operands", "factors"


@dataclasses.dataclass(frozen=True)
class _Rule:
    output: bool | Callable[[fx.Node], bool] = False  # keeps its own output (or: whether, per node)
    inputs: str = NONE  # NONE, FIRST, ALL or OPERANDS (see above)
    extra: Callable[[fx.Node], int] | None = None  # bytes of internal tensors it also keeps (masks, indices)


def _same_size_as_output(node: fx.Node) -> int:
    out = tensor_meta(node)
    return out.numel() * out.element_size() if out is not None else 0


def _int64_like_output(node: fx.Node) -> int:
    out = tensor_meta(node)
    return out.numel() * 8 if out is not None else 0


def bool_mask_bytes(node: fx.Node) -> int:
    """Bytes of a bool tensor shaped like `node`'s output (a mask of where it was positive)."""
    out = tensor_meta(node)
    return out.numel() if out is not None else 0


def _dropout_mask(node: fx.Node) -> int:
    """Train-mode dropout keeps its scaled noise (input-sized); one that returns its input keeps nothing."""
    return 0 if dropout_returns_input(node) else _same_size_as_output(node)


def _layer_norm_statistics(node: fx.Node) -> int:
    """Layer norm also keeps each row's mean and reciprocal standard deviation (float32, or float64 for a
    float64 input): one of each per normalized row."""
    out = tensor_meta(node)
    shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape", ())
    row = 1
    for d in shape if isinstance(shape, (list, tuple)) else (shape,):
        row *= d if isinstance(d, int) else 0
    if out is None or not row:
        return 0
    return 2 * (out.numel() // row) * max(4, out.element_size())


def _batch_norm_statistics(node: fx.Node) -> int:
    """Train-mode batch norm also keeps the batch's mean and inverse standard deviation (ATen's save_mean and
    save_invstd): one of each per channel, in its parameters' dtype (float32 for a bfloat16 input with float32
    parameters); in eval mode they are empty. A form match_batch_norm does not know counts as train mode."""
    out, bn = tensor_meta(node), match_batch_norm(node)
    if out is None or out.dim() < 2 or not isinstance(out.shape[1], int) or (bn is not None and bn.training is False):
        return 0
    params = [tensor_meta(a) for a in (bn.weight, bn.running_mean) if isinstance(a, fx.Node)] if bn is not None else []
    return 2 * out.shape[1] * max([out.element_size()] + [p.element_size() for p in params if p is not None])


def _exponent_is_tensor(node: fx.Node) -> bool:
    """pow keeps its result only for a tensor exponent (x ** 3 keeps x alone)."""
    exponent = node.args[1] if len(node.args) > 1 else node.kwargs.get("exponent")
    return isinstance(exponent, fx.Node)


_KEEPS_NOTHING = _Rule()
_KEEPS_OUTPUT = _Rule(output=True)
_KEEPS_INPUT = _Rule(inputs=FIRST)
_KEEPS_ALL_INPUTS = _Rule(inputs=ALL)
_KEEPS_INPUT_COPY = _Rule(extra=_same_size_as_output)  # in-place op whose backward needs the old input

_TABLE: dict[str, _Rule] = {
    # backward is computed from the output alone
    **dict.fromkeys(["relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "exp", "exp_", "softmax",
                     "log_softmax", "sqrt", "rsqrt"], _KEEPS_OUTPUT),
    # in-place activations whose backward reads the result (leaky_relu_ / elu_ need slope, alpha >= 0)
    **dict.fromkeys(["leaky_relu_", "elu_"], _KEEPS_OUTPUT),
    # in-place activations whose backward needs the old input: autograd saves a copy of it
    **dict.fromkeys(["hardtanh_", "relu6_", "hardswish_", "silu_"], _KEEPS_INPUT_COPY),
    # backward is computed from the input
    **dict.fromkeys(["hardtanh", "relu6", "leaky_relu", "elu", "hardswish", "silu", "gelu", "mish", "softplus",
                     "hardsigmoid", "abs", "log", "square", "avg_pool1d", "avg_pool2d", "avg_pool3d"],
                    _KEEPS_INPUT),
    # reflect / replicate padding keeps its input (constant padding keeps nothing: _constant_pad)
    "pad": _KEEPS_INPUT,
    "constant_pad_nd": _KEEPS_NOTHING,
    # a power keeps its tensor operands, and its result when the exponent is a tensor
    "pow": _Rule(output=_exponent_is_tensor, inputs=ALL),
    # max pooling keeps its input and the int64 argmax indices
    **dict.fromkeys(["max_pool1d", "max_pool2d", "max_pool3d"], _Rule(inputs=FIRST, extra=_int64_like_output)),
    # products and layers keep their operands (weights, running statistics: parameters and buffers)
    **dict.fromkeys(["mul", "div", "truediv"], _Rule(inputs=OPERANDS)),
    **dict.fromkeys(["addmm", "baddbmm"], _Rule(inputs=FACTORS)),
    **dict.fromkeys(["matmul", "mm", "bmm", "linear", "conv1d", "conv2d", "convolution",
                     "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                     "group_norm", "instance_norm", "embedding", "gather", "index"], _KEEPS_ALL_INPUTS),
    # batch norm keeps its operands and, in train mode, each channel's statistics
    "batch_norm": _Rule(inputs=ALL, extra=_batch_norm_statistics),
    # layer norm keeps its operands and each row's statistics
    "layer_norm": _Rule(inputs=ALL, extra=_layer_norm_statistics),
    # attention (where not measured: RUNTIME_KERNEL_OPS) keeps query, key, value and its output (plus the
    # log-sum-exp of each row), as the flash kernel does
    "scaled_dot_product_attention": _Rule(output=True, inputs=ALL),
    # train-mode dropout keeps its noise tensor, not its input
    "dropout": _Rule(extra=_dropout_mask),
    # linear in their inputs, reductions that need only shapes, copies and views: nothing kept
    **dict.fromkeys(["add", "sub", "neg", "iadd", "isub", "cat", "stack", "sum", "mean", "clone", "contiguous",
                     "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "to", "float", "type_as",
                     "identity", "view", "reshape", "flatten", "unflatten", "transpose", "permute", "t", "getitem",
                     "squeeze", "unsqueeze", "expand", "expand_as", "view_as", "reshape_as", "narrow", "select",
                     "chunk", "split", "unbind", "detach", "movedim", "swapaxes", "getattr", "size", "dim", "numel",
                     "cumsum", "diff", "_to_copy", "lift_fresh_copy", "_assert_tensor_metadata"],
                    _KEEPS_NOTHING),
    # in-place additions and copies (buffer updates, export's writebacks): their backward needs no values
    **dict.fromkeys(["add_", "sub_", "copy_", "zero_", "fill_"], _KEEPS_NOTHING),
    # comparisons and factories: results nobody differentiates
    **dict.fromkeys(["eq", "ne", "lt", "le", "gt", "ge", "__and__", "__or__", "logical_not", "arange", "zeros",
                     "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros",
                     "new_ones", "new_full", "new_empty", "scalar_tensor"], _KEEPS_NOTHING),
}

# Ops whose kernel torch picks at run time, from the device, dtype, dropout, the mask's kind and shape, causality and
# which inputs need a gradient (SDPA and the ATen ops it dispatches to): what they keep and allocate is measured.
RUNTIME_KERNEL_OPS = ATTENTION_FORWARD_OPS


def _unknown_aten_op(node: fx.Node) -> bool:
    """An ATen op the table does not know that writes into none of its arguments: safe to run on tensors of ones."""
    return (node.op == "call_function" and isinstance(node.target, _torch_private.op_overload_types())
            and not _torch_private.op_is_mutable(node.target) and _rule(node) is None)


def measured_by_running(node: fx.Node) -> bool:
    """Whether what `node` keeps comes from running it once (module docstring), not from the table."""
    helper = declared(node.target) if node.op == "call_function" else None
    if helper is not None:
        return helper.opaque
    return op_name(node) in RUNTIME_KERNEL_OPS or _unknown_aten_op(node)


def measurement(node: fx.Node, requires_grad: Collection[fx.Node] | None = None) -> OpaqueMemory | None:
    """What running `node` once shows it keeps and its backward allocates (fxopt.analysis.opaque_memory), for the
    calls no table can describe (`measured_by_running`); None for others or where it could not run.
    `requires_grad`: the inputs that need a gradient (fxopt.analysis.grad_needs); None: every floating one."""
    if not measured_by_running(node):
        return None
    helper = declared(node.target) if node.op == "call_function" else None
    return measured(node, requires_grad) if helper is not None else measured_call(node, requires_grad)


def _constant_pad(node: fx.Node) -> bool:
    """`F.pad` / `aten.pad` in constant mode (the default): its backward slices, keeping nothing."""
    if node.op != "call_function":
        return False
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    return mode == "constant"


def _rule(node: fx.Node) -> _Rule | None:
    """What an fxopt graph helper is declared to save, the table's rule for `node`, the view rule for
    an ATen view, or None for an unknown op."""
    helper = declared(node.target) if node.op == "call_function" else None
    if helper is not None and helper.saves is not None:
        return _Rule(extra=helper.saves)
    if helper is not None and helper.runs_without_grad is not None:
        return _KEEPS_NOTHING  # it runs under no_grad: autograd records nothing
    if helper is not None and not helper.opaque and helper.name is None:
        return _Rule(inputs=ALL)  # fxopt's own arithmetic (a fold's weights from the parameters): at most its inputs
    name = op_name(node)
    if name == "pad" and _constant_pad(node):
        return _KEEPS_NOTHING
    if name in _TABLE:
        return _TABLE[name]
    aliased = _torch_private.aliased_argument(node.target) if node.op == "call_function" else None
    return _KEEPS_NOTHING if aliased is not None and not aliased[1] and name is not None else None


def keeps_output_only_in_place(name: str) -> bool:
    """`leaky_relu`, `elu`: in place (`name_`) the op keeps its output for backward, out of place it does not."""
    inplace, outplace = _TABLE.get(f"{name}_"), _TABLE.get(name)
    return inplace is not None and outplace is not None and inplace.output and not outplace.output


def is_known_op(node: fx.Node) -> bool:
    """The table knows what this call keeps for backward (and so what it computes)."""
    return _rule(node) is not None


def _dropout_training(node: fx.Node) -> bool:
    """Whether a dropout node runs in training mode: its `training`/`train` flag is not False.

    Assumes `node` is a dropout (op_name == "dropout"); a flag computed in the graph counts as training.
    """
    flag = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", node.kwargs.get("train", True))
    return flag is not False


def dropout_returns_input(node: fx.Node) -> bool:
    """Whether a dropout node returns its input itself: in eval mode, or with probability 0 (ATen's dropout
    returns its input before it draws anything: no copy, no random numbers, no autograd node).

    Assumes `node` is a dropout (op_name == "dropout"); a probability computed in the graph counts as nonzero.
    """
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    return not _dropout_training(node) or (isinstance(p, (int, float)) and p == 0)


def _tensor_inputs(node: fx.Node) -> tuple[fx.Node, ...]:
    """Input nodes that are (or may be) tensors, in argument order, each once."""
    return tuple(n for n in node.all_input_nodes if tensor_meta(n) is not None or "val" not in n.meta)


@dataclasses.dataclass(frozen=True)
class SavedForBackward:
    saves_output: bool
    saved_inputs: tuple[fx.Node, ...]
    known: bool


def saved_for_backward(node: fx.Node, requires_grad: Collection[fx.Node] | None = None) -> SavedForBackward:
    """What autograd keeps for `node`'s backward (see module docstring); placeholders keep nothing.
    `requires_grad`: the inputs that need a gradient, where the op is measured (`measurement`)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return SavedForBackward(False, (), True)
    inputs = _tensor_inputs(node)
    opaque = measurement(node, requires_grad)
    if opaque is not None:
        flat = call_input_nodes(node)
        return SavedForBackward(opaque.saves_output, tuple(dict.fromkeys(flat[i] for i in opaque.saved_inputs)), True)
    rule = _rule(node)
    if rule is None:
        return SavedForBackward(True, inputs, False)
    operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node) and a in inputs]
    kept = {NONE: (), FIRST: inputs[:1], ALL: inputs, OPERANDS: _kept_operands(node, operands, requires_grad),
            FACTORS: tuple(dict.fromkeys(a for a in _factors(node) if isinstance(a, fx.Node)))}[rule.inputs]
    output = rule.output(node) if callable(rule.output) else rule.output
    return SavedForBackward(output, kept, not measured_by_running(node))


def _kept_operands(node: fx.Node, operands: list[fx.Node], requires_grad: Collection[fx.Node] | None) -> tuple:
    """The operands a product keeps: each for the other's gradient. Unknown gradients (`requires_grad` None): all of
    them, when there are two. Known: `mul` keeps one operand where the other needs a gradient (rotary embeddings'
    `q * cos` keeps `cos` alone, not the query), a quotient its divisor where either does and its dividend where the
    divisor does (ATen's derivatives of mul and div)."""
    if len(operands) < 2:
        return ()
    if requires_grad is None:
        return tuple(operands)
    first, second = operands[0], operands[1]
    if op_name(node) == "mul":
        kept = [first] if second in requires_grad else []
        kept += [second] if first in requires_grad else []
    else:
        kept = [first] if second in requires_grad else []
        kept += [second] if first in requires_grad or second in requires_grad else []
    return tuple(dict.fromkeys(kept))


def _factors(node: fx.Node) -> tuple:
    """The two multiplied arguments of `addmm` / `baddbmm` (positions 1 and 2, or by keyword)."""
    names = ("batch1", "batch2") if op_name(node) == "baddbmm" else ("mat1", "mat2")
    return tuple(node.args[i] if len(node.args) > i else node.kwargs.get(name) for i, name in zip((1, 2), names))


# Ops that may reshape an operand into a batch of matrices before their product: a permuted operand
# (attention's query, key and value) is then copied, and the backward keeps the copy, not the operand.
_MAY_SAVE_COPIES = frozenset({"matmul", "linear"})


def saved_copies(node: fx.Node) -> tuple[frozenset[fx.Node], int]:
    """The saved inputs whose backward keeps a copy instead of the input itself, and the copies' bytes.

    `matmul(q, k.transpose(-1, -2))` on HF attention's permuted heads saves two new tensors: the
    storage of `q` is not what autograd holds, so a region keeping `q` and the matmul's backward
    hold both. Found by running the op once per shape on meta tensors under saved-tensor hooks.
    """
    if node.op != "call_function" or op_name(node) not in _MAY_SAVE_COPIES:
        return frozenset(), 0
    inputs = [n for n in saved_for_backward(node).saved_inputs if tensor_meta(n) is not None]
    layouts = tuple(_layout(tensor_meta(n)) for n in inputs)
    if any(layout is None for layout in layouts):
        return frozenset(), 0  # symbolic sizes: assume the operands themselves are saved
    try:
        aliased, copied_bytes = _meta_saved(node.target, _call_pattern(node, inputs), layouts)
    except Exception:  # noqa: BLE001 - an op meta tensors cannot run: assume the operands are saved
        return frozenset(), 0
    if not copied_bytes:
        return frozenset(), 0  # every saved tensor is an input itself (a linear's bias is not saved at all)
    return frozenset(n for i, n in enumerate(inputs) if i not in aliased), copied_bytes


def _layout(val) -> tuple | None:
    if not all(isinstance(d, int) for d in (*val.shape, *val.stride())):
        return None
    return tuple(val.shape), tuple(val.stride()), val.dtype


def _call_pattern(node: fx.Node, inputs: list[fx.Node]):
    """node's args and kwargs with each tensor input replaced by its index in `inputs` (hashable)."""
    def arg(a):
        if isinstance(a, fx.Node):
            return ("input", inputs.index(a)) if a in inputs else ("other", None)
        return ("const", a)
    return tuple(arg(a) for a in node.args), tuple((k, arg(v)) for k, v in node.kwargs.items())


@functools.lru_cache(maxsize=256)
def _meta_saved(target, pattern, layouts) -> tuple[frozenset[int], int]:
    """Run `target` on meta tensors laid out as `layouts`: which inputs autograd saves as themselves, and the
    bytes of the saved tensors that alias no input (copies)."""
    metas = [torch.empty_strided(shape, stride, dtype=dtype, device="meta").requires_grad_(dtype.is_floating_point)
             for shape, stride, dtype in layouts]
    args_pattern, kwargs_pattern = pattern
    value = {"input": lambda i: metas[i], "const": lambda c: c}
    if any(kind == "other" for kind, _ in (*args_pattern, *(v for _, v in kwargs_pattern))):
        raise ValueError("an input that is not a saved tensor")
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        target(*(value[k](v) for k, v in args_pattern), **{name: value[k](v) for name, (k, v) in kwargs_pattern})
    storages = [_torch_private.untyped_storage_key(m) for m in metas]
    aliased, copied = set(), 0
    for t in saved:
        owners = [i for i, key in enumerate(storages) if _torch_private.untyped_storage_key(t) == key]
        aliased.update(owners)
        copied += 0 if owners else t.untyped_storage().nbytes()
    return frozenset(aliased), copied


def tensor_bytes(node: fx.Node) -> int:
    """Bytes of the tensor `node` computes (0 when unknown)."""
    val = tensor_meta(node)
    return val.numel() * val.element_size() if val is not None else 0


def saved_bytes(node: fx.Node, requires_grad: Collection[fx.Node] | None = None) -> int:
    """Bytes of non-parameter tensors kept for `node`'s backward, from `node.meta["val"]`.

    Graph inputs, parameters and buffers are not counted (they live anyway), nor are
    intermediate tensors counted twice when the output is also an input (in-place ops).
    """
    saved = saved_for_backward(node, requires_grad)
    copies, copied_bytes = saved_copies(node)
    nodes = {n for n in saved.saved_inputs if n.op not in ("placeholder", "get_attr") and n not in copies}
    if saved.saves_output:
        nodes.add(node)
    rule, opaque = _rule(node), measurement(node, requires_grad)
    if opaque is not None:
        extra = opaque.private_bytes
    else:
        extra = rule.extra(node) if rule is not None and rule.extra is not None else 0
    return sum(tensor_bytes(n) for n in nodes) + copied_bytes + extra
