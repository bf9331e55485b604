"""`fxopt inspect`: run the pipeline on a model and show, pass by pass, what it did.

Per pass: nodes before/after, what changed and what was refused (with reasons), estimated
FLOPs and saved-for-backward bytes before/after (fake-tensor estimates from
`fxopt.analysis.costs`), time taken and, with --verify, the largest difference from the
original model. The same facts come out as JSON with `--json` (keys listed in `JSON_KEYS`).
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.fx as fx
from tabulate import tabulate

from .._version import __version__
from ..analysis.costs import Costs, estimate_costs, placeholder_values
from ..pipeline.instruments import Instrument
from ..errors import FxoptError
from ..pipeline.report import PassReport, Report
from .cli_loading import describe_inputs

# The documented, stable shape of `fxopt inspect --json` (README "Inspecting a model").
JSON_KEYS = {
    "top": ("fxopt_version", "model", "mode", "inputs", "graphs", "compile_id", "recompile_reason", "graph_breaks",
            "dynamic_sizes", "size_class", "step_budget", "not_optimized", "passes", "summary"),
    "input": ("shape", "dtype"),
    "pass": ("name", "seconds", "nodes_before", "nodes_after", "changed", "stats", "sites", "figures", "skipped",
             "max_abs_diff", "estimated"),
    "site": ("action", "node", "reason", "detail"),
    "estimated": ("flops_before", "flops_after", "saved_bytes_before", "saved_bytes_after"),
    "summary": ("passes_run", "passes_changed", "sites_changed", "sites_refused", "nodes_before", "nodes_after",
                "flops_before", "flops_after", "saved_bytes_before", "saved_bytes_after", "seconds",
                "phase_seconds"),
}


def _outermost(paths) -> list[str]:
    """Graph paths not nested in another captured graph (running those runs the nested ones too)."""
    paths = list(paths)
    return [p for p in paths if not any(q != p and (q == "" or p.startswith(q + ".")) for q in paths)]


class CostEstimates(Instrument):
    """Estimate the model's costs before the first pass and after each pass that changed something."""

    def __init__(self, training: bool):
        self.training = training
        self.stages: list[Costs | None] = []  # stages[0]: captured input; stages[i]: after pass i
        self.seconds = 0.0  # time spent estimating

    def _estimate(self, graphs: dict[str, fx.GraphModule]) -> Costs | None:
        start = time.perf_counter()
        try:
            return self._sum(graphs)
        finally:
            self.seconds += time.perf_counter() - start

    def _sum(self, graphs: dict[str, fx.GraphModule]) -> Costs | None:
        parts = [estimate_costs(graphs[p], placeholder_values(graphs[p]), self.training) for p in _outermost(graphs)]
        if any(c is None for c in parts):
            return None
        saved = None if not self.training else sum(c.saved_bytes for c in parts)
        return Costs(sum(c.flops for c in parts), saved)

    def start(self, graphs):
        self.stages.append(self._estimate(graphs))

    def after_pass(self, index, report, code_before, graphs):
        self.stages.append(self._estimate(graphs) if report.changed else self.stages[-1])

    def around(self, index: int) -> dict[str, int | None]:
        """Estimates before and after pass number `index` (1-based), the `estimated` JSON record."""
        before, after = self.stages[index - 1], self.stages[index]
        return {
            "flops_before": before and before.flops, "flops_after": after and after.flops,
            "saved_bytes_before": before and before.saved_bytes, "saved_bytes_after": after and after.saved_bytes,
        }


class PassProgress(Instrument):
    """Say on the progress line which pass ran, with the time elapsed."""

    def __init__(self, progress):
        self.progress = progress

    def start(self, graphs):
        self.progress.status(f"captured {len(graphs)} graph(s); running the passes")

    def after_pass(self, index, report, code_before, graphs):
        self.progress.status(f"pass {index} ({report.name}) done")


def phase_times(total: float, report: Report, costs: CostEstimates, recorder=None) -> dict[str, float]:
    """Where the `total` seconds of an `optimize` call went: capture (with shape propagation, first-use
    imports and any verification), the passes, the cost estimates; and, for the HTML page (`recorder`),
    measuring memory inside the pipeline and after it."""
    passes = sum(p.seconds for p in report.passes)
    inside = recorder.pipeline_seconds if recorder is not None else 0.0
    times = {"capture and checks": max(0.0, total - passes - costs.seconds - inside), "passes": passes,
             "estimates": costs.seconds}
    if recorder is not None:
        times["measuring memory"] = recorder.seconds
    return times


def _si(value: int | None, unit: str) -> str:
    if value is None:
        return "?"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value} {unit}"


def human_bytes(n: int | None) -> str:
    """Bytes with a binary unit and three or four significant digits: '4.00 MiB', '1020 KiB', '512 B'."""
    if n is None:
        return "?"
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            value = n / scale
            digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
            return f"{value:.{digits}f} {unit}"
    return f"{n} B"


