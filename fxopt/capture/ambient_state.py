"""Which of torch's global modes the model's own code read while it was exported, and what it read.

A forward may branch on torch's global state: `if torch.is_grad_enabled(): ...`, an attention that
casts to `torch.get_autocast_dtype("cpu")` when `torch.is_autocast_enabled("cpu")`. torch.export runs
that Python once and bakes the branch taken into the graph; fxopt exports with gradients enabled and
autocast off, so a graph called under `torch.no_grad()` or `torch.autocast` would compute the branch
eager no longer takes. `recording_reads()` records each such read -- (function name, arguments,
value) -- made from code outside torch (the model's, or a library's such as transformers; torch's
own reads, such as `no_grad.__enter__` saving the mode it restores, are how export represents
those regions and are not recorded), and `changed(reads)` says which no longer holds at call time.
A model that reads none (almost all) records nothing, and its calls check nothing.

Reads through a name bound before the export (`from torch import is_grad_enabled` at import time)
are not seen: they call the function itself, not the attribute of `torch` recorded here.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import torch

from ..user_code import caller_is_users

READERS = ("is_grad_enabled", "is_inference_mode_enabled", "is_autocast_enabled", "get_autocast_dtype")


class Read(NamedTuple):
    function: str  # a name in READERS: an attribute of `torch`
    args: tuple
    kwargs: tuple  # (name, value) pairs
    value: Any

    def now(self):
        """What the function returns if called again now, with the same arguments."""
        return getattr(torch, self.function)(*self.args, **dict(self.kwargs))

    def expression(self) -> str:
        """The call as the model wrote it: `torch.is_autocast_enabled('cpu')`."""
        arguments = [*map(repr, self.args), *(f"{k}={v!r}" for k, v in self.kwargs)]
        return f"torch.{self.function}({', '.join(arguments)})"

    def describe(self) -> str:
        return f"{self.expression()} == {self.value!r}"


def changed(reads: tuple[Read, ...]) -> Read | None:
    """The first read whose function, called again with the same arguments, now returns another value."""
    for read in reads:
        if read.now() != read.value:
            return read
    return None


@contextlib.contextmanager
def recording_reads():
    """Within: every call of a READERS function from outside torch and fxopt is appended to the list yielded."""
    reads: list[Read] = []
    originals = {name: getattr(torch, name) for name in READERS}

    def recorder(name, function):
        @functools.wraps(function)
        def read(*args, **kwargs):
            value = function(*args, **kwargs)
            record = Read(name, args, tuple(kwargs.items()), value)
            if caller_is_users() and record not in reads:
                reads.append(record)
            return value
        return read

    for name, function in originals.items():
        setattr(torch, name, recorder(name, function))
    try:
        yield reads
    finally:
        for name, function in originals.items():
            setattr(torch, name, function)
