"""A module whose forward runs as written while some of its children are captured graphs: a shell.

Capture cannot export a module (its forward branches on a tensor's value, or assigns one of its
plain attributes) but exports some of its children. `shell_of(module, replaced)` returns a shallow
copy of `module` holding the replacements, so that the caller's module keeps its own children:
leaf modules, parameters and buffers are shared, and so are its plain attributes. A forward
that rebinds one (`self.calls += 1`, `self.last = y`) writes the shell's own `__dict__`, which
eager would have written on the caller's module; so each call of the shell first takes the
module's current plain attributes (set by the caller since) and afterwards hands back what the
forward assigned. Objects the forward changes in place (`self.history.append(y)`) are the same
objects in both.
"""
from __future__ import annotations

import copy
import functools

import torch

from ..user_code import plain_attributes

_FORWARD = "forward"


def shell_of(module: torch.nn.Module, replaced: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """A shallow copy of `module` with the children `replaced`, whose plain attributes follow `module`'s."""
    shell = copy.copy(module)
    shell._modules = {**module._modules, **replaced}
    if _FORWARD not in vars(module):  # a forward set on the instance is the caller's own: left as it is
        vars(shell)[_FORWARD] = functools.partial(_forward_sharing_attributes, shell, module)
    return shell


def _forward_sharing_attributes(shell: torch.nn.Module, module: torch.nn.Module, *args, **kwargs):
    _copy_plain_attributes(module, shell)
    try:
        return type(module).forward(shell, *args, **kwargs)
    finally:
        _copy_plain_attributes(shell, module)


def _copy_plain_attributes(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Bind in `target` each plain attribute of `source` that `target` binds to another object."""
    target_attributes = vars(target)
    for name, value in plain_attributes(source).items():
        if name != _FORWARD and target_attributes.get(name, target) is not value:
            target_attributes[name] = value
