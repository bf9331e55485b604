"""Warnings tests expect but do not test, kept out of the warnings summary where they are expected.

`budget_may_be_unmet()`: tests of what a memory_budget does, not whether it is met, run tiny models that often
cannot reach a low budget; fxopt's "NOT met" warning (tested in test_checkpoint_activations.py) is expected there.
The `budget_may_be_unmet` fixture (conftest.py) applies it to a test.
"""
from __future__ import annotations

import contextlib
import warnings

UNMET_BUDGET = r"fxopt: memory_budget .* NOT met"


@contextlib.contextmanager
def budget_may_be_unmet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=UNMET_BUDGET, category=UserWarning)
        yield
