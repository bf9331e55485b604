"""Run a model for information without leaving a trace on it or on its inputs.

fxopt runs the model, or graphs holding its tensors, for information (the example call's outputs,
which modules run, op timings, shapes). A `forward` may write anything it can reach:
buffers (`self.count += 1`), parameters (`self.ema.mul_(0.9)` under no_grad), plain tensor
attributes (`self.t.add_(1)`), its inputs
(`x.mul_(2)`), rebind an attribute (`self.t = self.t + 1`, `self.calls += 1`, `self.last = y`),
or change a list, dict or set attribute in place (`self.history.append(y)`). `preserved_state`
snapshots all of them, and the RNG, and puts every one back on exit.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.fx as fx

from . import _torch_private
from .host_rng import forked_rng
from .tree import tensors_in
from .user_code import plain_attributes


class _Snapshot:
    """Every tensor a forward can reach through `module` or `inputs`, with a copy of its value and its version."""

    def __init__(self, module: torch.nn.Module, inputs, parameters: bool):
        self.slots = []  # (owner dict, key, tensor object, saved value, version)
        for m in module.modules():
            for slots in (m._parameters, m._buffers, m.__dict__) if parameters else (m._buffers, m.__dict__):
                for key, value in list(slots.items()):
                    if isinstance(value, torch.Tensor) and _has_data(value):
                        self.slots.append((slots, key, value, *_saved(value)))
        self.inputs = [(x, *_saved(x)) for x in tensors_in(inputs) if _has_data(x)]
        # Every binding of the user's modules, as it is (fxopt's own GraphModules run no Python that assigns, and the
        # passes that preserve state while they rewrite one may set what must stay: `gm.meta`, new submodules).
        users = [m for m in module.modules() if not isinstance(m, fx.GraphModule)]
        self.attributes = [(vars(m), dict(vars(m))) for m in users]
        self.containers = [(value, copy.copy(value)) for m in users
                           for value in plain_attributes(m).values() if type(value) in (list, dict, set)]
        self.generators = [(value, value.get_state()) for m in users for value in vars(m).values()
                           if isinstance(value, torch.Generator)]  # a model's own stream, besides the global ones

    def restore(self) -> None:
        for attributes, bindings in self.attributes:
            for key in [k for k in attributes if k not in bindings]:  # attributes the forward added
                del attributes[key]
            attributes.update(bindings)
        for container, contents in self.containers:  # refilled, not compared: `==` on tensors inside is no bool
            container.clear()
            container.update(contents) if isinstance(container, (dict, set)) else container.extend(contents)
        for generator, state in self.generators:
            generator.set_state(state)
        with torch.no_grad():
            for slots, key, tensor, saved, version in self.slots:
                slots[key] = tensor  # a forward may have rebound the attribute
                _put_back(tensor, saved, version)
            for tensor, saved, version in self.inputs:
                _put_back(tensor, saved, version)



def _saved(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    return t.detach().clone(), _torch_private.tensor_version(t)


def _has_data(t: torch.Tensor) -> bool:
    """False for a lazy parameter, and for a tensor whose storage was freed (FSDP2 resizes the storage
    of an unsharded parameter to 0 between uses), and for a fake tensor (a compiler's stand-in: DDP's
    optimizer hands a backend fakes): there is no value to save, and reading one crashes."""
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin) or _torch_private.is_fake(t):
        return False
    return t.numel() == 0 or t.is_meta or _torch_private.has_storage_bytes(t)


def _put_back(tensor: torch.Tensor, saved: torch.Tensor, version: int) -> None:
    """Write `saved` back into `tensor` if something wrote it in place.

    The version counter does not see every write: ATen's train-mode batch_norm updates the running
    statistics inside the kernel without bumping it, so the values are compared as well.
    """
    if tensor.shape != saved.shape:  # an expanded tensor is not writable
        return
    if _torch_private.tensor_version(tensor) != version or not _same_values(tensor, saved):
        tensor.copy_(saved)


def _same_values(tensor: torch.Tensor, saved: torch.Tensor) -> bool:
    return tensor.dtype == saved.dtype and bool(torch.eq(tensor, saved).logical_or_(tensor.isnan() & saved.isnan()).all()) \
        if tensor.is_floating_point() or tensor.is_complex() else torch.equal(tensor, saved)


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module, inputs=(), parameters: bool = True):
    """Snapshot what a forward of `module` on `inputs` may change, the CPU/CUDA RNG and Python's and NumPy's
    global generators (fxopt.host_rng); restore on exit.

    `parameters=False` leaves parameters out (copying them is most of the cost): for runs of graphs
    that write none (timing and calibration runs under no_grad).
    """
    snapshot = _Snapshot(module, inputs, parameters)
    with forked_rng():
        try:
            yield
        finally:
            snapshot.restore()
