"""Which of a model's modules are running now: the innermost is the one to name when a call fails."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from .state_preservation import preserved_state


@contextlib.contextmanager
def running_modules(model: torch.nn.Module) -> Iterator[list[tuple[str, torch.nn.Module, tuple, dict]]]:
    """The stack of `model`'s modules running now, innermost last, as (path, module, args, kwargs).

    A pre-hook pushes each module as it starts and a forward hook pops it when it returns: a forward
    that raises never pops, so after a failure the top of the stack is the module that failed. The
    hooks are removed on leaving.
    """
    stack: list[tuple[str, torch.nn.Module, tuple, dict]] = []
    handles = []
    for path, sub in model.named_modules():
        def enter(mod, call_args, call_kwargs, path=path):
            stack.append((path, mod, call_args, call_kwargs))

        def leave(mod, call_args, output):  # returns None: the output is unchanged
            stack.pop()

        handles.append(sub.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(sub.register_forward_hook(leave))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


@dataclasses.dataclass
class Rejection:
    """What failed when a model rejected a call: the innermost running module ("" and the model itself when its
    own forward raised), the inputs it was given, and the error."""

    path: str
    module: torch.nn.Module
    args: tuple
    kwargs: dict
    error: BaseException


def rejection(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> Rejection | None:
    """Run `model(*args, **kwargs)` once, uncompiled, leaving no trace on it or its inputs; None if it runs, else
    what rejected the call (a `sys.exit` in the model's code included)."""
    kwargs = dict(kwargs or {})
    try:
        with running_modules(model) as running, preserved_state(model, (args, kwargs)):
            model(*args, **kwargs)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's model rejected the call
        path, module, call_args, call_kwargs = running[-1] if running else ("", model, args, kwargs)
        return Rejection(path, module, tuple(call_args), dict(call_kwargs), e)
    return None
