"""Scopes for Python's cyclic garbage collector while fxopt builds a graph.

Capture and the passes make millions of short-lived Python objects, so the collector runs hundreds
of times per `optimize()`; each full collection walks every object of the process, the caller's
model, libraries and data included (HF MobileNetV2 beside transformers: ~400,000 objects, 0.25-0.3 s
of full collections per optimize() call).

- `heap_frozen()`: what existed before is left out of collections (`gc.freeze`), which then walk
  only what fxopt made; it is put back (`gc.unfreeze`) after. fxopt's own garbage is collected as it
  goes; cyclic garbage the caller's program had left, or made meanwhile in another thread, waits for
  the first full collection after instead. A caller who froze the heap already (a pre-fork server)
  keeps it frozen: then nothing is done.
- `collector_paused()`: no collection at all, for a stretch that makes objects without cycles at a
  high rate (the checkpoint planner's labels).
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def heap_frozen():
    """Collections inside leave out every object that existed before (see module docstring)."""
    if gc.get_freeze_count():  # the caller's freeze: unfreezing after would undo it
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def collector_paused():
    """No cyclic garbage collection inside (see module docstring)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
