"""Which calls an exported graph may take: what `torch.export` assumed about the example call.

Export specializes a graph to its example call: the argument structure (positional count,
keyword names), every non-tensor argument's value (`return_dict=True`), each tensor's dtype,
device and sizes — except the dimensions it kept symbolic (the batch dimension, within the
range export allows, e.g. `>= 2`: sizes 0 and 1 are always specialized) -- and the global modes
the model's code read while it was traced (`torch.is_grad_enabled()`: fxopt.capture.ambient_state),
which a call must find as they were. `CallSpec` records
these facts as plain data (it pickles with the result) and checks a call against them in
microseconds, returning a reason rather than raising, so that the caller can run the original
module instead of hitting export's `AssertionError: Guard failed`.

The full check flattens the call with pytree and checks each leaf (tens of microseconds). A
call made only of plain tensors and scalars (`model(ids)`, `model(x, return_dict=False)`) is
first summarized by a key that determines that check's outcome: the keyword names in order,
each tensor's dtype, device and shape, each scalar's type and value. A key the full check
accepted before is accepted again without it (one tuple and one set lookup).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import _torch_private
from .ambient_state import Read, changed

MAX_ACCEPTED_CALLS = 64  # distinct accepted call keys remembered per graph (batch sizes, keyword orders)
_SCALARS = (bool, int, float, str, type(None))


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    device: str
    sizes: tuple  # int, or the name of a symbolic size ("s0")

    def describe(self) -> str:
        return f"({', '.join(map(str, self.sizes))}) {str(self.dtype).removeprefix('torch.')}"


@dataclasses.dataclass
class CallSpec:
    """What an exported graph assumes about its call (see module docstring)."""

    in_spec: Any  # the pytree structure of (args, kwargs)
    keywords: tuple[str, ...]  # keyword argument names, in the order the graph flattens them
    leaves: list  # per flattened argument: a TensorSpec, or the non-tensor value itself
    names: list[str]  # per flattened argument: its name in the call, for messages
    ranges: dict[str, tuple[int, int | None]]  # symbolic size -> (min, max or None)
    ambient: tuple[Read, ...] = ()  # global modes the model's code read while traced, and their values
    # keys of calls the full check accepted (see module docstring); not pickled
    _accepted: set = dataclasses.field(default_factory=set, init=False, repr=False, compare=False)

    @classmethod
    def from_export(cls, gm: torch.fx.GraphModule, range_constraints: dict, kwargs: dict,
                    ambient: tuple[Read, ...] = ()) -> CallSpec:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        leaves = [_leaf_spec(n.meta.get("val")) for n in placeholders]
        ranges = {}
        for symbol, value_range in range_constraints.items():
            if value_range.lower.is_Integer:  # not a value read from a tensor (`.item()`: -oo..oo), no input's size
                ranges[str(symbol)] = (int(value_range.lower), _finite(value_range.upper))
        return cls(_torch_private.call_structure(gm), tuple(kwargs), leaves, [n.name for n in placeholders], ranges,
                   tuple(ambient))

    def mismatch(self, args: tuple, kwargs: dict) -> str | None:
        """None if the graph may take this call, else why not (one line)."""
        if self.ambient and (read := changed(self.ambient)) is not None:
            return f"{read.expression()} is {read.now()!r}; the model read {read.value!r} when traced"
        key = _call_key(args, kwargs)
        if key is not None and key in self._accepted:
            return None
        problem = self._full_mismatch(args, kwargs)
        if problem is None and key is not None and len(self._accepted) < MAX_ACCEPTED_CALLS:
            self._accepted.add(key)
        return problem

    def _full_mismatch(self, args: tuple, kwargs: dict) -> str | None:
        if set(kwargs) != set(self.keywords):
            return f"keyword arguments {sorted(kwargs)}, the graph was exported for {sorted(self.keywords)}"
        leaves, spec = _torch_private.tree_flatten((tuple(args), {k: kwargs[k] for k in self.keywords}))
        if spec != self.in_spec:
            return f"{len(args)} positional argument(s) or nested structure unlike the example call"
        bound: dict[str, int] = {}
        for name, expected, value in zip(self.names, self.leaves, leaves):
            problem = self._leaf_mismatch(expected, value, bound)
            if problem:
                return f"{name}: {problem}"
        return None

    def _leaf_mismatch(self, expected, value, bound: dict[str, int]) -> str | None:
        if not isinstance(expected, TensorSpec):
            if isinstance(value, torch.Tensor) or type(value) is not type(expected) or value != expected:
                return f"{value!r}, the graph assumes {expected!r}"
            return None
        if not isinstance(value, torch.Tensor):
            return f"a {type(value).__name__}, the graph assumes a tensor {expected.describe()}"
        if value.dtype != expected.dtype or str(value.device) != expected.device or value.dim() != len(expected.sizes):
            return (f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} on {value.device}, "
                    f"the graph assumes {expected.describe()} on {expected.device}")
        for size, want in zip(value.shape, expected.sizes):
            if isinstance(want, int):
                if size != want:
                    return f"shape {tuple(value.shape)}, the graph assumes {expected.describe()}"
                continue
            if bound.setdefault(want, size) != size:
                return f"size {size} where the graph needs {want} = {bound[want]} (the same size as another input)"
            if not self._size_allowed(want, size):
                low, high = self.ranges.get(want, (0, None))
                allowed = f"{low}..{high}" if high is not None else f">= {low}"
                return f"shape {tuple(value.shape)}, the graph assumes {expected.describe()} with {want} {allowed}"
        return None

    def _size_allowed(self, want: int | str, size: int) -> bool:
        """`size` is the fixed size `want`, or within the range of the symbolic size `want`."""
        if isinstance(want, int):
            return size == want
        low, high = self.ranges.get(want, (0, None))
        return low <= size and (high is None or size <= high)

    def differs_only_in_batch(self, args: tuple, kwargs: dict) -> bool:
        """True if the call is like the example except for the size of dimension 0 of some tensors
        (a call a graph exported with a dynamic batch dimension may take)."""
        if set(kwargs) != set(self.keywords) or changed(self.ambient) is not None:
            return False
        leaves, spec = _torch_private.tree_flatten((tuple(args), {k: kwargs[k] for k in self.keywords}))
        if spec != self.in_spec:
            return False
        other_batch = False
        for expected, value in zip(self.leaves, leaves):
            tensor = isinstance(expected, TensorSpec) and isinstance(value, torch.Tensor)
            if tensor and value.dim() == len(expected.sizes) > 0:
                other_sizes = zip(value.shape[1:], expected.sizes[1:])
                if value.dtype != expected.dtype or str(value.device) != expected.device or any(
                        isinstance(want, int) and size != want for size, want in other_sizes):
                    return False
                other_batch |= not self._size_allowed(expected.sizes[0], value.shape[0])
            elif self._leaf_mismatch(expected, value, {}):
                return False
        return other_batch

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_accepted", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._accepted = set()

    def describe(self) -> str:
        """E.g. `x: (s0, 3, 32, 32) float32; return_dict=True; s0 >= 2`."""
        parts = [f"{name}: {leaf.describe()}" if isinstance(leaf, TensorSpec) else f"{name}={leaf!r}"
                 for name, leaf in zip(self.names, self.leaves)]
        used = {s for leaf in self.leaves if isinstance(leaf, TensorSpec) for s in leaf.sizes if isinstance(s, str)}
        for symbol in sorted(used):
            low, high = self.ranges.get(symbol, (0, None))
            parts.append(f"{symbol} in {low}..{high}" if high is not None else f"{symbol} >= {low}")
        return "; ".join(parts + [read.describe() for read in self.ambient])


def _call_key(args: tuple, kwargs: dict) -> tuple | None:
    """What decides `CallSpec._full_mismatch` for a call of plain tensors and scalars (see module docstring);
    None for any other call (a tensor subclass, a list, a dict, a ModelOutput...), which the full check takes."""
    key = [tuple(kwargs)]
    for value in (*args, *kwargs.values()) if kwargs else args:
        kind = type(value)
        if kind is torch.Tensor:
            key.append((value.dtype, value.device, value.shape))
        elif kind in _SCALARS:
            key.append((kind, value))
        else:
            return None
    return tuple(key)


def _finite(bound) -> int | None:
    """A range bound as an int, None for infinity (sympy's `int_oo`)."""
    return int(bound) if bound.is_Integer else None


def _leaf_spec(value):
    """The recorded fact about one flattened argument (a placeholder's example value)."""
    if not isinstance(value, torch.Tensor):
        return value
    sizes = tuple(int(s) if not isinstance(s, torch.SymInt) else str(s.node.expr) for s in value.shape)
    return TensorSpec(value.dtype, str(value.device), sizes)
