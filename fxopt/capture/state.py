"""Run a model for information without leaving a trace: buffers and RNG come back as they were."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module):
    """Snapshot buffers (BatchNorm running stats) and the CPU/CUDA RNG, restore them on exit."""
    saved = {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            yield
        finally:
            for name, b in module.named_buffers():
                if name in saved:
                    b.copy_(saved[name])


def record_submodule_calls(model: torch.nn.Module, example_inputs: tuple) -> dict[str, tuple[tuple, dict]]:
    """Run `model` once and return, for each submodule path, the (args, kwargs) of its first call."""
    calls: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for path, sub in model.named_modules():
        def hook(mod, args, kwargs, path=path):
            calls.setdefault(path, (args, kwargs))

        handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with preserved_state(model):
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return calls
