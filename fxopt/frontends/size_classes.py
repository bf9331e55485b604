"""A dynamic training graph under `memory_budget`, planned again for each size class it runs.

A graph Dynamo made dynamic runs every length, but what `checkpoint_activations` keeps is decided at one
call's sizes. Where the peak sits depends on them: GPT-2 at 2 x 52 tokens has its peak in the
vocabulary-sized logits and no region lowers it, so the plan keeps none; at 2 x 512 the activations hold
the peak and that plan recomputes nothing (1.00x of eager's peak at budget 0.5). So each symbolic size
is put in a class, the powers of two bounding it (17..32, 33..64, ...), and the first call of a class
plans the graph at its own sizes; the calls after it in the class run that plan. A plan made anywhere in
a class is made at sizes within a factor of two of every call it serves, and a loop over lengths up to
L plans at most log2(L) times per dynamic dimension. The graph itself is generic (any size runs it), so
a plan is always correct; the class only decides which plan is priced for the call. Where graph breaks split a
step under a size budget, a class may also be planned again once for its share of the step
(fxopt/frontends/step_memory.py).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.fx as fx

from .step_memory import StepBudget, StepLedger, StepShare


def _tensor_placeholders(gm: fx.GraphModule):
    """(input position, placeholder, its example value) of each of a Dynamo graph's tensor inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [(position, node, value) for position, node in enumerate(placeholders)
            if isinstance(value := node.meta.get("example_value"), torch.Tensor)]


def symbolic_dims(gm: fx.GraphModule) -> list[tuple[int, int, str]]:
    """(input position, dimension, placeholder name) of every symbolic size among a Dynamo graph's tensor inputs."""
    return [(position, dim, node.name) for position, node, value in _tensor_placeholders(gm)
            for dim, size in enumerate(value.shape) if not isinstance(size, int)]


def symbolic_inputs(gm: fx.GraphModule) -> list[str]:
    """The tensor inputs of a Dynamo graph with a symbolic size, as `name: [s0, 3]` (the report's dynamic sizes)."""
    return [f"{node.name}: {list(value.shape)}" for _, node, value in _tensor_placeholders(gm)
            if any(not isinstance(size, int) for size in value.shape)]


def size_class(size: int) -> int:
    """The class of a size: k for sizes in 2**(k-1)+1 .. 2**k (1 is class 0, 2 class 1, 3..4 class 2)."""
    return (size - 1).bit_length()


def describe_class(dims: list[tuple[int, int, str]], key: tuple[int, ...]) -> str:
    """`L_input_ids_ dim 1 in 33..64` for each symbolic size."""
    return "; ".join(f"{name} dim {dim} in {_lowest(k)}..{2 ** k}" for (_, dim, name), k in zip(dims, key))


def _lowest(k: int) -> int:
    return 2 ** (k - 1) + 1 if k > 0 else 1


Plan = tuple[Callable, StepShare | None]  # a plan's forward, and its part in the step (None: none to share)


class SizeClassPlans:
    """Calls a plan of the graph priced for the call's size class, planning one (`plan(args, size_class,
    step_budget)`) at the first call of a class; `first` is the plan made when Dynamo compiled the graph, for
    `first_args`' class. A graph without symbolic sizes has one class. Each call of a plan with a share of the
    step's budget is recorded in `ledger`, which may have the class planned again for the step
    (fxopt/frontends/step_memory.py)."""

    def __init__(self, dims: list[tuple[int, int, str]], first_args: list, first: Plan,
                 plan: Callable[[list, str, StepBudget | None], Plan], ledger: StepLedger | None):
        self.dims = dims
        self.plan = plan
        self.ledger = ledger
        self.plans = {self.key_of(dims, first_args): first}
        self.step_budgets: dict[tuple[int, ...], StepBudget] = {}

    @staticmethod
    def key_of(dims: list[tuple[int, int, str]], args) -> tuple[int, ...]:
        """The size class of each symbolic size in a call with `args`."""
        return tuple(size_class(args[position].shape[dim]) for position, dim, _ in dims)

    def __call__(self, *args):
        key = self.key_of(self.dims, args) if self.dims else ()
        planned = self.plans.get(key)
        if planned is None:
            planned = self.plans[key] = self.plan(list(args), describe_class(self.dims, key),
                                                  self.step_budgets.get(key))
        forward, share = planned
        outputs = forward(*args)
        if share is not None and self.ledger is not None:
            self.ledger.record(outputs, share, functools.partial(self.replan, key))
        return outputs

    def replan(self, key: tuple[int, ...], step_budget: StepBudget) -> None:
        """Plan class `key` again at its next call, for `step_budget`: once per class."""
        if key not in self.step_budgets:
            self.step_budgets[key] = step_budget
            self.plans.pop(key, None)
