"""The memory of one step over time: live activation bytes after every ATen op, measured on real tensors.

`measure_timeline(model, inputs, training)` runs one step (forward; in training forward, a sum
loss and backward) under the same storage-counting dispatch mode as `fxopt.measure.measure_peak`
and records, after each op, the bytes of the storages the step created that are still alive
(parameters, buffers, inputs and the gradients left after the step are not counted, as there).
Each op is labelled with where it ran: the innermost module running (forward hooks; in a
GraphModule -- the model, or one a wrapper calls -- the module path of the graph node running, from
its `nn_module_stack`, so an exported graph of ATen ops is attributed as finely as the eager
model), or in backward the module
whose forward made the autograd node being run; an op run in backward while a module's forward is
running is a recomputation (a checkpointed region).

The caller's state is left as it was: buffers (BatchNorm statistics), RNG, and `.grad`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
import torch.fx as fx

from ..._torch_private import tree_leaves
from ...host_rng import forked_host_rng
from ...measure import _LiveStorageMode, _storage_ids
from ...node_runner import NodeRunner
from ...pipeline.instruments import Instrument
from .snapshots import node_module_path

FORWARD, BACKWARD, RECOMPUTE = "forward", "backward", "recompute"


@dataclasses.dataclass(frozen=True)
class OpPoint:
    live_bytes: int  # after the op ran
    op: str  # ATen op, e.g. "aten.mm.default"
    phase: str  # FORWARD, BACKWARD or RECOMPUTE
    where: str  # module path ("" the model itself), or "" if unknown


@dataclasses.dataclass
class Timeline:
    label: str
    points: list[OpPoint]

    @property
    def peak_index(self) -> int:
        return max(range(len(self.points)), key=lambda i: self.points[i].live_bytes) if self.points else 0

    @property
    def peak_bytes(self) -> int:
        return self.points[self.peak_index].live_bytes if self.points else 0

    @property
    def backward_start(self) -> int | None:
        """Index of the first op of backward, or None in inference."""
        return next((i for i, p in enumerate(self.points) if p.phase != FORWARD), None)

    def describe_peak(self) -> str:
        if not self.points:
            return "no ops ran"
        p = self.points[self.peak_index]
        where = f"{p.where or 'the model'}"
        return f"op {self.peak_index} of {len(self.points)}, {p.phase} of {where} ({p.op})"


class _TimelineMode(_LiveStorageMode):
    """The live-storage log, plus one marker per op: (events so far, op, phase, where)."""

    def __init__(self, preexisting, module_stack: list[str], made_by: dict[int, str]):
        super().__init__(preexisting)
        self.module_stack = module_stack
        self.made_by = made_by  # id(autograd node) -> module path whose forward made it
        self.in_backward = False
        self.markers: list[tuple[int, str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        where = self.module_stack[-1] if self.module_stack else ""
        if not self.in_backward:
            phase = FORWARD
        elif self.module_stack:
            phase = RECOMPUTE
        else:
            phase = BACKWARD
            node = torch._C._current_autograd_node()
            where = self.made_by.get(id(node), "") if node is not None else ""
        self.markers.append((len(self.events), str(func), phase, where))
        return out


def _newest_node(values) -> int:
    """The highest autograd sequence number among the nodes behind `values` (-1 if none)."""
    numbers = [t.grad_fn._sequence_nr() for t in tree_leaves(values)
               if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    return max(numbers, default=-1)


def _claim(outputs, newer_than: int, path: str, made_by: dict[int, str]) -> None:
    """Attribute to `path` the autograd nodes behind `outputs` made after its inputs' and not claimed
    yet (inner modules' hooks run first, so they claim their own nodes)."""
    todo = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in made_by or node._sequence_nr() <= newer_than:
            continue
        made_by[id(node)] = path
        todo.extend(next_node for next_node, _ in node.next_functions)


@contextlib.contextmanager
def _module_stack(model: torch.nn.Module, stack: list[str], made_by: dict[int, str]):
    """Keep `stack` equal to the paths of the modules whose forward is running; fill `made_by`."""
    newer_than: list[int] = []

    def enter(module, args, path: str) -> None:
        stack.append(path)
        newer_than.append(_newest_node(args))

    def leave(module, args, output) -> None:  # a hook that returned something would replace the output
        if stack:
            _claim(output, newer_than.pop(), stack.pop(), made_by)

    handles = []
    for path, sub in model.named_modules():
        handles.append(sub.register_forward_pre_hook(lambda m, a, path=path: enter(m, a, path)))
        handles.append(sub.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _attributing(stack: list[str], made_by: dict[int, str]):
    """A NodeRunner hook keeping `stack` at the module path of the node running, and claiming the autograd nodes
    its output was made by for that path."""

    def hook(node: fx.Node, env: dict):
        path = node_module_path(node) if node.op in ("call_function", "call_method") else None
        if not path:
            return
        newer_than = _newest_node([env[a] for a in node.all_input_nodes if a in env])
        stack.append(".".join(path))
        try:
            out = yield
        finally:
            stack.pop()
        _claim(out, newer_than, ".".join(path), made_by)
    return hook


@contextlib.contextmanager
def _graphs_run_node_by_node(model: torch.nn.Module, stack: list[str], made_by: dict[int, str]):
    """Every GraphModule in `model` (the model itself, or one a wrapper calls) that records module paths
    runs node by node while this is active, so its ops are attributed to those modules."""
    patched = []
    for m in model.modules():
        if isinstance(m, fx.GraphModule) and any(n.meta.get("nn_module_stack") for n in m.graph.nodes):
            generated = m.forward

            def forward(*args, _gm=m, _generated=generated, **kwargs):
                if kwargs:
                    return _generated(*args, **kwargs)
                return NodeRunner(_gm, [_attributing(stack, made_by)]).run(*args)

            m.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
            patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


@contextlib.contextmanager
def _untouched(model: torch.nn.Module):
    """Restore buffers, RNG and parameter `.grad` after running `model` for information."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    grads = [(p, p.grad) for p in model.parameters()]
    with torch.random.fork_rng(devices=[]), forked_host_rng():
        try:
            yield
        finally:
            with torch.no_grad():
                for name, b in model.named_buffers():
                    if name in buffers and not torch.equal(b, buffers[name]):
                        b.copy_(buffers[name])
            for p, g in grads:
                p.grad = g


def _loss(output) -> torch.Tensor | None:
    parts = [t.float().sum() for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    return sum(parts) if parts else None


def measure_timeline(model: torch.nn.Module, inputs: tuple, training: bool, label: str) -> Timeline:
    """Live bytes after each op of one step of `model(*inputs)` (training: forward + backward)."""
    stack: list[str] = []
    made_by: dict[int, str] = {}
    preexisting = _storage_ids([*model.parameters(), *model.buffers(), *inputs])
    keep = [t.untyped_storage() for t in [*model.parameters(), *model.buffers(), *inputs]
            if isinstance(t, torch.Tensor)]  # ids are only unique while alive
    mode = _TimelineMode(preexisting, stack, made_by)
    with _untouched(model), _module_stack(model, stack, made_by), _graphs_run_node_by_node(model, stack, made_by), \
            torch.set_grad_enabled(training):
        for p in model.parameters():
            p.grad = None
        with mode:
            output = model(*inputs)
            loss = _loss(output) if training else None
            del output
            if loss is not None:
                mode.in_backward = True
                loss.backward()
                del loss
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_serials = {mode.live_serials[key] for key in _storage_ids(grads) if key in mode.live_serials}
        del grads
    del keep
    live, done, points = 0, 0, []
    for event_count, op, phase, where in mode.markers:
        for delta, serial in mode.events[done:event_count]:
            if serial not in grad_serials:
                live += delta
        done = event_count
        points.append(OpPoint(live, op, phase, where))
    return Timeline(label, points)


class StagePeaks(Instrument):
    """The measured peak of a step after each pass, when the whole model is one graph (else None).

    A graph that cannot run on the example inputs by itself (a part of the model) has no figure.
    """

    def __init__(self, inputs: tuple, training: bool):
        self.inputs, self.training = inputs, training
        self.peaks: list[int | None] = []
        self.seconds = 0.0

    def _measure(self, graphs) -> int | None:
        gm = graphs.get("")
        if gm is None:
            return None
        start = time.perf_counter()
        try:
            return measure_timeline(gm, self.inputs, self.training, "").peak_bytes
        except Exception:  # noqa: BLE001 - the graph alone does not run on these inputs: no figure
            return None
        finally:
            self.seconds += time.perf_counter() - start

    def start(self, graphs):
        self.peaks.append(self._measure(graphs))

    def after_pass(self, index, report, code_before, graphs):
        changed = any(gm.code != code_before[path] for path, gm in graphs.items())
        self.peaks.append(self._measure(graphs) if changed else self.peaks[-1])
