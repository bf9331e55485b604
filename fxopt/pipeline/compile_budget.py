"""`memory_budget` under torch.compile: fxopt's plans as tags for AOTAutograd's partitioner.

    torch.compile(model, backend="fxopt", options={"memory_budget": 0.5})      # or "64MB"

On the eager path `checkpoint_activations` wraps regions in `torch.utils.checkpoint`. Under torch.compile AOTAutograd's
min-cut partitioner decides what the forward saves; fxopt's planner offers it plans as tags
(fxopt.checkpointing.candidates) and a partition function takes the cheapest whose predicted step peak fits
(fxopt.checkpointing.partitioner). The joint graph's rewrites (`JOINT_PASSES`) run here, by the PassManager, so they are
linted and reported like any pass. Budgets are parsed as in `fxopt.optimize` (fxopt.checkpointing.budget); under
torch.compile they bound the step peak: a graph split from others by graph breaks gets the budget less what the step's
earlier graphs keep (the backend's ledger, fxopt/frontends/step_memory.py), as on the eager path.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from .. import _torch_private
from ..capture import CapturedGraph
from ..checkpointing.budget import KeptBytes, parse_budget
from ..checkpointing.candidates import plan_candidates
from ..checkpointing.partitioner import BudgetPartitioner
from ..errors import FxoptError
from ..passes import JOINT_PASSES
from ..passes.base import TRAINING, PassContext
from .manager import PassManager
from .report import PassReport, Report

__all__ = ["compile_with_memory_budget", "parse_budget"]


class _JointRewrites:
    """The joint passes, run by the PassManager on each joint graph the partitioner is given; their reports kept."""

    def __init__(self):
        self.reports: list[PassReport] = []

    def __call__(self, joint: fx.GraphModule) -> None:
        manager = PassManager([p() for p in JOINT_PASSES])
        report = manager.run(None, [CapturedGraph("joint", joint, None)], PassContext(TRAINING, aot_autograd_next=True))
        self.reports.extend(report.passes)


def compile_with_memory_budget(gm: fx.GraphModule, example_inputs: list, budget, inner: str,
                               report: Report | None = None, held: KeptBytes = KeptBytes()):
    """Compile a training graph with `inner` ("inductor" or "aot_eager") so its step peak fits `budget` while the step's
    earlier graphs keep `held` (graphs split by graph breaks share the budget); the outcome goes into `report`'s
    checkpoint_activations entry."""
    if inner == "inductor" and not _torch_private.has_custom_partitioner():
        raise FxoptError("memory_budget under torch.compile with inner='inductor' needs a torch whose Inductor takes "
                         "a custom partitioner (torch >= 2.8); use inner='aot_eager' or fxopt.optimize")
    rewrites = _JointRewrites()
    partitioner = BudgetPartitioner(budget, plan_candidates(gm, example_inputs), rewrite_joint=rewrites, held=held)
    if inner == "aot_eager":
        compiled = _torch_private.aot_eager_compile(gm, example_inputs, partitioner)
    else:
        compiled = _torch_private.inductor_compile_with_partitioner(gm, example_inputs, partitioner)
    if report is not None and partitioner.outcome is not None:
        entry = PassReport(name="checkpoint_activations", figures=dataclasses.asdict(partitioner.outcome))
        entry.figures["joint_rewrites"] = {r.name: sum(r.stats.values()) for r in rewrites.reports}
        if not partitioner.outcome.budget_met:
            entry.figures["headline"] = (f"memory_budget {budget!r} NOT met under torch.compile: lowest reachable "
                                         f"step peak {partitioner.outcome.peak_bytes_after / 1e6:.2f} MB")
        report.passes = [p for p in report.passes if p.name != entry.name] + [entry]
    return compiled
