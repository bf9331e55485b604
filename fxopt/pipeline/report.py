"""The report fxopt attaches to every optimized model: what each pass changed, refused, and why."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tabulate import tabulate

from ..passes.base import PassResult, Site


@dataclasses.dataclass
class PassReport(PassResult):
    """One pass over every captured graph of the model: its results summed, with time and sizes."""

    name: str
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    max_abs_diff: float | None = None  # set by verify=True

    @property
    def what_happened(self) -> str:
        """One line for the pass tables: why it was skipped, else its statistics, else "nothing to do"."""
        if self.skipped:
            return f"skipped: {self.skipped}"
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.stats.items())) or "nothing to do"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stats"] = dict(self.stats)
        d["figures"] = {key: _jsonable(value) for key, value in self.figures.items()}
        d["changed"] = self.changed
        return d


def _jsonable(value: Any) -> Any:
    """`value` as JSON data: containers element by element, other objects (a torch.Size, a dtype) as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


@dataclasses.dataclass
class Report:
    mode: str
    passes: list[PassReport] = dataclasses.field(default_factory=list)
    graphs: list[str] = dataclasses.field(default_factory=list)  # the graph's name
    dynamic_sizes: list[str] = dataclasses.field(default_factory=list)  # inputs with symbolic sizes (passes planned at
    # the sizes of the call that compiled the graph; what they decided holds at every size)
    size_class: str = ""  # a plan per size class (a dynamic training graph under memory_budget): the sizes it serves
    step_budget: str = ""  # a plan made again for its share of a step split by graph breaks (frontends/step_memory.py)
    compile_id: str | None = None  # Dynamo's: "frame/attempt"
    recompile_reason: str | None = None  # the guard that failed, for a graph compiled again
    graph_breaks: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (Dynamo's reason, file:line)
    not_optimized: str = ""  # why the graph runs as Dynamo captured it, without fxopt's passes

    def __getitem__(self, name: str) -> PassReport:
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "graphs": list(self.graphs),
            "passes": [p.to_dict() for p in self.passes],
            "dynamic_sizes": list(self.dynamic_sizes),
            "size_class": self.size_class,
            "step_budget": self.step_budget,
            "compile_id": self.compile_id,
            "recompile_reason": self.recompile_reason,
            "graph_breaks": [list(b) for b in self.graph_breaks],
            "not_optimized": self.not_optimized,
        }

    def pass_table(self, extra: dict[str, Callable[[int, PassReport], str]] | None = None) -> tuple[list, list]:
        """(headers, rows) of the pass table every front end shows: pass, nodes, what happened, the
        `extra` columns (header -> cell of (pass number from 1, pass)), time, and max |diff| if verified."""
        extra = extra or {}
        verified = any(p.max_abs_diff is not None for p in self.passes)
        headers = ["pass", "nodes", "what happened", *extra, "time"] + (["max |diff|"] if verified else [])
        rows = []
        for index, p in enumerate(self.passes, start=1):
            row = [p.name, f"{p.nodes_before} → {p.nodes_after}", p.what_happened,
                   *(cell(index, p) for cell in extra.values()), f"{p.seconds * 1e3:.1f} ms"]
            if verified:
                row.append("-" if p.max_abs_diff is None else f"{p.max_abs_diff:.2e}")
            rows.append(row)
        return headers, rows

    def summary_table(self) -> str:
        headers, rows = self.pass_table()
        return tabulate(rows, headers=headers)

    def sites_table(self, keep: Callable[[PassReport, Site], bool] = lambda p, s: True) -> str:
        """Every site of every pass (those `keep(pass, site)` accepts), or "" if there are none."""
        rows = [[p.name, s.node, s.action, s.reason, s.detail] for p in self.passes for s in p.sites if keep(p, s)]
        return tabulate(rows, headers=["pass", "node", "action", "reason", "detail"]) if rows else ""

    @property
    def runs_as_captured(self) -> bool:
        """Whether no pass planned or changed anything in this graph: fxopt left it as Dynamo captured it."""
        return bool(self.not_optimized) or (bool(self.passes) and all(p.skipped for p in self.passes))

    def dynamo_sections(self) -> list[str]:
        """Lines on what TorchDynamo did for this graph: why it compiled again, the graph breaks before it,
        which input sizes are symbolic, and why fxopt left the graph as captured (empty if none of these)."""
        lines = []
        if self.not_optimized:
            lines += ["", f"Not optimized (runs as Dynamo captured it, at eager's cost): {self.not_optimized}"]
        if self.recompile_reason:
            lines += ["", f"Compiled again ({self.compile_id}) because a guard failed: {self.recompile_reason}"]
        if self.graph_breaks:
            lines += ["", "Graph breaks (the code between graphs runs as Python):",
                      tabulate([[where, why] for why, where in self.graph_breaks], headers=["where", "Dynamo's reason"])]
        if self.size_class:
            lines += ["", f"Dynamic sizes: {'; '.join(self.dynamic_sizes)}. This plan serves the size class "
                      f"{self.size_class}; the first call of another class is planned at its own sizes"]
        elif self.dynamic_sizes and self.runs_as_captured:
            lines += ["", "Dynamic sizes (the graph runs as captured, at every size): " + "; ".join(self.dynamic_sizes)]
        elif self.dynamic_sizes:
            lines += ["", "Dynamic sizes (planned at the sizes of the call that compiled the graph; one plan serves "
                      "every size): " + "; ".join(self.dynamic_sizes)]
        if self.step_budget:
            lines += ["", f"This graph was {self.step_budget}"]
        return lines

    def __str__(self) -> str:
        parts = [f"fxopt report ({self.mode}, {len(self.graphs)} graph(s))",
                 *(f"{p.name}: {p.figures['headline']}" for p in self.passes if p.figures.get("headline")),
                 self.summary_table(),
                 *self.dynamo_sections()]
        sites = self.sites_table()
        if sites:
            parts += ["", sites]
        return "\n".join(parts)
