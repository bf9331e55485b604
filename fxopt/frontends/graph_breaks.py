"""Which of Dynamo's graph-break records belong in one model's reports.

Dynamo keeps one list of graph breaks for the whole process. A report takes the breaks recorded since the model's last
report; but a frame of another model (or of plain `torch.compile`) converted in between, or one of this model's that
produced no graph, records breaks too. So where fxopt sees the boundaries of the frames Dynamo converts for this model
(`converting()`, around Dynamo's frame callback: fxopt.optimize's results), a report takes only the breaks recorded
inside them, those of frames that made no graph included (a forward that breaks before any op reports its break with
the graph of the code after it). Where it does not (the backend handed to `torch.compile` directly), a report takes
every break recorded since any report of such a backend.
"""
from __future__ import annotations

import contextlib

from .. import _torch_private

_seen_without_frames = [0]  # the process's records already given to a report of a backend without frame boundaries


class GraphBreaks:
    """The graph-break records of one model's frames that no report has taken yet (see the module docstring)."""

    def __init__(self):
        self._pending: list[tuple[str, str]] = []  # recorded in this model's frames converted before
        self._converting_from: int | None = None  # while one of its frames converts: where its records start

    @contextlib.contextmanager
    def converting(self):
        """While Dynamo converts a frame of this model: the records it makes are this model's."""
        self._converting_from = _torch_private.graph_break_count()
        try:
            yield
        finally:
            self._pending += _torch_private.graph_breaks_since(self._converting_from)
            self._converting_from = None

    def take(self) -> list[tuple[str, str]]:
        """The breaks a report made now lists: this model's not yet reported, and none again after."""
        count = _torch_private.graph_break_count()
        if self._converting_from is None:  # no frame boundaries: every record since the last such report
            breaks, _seen_without_frames[0] = _torch_private.graph_breaks_since(_seen_without_frames[0]), count
            return breaks
        breaks, self._pending = self._pending + _torch_private.graph_breaks_since(self._converting_from), []
        self._converting_from = count
        return breaks
