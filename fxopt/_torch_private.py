"""Every private torch API fxopt touches, each behind one small function.

A torch upgrade that moves one of these should need a change here and nowhere else.
"""
from __future__ import annotations

import torch


def fake_tensor_mode():
    """A fresh FakeTensorMode that also accepts real tensors (parameters) as inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def detect_fake_mode(inputs):
    """The FakeTensorMode that `inputs` already live in (Dynamo hands one to backends), or None."""
    from torch._guards import detect_fake_mode as _detect

    return _detect(inputs)


def unset_fake_mode():
    """Leave any ambient fake mode (Dynamo compiles backends inside one) for real computation."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def register_dynamo_backend(name: str, compiler_fn) -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if name not in _BACKENDS:
        register_backend(compiler_fn=compiler_fn, name=name)


def no_dispatch():
    from torch.utils._mode_utils import no_dispatch as _no_dispatch

    return _no_dispatch()


def untyped_storage_key(t: torch.Tensor):
    """A key identifying the storage behind `t` (views share it)."""
    return t.untyped_storage()._cdata


def fake_tensor_prop(gm, mode):
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    return FakeTensorProp(gm, mode)


def dispatch_mode_base():
    """The base class of Python dispatch modes (torch.utils._python_dispatch.TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def tree_leaves(tree) -> list:
    from torch.utils._pytree import tree_leaves as _leaves

    return _leaves(tree)


def module_hooks(module: torch.nn.Module) -> list[str]:
    """The kinds of hook that run around a call of `module`: its own and the global ones."""
    from torch.nn.modules import module as nn_module

    kinds = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
    return [k for k in kinds if getattr(module, f"_{k}") or getattr(nn_module, f"_global_{k}")]
