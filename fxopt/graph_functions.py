"""fxopt's own functions inside graphs (`folded_conv_bn_params`, `relu_mask`, the no-grad wrappers, ...).

Passes emit these helpers as single `call_function` nodes. Each is declared once, with
`@graph_function`, and every analysis reads that declaration (`declared(fn)`):

  name               the op name analyses key their tables by (`fxopt.op_names.op_name`), e.g.
                     "batch_norm" for a BatchNorm that updates its statistics once; None: no op name
  mutates            writes into a tensor it is given (`fxopt.analysis.side_effects`: MUTATION)
  updates_stats      updates BatchNorm running statistics (side_effects: STATS)
  saves              bytes its backward keeps, given its node (it keeps neither its output nor its
                     inputs as such: a bool mask, a weight); None: what the saved-for-backward table
                     says for `name` (`fxopt.analysis.saved_tensors`)
  weight_gradient    bytes of the gradient its backward makes for its weight (its first argument), given its node,
                     where that is not the weight's size (a sparse gradient); None: the weight's size
  gradient_in_place  its backward writes its input's gradient over its output's (one tensor, not two)
  runs_without_grad  "callable" or "method": it runs its first argument (a module, a function name, a
                     method name) under `torch.no_grad()`, and has that call's effects (side_effects,
                     `fxopt.analysis.grad_needs`)
  opaque             runs code fxopt does not read (a user's autograd Function: fxopt.capture.autograd_functions;
                     side_effects: OPAQUE)

A graph holds a function it passes to a helper by name (fx cannot print a function object as an
argument): `importable_name(fn)` gives that name, `import_by_name(name)` the function back.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Declared:
    """What a graph helper is and does besides computing its result (see module docstring)."""

    name: str | None = None
    mutates: bool = False
    updates_stats: bool = False
    saves: Callable | None = None  # node -> bytes its backward keeps
    weight_gradient: Callable | None = None  # node -> bytes of its weight's gradient
    gradient_in_place: bool = False  # its input's gradient is written over its output's
    runs_without_grad: str | None = None  # "callable", "method" or None
    opaque: bool = False


_GRAPH_FUNCTIONS: dict = {}  # function -> Declared


def graph_function(fn=None, *, name: str | None = None, mutates: bool = False, updates_stats: bool = False,
                   saves: Callable | None = None, weight_gradient: Callable | None = None,
                   gradient_in_place: bool = False, runs_without_grad: str | None = None, opaque: bool = False):
    """Declare `fn` as put into graphs by fxopt (see module docstring); bare, or with its facts."""
    def declare(f):
        _GRAPH_FUNCTIONS[f] = Declared(name, mutates, updates_stats, saves, weight_gradient, gradient_in_place,
                                         runs_without_grad, opaque)
        return f

    return declare(fn) if fn is not None else declare


def declared(fn) -> Declared | None:
    """What `fn` was declared to be, or None if it is not an fxopt graph helper."""
    try:
        return _GRAPH_FUNCTIONS.get(fn)
    except TypeError:  # an unhashable callable
        return None


def qualified_name(fn) -> str:
    """`module.qualname` of a callable."""
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"


@functools.cache
def import_by_name(name: str):
    """The object at `module.attr.attr` (the longest importable module prefix, then attributes)."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except (ImportError, TypeError, ValueError):
            continue
        for attr in parts[split:]:
            value = getattr(value, attr)
        return value
    raise ImportError(f"cannot import {name!r}")


def importable_name(fn) -> str | None:
    """A name `import_by_name` turns back into `fn` (a graph can hold it as a string), or None.

    torch's C functions report a class as their home (`torch._VariableFunctionsClass.relu`), so the
    public namespaces are tried too.
    """
    short = getattr(fn, "__name__", "")
    candidates = (qualified_name(fn), f"{getattr(fn, '__module__', None)}.{short}", f"torch.{short}",
                  f"torch.nn.functional.{short}", f"operator.{short}")
    for candidate in candidates:
        try:
            if import_by_name(candidate) is fn:
                return candidate
        except (ImportError, AttributeError):
            continue
    return None
