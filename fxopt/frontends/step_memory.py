"""What the training graphs of the step in flight keep for backward: how graphs split by graph breaks share a budget.

A graph break splits one training step into several graphs, each planned by `checkpoint_activations` when Dynamo
compiles it (or at the first call of its size class). While graph k runs its forward and backward, every graph that
ran its forward before it in the same step still keeps what it saved for backward: the step's peak at graph k is that
held memory plus graph k's own peak. So `memory_budget` bounds the sum: graph k is planned for the budget less what the
graphs before it keep, as their plans keep it (`PassContext.step_held`); a fractional budget is a fraction of eager's
step there, what those graphs would keep in eager plus graph k's own step as captured
(fxopt.checkpointing.budget.graph_limit). Earlier graphs that keep less than their share leave the room to later ones.

A graph planned before the later graphs of its step were seen cannot leave them room. With a fraction each graph
takes only its fraction, so the step stays near it; a size budget is all room, and the first graph may fill it. So
when a step's plans together exceed a size budget (at its forward's end), the step's plans are made again (once
per graph and size class, at their next calls) for the budget as a fraction of eager's whole step, which the step's
graphs now tell: its largest held-plus-own peak.

`StepLedger` knows which graph calls are in flight without being told where a step ends: each call of a planned graph
records its share under a token that its outputs' gradient hooks hold; the first gradient to reach those outputs (its
backward begins) removes the record, and so does the autograd graph being dropped without a backward (the hooks, and
with them the token, are freed). The first record removed while others are in flight is the step's last graph: its
backward beginning ends the step's forward.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..checkpointing.budget import KeptBytes, parse_budget


@dataclasses.dataclass(frozen=True)
class StepShare:
    """One plan's part in its step: what it keeps for backward, and its own step peak as captured and as planned."""
    kept: KeptBytes
    captured_peak: int
    planned_peak: int


class StepBudget(NamedTuple):
    """A plan's share of a size budget, made again once the step is known: a fraction of eager's step, and why."""
    fraction: float
    note: str


def _gradient_function(value) -> torch.autograd.graph.Node | None:
    """The autograd node that made `value`; None for a non-tensor, a leaf, a tensor without grad, or a view autograd
    refuses to name one for (made under no_grad, its base written in place since: reading `grad_fn` raises)."""
    if not (isinstance(value, torch.Tensor) and value.requires_grad):
        return None
    try:
        return value.grad_fn
    except RuntimeError:
        return None


class _InFlight:
    """A graph call whose backward has not begun: the key of its record, alive while its autograd graph holds it."""


class StepLedger:
    """See the module docstring; one per backend (per `fxopt.optimize` result), `memory_budget()` giving its budget."""

    def __init__(self, memory_budget: Callable[[], object]):
        self.memory_budget = memory_budget
        self._in_flight: weakref.WeakKeyDictionary[_InFlight, tuple[StepShare, Callable[[StepBudget], None]]] = \
            weakref.WeakKeyDictionary()
        self._newest: Callable[[], _InFlight | None] = lambda: None  # the record made last, while it lives

    def held(self) -> KeptBytes:
        """What the graph calls in flight keep, together."""
        shares = [share for share, _ in self._in_flight.values()]
        return KeptBytes(sum(s.kept.eager for s in shares), sum(s.kept.planned for s in shares))

    def record(self, outputs, share: StepShare, replan: Callable[[StepBudget], None]) -> None:
        """A call of a plan with `share` made `outputs` (the graph's flat outputs); `replan(step_budget)` has its plan
        made again."""
        nodes = {id(node): node for node in map(_gradient_function, outputs) if node is not None}
        if not nodes:  # nothing to differentiate (a leaf output would keep a hook for good: none is taken)
            return
        token = _InFlight()
        self._in_flight[token] = (share, replan)
        self._newest = weakref.ref(token)

        def backward_began(_grad_outputs, token=token):
            self._backward_began(token)

        for node in nodes.values():
            node.register_prehook(backward_began)

    def _backward_began(self, token: _InFlight) -> None:
        if token not in self._in_flight:  # one record, several outputs: the first of their backwards removed it
            return
        if len(self._in_flight) > 1 and self._newest() is token:  # the step's last graph: its forward has ended
            self._share_step(list(self._in_flight.values()))
        del self._in_flight[token]

    def _share_step(self, records: list[tuple[StepShare, Callable[[StepBudget], None]]]) -> None:
        """Under a size budget, a step whose plans together exceed it: its plans made again for the budget as a
        fraction of eager's step (once per plan: the replan callbacks ignore a second request)."""
        budget = self.memory_budget()
        kind, amount = parse_budget(budget)
        if kind != "bytes":
            return
        held, eager_step, planned_step = KeptBytes(), 0, 0  # each graph's peak stands on what the ones before keep
        for share, _ in records:
            eager_step = max(eager_step, held.eager + share.captured_peak)
            planned_step = max(planned_step, held.planned + share.planned_peak)
            held = KeptBytes(held.eager + share.kept.eager, held.planned + share.kept.planned)
        if planned_step <= amount:
            return
        fraction = min(1.0, amount / eager_step)
        note = (f"planned again for its share of the step: memory_budget {budget!r} is {fraction:.2f} of "
                f"eager's step ({eager_step / 1e6:.2f} MB estimated over {len(records)} graph calls split by graph "
                f"breaks)")
        for _, replan in records:
            replan(StepBudget(fraction, note))


class RecordedCalls:
    """A dynamic graph lowered through AOTAutograd under a budget, its every call recorded in `ledger` with `share`.
    Its plan is the partitioner's, made once with Dynamo's symbolic sizes: a step over a size budget does not have it
    made again (at one call's sizes it would serve only those)."""

    def __init__(self, forward: Callable, share: StepShare, ledger: StepLedger):
        self.forward, self.share, self.ledger = forward, share, ledger

    def __call__(self, *args):
        outputs = self.forward(*args)
        self.ledger.record(outputs, self.share, _plan_kept)
        return outputs


def _plan_kept(step_budget: StepBudget) -> None:
    """A dynamic graph's partition is not made again for the step's share."""
