"""Run a model for information without leaving a trace: buffers and RNG come back as they were."""
from __future__ import annotations

import contextlib

import torch

from ..errors import FxoptError


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
                if name in saved and not torch.equal(b, saved[name]):  # expanded buffers cannot be written
                    b.copy_(saved[name])


@contextlib.contextmanager
def flipped_mode(module: torch.nn.Module):
    """Run with `module.train(not module.training)`; every module's own flag is restored on exit."""
    flags = [(m, m.training) for m in module.modules()]
    module.train(not module.training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _describe_values(values) -> str:
    """`(2, 3, 32, 32) float32` for each tensor among `values`, for error messages."""
    from ..pipeline.verify import flatten_tensors

    shapes = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in flatten_tensors(list(values))]
    return ", ".join(shapes) or "no tensors"


def record_submodule_calls(model: torch.nn.Module, example_inputs: tuple,
                           outputs: dict[str, object] | None = None) -> dict[str, tuple[tuple, dict]]:
    """Run `model` once and return, for each submodule path, the (args, kwargs) of its first call.

    With `outputs`, also fill it with each submodule path's first result.

    If the model rejects the inputs, raise FxoptError naming the innermost module that was
    running and the shapes it was given (the stack of modules is tracked with hooks).
    """
    calls: dict[str, tuple[tuple, dict]] = {}
    stack: list[tuple[str, torch.nn.Module, tuple, dict]] = []
    handles = []
    for path, sub in model.named_modules():
        def enter(mod, args, kwargs, path=path):
            calls.setdefault(path, (args, kwargs))
            stack.append((path, mod, args, kwargs))

        def leave(mod, args, output, path=path):
            stack.pop()
            if outputs is not None:
                outputs.setdefault(path, output)

        handles.append(sub.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(sub.register_forward_hook(leave))
    try:
        with preserved_state(model):
            model(*example_inputs)
    except Exception as e:
        path, mod, args, kwargs = stack[-1] if stack else ("", model, example_inputs, {})
        where = f"module {path!r} ({type(mod).__name__})" if path else f"the model ({type(mod).__name__})"
        raise FxoptError(f"{type(model).__name__} rejected the example inputs "
                         f"[{_describe_values(example_inputs)}]: {where} failed on inputs "
                         f"[{_describe_values([*args, *kwargs.values()])}]: {type(e).__name__}: {e}") from e
    finally:
        for h in handles:
            h.remove()
    return calls