def format_change(before, after, fmt) -> str:
    if before is None or after is None:
        return f"{fmt(before)} → {fmt(after)}"
    if before == after:
        return fmt(before)
    ratio = f" ({(after - before) / before:+.1%})" if before else ""
    return f"{fmt(before)} → {fmt(after)}{ratio}"


def format_flops(n):
    return _si(n, "FLOP")


@dataclasses.dataclass
class InspectResult:
    spec: str
    inputs: tuple
    report: Report
    costs: CostEstimates
    timings: dict[str, float] = dataclasses.field(default_factory=dict)  # phase -> seconds (phase_times)
    only: str | None = None  # list only "changed" or "refused" sites
    pass_filter: str | None = None  # list only this pass's sites

    def __post_init__(self):
        names = [p.name for p in self.report.passes]
        if self.pass_filter is not None and self.pass_filter not in names:
            raise FxoptError(f"--pass {self.pass_filter!r}: no such pass ran; passes that ran: {', '.join(names)}")

    @property
    def training(self) -> bool:
        return self.report.mode == "training"

    def to_dict(self) -> dict:
        data = {"fxopt_version": __version__, "model": self.spec,
                "inputs": [{"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
                           for x in self.inputs if isinstance(x, torch.Tensor)],
                **self.report.to_dict()}
        data["passes"] = [{**entry, "estimated": self.costs.around(index)} for index, entry in
                          enumerate(data["passes"], start=1)]
        data["passes"] = [{key: entry[key] for key in JSON_KEYS["pass"]} for entry in data["passes"]]
        data["summary"] = self.summary()
        return {key: data[key] for key in JSON_KEYS["top"]}

    def summary(self) -> dict:
        passes = self.report.passes
        first, last = self.costs.stages[0], self.costs.stages[-1]
        sites = [s for p in passes for s in p.sites]
        return {
            "passes_run": len(passes),
            "passes_changed": sum(p.changed for p in passes),
            "sites_changed": sum(not s.refused for s in sites),
            "sites_refused": sum(s.refused for s in sites),
            "nodes_before": passes[0].nodes_before, "nodes_after": passes[-1].nodes_after,
            "flops_before": first and first.flops, "flops_after": last and last.flops,
            "saved_bytes_before": first and first.saved_bytes, "saved_bytes_after": last and last.saved_bytes,
            "seconds": sum(p.seconds for p in passes),
            "phase_seconds": dict(self.timings),
        }

    def passes_table(self) -> str:
        def estimate(what: str, fmt):
            return lambda index, p: format_change(self.costs.around(index)[f"{what}_before"],
                                                  self.costs.around(index)[f"{what}_after"], fmt)

        extra = {"FLOPs (est.)": estimate("flops", format_flops)}
        if self.training:
            extra["saved for backward (est.)"] = estimate("saved_bytes", human_bytes)
        headers, rows = self.report.pass_table(extra)
        return tabulate(rows, headers=headers)

    def summary_line(self) -> str:
        s = self.summary()
        parts = [f"{s['passes_run']} pass(es), {s['passes_changed']} changed the model",
                 f"{s['sites_changed']} site(s) rewritten, {s['sites_refused']} refused",
                 f"nodes {s['nodes_before']} → {s['nodes_after']}",
                 f"FLOPs {format_change(s['flops_before'], s['flops_after'], format_flops)}"]
        if self.training:
            parts.append(f"saved for backward {format_change(s['saved_bytes_before'], s['saved_bytes_after'], human_bytes)}")
        if self.timings:
            parts.append("time: " + ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.timings.items()))
        else:
            parts.append(f"{s['seconds'] * 1e3:.1f} ms")
        return "Summary: " + "; ".join(parts)

    def _keep_site(self, p: PassReport, site) -> bool:
        if self.pass_filter is not None and p.name != self.pass_filter:
            return False
        return self.only is None or site.refused == (self.only == "refused")

    def __str__(self) -> str:
        lines = [f"fxopt inspect {self.spec}: {self.report.mode}, inputs {describe_inputs(self.inputs)}, "
                 f"{len(self.report.graphs)} graph(s)", "", self.passes_table()]
        sites = self.report.sites_table(self._keep_site)
        if sites:
            lines += ["", sites]
        elif self.only or self.pass_filter:
            lines += ["", "(no site matches --only / --pass)"]
        lines += self.report.dynamo_sections()
        if self.report.graph_breaks:
            lines += ["", "(estimates cover this graph; the code Dynamo left outside it is not counted)"]
        if self.costs.stages[0] is None:
            lines += ["", "(? : the estimate needs a run on fake tensors, which this model's code does not allow)"]
        lines += ["", self.summary_line()]
        return "\n".join(lines)
