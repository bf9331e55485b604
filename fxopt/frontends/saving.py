"""`fxopt.save(result, path)` / `fxopt.load(path)`: an optimized model on disk and back.

A result holds modules and fxopt's graphs, not only tensors, so `torch.load`'s default
(`weights_only=True`) refuses it with an UnpicklingError that does not say why. `save` writes the
result inside a `SavedResult` record (format, fxopt version) with `torch.save`; `load` first lists
the globals the file's pickle would import, without running it
(`torch.serialization.get_unsafe_globals_in_checkpoint`), refuses a file that holds no such record
with an FxoptError, then loads it with `weights_only=False`. That runs the file's pickle, as any
`torch.load(weights_only=False)` does: load only files you trust.
"""
from __future__ import annotations

import dataclasses
import os
import zipfile

import torch

from .._version import __version__
from ..errors import FxoptError

FORMAT = 1  # the layout of SavedResult; a newer one is refused by an older fxopt


@dataclasses.dataclass
class SavedResult:
    format: int
    fxopt_version: str
    model: torch.nn.Module


_RECORD = f"{SavedResult.__module__}.{SavedResult.__qualname__}"


def save(result: torch.nn.Module, path) -> None:
    """Write `result` (what `fxopt.optimize` returned) to `path`; `fxopt.load(path)` gives it back."""
    if not isinstance(result, torch.nn.Module) or not hasattr(result, "fxopt_report"):
        raise FxoptError(f"fxopt.save takes what fxopt.optimize returned, got a {type(result).__name__}: "
                         "save other objects with torch.save")
    torch.save(SavedResult(FORMAT, __version__, result), path)


def _check_written_by_save(path) -> None:
    """An FxoptError unless `path` is a torch archive holding a SavedResult (its pickle is not run)."""
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FxoptError(f"fxopt.load({name!r}): no such file")
    if not zipfile.is_zipfile(name):
        raise FxoptError(f"fxopt.load({name!r}): not a file written by fxopt.save (not a torch.save archive)")
    if _RECORD not in torch.serialization.get_unsafe_globals_in_checkpoint(name):
        raise FxoptError(f"fxopt.load({name!r}): not a file written by fxopt.save (it holds no optimized model): "
                         "load it with torch.load, or write one with fxopt.save(fxopt.optimize(model, x), path)")


def load(path, map_location=None) -> torch.nn.Module:
    """The optimized model `fxopt.save` wrote to `path` (`map_location` as for `torch.load`). Trusted files only:
    loading runs the file's pickle."""
    _check_written_by_save(path)
    saved = torch.load(path, map_location=map_location, weights_only=False)
    if saved.format > FORMAT:
        raise FxoptError(f"fxopt.load({os.fspath(path)!r}): written by fxopt {saved.fxopt_version} in format "
                         f"{saved.format}, newer than this fxopt {__version__} reads ({FORMAT}): upgrade fxopt")
    return saved.model
