"""Run passes in order over every captured graph, checking the graph after each one.

After each pass: `graph.lint()`, and where it changed the graph `recompile()` and the shapes of what it changed
brought up to date; the instruments called, and (with a verifier) the whole model compared with the original. An
exception inside a pass is re-raised as FxoptError naming that pass and the ones before it.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
import torch.fx as fx

from ..analysis.shapes import update_shapes
from ..capture import CapturedGraph
from ..errors import FxoptError
from ..model_copy import graph_snapshot
from ..passes.base import Pass, PassContext, PassResult
from .instruments import Instrument
from .report import PassReport, Report
from .verify import Verifier


def _code_of(graph: fx.Graph) -> list[tuple]:
    """What a graph's generated code is made of, node by node: equal lists give the same code."""
    return [(n, n.name, n.op, n.target, n.args, n.kwargs, n.type) for n in graph.nodes]


class PassManager:
    def __init__(self, passes: Sequence[Pass], instruments: Sequence[Instrument] = (),
                 verifier: Verifier | None = None):
        self.passes = list(passes)
        self.instruments = list(instruments)
        self.verifier = verifier

    def run(self, module: torch.nn.Module, graphs: Sequence[CapturedGraph], ctx: PassContext) -> Report:
        report = Report(ctx.mode, graphs=[g.path for g in graphs])
        by_path = {g.path: g.gm for g in graphs}
        captured = {g.path: graph_snapshot(g.gm) for g in graphs} if any(p.reads_captured_graph for p in self.passes) else {}
        for instrument in self.instruments:
            instrument.start(by_path)
        for index, p in enumerate(self.passes, start=1):
            entry = PassReport(p.name)
            if ctx.mode not in p.modes:  # named for graphs of either mode (torch.compile): not this one
                entry.skipped = f"runs only in {' and '.join(p.modes)} mode, this graph is {ctx.mode}"
                report.passes.append(entry)
                continue
            code_before = {path: gm.code for path, gm in by_path.items()}
            for g in graphs:
                self._run_one(p, g, dataclasses.replace(ctx, graph_path=g.path, captured=captured.get(g.path),
                                                                  constant_inputs=ctx.constant_inputs | g.constant_inputs,
                                                                  later_passes=tuple(q.name for q in self.passes[index:])),
                              entry,
                              done=[q.name for q in self.passes[:index - 1]], qualify=len(graphs) > 1)
            report.passes.append(entry)
            for instrument in self.instruments:  # before verifying, so a failing stage is still shown
                instrument.after_pass(index, entry, code_before, by_path)
            if self.verifier is not None:
                entry.max_abs_diff = self.verifier.check(module, p.name)
        return report

    @staticmethod
    def _run_one(p: Pass, g: CapturedGraph, ctx: PassContext, entry: PassReport, done: list[str],
                qualify: bool) -> None:
        gm: fx.GraphModule = g.gm
        nodes_before = len(gm.graph.nodes)
        start = time.perf_counter()
        try:
            code_before = _code_of(gm.graph)
            result = p.run(gm, ctx)
            if not isinstance(result, PassResult):
                raise TypeError(f"run() returned {type(result).__name__}, not a PassResult")
            gm.graph.lint()
            # a pass that changed nothing needs no recompile (HF MobileNetV2 in training: 3 of 6 passes; 25-40 ms each)
            if _code_of(gm.graph) != code_before:
                gm.recompile()
                if g.example_inputs is not None:  # a joint graph's rewrites keep its values' metadata themselves
                    update_shapes(gm, g.example_inputs)
        except FxoptError:
            raise
        except Exception as e:
            after = f" (after {', '.join(done)})" if done else " (the first pass)"
            where = f" on graph {g.path!r}" if g.path else ""
            raise FxoptError(f"pass {p.name!r} failed{where}{after}: {type(e).__name__}: {e}") from e
        entry.seconds += time.perf_counter() - start
        entry.nodes_before += nodes_before
        entry.nodes_after += len(gm.graph.nodes)
        entry.stats.update(result.stats)
        prefix = f"{g.path}:" if qualify else ""  # sites of several graphs say whose they are
        for site in result.sites:
            site.node = prefix + site.node
        entry.sites.extend(result.sites)
        for key, value in result.figures.items():
            if isinstance(value, (int, float, list)):  # summed, or concatenated, over the graphs
                entry.figures[key] = entry.figures.get(key, type(value)()) + value
            else:
                entry.figures[key] = value
        if result.skipped:
            entry.skipped = result.skipped
