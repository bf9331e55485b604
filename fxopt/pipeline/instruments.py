"""Instruments watch the pipeline: they see every graph before the first pass and after each pass.

They never change a graph. The CLI turns its flags into these (`--show-graph`, `--diff`,
`--dump-dir`); per-pass timing is always in the report.
"""
from __future__ import annotations

import difflib
import pathlib
import sys
from typing import TextIO

import torch.fx as fx

from .report import PassReport


class Instrument:
    def start(self, graphs: dict[str, fx.GraphModule]) -> None:
        """Called once with the captured graphs, before any pass."""

    def after_pass(self, index: int, report: PassReport, code_before: dict[str, str],
                   graphs: dict[str, fx.GraphModule]) -> None:
        """Called after pass number `index` (1-based) ran over every graph."""


def _label(path: str) -> str:
    return path or "<model>"


class PrintGraphs(Instrument):
    """Print each graph's code after each pass (only after passes that changed it, by default)."""

    def __init__(self, stream: TextIO | None = None, only_changed: bool = True):
        self.stream = stream or sys.stdout
        self.only_changed = only_changed

    def after_pass(self, index, report, code_before, graphs):
        for path, gm in graphs.items():
            if self.only_changed and gm.code == code_before[path]:
                continue
            print(f"# ---- {_label(path)} after {report.name} ----{gm.code}", file=self.stream)


class PrintDiff(Instrument):
    """Print a unified diff of each graph's generated code before/after each pass that changed it."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout

    def after_pass(self, index, report, code_before, graphs):
        for path, gm in graphs.items():
            diff = difflib.unified_diff(code_before[path].splitlines(), gm.code.splitlines(),
                                        f"{_label(path)} before {report.name}", f"{_label(path)} after {report.name}",
                                        lineterm="")
            text = "\n".join(diff)
            if text:
                print(text, file=self.stream)


class DumpStages(Instrument):
    """Write every stage to `folder`: 00_input.py, 01_<pass>.py, ... (one section per graph)."""

    def __init__(self, folder: str | pathlib.Path):
        self.folder = pathlib.Path(folder)

    def _write(self, name: str, graphs: dict[str, fx.GraphModule]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        text = "\n".join(f"# ===== graph {_label(p)} =====\n{gm.code}" for p, gm in graphs.items())
        (self.folder / f"{name}.py").write_text(text)

    def start(self, graphs):
        self._write("00_input", graphs)

    def after_pass(self, index, report, code_before, graphs):
        self._write(f"{index:02d}_{report.name}", graphs)
