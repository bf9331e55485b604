"""What is the user's code and state, as opposed to torch's and fxopt's own, while fxopt watches a model run.

`MODULE_INTERNALS`: the attributes every `torch.nn.Module` has in its `__dict__` (`training`, the dicts of
parameters, buffers, children and hooks); everything else a module holds is the user's (`plain_attributes`).
`is_users_module(name)`: a Python module outside torch and fxopt, whose code is the model's (or a library's such
as transformers), not the tracer's; `caller_is_users()` asks it of the function calling the one that asks.
`warn_at_users_line(message)`: a warning shown at the innermost line of the user's code on the stack (the call
of `fxopt.optimize` or of the optimized model), wherever inside fxopt or torch it is raised.
"""
from __future__ import annotations

import sys
import sysconfig
import warnings

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


_PATHS = sysconfig.get_paths()
_STDLIB = tuple({_PATHS["stdlib"], _PATHS["platstdlib"]})
_INSTALLED = tuple({_PATHS["purelib"], _PATHS["platlib"]})  # inside the stdlib folder on most installs


def _in_stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and not filename.startswith(_INSTALLED)


def _is_users_frame(frame) -> bool:
    """A frame of the user's code: not torch's or fxopt's (`python -m fxopt` runs fxopt's `__main__` as
    "__main__"), nor the standard library's (contextlib, runpy) between them."""
    name = frame.f_globals.get("__name__", "")
    spec = frame.f_globals.get("__spec__")
    if name == "__main__" and spec is not None:
        name = spec.name
    return is_users_module(name) and not _in_stdlib(frame.f_code.co_filename)


def warn_at_users_line(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message)` attributed to the innermost frame of the user's code (`_is_users_frame`),
    so the warning names the user's file and line; with no such frame, the outermost one."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and not _is_users_frame(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
