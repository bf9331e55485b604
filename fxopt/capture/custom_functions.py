"""Custom autograd Functions called by a forward being exported.

A `torch.autograd.Function` runs its own `backward` in eager: a straight-through estimator passes the
gradient of `round` through unchanged, a gradient-reversal layer negates it, BLOOM's training GELU
uses its own formula, a distributed collective all-reduces it. Non-strict torch.export traces the
Function's forward into ATen ops and keeps nothing of its backward, so autograd differentiates those
ops instead (the gradient of `round` is 0): a silent wrong gradient. Within `refusing_custom_functions()`
the `apply` of any Function not defined by fxopt raises `CustomFunctionCall`, so capture refuses to
export the module calling it; that module runs as written while its other children are captured
(fxopt.capture). A Function that overrides `apply` itself is not seen.
"""
from __future__ import annotations

import contextlib

import torch


class CustomFunctionCall(Exception):
    """A forward being exported called a custom autograd Function (module docstring)."""


@contextlib.contextmanager
def refusing_custom_functions():
    """Within: `torch.autograd.Function.apply` raises CustomFunctionCall for a Function not defined by fxopt."""
    function = torch.autograd.Function
    original = function.__dict__["apply"]  # the classmethod itself, put back as it was

    def apply(cls, *args, **kwargs):
        if cls.__module__.partition(".")[0] != "fxopt":
            raise CustomFunctionCall(
                f"forward calls the custom autograd.Function {cls.__qualname__} (from {cls.__module__}): an exported "
                f"graph would differentiate its forward instead of running its own backward")
        return original.__func__(cls, *args, **kwargs)

    function.apply = classmethod(apply)
    try:
        yield
    finally:
        function.apply = original
