"""Which graph nodes may share storage, and who reads a tensor after a given node.

Two nodes alias when writing one may change the other: a view and its base (`view`, `reshape`,
`flatten`, `transpose`, slicing, `getitem`), an in-place op and its input, an op that may return
its input itself (`contiguous`, `to`, eval-mode dropout, `nn.Identity`). Aliasing is kept as
groups (union-find), which over-approximates "may alias" and so errs on the safe side.

Sources, all merged:
- the view/in-place rules below, keyed by `fxopt.analysis.saved_tensors.op_name`; for ATen ops
  (torch.export graphs) the op's schema, which says which argument a view or an in-place /
  `out=` result shares storage with (`aten.view(Tensor(a) self)`, `aten.add.out(..., Tensor(a!) out)`);
- an op fxopt does not know (not in the saved-for-backward table) may alias every tensor input;
- FakeTensor storages in `node.meta["val"]`: nodes whose fake tensors share a storage.
"""
from __future__ import annotations

import torch.fx as fx

from .. import _torch_private
from ..op_names import is_inplace_op, op_name
from .saved_tensors import dropout_returns_input, is_known_op
from .shapes import tensor_meta

# Ops whose output is (or may be) a view of, or the same tensor as, their first tensor input.
VIEW_OPS = frozenset({
    "view", "reshape", "flatten", "unflatten", "transpose", "permute", "t", "getitem", "squeeze", "unsqueeze",
    "expand", "expand_as", "view_as", "reshape_as", "narrow", "select", "chunk", "split", "unbind", "detach",
    "movedim", "swapaxes", "contiguous", "to", "float", "type_as", "identity", "getattr",
})
# View ops returning several views of one base: autograd forbids writing into any of them in place.
_MULTI_OUTPUT_VIEW_OPS = frozenset({"chunk", "split", "unbind"})
# Reading only a tensor's metadata is not a read of its values (export checks dtypes with the last one).
_METADATA_OPS = frozenset({"size", "dim", "numel", "sym_size", "sym_stride", "sym_numel", "_assert_tensor_metadata"})
_METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout"})


def is_metadata_read(node: fx.Node) -> bool:
    """`x.size()`, `x.shape`, `x.dtype`...: the node reads no tensor values."""
    name = node.op in ("call_method", "call_function") and op_name(node)
    if name in _METADATA_OPS:
        return True
    return name == "getattr" and len(node.args) > 1 and node.args[1] in _METADATA_ATTRS


def has_internal_overlap(node: fx.Node) -> bool:
    """Several elements of the tensor share memory (an `expand`ed view): it cannot be written in place.

    Unknown shapes count as overlapping.
    """
    val = tensor_meta(node)
    return val is None or any(stride == 0 and size > 1 for stride, size in zip(val.stride(), val.shape))


def returns_several_views(node: fx.Node) -> bool:
    """`chunk`, `split`, `unbind` and other ops returning a list of views of one tensor."""
    if node.op == "call_function" and _torch_private.aten_op_name(node.target) is not None:
        return _torch_private.returns_list(node.target) and _torch_private.aliased_argument(node.target) is not None
    return op_name(node) in _MULTI_OUTPUT_VIEW_OPS


def aliased_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes the output may share storage with (a known op: at most one)."""
    name = op_name(node)
    inputs = [n for n in node.all_input_nodes if not is_metadata_read(n)]
    if name == "dropout":
        return inputs[:1] if dropout_returns_input(node) else []
    aliased = _torch_private.aliased_argument(node.target) if node.op == "call_function" else None
    if aliased is not None:
        value = _torch_private.bind_aten_arguments(node.target, node.args, node.kwargs).get(aliased[0])
        return [value] if isinstance(value, fx.Node) else []
    return inputs[:1] if name in VIEW_OPS or is_inplace_op(name) else []


class AliasInfo:
    """Groups of graph nodes that may share storage (see module docstring)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self._order = {node: i for i, node in enumerate(gm.graph.nodes)}
        self._parent: dict[fx.Node, fx.Node] = {}
        self._groups: dict[fx.Node, list[fx.Node]] | None = None  # root -> its group in graph order; made on demand
        by_storage: dict[int, fx.Node] = {}
        for node in gm.graph.nodes:
            self._parent[node] = node
            if node.op in ("call_function", "call_method", "call_module") and not is_metadata_read(node):
                unknown = [n for n in node.all_input_nodes if not is_metadata_read(n)]
                may_alias = unknown if not is_known_op(node) else aliased_inputs(node)
                for n in may_alias:
                    self.merge(node, n)
            val = tensor_meta(node)
            if val is not None and _torch_private.is_fake(val):
                key = _torch_private.untyped_storage_key(val)
                if key in by_storage:
                    self.merge(node, by_storage[key])
                else:
                    by_storage[key] = node

    def _root(self, node: fx.Node) -> fx.Node:
        while self._parent[node] is not node:
            self._parent[node] = self._parent[self._parent[node]]
            node = self._parent[node]
        return node

    def merge(self, a: fx.Node, b: fx.Node) -> None:
        """Record that `a` and `b` may share storage (e.g. after making `a` write into `b`)."""
        self._parent.setdefault(a, a)
        self._parent.setdefault(b, b)
        self._parent[self._root(a)] = self._root(b)
        self._groups = None

    def replaced(self, old: fx.Node, new: fx.Node) -> None:
        """Record that `new` took `old`'s place in the graph: its position, and whatever `old` may share storage with."""
        self._order[new] = self._order[old]
        self.merge(new, old)

    def aliases(self, node: fx.Node) -> list[fx.Node]:
        """Every node of the graph that may share storage with `node` (itself included), in graph order."""
        if self._groups is None:  # one pass over the graph for every later call until the next merge
            self._groups = {}
            for n in self._order:
                self._groups.setdefault(self._root(n), []).append(n)
        return list(self._groups.get(self._root(node), ()))

    def value_reads_after(self, node: fx.Node, position: fx.Node) -> list[fx.Node]:
        """Users of `node` after `position` in the graph that read its values (not just its shape).

        Positions are those of the graph this was built on: rewrite nodes in place, do not insert.
        """
        limit = self._order[position]
        return [u for u in node.users if self._order.get(u, limit + 1) > limit and not is_metadata_read(u)]
