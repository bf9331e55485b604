"""Which of a model's modules are running now: the innermost is the one to name when a call fails."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


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
