"""What is the user's code and state, as opposed to torch's and fxopt's own, while fxopt watches a model run.

`MODULE_INTERNALS`: the attributes every `torch.nn.Module` has in its `__dict__` (`training`, the dicts of
parameters, buffers, children and hooks); everything else a module holds is the user's (`plain_attributes`).
`is_users_module(name)`: a Python module outside torch and fxopt, whose code is the model's (or a library's such
as transformers), not the tracer's; `caller_is_users()` asks it of the function calling the one that asks.
"""
from __future__ import annotations

import sys

import torch

MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_TRACER_PACKAGES = ("torch", "fxopt")


def plain_attributes(module: torch.nn.Module) -> dict:
    """The entries of `module`'s `__dict__` that are not torch's own (MODULE_INTERNALS)."""
    return {name: value for name, value in vars(module).items() if name not in MODULE_INTERNALS}


def is_users_module(module_name: str) -> bool:
    return module_name.partition(".")[0] not in _TRACER_PACKAGES


def caller_is_users() -> bool:
    """Whether the function that called the caller of this one is the user's code (is_users_module)."""
    return is_users_module(sys._getframe(2).f_globals.get("__name__", ""))
