"""`fxopt inspect --html FILE`, and the same page from Python.

    from fxopt.frontends.html import optimize_and_explain
    fast = optimize_and_explain(model, (batch,), "fxopt.html", mode="training", memory_budget=0.5)

The page needs matplotlib for its plot: `pip install "fxopt[report]"`.
"""
from __future__ import annotations

import pathlib
import time

import torch

from ..api import normalize_inputs, optimize
from ..cli_inspect import CostEstimates
from .page import PageData, write_page
from .plot import check_matplotlib
from .snapshots import GraphSnapshots
from .timeline import StagePeaks, Timeline, measure_timeline


class PageRecorder:
    """The instruments the page needs (graphs per stage, measured peak per stage), and the rest of its data."""

    def __init__(self, inputs: tuple, training: bool):
        check_matplotlib()  # fail before the pipeline runs, not after
        self.inputs, self.training = inputs, training
        self.snapshots = GraphSnapshots()
        self.peaks = StagePeaks(inputs, training)

    @property
    def instruments(self) -> list:
        return [self.snapshots, self.peaks]

    @property
    def seconds(self) -> float:
        """Time its instruments took inside the pipeline."""
        return self.snapshots.seconds + self.peaks.seconds

    def timelines(self, model: torch.nn.Module, optimized: torch.nn.Module) -> list[Timeline]:
        """The step measured before (the caller's model) and after (fxopt's result)."""
        return [measure_timeline(model, self.inputs, self.training, "before fxopt"),
                measure_timeline(optimized, self.inputs, self.training, "after fxopt")]

    def page(self, name: str, inputs_text: str, report, timelines, estimates=(), timings=None) -> PageData:
        return PageData(name, inputs_text, report, timelines, self.snapshots.stages, self.peaks.peaks,
                        list(estimates), dict(timings or {}))


def describe_inputs(inputs: tuple) -> str:
    shapes = ", ".join("x".join(map(str, x.shape)) or "scalar" for x in inputs)
    dtypes = sorted({str(x.dtype).removeprefix("torch.") for x in inputs})
    return f"{shapes} ({', '.join(dtypes)})"


def optimize_and_explain(model: torch.nn.Module, example_inputs, path: str | pathlib.Path, *, mode: str = "auto",
                         passes=None, verify: bool = False, **pass_options) -> torch.nn.Module:
    """`fxopt.optimize(...)`, and the HTML page of what it did written to `path`; returns the optimized model."""
    inputs = normalize_inputs(example_inputs)
    training = mode == "training" or (mode == "auto" and model.training)
    recorder = PageRecorder(inputs, training)
    costs = CostEstimates(training)
    start = time.perf_counter()
    optimized = optimize(model, inputs, mode=mode, passes=passes, verify=verify,
                         instruments=[costs, *recorder.instruments], **pass_options)
    total = time.perf_counter() - start
    report = optimized.fxopt_report
    start = time.perf_counter()
    timelines = recorder.timelines(model, optimized)
    timings = phase_times(total, report, costs, recorder, time.perf_counter() - start)
    estimates = [costs.around(k) for k in range(1, len(report.passes) + 1)]
    write_page(path, recorder.page(type(model).__name__, describe_inputs(inputs), report, timelines,
                                   estimates, timings))
    return optimized


def phase_times(total: float, report, costs: CostEstimates, recorder: PageRecorder | None,
                after_seconds: float = 0.0) -> dict[str, float]:
    """Where the time of an `optimize` call that took `total` seconds went (and `after_seconds` measuring after)."""
    passes = sum(p.seconds for p in report.passes)
    measuring = (recorder.seconds if recorder else 0.0) + after_seconds
    times = {"capture and checks": total - passes - costs.seconds - (recorder.seconds if recorder else 0.0),
             "passes": passes, "estimates": costs.seconds}
    if recorder is not None:
        times["measuring memory"] = measuring
    return times
