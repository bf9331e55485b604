"""Shape and dtype of every node, from example inputs, without running the model for real.

FakeTensor propagation stores a fake tensor in `node.meta["val"]` (the key Dynamo and AOTAutograd
use too). A graph whose opaque leaves branch on tensor values cannot run on fake tensors; then
the graph runs once on the real inputs, with buffers and RNG restored, and meta tensors are kept.

After a pass, `update_shapes` re-runs only what the pass changed: each node remembers what it was
computed from (`meta["fxopt_shape_of"]`: its op, target, arguments and input nodes); a node that
is new or differs, and every node whose input then got other metadata (shape, stride, dtype,
device, requires_grad), runs again on fake tensors; every other node keeps its value.
"""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from .. import _torch_private
from ..node_runner import NodeRunner
from ..state_preservation import preserved_state
from .side_effects import effects


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _record_meta(node: fx.Node, env: dict):
    """A NodeRunner hook: the node's real output, as a meta tensor, becomes its `meta["val"]`."""
    node.meta["val"] = _to_meta((yield))


def propagate_shapes(gm: fx.GraphModule, example_inputs: tuple) -> None:
    """Fill `node.meta["val"]` for every node of `gm` (see module docstring).

    Buffers and the inputs are restored afterwards: even under fake tensors, a train-mode BatchNorm bumps
    its real `num_batches_tracked`, and the real run a data-dependent graph falls back to updates the
    statistics a Dynamo graph takes as inputs.
    """
    with preserved_state(gm, tuple(example_inputs)):
        try:
            mode = _torch_private.detect_fake_mode(example_inputs) or _torch_private.fake_tensor_mode()
            fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
            _torch_private.fake_tensor_prop(gm, mode).propagate_dont_convert_inputs(*fake_inputs)
        except Exception:  # noqa: BLE001 - data-dependent code: fall back to one real run
            NodeRunner(gm, [_record_meta], every_node=True).run(*example_inputs)
    remember_shape_sources(gm)


class FakeRerun:
    """Runs chosen nodes of a graph again on the fake tensors its nodes hold (`meta["val"]`), one at a
    time in the order the caller picks; every other node keeps its value: after a pass (`update_shapes`)
    and after a layout change.

    Used as a context manager: the first node run again that may have an effect (a train-mode
    BatchNorm bumps its real `num_batches_tracked` even on fake inputs) saves the model's state, and
    leaving the block puts it back. `changed` is the caller's record of nodes whose value changed."""

    def __init__(self, gm: fx.GraphModule, mode):
        self.gm, self.mode = gm, mode
        self.changed: set[fx.Node] = set()
        self._prop = _torch_private.fake_tensor_prop(gm, mode)
        self._prop.env = {n: n.meta["val"] for n in gm.graph.nodes if "val" in n.meta}
        self._state = contextlib.ExitStack()
        self._state_saved = False

    def __enter__(self) -> FakeRerun:
        return self

    def __exit__(self, *exc) -> None:
        self._state.close()

    def input_changed(self, node: fx.Node) -> bool:
        return any(i in self.changed for i in node.all_input_nodes)

    def run(self, node: fx.Node):
        """Run `node` on its inputs' current values; its `meta["val"]` becomes the result, which is returned."""
        if not self._state_saved and effects(node, self.gm):
            self._state.enter_context(preserved_state(self.gm))
            self._state_saved = True
        with self.mode:
            value = self._prop.env[node] = self._prop.run_node(node)  # which also sets `meta["val"]`
        return value

    def keep(self, node: fx.Node, value) -> None:
        """Give `node` this value (a node added to the graph gets one without running)."""
        node.meta["val"] = self._prop.env[node] = value


_SOURCE = "fxopt_shape_of"
_MISSING = object()
# Calls that change global state for the nodes after them: a graph that gains one is propagated whole.
_GLOBAL_STATE_CALLS = _torch_private.grad_and_autocast_state_calls()


def _source(node: fx.Node, gm: fx.GraphModule) -> tuple:
    """What `node`'s value is computed from, as far as a pass can change it."""
    target = node.target
    if node.op in ("get_attr", "call_module"):
        target = (target, id(_attribute(gm, target)))
    return node.op, target, repr(node.args), repr(node.kwargs), tuple(id(n) for n in node.all_input_nodes)


def _attribute(gm: fx.GraphModule, target: str):
    """The object a get_attr / call_module target names (None if a pass removed it)."""
    try:
        return operator.attrgetter(target)(gm)
    except AttributeError:
        return None


def remember_shape_sources(gm: fx.GraphModule) -> None:
    """Mark every node's `meta["val"]` as up to date (what `update_shapes` compares against)."""
    for node in gm.graph.nodes:
        node.meta[_SOURCE] = _source(node, gm)


def _metadata(value):
    """What a node's users see of its value; sizes as text, so symbolic ones are compared without a guard."""
    if isinstance(value, torch.Tensor):
        return str(value.shape), str(value.stride()), value.dtype, value.device, value.requires_grad
    if isinstance(value, (tuple, list)):
        return tuple(_metadata(v) for v in value)
    if value is _MISSING or value is None or isinstance(value, (int, float, bool, str)):
        return value
    return str(value) if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) else type(value)


def update_shapes(gm: fx.GraphModule, example_inputs: tuple) -> int:
    """Bring `node.meta["val"]` up to date after a pass changed `gm` (see module docstring).

    Returns how many nodes ran again; a graph that cannot be updated in part is propagated whole.
    """
    stale = {n for n in gm.graph.nodes if n.meta.get(_SOURCE) != _source(n, gm) or "val" not in n.meta}
    if not stale:
        return 0
    placeholders = [n.meta.get("val", _MISSING) for n in gm.graph.find_nodes(op="placeholder")]
    mode = _torch_private.detect_fake_mode([v for v in placeholders if v is not _MISSING])
    whole = mode is None or _MISSING in placeholders or any(
        n.op == "placeholder" or (n.op == "call_function" and n.target in _GLOBAL_STATE_CALLS) for n in stale)
    if whole:
        propagate_shapes(gm, example_inputs)
        return len(gm.graph.nodes)
    try:
        with FakeRerun(gm, mode) as rerun:
            for node in gm.graph.nodes:
                if node in stale or rerun.input_changed(node):
                    before = _metadata(node.meta.get("val", _MISSING))
                    if _metadata(rerun.run(node)) != before:
                        rerun.changed.add(node)
    except Exception:  # noqa: BLE001 - a node that needs real values: propagate as the first time
        propagate_shapes(gm, example_inputs)
        return len(gm.graph.nodes)
    remember_shape_sources(gm)
    return len(stale | rerun.changed)


def tensor_meta(node) -> torch.Tensor | None:
    """The fake/meta tensor a node produces, or None if it does not produce a single tensor."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val", node.meta.get("example_value"))
    return val if isinstance(val, torch.Tensor) else None
