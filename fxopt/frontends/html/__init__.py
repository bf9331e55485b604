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
from ...errors import FxoptError
from ..cli_inspect import CostEstimates, phase_times
from .page import PageData, write_page
from .plot import check_matplotlib
from .snapshots import GraphSnapshots
from .timeline import StagePeaks, measure_timeline


class PageRecorder:
    """Collects what the page shows: the instruments it needs inside the pipeline (each stage's graphs,
    each stage's measured peak), then the before/after timelines, and writes the page."""

    def __init__(self, inputs: tuple, training: bool):
        check_matplotlib()  # fail before the pipeline runs, not after
        self.inputs, self.training = inputs, training
        self.snapshots = GraphSnapshots()
        self.peaks = StagePeaks(inputs, training)
        self.after_seconds = 0.0  # measuring the timelines, after the pipeline

    @property
    def instruments(self) -> list:
        return [self.snapshots, self.peaks]

    @property
    def pipeline_seconds(self) -> float:
        """Time its instruments took inside the pipeline."""
        return self.snapshots.seconds + self.peaks.seconds

    @property
    def seconds(self) -> float:
        return self.pipeline_seconds + self.after_seconds

    def write(self, path: str | pathlib.Path, name: str, model: torch.nn.Module, optimized: torch.nn.Module,
              costs: CostEstimates, optimize_seconds: float) -> dict[str, float]:
        """Measure the step before (the caller's model) and after (fxopt's result), write the page; return
        where the time went (`phase_times`)."""
        start = time.perf_counter()
        # The optimized graph itself, on the inputs it was compiled on (its parameters among them): the
        # timeline's attribution hooks on the result would make Dynamo compile it again, with them inside.
        graph_inputs = optimized.graph_inputs if len(optimized.graph_modules) == 1 else None
        timelines = [measure_timeline(model, self.inputs, self.training, "before fxopt")]
        if graph_inputs is not None:
            timelines.append(measure_timeline(optimized.graph_module, tuple(graph_inputs), self.training,
                                              "after fxopt"))
        self.after_seconds += time.perf_counter() - start
        report = optimized.fxopt_report
        timings = phase_times(optimize_seconds, report, costs, self)
        estimates = [costs.around(k) for k in range(1, len(report.passes) + 1)]
        page = PageData(name, describe_inputs(self.inputs), report, timelines, self.snapshots.stages,
                        self.peaks.peaks, estimates, timings)
        try:
            write_page(path, page)
        except OSError as e:
            raise FxoptError(f"cannot write the HTML page to {str(path)!r}: {e.strerror}") from e
        return timings


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
    recorder.write(path, type(model).__name__, model, optimized, costs, time.perf_counter() - start)
    return optimized
