"""The report fxopt attaches to every optimized model: what each pass changed, refused, and why."""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

from tabulate import tabulate

from ..capture import OpaqueModule, Specialization
from ..guards import Guard, GuardSet
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
    opaque: list[OpaqueModule] = dataclasses.field(default_factory=list)
    specialized: list[Specialization] = dataclasses.field(default_factory=list)  # graphs guarded by a call check
    graphs: list[str] = dataclasses.field(default_factory=list)  # where each captured graph sits
    guards: list[Guard] = dataclasses.field(default_factory=list)  # facts the result checks on every call
    guard_events: Counter = dataclasses.field(default_factory=Counter)  # "<fact>: <what fxopt did>" -> calls

    def __getitem__(self, name: str) -> PassReport:
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "graphs": list(self.graphs),
            "opaque_modules": [dataclasses.asdict(o) for o in self.opaque],
            "specialized_graphs": [dataclasses.asdict(s) for s in self.specialized],
            "passes": [p.to_dict() for p in self.passes],
            "guards": [g.to_dict() for g in self.guards],
            "guard_events": dict(self.guard_events),
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

    def capture_sections(self) -> list[str]:
        """Lines listing the opaque modules and the specialized graphs (empty if there are none)."""
        lines = []
        if self.opaque:
            rows = [[o.path or "<model>", o.type, o.reason] for o in self.opaque]
            lines += ["", "Opaque modules (run unchanged; their children may still be optimized):",
                      tabulate(rows, headers=["module", "type", "why"])]
        if self.specialized:
            rows = [[s.path or "<model>", s.assumes] for s in self.specialized]
            lines += ["", "Specialized graphs (any other call runs the original module):",
                      tabulate(rows, headers=["module", "graph assumes"])]
        return lines

    def guard_sections(self) -> list[str]:
        """Lines summarizing the guards (per owner and kind) and what happened when one failed."""
        lines = []
        if self.guards:
            rows = [[owner, kind, count, example] for owner, kind, count, example in GuardSet(self.guards).summary()]
            lines += ["", "Guards (checked on every call; when one fails fxopt re-optimizes or runs the original):",
                      tabulate(rows, headers=["owner", "kind", "count", "first"])]
        if self.guard_events:
            rows = [[what, n] for what, n in self.guard_events.items()]
            lines += ["", tabulate(rows, headers=["guard failed: what fxopt did", "calls"])]
        return lines

    def __str__(self) -> str:
        parts = [f"fxopt report ({self.mode}, {len(self.graphs)} graph(s))",
                 *(f"{p.name}: {p.figures['headline']}" for p in self.passes if p.figures.get("headline")),
                 self.summary_table(),
                 *self.capture_sections(), *self.guard_sections()]
        sites = self.sites_table()
        if sites:
            parts += ["", sites]
        return "\n".join(parts)
