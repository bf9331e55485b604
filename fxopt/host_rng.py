"""The host's global random generators: Python's `random` and NumPy's `numpy.random`.

torch.random.fork_rng keeps torch's generators; a forward may also draw from these
(`if random.random() < self.drop_path`: stochastic depth written with Python's generator).
`forked_host_rng(seed)` is their `torch.random.fork_rng`: a run of the caller's model made for information
(preserved_state's, verify=True's steps, the HTML timeline's) leaves the caller's streams where they were,
and verify=True's reference and candidate steps draw from generators seeded alike, so the same numbers.
"""
from __future__ import annotations

import contextlib
import random
import sys


@contextlib.contextmanager
def forked_host_rng(seed: int | None = None):
    """Python's and NumPy's global generators put back on exit; seeded with `seed` inside when one is given."""
    numpy_random = getattr(sys.modules.get("numpy"), "random", None)  # not imported by fxopt: only a forward draws
    python_state = random.getstate()
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    try:
        if seed is not None:
            random.seed(seed)
            if numpy_random is not None:
                numpy_random.seed(seed)
        yield
    finally:
        random.setstate(python_state)
        if numpy_random is not None:
            numpy_random.set_state(numpy_state)


@contextlib.contextmanager
def forked_rng():
    """Every generator a forward may draw from put back on exit: torch's (CPU, and the current CUDA device once
    CUDA is initialized), Python's and NumPy's."""
    import torch

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), forked_host_rng():
        yield
