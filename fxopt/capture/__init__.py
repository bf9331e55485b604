"""Capture: the ATen graphs of a model as TorchDynamo sees it called.

TorchDynamo (torch.compile's front end) hands a backend one graph per region of Python it traced: one
graph for a model whose `forward` it follows to the end, several where the code breaks the graph.
`aten_graph` traces such a graph to ATen ops (pre-dispatch: autograd still sees every op, so the graph
runs under eager autograd as the model's own ops would), keeping each op's module path and source line,
and Dynamo's symbolic sizes. Parameters and buffers are graph inputs (`constant_inputs` names them).
Attention masks a library builds only because it is being traced, and eager skips, are dropped
(`attention_masks.py`): the graph calls attention as eager does.

`capture(model, args, kwargs)` runs that for one call without optimizing anything, leaving no trace on
the model: the graphs a test, the command line or a benchmark looks at alone.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import _torch_private
from ..errors import FxoptError
from ..state_preservation import preserved_state
from .attention_masks import drop_constant_masks
from .autograd_functions import as_one_op, is_autograd_function_call
from .naming import model_path

__all__ = ["Capture", "CapturedGraph", "NotTraceable", "aten_graph", "capture", "check_initialized"]

class NotTraceable(Exception):
    """A Dynamo graph fxopt leaves as captured; the message says why."""


@dataclasses.dataclass
class CapturedGraph:
    """One graph: its name, the graph, the example values of its placeholders and which of them hold state."""

    path: str
    gm: fx.GraphModule
    example_inputs: tuple  # one value per placeholder, in order (tensors and sizes)
    constant_inputs: frozenset[str] = frozenset()  # placeholders holding parameters or buffers


@dataclasses.dataclass
class Capture:
    module: torch.nn.Module
    graphs: list[CapturedGraph]


def check_initialized(model: torch.nn.Module) -> None:
    """A lazy module (LazyBatchNorm2d, LazyLinear) has no shapes until its first call: say so, as the reason."""
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
            raise FxoptError(f"module {path or '<model>'!r} ({type(m).__name__}) has uninitialized parameters; "
                             f"run the model once on a batch (which sizes them) before fxopt.optimize")


def aten_graph(gm: fx.GraphModule, example_inputs: list) -> tuple[fx.GraphModule, frozenset[str]]:
    """Dynamo's graph traced to ATen ops, and the names of its placeholders that hold parameters or buffers;
    NotTraceable where the trace fails."""
    try:
        aten, _ = _torch_private.aten_graph_of_dynamo_graph(gm, example_inputs, _keep_autograd_functions_whole)
    except Exception as e:  # noqa: BLE001 - an op or a value the ATen trace cannot follow: run as captured
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise NotTraceable(f"fxopt's ATen trace of it failed: {type(e).__name__}: {first_line}") from e
    _drop_unused_scalar_reads(aten)
    drop_constant_masks(aten)  # eager's attention: no mask where Dynamo built an all-True or causal one
    dynamo_constants = _torch_private.dynamo_parameter_placeholders(gm, example_inputs)
    constants = set()
    for dynamo, node in zip(gm.graph.find_nodes(op="placeholder"), aten.graph.find_nodes(op="placeholder")):
        if dynamo.name in dynamo_constants:
            constants.add(node.name)
            node.meta["constant_input"] = True  # analyses run on the graph alone know its state (analysis.ops)
            source = _torch_private.dynamo_input_source(dynamo)
            if source is not None:  # reports name a parameter as the model does: `encoder.layer.0.weight`
                node.meta["state_name"] = model_path(source)
    return aten, frozenset(constants)


def _keep_autograd_functions_whole(target, args: tuple, kwargs: dict):
    """A custom autograd Function's call as one op running its own forward and backward (capture/autograd_functions.py)."""
    if not is_autograd_function_call(target):
        return NotImplemented
    fwd, bwd, *call_args = args
    return as_one_op(fwd, bwd, tuple(call_args), kwargs)


def _drop_unused_scalar_reads(gm: fx.GraphModule) -> None:
    """Remove `.item()` reads nothing uses. A float module attribute Dynamo made dynamic (a Dropout's `p` that differed
    between two models of one class) reaches the graph as a 0-d tensor read by `.item()`; where the ATen trace
    specialized the value (dropout's `0 <= p <= 1` check), the read is left with no user. Fake tensors cannot run
    it (its value is data), so every estimate that runs the graph on them (FLOPs, memory) would give up."""
    dead = [n for n in gm.graph.nodes if n.op == "call_function" and not n.users
            and n.target in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)]
    for node in dead:
        gm.graph.erase_node(node)
    if dead:
        gm.recompile()


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> Capture:
    """The ATen graphs of `model(*args, **kwargs)` at exactly these inputs' sizes (see module docstring);
    the model and inputs are left as they were.

    `module` is the first graph (the whole model's, where Dynamo traced `forward` to its end).
    """
    if not isinstance(model, torch.nn.Module):
        raise FxoptError(f"expected a torch.nn.Module, got {type(model).__name__}")
    check_initialized(model)
    graphs: list[CapturedGraph] = []

    def record(gm: fx.GraphModule, example_inputs: list):
        aten, constants = aten_graph(gm, example_inputs)
        concrete = tuple(_torch_private.size_hint(x) if isinstance(x, torch.SymInt) else x for x in example_inputs)
        graphs.append(CapturedGraph(f"graph_{len(graphs)}", aten, concrete, constants))
        return gm

    kwargs = dict(kwargs or {})
    with preserved_state(model, (args, kwargs)), _torch_private.settings_applied():
        _torch_private.compile_on_its_own(model, record, dynamic=False)(*args, **kwargs)
    if not graphs:
        raise FxoptError(f"TorchDynamo captured no graph of {type(model).__name__} (nothing in its forward is torch "
                         f"ops, or all of it broke the graph)")
    return Capture(graphs[0].gm, graphs)
