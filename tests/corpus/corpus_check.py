"""One corpus run: optimize a model in a mode (with or without a memory budget), compare with eager,
and summarize from `report.to_dict()` what each pass did.

Shared by the corpus tests (`test_corpus.py`) and the table (`python -m tests.corpus.table`).
"""
from __future__ import annotations

import dataclasses

import torch

import fxopt
from fxopt.pipeline.verify import max_difference, run_step

from corpus_models import build
from device_under_test import DEVICE

TOLERANCE = 1e-7  # float64: a larger difference is a bug, not rounding
BUDGET = 0.5
VARIANTS = {  # name -> (mode, pass options)
    "inference": ("inference", {}),
    "training": ("training", {}),
    "training+budget": ("training", {"memory_budget": BUDGET}),
}
# Table columns: (header, pass name, which stats count). None = the sites the pass changed.
COLUMNS = (("folded", "fold_conv_bn", None), ("in-place", "inplace_relu", None),
           ("checkpointed", "checkpoint_activations", None), ("pruned", "prune_dead_grads", None))


@dataclasses.dataclass
class CorpusResult:
    model: str
    variant: str
    max_diff: float
    worst: str  # the tensor that differs most
    ok: bool
    report: dict  # report.to_dict()

    def changed(self, pass_name: str) -> int:
        """Sites the pass changed: its stats that are not refusals (robust to new stat names)."""
        for p in self.report.get("passes", []):
            if p["name"] == pass_name:
                return sum(n for key, n in p["stats"].items() if not key.startswith(("refused", "skipped")))
        return 0

    def refused(self, pass_name: str) -> int:
        for p in self.report.get("passes", []):
            if p["name"] == pass_name:
                return sum(n for key, n in p["stats"].items() if key.startswith("refused"))
        return 0

    @property
    def opaque(self) -> int:
        return len(self.report.get("opaque_modules", []))

    @property
    def guards(self) -> int:
        """Assumptions checked per call: specialized graphs, and the guards list where the report has one."""
        return len(self.report.get("specialized_graphs", [])) + len(self.report.get("guards", []))


def run(model_name: str, variant: str, dtype=torch.float64, tolerance: float = TOLERANCE) -> CorpusResult:
    mode, options = VARIANTS[variant]
    model, inputs = build(model_name, training=mode == "training", dtype=dtype)
    model, inputs = model.to(DEVICE), tuple(x.to(DEVICE) for x in inputs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimized = fxopt.optimize(model, inputs, mode=mode, **options)
    assert all(p.grad is None for p in model.parameters()), "optimize() left .grad on the caller's parameters"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "optimize() changed the caller's state"
    training = mode == "training"
    reference = run_step(model, inputs, training).tensors
    got = run_step(optimized, inputs, training).tensors
    worst, name, ok = max_difference(reference, got, tolerance, tolerance)
    return CorpusResult(model_name, variant, worst, name, ok, optimized.fxopt_report.to_dict())
