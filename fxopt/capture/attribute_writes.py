"""Which plain attributes of the model's modules its forward assigns while it is exported.

`self.calls += 1` on an int, `self.last_attention = probs.detach()`: eager sets the attribute on
every call, a graph never does. torch.export runs the assignment once while tracing, then puts
the attributes back as they were (for a tensor it also warns; for an int or a list it says
nothing), so the graph it returns silently drops the write. `recording_writes(model)` records
each such assignment made from the model's own code (not torch's or fxopt's), by module path and
attribute name; capture then refuses to export that module, which runs as written while its
children are captured (fxopt.capture).

Parameters, buffers and submodules are not recorded: export tracks writes to registered state
(a buffer's `+=` becomes an in-place op of the graph). Writes that do not go through
`torch.nn.Module.__setattr__` (`object.__setattr__(self, ...)`, a module class overriding
`__setattr__` without calling it, an attribute of a held object: `self.config.x = 1`) are not seen.
"""
from __future__ import annotations

import contextlib

import torch

from ..user_code import caller_is_users


@contextlib.contextmanager
def recording_writes(model: torch.nn.Module):
    """Within: each plain-attribute assignment from outside torch and fxopt to a module of `model` is appended, as
    "path.name" ("name" for the root), to the list yielded, once."""
    paths = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), path)
    writes: list[str] = []
    original = torch.nn.Module.__setattr__

    def recording_setattr(self, name, value):
        if id(self) in paths and not _is_registered_state(self, name, value) and caller_is_users():
            where = ".".join(filter(None, (paths[id(self)], name)))
            if where not in writes:
                writes.append(where)
        original(self, name, value)

    torch.nn.Module.__setattr__ = recording_setattr
    try:
        yield writes
    finally:
        torch.nn.Module.__setattr__ = original


def _is_registered_state(module: torch.nn.Module, name: str, value) -> bool:
    """A parameter, buffer or submodule slot (export tracks those), or a new one being registered."""
    return (name in module._parameters or name in module._buffers or name in module._modules
            or isinstance(value, (torch.nn.Parameter, torch.nn.Module)))
