"""fxopt.collector: optimize() leaves the caller's heap out of garbage collections, and the collector as it was."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt.collector import collector_paused, heap_frozen
from fxopt.errors import FxoptError


class _Cycle:
    def __init__(self):
        self.me = self


def test_heap_frozen_collects_what_is_made_inside():
    """Inside, what existed before is frozen, a cycle made inside is still collected, and after, nothing is frozen."""
    before = weakref.ref(_Cycle())  # garbage left by the caller: waits for the first full collection after
    with heap_frozen():
        assert gc.get_freeze_count() > 0
        inside = weakref.ref(_Cycle())
        gc.collect()
        assert inside() is None and before() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before() is None


def test_a_callers_freeze_is_kept():
    """A heap the caller froze (a pre-fork server) stays frozen after."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with heap_frozen():
            pass
        # not unfrozen (which empties it); frozen objects freed meanwhile leave the count (a clean-clone run: 2 fewer)
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()


@pytest.mark.filterwarnings("ignore:fxopt. memory_budget")  # a model too small for any region
def test_optimize_leaves_the_collector_as_it_was_also_when_it_fails():
    """After optimize() -- one that works and one that raises -- nothing is frozen and the collector is enabled."""
    fxopt.optimize(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).train(), (torch.randn(2, 4),), memory_budget=0.5)
    with pytest.raises(FxoptError):  # the model rejects its example
        fxopt.optimize(nn.Linear(4, 4), (torch.randn(2, 5),), mode="inference", passes=["fold_conv_bn"])
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_collector_paused_restores_a_disabled_collector():
    """A collector the caller disabled stays disabled after a pause."""
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
