"""What a forward being exported asks of autograd that the exported graph would drop.

Non-strict torch.export traces a forward into ATen ops; what the forward arranges for its backward is
not an op, and the graph silently loses it:

* a custom `torch.autograd.Function`: its forward is traced, its own `backward` dropped, so autograd
  differentiates the forward instead (a straight-through estimator's gradient of `round` becomes 0, a
  gradient-reversal layer loses its sign, BLOOM's training GELU its own formula, a collective its
  all-reduce);
* a hook on a tensor (`h.register_hook(fn)`: Grad-CAM's gradient capture, a gradient clip or scale),
  or `h.retain_grad()`;
* saved-tensor hooks entered in the forward (`with torch.autograd.graph.save_on_cpu():` offloading).

Within `refusing_autograd_extensions()` a custom Function's call is recorded as one op that runs the
Function itself, its backward included (fxopt.capture.autograd_functions), where that op stands for it
exactly; any other (torch's own, one defined inside a function, one returning a view of its input, ...),
and each hook above called from the model's code (not torch's or fxopt's), raises `AutogradExtension`, so
capture refuses to export the module calling it; that module runs as written while its other children are
captured (fxopt.capture). fxopt's own Functions, a torch.library custom op's (which export keeps as the op
with its registered backward), and a Function called by a recorded Function's forward (part of it) run as
they are. A Function that overrides `apply` itself is not seen.
"""
from __future__ import annotations

import contextlib

import torch

from ..user_code import caller_is_users
from .autograd_functions import NotRecordable, inside_recorded_function, recorded_apply, why_not_recorded


class AutogradExtension(Exception):
    """A forward being exported asked autograd for something the graph would drop (module docstring)."""


@contextlib.contextmanager
def refusing_autograd_extensions():
    """Within: custom Functions' `apply` (but _KEPT_FUNCTIONS') is recorded as fxopt's op or raises
    AutogradExtension, and tensor and saved-tensor hooks from the model's code raise it (module docstring)."""
    function, tensor, saved = torch.autograd.Function, torch.Tensor, torch.autograd.graph.saved_tensors_hooks
    # each class's own entry (the classmethod itself for `apply`), or None where it inherits the method
    originals = [(owner, name, vars(owner).get(name)) for owner, names in
                 ((function, ["apply"]), (tensor, list(_TENSOR_HOOKS)), (saved, ["__enter__"])) for name in names]
    plain_apply = function.__dict__["apply"].__func__

    def apply(cls, *args, **kwargs):
        if cls.__module__.startswith(_KEPT_FUNCTIONS) or inside_recorded_function():
            return plain_apply(cls, *args, **kwargs)
        reason = why_not_recorded(cls, args, kwargs)
        try:
            if not reason:
                return recorded_apply(cls, args)
        except NotRecordable as e:
            reason = str(e)
        raise AutogradExtension(
            f"forward calls the custom autograd.Function {cls.__qualname__} (from {cls.__module__}), which fxopt "
            f"cannot record as an op: {reason}; an exported graph would differentiate its forward instead of running "
            f"its own backward")

    function.apply = classmethod(apply)
    for name, why in _TENSOR_HOOKS.items():
        setattr(tensor, name, _refused_from_users_code(getattr(tensor, name), f"forward calls Tensor.{name}: {why}"))
    saved.__enter__ = _refused_from_users_code(saved.__enter__, "forward enters saved-tensor hooks: an exported graph "
                                                                "would save its tensors without them")
    try:
        yield
    finally:
        for owner, name, original in originals:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


# fxopt's own, and the Function torch.library makes for a custom op's registered autograd (export keeps the op
# itself, whose backward is that registration)
_KEPT_FUNCTIONS = ("fxopt.", "torch._library.")

_TENSOR_HOOKS = {
    "register_hook": "an exported graph would run its backward without the hook",
    "register_post_accumulate_grad_hook": "an exported graph would run its backward without the hook",
    "retain_grad": "an exported graph would not keep the gradient",
}


def _refused_from_users_code(method, reason: str):
    def refused(*args, **kwargs):
        if caller_is_users():
            raise AutogradExtension(reason)
        return method(*args, **kwargs)

    return refused
