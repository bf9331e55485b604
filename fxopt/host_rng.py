"""The host's global random generators: Python's `random` and NumPy's `numpy.random`.

torch.random.fork_rng keeps torch's generators; a forward may also draw from these
(`if random.random() < self.drop_path`: stochastic depth written with Python's generator).
`HostRandomState()` records both; `drawn()` names those drawn from since, and `restore()` puts
them back. Capture uses it to leave the caller's streams as they were, and to refuse to export a
forward that draws from them: the graph would bake the one draw made while tracing.
`forked_host_rng(seed)` is their `torch.random.fork_rng`: a run of the caller's model made for information
(preserved_state's, verify=True's steps, the HTML timeline's) leaves the caller's streams where they were,
and verify=True's reference and candidate steps draw from generators seeded alike, so the same numbers.
"""
from __future__ import annotations

import contextlib
import random
import sys


class HostRandomState:
    """The states of Python's global generator and, if NumPy is imported, NumPy's legacy global one."""

    def __init__(self):
        self.python = random.getstate()
        self.numpy = _numpy_random().get_state() if _numpy_random() else None

    def drawn(self) -> list[str]:
        """The generators whose state moved since this snapshot ("random", "numpy.random")."""
        moved = ["random"] if random.getstate() != self.python else []
        if self.numpy is not None and not _same_numpy_state(_numpy_random().get_state(), self.numpy):
            moved.append("numpy.random")
        return moved

    def restore(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            _numpy_random().set_state(self.numpy)


@contextlib.contextmanager
def forked_host_rng(seed: int | None = None):
    """Python's and NumPy's global generators put back on exit; seeded with `seed` inside when one is given."""
    state = HostRandomState()
    try:
        if seed is not None:
            random.seed(seed)
            if _numpy_random() is not None:
                _numpy_random().seed(seed)
        yield
    finally:
        state.restore()


def _numpy_random():
    numpy = sys.modules.get("numpy")  # not imported by fxopt: only a forward that uses it has drawn from it
    return getattr(numpy, "random", None)


def _same_numpy_state(a: tuple, b: tuple) -> bool:
    """('MT19937', key array, position, has_gauss, cached_gaussian) compared field by field."""
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and a[2:] == b[2:]
