"""The memory of one training step run as an AOTAutograd partition: a forward graph and a backward graph.

Under torch.compile, AOTAutograd runs a training graph as two graphs: the forward returns the user's outputs and the
tensors saved for backward; the backward takes those and the outputs' gradients (`tangents_*`) and returns the inputs'
gradients. `partition_peak` simulates both on the fake tensors of `node.meta["val"]` (each storage counted once, so
views cost nothing):

* a value is allocated by the node that first makes its storage and freed after the last node that reads a value sharing
  that storage (generated code, boxed calls: Inductor, torch's aot_eager, drop each input and intermediate after its
  last use);
* the forward's outputs live to its end; saved tensors live from the forward until their last use in the backward, and
  the outputs' gradients from the backward's start;
* a CPU pointwise op whose operands differ in dtype (a float times a bool mask) first copies each operand that is not of
  the common dtype to it (ATen's TensorIterator on CPU; CUDA casts on the fly): those copies live while the op runs
  (`_promotion_copies`);
* a CPU convolution or convolution backward allocates scratch beside its outputs (copies of its operands in the kernel
  library's layout, a second weight-sized buffer; none for a 1x1 one or on channels-last operands, and it can exceed the
  result: docs/checkpointing.md): the most it holds at once, outputs and scratch, measured once per distinct call
  (fxopt.analysis.call_peaks.call_peak, the measurement the eager model reads too), is added to what was alive before
  it. Its gradient outputs count there too (a weight's gradient is copied once more before it is returned), so this errs
  high by at most one weight gradient; so does an attention kernel's forward or backward (the CPU flash kernel's
  backward holds copies of its gradient and accumulators beside what it returns), on any device;
* storages of the joint graph's inputs (parameters, buffers, inputs) live anyway, and the backward's outputs (the
  gradients the step leaves in `.grad`, as with `zero_grad(set_to_none=True)`) are not step memory: neither is counted,
  as in `fxopt.measure.measure_peak`.

The step's peak is the larger of the two graphs' peaks. Exact for graphs run op by op (aot_eager: checked against the
allocator in tests/test_backend_memory.py); Inductor fuses pointwise ops, whose intermediates then never exist, so there
it is an upper bound.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import _torch_private
from ..analysis.call_peaks import call_peak


@dataclasses.dataclass(frozen=True)
class PartitionPeak:
    """Bytes of one training step under a partition (see module docstring)."""

    forward: int  # the forward's peak
    backward: int  # the backward's peak, saved tensors included
    saved: int  # bytes saved for backward, each storage once, inputs' storages left out

    @property
    def step(self) -> int:
        return max(self.forward, self.backward)


def _tensors(node: fx.Node) -> list[torch.Tensor]:
    return [t for t in _torch_private.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return _torch_private.size_hint(t.untyped_storage().nbytes())


def _storages(nodes) -> dict:
    """Storage key -> bytes of every tensor the nodes produce."""
    return {_torch_private.untyped_storage_key(t): _nbytes(t) for node in nodes for t in _tensors(node)}


PROMOTED_ARGUMENTS = ("self", "other")  # the operands TensorIterator promotes to a common dtype (not a mask or condition)


def _promotion_copies(node: fx.Node) -> int:
    """Bytes of the operands a CPU pointwise ATen op copies to the common dtype before it runs (`x * mask` with a
    float x and a bool mask allocates a float copy of the mask beside its output)."""
    if node.op != "call_function" or _torch_private.aten_op_name(node.target) is None or \
            not _torch_private.op_is_pointwise(node.target):
        return 0
    bound = _torch_private.bind_aten_arguments(node.target, node.args, node.kwargs)
    operands = [bound[name].meta.get("val") if isinstance(bound.get(name), fx.Node) else bound.get(name)
                for name in PROMOTED_ARGUMENTS]
    if not all(isinstance(o, (torch.Tensor, int, float)) for o in operands):
        return 0
    tensors = [t for t in operands if isinstance(t, torch.Tensor)]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return 0
    common = torch.result_type(*operands)
    return sum(_torch_private.size_hint(t.numel()) * common.itemsize for t in tensors if t.dtype != common)


def _graph_peak(graph: fx.Graph, live: dict, not_counted: set) -> int:
    """Peak bytes while `graph` runs, starting with `live` (storage key -> bytes, freed at last use like the
    graph's own values); the graph's outputs stay alive to its end."""
    nodes = list(graph.nodes)
    position_of = {node: position for position, node in enumerate(nodes)}
    last_use = {}
    for position, node in enumerate(nodes):
        end = len(nodes) if any(user.op == "output" for user in node.users) else \
            max((position_of[user] for user in node.users), default=position)
        for t in _tensors(node):
            key = _torch_private.untyped_storage_key(t)
            last_use[key] = max(last_use.get(key, -1), end)
    freed_at: dict[int, list] = {}
    for key, end in last_use.items():
        freed_at.setdefault(end, []).append(key)
    live = dict(live)
    now = peak = sum(live.values())
    for position, node in enumerate(nodes):
        if node.op == "call_function":
            before = now
            for t in _tensors(node):
                key = _torch_private.untyped_storage_key(t)
                if key not in live and key not in not_counted:
                    live[key] = _nbytes(t)
                    now += live[key]
            peak = max(peak, now + _promotion_copies(node), before + call_peak(node))
        for key in freed_at.get(position, ()):
            now -= live.pop(key, 0)
    return peak


def partition_peak(joint: fx.GraphModule, forward: fx.GraphModule, backward: fx.GraphModule) -> PartitionPeak:
    """The step's memory when AOTAutograd runs `joint` as `forward` then `backward` (see module docstring)."""
    inputs = set(_storages(n for n in joint.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")))
    gradients = set(_storages(a for out in backward.graph.find_nodes(op="output") for a in out.all_input_nodes))
    at_start = {key: nbytes for key, nbytes in _storages(backward.graph.find_nodes(op="placeholder")).items()
                if key not in inputs}
    tangents = _storages(n for n in backward.graph.find_nodes(op="placeholder") if n.name.startswith("tangents"))
    return PartitionPeak(_graph_peak(forward.graph, {}, inputs),
                         _graph_peak(backward.graph, at_start, inputs | gradients),
                         sum(nbytes for key, nbytes in at_start.items() if key not in tangents))
