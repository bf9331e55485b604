"""fxopt's own functions inside graphs (`folded_conv_bn_params`, `relu_mask`, the no-grad wrappers, ...).

Passes emit these helpers as single `call_function` nodes. Each is declared with
`@graph_function`, saying what it does besides computing its result (`mutates`,
`updates_stats`), which is what `fxopt.analysis.side_effects` reports for its calls.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Declared:
    """What a graph helper does besides computing its result."""

    mutates: bool = False  # writes into a tensor it is given
    updates_stats: bool = False  # updates BatchNorm running statistics


_GRAPH_FUNCTIONS: dict = {}  # function -> Declared


def graph_function(fn=None, *, mutates: bool = False, updates_stats: bool = False):
    """Declare `fn` as emitted into graphs by a pass (see module docstring); bare, or with its effects."""
    def declare(f):
        _GRAPH_FUNCTIONS[f] = Declared(mutates, updates_stats)
        return f

    return declare(fn) if fn is not None else declare


def declared(fn) -> Declared | None:
    """What `fn` was declared to do, or None if it is not an fxopt graph helper."""
    try:
        return _GRAPH_FUNCTIONS.get(fn)
    except TypeError:  # an unhashable callable
        return None
