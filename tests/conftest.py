import gc
import os
import sys

import pytest
import torch

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "corpus")]
from device_under_test import DEVICE  # noqa: E402
from expected_warnings import budget_may_be_unmet, recompile_limit_may_be_reached  # noqa: E402

# The tests run tiny tensors: one intra-op thread is faster than two and gives the same numbers
# on every machine.
torch.set_num_threads(1)


def pytest_sessionfinish(session, exitstatus):
    """Everything the suite made stays until the process exits: frozen, pytest's five closing garbage collections
    need not walk it again (seconds over the compiled graphs; an xdist worker is interrupted after five)."""
    gc.freeze()


@pytest.fixture
def device() -> torch.device:
    """Where device-independent tests run: FXOPT_TEST_DEVICE (cpu by default; cuda on a GPU machine)."""
    return DEVICE


@pytest.fixture(name="fresh_dynamo")
def fresh_dynamo_fixture():
    """The test starts and ends with Dynamo's caches empty: no sizes known dynamic (Dynamo remembers them per code
    object, across models), no compiled code reused from another test."""
    from fxopt import _torch_private

    _torch_private.reset_dynamo()
    yield
    _torch_private.reset_dynamo()


@pytest.fixture(name="budget_may_be_unmet")
def budget_may_be_unmet_fixture():
    """fxopt's warning that a memory_budget is not met is expected in this test (tests/expected_warnings.py)."""
    with budget_may_be_unmet():
        yield


@pytest.fixture(name="recompile_limit_may_be_reached")
def recompile_limit_may_be_reached_fixture():
    """fxopt's warning that part of a call ran as eager past Dynamo's recompile limit is expected in this test."""
    with recompile_limit_may_be_reached():
        yield
