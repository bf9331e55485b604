"""Capture runs the model once for real, preserving its state, to record each child's call."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from .. import _torch_private
from ..errors import FxoptError
from ..state_preservation import preserved_state
from ..tree import tensors_in


def _describe_values(values) -> str:
    """`(2, 3, 32, 32) float32` for each tensor among `values`, for error messages."""
    shapes = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors_in(list(values))]
    return ", ".join(shapes) or "no tensors"


@contextlib.contextmanager
def running_modules(model: torch.nn.Module, on_enter: Callable[[str, tuple, dict], None] | None = None
                    ) -> Iterator[list[tuple[str, torch.nn.Module, tuple, dict]]]:
    """The stack of `model`'s modules running now, innermost last, as (path, module, args, kwargs).

    A pre-hook pushes each module as it starts (calling `on_enter(path, args, kwargs)` first) and a
    forward hook pops it when it returns: a forward that raises never pops, so after a failure the
    top of the stack is the module that failed. The hooks are removed on leaving.
    """
    stack: list[tuple[str, torch.nn.Module, tuple, dict]] = []
    handles = []
    for path, sub in model.named_modules():
        def enter(mod, call_args, call_kwargs, path=path):
            if on_enter is not None:
                on_enter(path, call_args, call_kwargs)
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


def record_submodule_calls(model: torch.nn.Module, args: tuple, kwargs: dict,
                           runs_autograd: set[str] | None = None) -> dict[str, tuple[tuple, dict]]:
    """Run `model` once (state preserved) and return, for each submodule path, the (args, kwargs) of its first call.

    With `runs_autograd`, also add to it every module running when the forward called
    `torch.autograd.grad` or `backward` (export cannot capture those).

    If the model rejects the inputs, raise FxoptError naming the innermost module that was
    running and the shapes it was given (the stack of modules is tracked with hooks).
    """
    calls: dict[str, tuple[tuple, dict]] = {}

    def note_autograd() -> None:
        if runs_autograd is not None:
            runs_autograd.update(path for path, *_ in stack)

    try:
        with running_modules(model, lambda path, a, k: calls.setdefault(path, (a, k))) as stack, \
                preserved_state(model, (args, kwargs)), _torch_private.noting_autograd_runs(note_autograd):
            model(*args, **kwargs)
    except Exception as e:
        path, mod, call_args, call_kwargs = stack[-1] if stack else ("", model, args, kwargs)
        where = f"module {path!r} ({type(mod).__name__})" if path else f"the model ({type(mod).__name__})"
        raise FxoptError(f"{type(model).__name__} rejected the example inputs "
                         f"[{_describe_values([*args, *kwargs.values()])}]: {where} failed on inputs "
                         f"[{_describe_values([*call_args, *call_kwargs.values()])}]: {type(e).__name__}: {e}") from e
    return calls
