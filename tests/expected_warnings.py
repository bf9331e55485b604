"""Warnings tests expect but do not test, kept out of the warnings summary where they are expected.

`budget_may_be_unmet()`: tests of what a memory_budget does, not whether it is met, run tiny models that often
cannot reach a low budget; fxopt's "NOT met" warning (tested in test_checkpoint_activations.py) is expected there.
The `budget_may_be_unmet` fixture (conftest.py) applies it to a test.

`recompile_limit_may_be_reached()`: generated networks (the fuzzer) may compile part of a call anew on every call
(a BatchNorm with `momentum=None` reads its step count as a Python float after a graph break); past Dynamo's
recompile limit that part runs as eager does, which fxopt's warning says (tested in test_user_changes.py).
"""
from __future__ import annotations

import contextlib
import warnings

UNMET_BUDGET = r"fxopt: memory_budget .* NOT met"
RECOMPILE_LIMIT = r"fxopt: part or all of a call of .* ran as eager runs it"


@contextlib.contextmanager
def budget_may_be_unmet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=UNMET_BUDGET, category=UserWarning)
        yield


@contextlib.contextmanager
def recompile_limit_may_be_reached():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=RECOMPILE_LIMIT, category=UserWarning)
        yield
