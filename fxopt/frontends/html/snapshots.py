"""What each captured graph looks like at each stage of the pipeline, in a form the page can draw.

`GraphSnapshots` is an instrument: before the first pass and after each pass that changed
something it records every graph as a flat list of `NodeView`s (name as the report names sites,
op label, module path, inputs, checkpointed region). It reads only what any graph form carries:

* module path: `node.meta["nn_module_stack"]` (torch.export, Dynamo and torch.fx tracing all
  record it), else the target of a `call_module`, else the graph's own path;
* checkpointed regions: a `call_module` whose module holds a GraphModule (its nodes are shown in
  its place, inside a region box), or nodes tagged `meta["recompute"]` with a recompute policy
  (selective activation checkpointing), grouped by `meta["ac_graph_id"]`.
"""
from __future__ import annotations

import dataclasses
import re
import time

import torch
import torch.fx as fx

from ..._torch_private import tree_leaves
from ...pipeline.instruments import Instrument


@dataclasses.dataclass(frozen=True)
class NodeView:
    name: str  # as the report names sites: "<graph path>:<node>" ("<node>" for the whole model's graph)
    label: str  # what it computes: "linear", "Conv2d", "relu_", ...
    path: tuple[str, ...]  # module path, split at dots
    inputs: tuple[str, ...]  # names of the nodes it reads
    region: str = ""  # the checkpointed region it is recomputed in, or ""
    shape: str = ""
    makes_tensor: bool = True  # False for a size or other number (no data edge is drawn from it)


@dataclasses.dataclass
class Stage:
    name: str  # "captured" or the pass that produced it
    nodes: list[NodeView]
    changed: bool = True  # False: the pass left every graph as it was


_PATH_NOISE = re.compile(r"^(L\['self'\]|L__self__|self)\.?")


def normalize_path(text: str) -> tuple[str, ...]:
    """'encoder.layer.0', "L['self'].encoder.layer[0]" or "L__self___encoder" -> ('encoder', 'layer', '0')."""
    if text.startswith("_empty_nn_module_stack"):  # torch.export's stand-in for "no module": the model itself
        return ()
    text = _PATH_NOISE.sub("", text)
    text = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", text).replace("._modules.", ".")
    return tuple(part for part in text.split(".") if part)


def node_module_path(node: fx.Node) -> tuple[str, ...] | None:
    stack = node.meta.get("nn_module_stack")
    if stack:
        value = list(stack.values())[-1]
        return normalize_path(value[0] if isinstance(value, tuple) else str(value))
    if node.op == "call_module":
        return normalize_path(str(node.target))
    return None


def _label(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        try:
            return type(gm.get_submodule(node.target)).__name__
        except AttributeError:
            return str(node.target)
    if node.op == "call_method":
        return f".{node.target}"
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    overload = getattr(target, "_overloadname", None)  # aten.mm.default -> mm
    if overload is not None:
        name = str(getattr(target, "_opname", name))
    return name


def _shape(node: fx.Node) -> str:
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    shape = getattr(val, "shape", None)
    return "x".join(str(s) for s in shape) if shape is not None else ""


def _makes_tensor(node: fx.Node) -> bool:
    if "val" not in node.meta:
        return True  # not known: drawn as data
    return any(isinstance(v, torch.Tensor) for v in tree_leaves(node.meta["val"]))


def _inner_graph(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The GraphModule a call_module runs (a checkpointed region's body), or None."""
    if node.op != "call_module":
        return None
    try:
        sub = gm.get_submodule(node.target)
    except AttributeError:
        return None
    held = [*sub.modules(), *vars(sub).values()]  # a body kept unregistered (its modules are the parent's) too
    return next((m for m in held if isinstance(m, fx.GraphModule)), None)


def _recompute_region(node: fx.Node) -> str:
    policy = node.meta.get("recompute")
    if policy is None or "RECOMPUTE" not in str(policy):
        return ""
    return f"recomputed#{node.meta.get('ac_graph_id', 0)}"


def view_graph(gm: fx.GraphModule, graph_path: str) -> list[NodeView]:
    """The call nodes of `gm` (placeholders, attributes and the output left out), in order."""
    prefix = normalize_path(graph_path)
    qualify = (lambda name: f"{graph_path}:{name}") if graph_path else (lambda name: name)
    views: list[NodeView] = []

    def add(graph: fx.Graph, owner: fx.GraphModule, region: str, rename: dict[str, str]) -> None:
        for node in graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):  # parameters and buffers are not ops
                continue
            body = _inner_graph(owner, node)
            if body is not None and body is not owner:
                inner_inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
                outer = [rename.get(a.name, qualify(a.name)) for a in node.all_input_nodes]
                add(body.graph, body, qualify(node.name),
                    {p.name: name for p, name in zip(inner_inputs, outer)})
                continue
            path = node_module_path(node)
            views.append(NodeView(
                name=qualify(node.name), label=_label(node, owner),
                path=prefix + path if path is not None else prefix,
                inputs=tuple(rename.get(a.name, qualify(a.name)) for a in node.all_input_nodes),
                region=region or _recompute_region(node), shape=_shape(node), makes_tensor=_makes_tensor(node)))

    add(gm.graph, gm, "", {})
    return views


class GraphSnapshots(Instrument):
    """Record every graph before the first pass and after each pass (instrument for the HTML page)."""

    def __init__(self):
        self.stages: list[Stage] = []
        self.seconds = 0.0

    def _snapshot(self, name: str, graphs: dict[str, fx.GraphModule]) -> None:
        start = time.perf_counter()
        several = len(graphs) > 1  # then node names say their graph, as the report's sites do
        nodes = [v for path, gm in graphs.items() for v in view_graph(gm, path if several else "")]
        self.stages.append(Stage(name, nodes))
        self.seconds += time.perf_counter() - start

    def start(self, graphs):
        self._snapshot("captured", graphs)

    def after_pass(self, index, report, code_before, graphs):
        if any(gm.code != code_before[path] for path, gm in graphs.items()):
            self._snapshot(report.name, graphs)
        else:
            self.stages.append(Stage(report.name, self.stages[-1].nodes, changed=False))

