"""`torch.save` / `torch.load` of an optimized model keep its graphs exactly.

torch.fx pickles a GraphModule as its generated Python code and rebuilds it on load by tracing
that code with `symbolic_trace`. On an exported graph that retrace silently changes what the
model computes: it runs through `wrap_with_autocast` / `wrap_with_set_grad_enabled` regions
(an autocast output comes back float32) and drops in-place writes to buffers. So fxopt's
GraphModules pickle the graph itself (nodes, targets, the pytree call structure; node meta
without example values; operators, which do not pickle, by name, also where an argument is one)
and are rebuilt from it on load, no tracing. Loading needs
`torch.load(path, weights_only=False)` (the file holds modules, not only tensors) and fxopt
importable.

GraphModule gives each instance its own class, so the pickling rule is set on that class;
a deep copy gets a new class, and a deepcopy hook sets the rule there too.
"""
from __future__ import annotations

import dataclasses
import pickle

import torch
import torch.fx as fx

from .. import _torch_private
from .direct_reads import read_attributes_directly

_EXAMPLE_VALUE_META = ("val", "example_value", "tensor_meta", "from_node", "unbacked_bindings")


def keep_graph_when_pickled(module: torch.nn.Module) -> None:
    """Make every GraphModule in `module` pickle its graph rather than its code (see module docstring)."""
    for m in module.modules():
        if isinstance(m, fx.GraphModule):
            type(m).__reduce__ = _reduce_with_graph
            _torch_private.add_deepcopy_hook(m, keep_graph_when_pickled)
        for held in vars(m).values():  # graphs a module holds outside the tree (a checkpointed region's body)
            if isinstance(held, fx.GraphModule) and type(held).__reduce__ is not _reduce_with_graph:
                keep_graph_when_pickled(held)


def _reduce_with_graph(gm: fx.GraphModule):
    state = {k: v for k, v in gm.__dict__.items() if k not in ("_graph", "_code")}
    return _rebuild, (state, _graph_records(gm.graph), _torch_private.graph_codegen(gm.graph))


@dataclasses.dataclass(frozen=True)
class _NodeRef:
    name: str


@dataclasses.dataclass(frozen=True)
class _MemoryFormatRef:
    """A `torch.memory_format` argument (`torch.save`'s pickler cannot write one itself)."""
    name: str


def _reference(value):
    if isinstance(value, fx.Node):
        return _NodeRef(value.name)
    if isinstance(value, torch.memory_format):
        return _MemoryFormatRef(str(value).removeprefix("torch."))
    return _torch_private.op_reference(value)  # an operator passed as an argument (a kept convolution's own op)


def _graph_records(graph: fx.Graph) -> list[tuple]:
    """`graph` as picklable data: per node (op, name, target, args, kwargs, meta), nodes named by reference."""
    return [(n.op, n.name, _torch_private.op_reference(n.target), fx.node.map_aggregate(n.args, _reference),
             fx.node.map_aggregate(n.kwargs, _reference),
             {k: v for k, v in n.meta.items() if k not in _EXAMPLE_VALUE_META and _pickles(v)})
            for n in graph.nodes]


def _pickles(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:  # noqa: BLE001 - any value that does not pickle is left out of the saved meta
        return False


def _rebuild(state: dict, records: list[tuple], codegen) -> fx.GraphModule:
    """The GraphModule `_reduce_with_graph` saved, with its graph as it was (no retrace)."""
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}

    def node_of(value):
        if isinstance(value, _MemoryFormatRef):
            return getattr(torch, value.name)
        return nodes[value.name] if isinstance(value, _NodeRef) else _torch_private.op_from_reference(value)

    for op, name, target, args, kwargs, meta in records:
        node = graph.create_node(op, _torch_private.op_from_reference(target), fx.node.map_aggregate(args, node_of),
                                 fx.node.map_aggregate(kwargs, node_of), name=name)
        node.meta = meta
        nodes[name] = node
    _torch_private.set_graph_codegen(graph, codegen)
    gm = fx.GraphModule.__new__(fx.GraphModule)
    gm.__dict__.update(state)
    gm.graph = graph  # sets the owning module and regenerates forward
    keep_graph_when_pickled(gm)
    read_attributes_directly(gm)
    return gm
