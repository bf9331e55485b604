"""Which of a model's outputs a loss differentiates (`differentiable_outputs`): parsing and checking the option."""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from .errors import FxoptError


@dataclasses.dataclass(frozen=True)
class OutputPlaces:
    """Where a model's outputs are among its Dynamo graph's outputs: each output's index or key with the
    positions of its tensors (`entries`), found for a graph of `graph_outputs` outputs."""

    entries: tuple[tuple[Hashable, tuple[int, ...]], ...]
    graph_outputs: int

    def entries_of(self, graph_outputs: int) -> dict[Hashable, tuple[int, ...]] | None:
        """The entries for a graph returning `graph_outputs` outputs (a recompile of the same frame), or None
        for a graph these places were not found on."""
        return dict(self.entries) if graph_outputs == self.graph_outputs else None


def parse_differentiable_outputs(value) -> tuple | None:
    """None, or a tuple of output indices (ints) or of dict keys (strs); anything else is an FxoptError."""
    if value is None:
        return None
    items = [value] if isinstance(value, (int, str)) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, (int, str)) and not isinstance(i, bool)
                                                     for i in items):
        raise FxoptError(f"differentiable_outputs must be None, an output index, a dict key, or a list of "
                         f"them; got {value!r}")
    if len({type(i) for i in items}) > 1:
        raise FxoptError(f"differentiable_outputs mixes indices and keys: {value!r}")
    return tuple(items)


def entries_of(out) -> dict[Hashable, object]:
    """A returned structure's entries by index (tuple/list or a single value) or key (dict)."""
    if isinstance(out, dict):
        return dict(out)
    if isinstance(out, (tuple, list)):
        return dict(enumerate(out))
    return {0: out}


def chosen_outputs(entries: dict, selection: tuple) -> set:
    """The keys of `entries` that `selection` (parsed differentiable_outputs) names; bad names: FxoptError."""
    keyed = bool(entries) and all(isinstance(k, str) for k in entries)
    for item in selection:
        if isinstance(item, str) and not keyed:
            raise FxoptError(f"differentiable_outputs names key {item!r}, but the model returns "
                             f"{len(entries)} positional output(s); use indices 0..{len(entries) - 1}")
        if isinstance(item, int) and keyed:
            raise FxoptError(f"differentiable_outputs gives index {item}, but the model returns a dict; "
                             f"use its keys: {', '.join(map(repr, entries))}")
        if item not in entries:
            what = (f"keys: {', '.join(map(repr, entries))}" if keyed
                    else f"{len(entries)} output(s), indices 0..{len(entries) - 1}")
            raise FxoptError(f"differentiable_outputs {item!r} is not an output of the model ({what})")
    return set(selection)
