"""Measure what a step really costs on any device: peak live bytes, saved-for-backward bytes, FLOPs.

CPU has no `torch.cuda.max_memory_allocated`. `measure_peak` counts the storages torch allocates
while a step runs, through a dispatch mode, and frees them when their last reference dies
(weak references on the storage, the way `torch.distributed._tools.mem_tracker` does). Storages
that exist before the step (parameters, buffers, inputs) and the gradients left after it are not
counted, so the figure is the activation + temporary memory of the step, deterministic on CPU.

`measure_allocator_peak` reads the same figure from the allocator's own events
(torch.profiler memory events): it also sees inside code compiled by torch.compile, where a
dispatch mode sees only the eager ops around the compiled call, and tensors made outside any op,
which a dispatch mode misses: the copy of the CPU RNG state each non-reentrant checkpoint region
keeps until its backward (`torch.get_rng_state()`, 5,056 bytes per region).

These are measurements for tests, benchmarks and the CLI; passes use estimates (fxopt.analysis).
"""
from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from ._torch_private import allocation_profile, dispatch_mode_base, profiler_allocations, tree_leaves


class _LiveStorageMode(dispatch_mode_base()):
    """Logs (+bytes, serial) when an op creates a storage and (-bytes, serial) when it dies.

    Each allocation gets a serial number: Python reuses `id()`s of dead objects, so an id
    only names a storage while it is alive (`live_serials`).

    TorchDynamo runs a frame uncompiled while a dispatch mode is active, unless the mode ignores
    compile internals: this one does, so what it measures of an optimized model is the optimized graph.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, preexisting: set[int]):
        super().__init__()
        self.preexisting = preexisting
        self.live_serials: dict[int, int] = {}  # id(storage) -> serial, for live storages only
        self.refs: dict[int, weakref.ref] = {}
        self.events: list[tuple[int, int]] = []

    def _freed(self, key: int, serial: int, nbytes: int, _ref) -> None:
        if self.live_serials.get(key) == serial:
            del self.live_serials[key]
        self.refs.pop(serial, None)
        self.events.append((-nbytes, serial))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage, nbytes = _memory_of(t)
            key = id(storage)
            if key in self.live_serials or key in self.preexisting or nbytes == 0:
                continue
            serial = len(self.events)
            self.live_serials[key] = serial
            self.refs[serial] = weakref.ref(storage, lambda r, k=key, s=serial, n=nbytes: self._freed(k, s, n, r))
            self.events.append((nbytes, serial))
        return out


def _memory_of(t: torch.Tensor) -> tuple[object, int]:
    """What holds a tensor's memory and its bytes: its storage; for a tensor with none to show (oneDNN's opaque
    layout, a prepacked weight), the tensor itself and its elements' bytes."""
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return t, t.numel() * t.element_size()
    return storage, storage.nbytes()


def _storage_ids(tensors) -> set[int]:
    return {id(t.untyped_storage()) for t in tensors if isinstance(t, torch.Tensor)}


def measure_peak(step: Callable[[], object], module: torch.nn.Module, inputs: tuple = ()) -> int:
    """Peak bytes of storages created by `step()` and alive at once, gradients excluded."""
    preexisting = _storage_ids([*module.parameters(), *module.buffers(), *inputs])
    keep = [t.untyped_storage() for t in [*module.parameters(), *module.buffers(), *inputs]
            if isinstance(t, torch.Tensor)]  # ids are only unique while alive
    mode = _LiveStorageMode(preexisting)
    with mode:
        result = step()
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    grads += [x.grad for x in inputs if isinstance(x, torch.Tensor) and x.grad is not None]
    grad_serials = {mode.live_serials[key] for key in _storage_ids(grads) if key in mode.live_serials}
    del result, keep
    live = peak = 0
    for delta, serial in mode.events:
        if serial in grad_serials:
            continue
        live += delta
        peak = max(peak, live)
    return peak


def measure_saved_bytes(forward: Callable[[], object], module: torch.nn.Module | None = None) -> int:
    """Bytes autograd keeps for backward after `forward()`, each storage counted once.

    With `module`, its parameters and buffers are not counted (they live anyway).
    """
    storages: dict[int, int] = {}
    keep = []
    excluded = _storage_ids([*module.parameters(), *module.buffers()]) if module is not None else set()

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        keep.append(s)
        if id(s) not in excluded:
            storages[id(s)] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values())


@dataclasses.dataclass
class StepCost:
    peak_bytes: int
    flops: int


def measure_training_step(model: torch.nn.Module, inputs: tuple, loss_fn=None) -> StepCost:
    """Peak memory and FLOPs of forward + backward of `model(*inputs)` (grads cleared first)."""
    loss_fn = loss_fn or (lambda out: sum(t.float().sum() for t in tree_leaves(out)
                                          if isinstance(t, torch.Tensor) and t.requires_grad))

    def step():
        loss_fn(model(*inputs)).backward()

    model.zero_grad(set_to_none=True)
    peak = measure_peak(step, model, inputs)
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        step()
    model.zero_grad(set_to_none=True)
    return StepCost(peak, counter.get_total_flops())


def measure_allocator_peak(model: torch.nn.Module, inputs: tuple, forward=None, gradients_before: bool = True) -> int:
    """Peak bytes allocated and alive at once during one training step of `forward(*inputs)`, from
    the allocator's events (after one warm-up step; `forward` defaults to `model`).

    gradients_before=True: parameter gradients exist before the measured step, so the figure is
    activations + temporaries (gradients in flight before they accumulate included).
    gradients_before=False: they are None before it (`zero_grad(set_to_none=True)`), and what the step
    allocates and leaves allocated (the new `.grad` tensors) is not counted, as in `measure_peak`.
    """
    forward = model if forward is None else forward  # not `or`: a compiled module has no truth value

    def step():
        forward(*inputs).sum().backward()

    def reset_gradients():
        for p in model.parameters():  # gradients accumulate in place: not counted as step memory
            p.grad = torch.zeros_like(p) if gradients_before else None

    reset_gradients()
    step()
    reset_gradients()
    peak = allocator_peak(step, count_what_stays=gradients_before)
    model.zero_grad(set_to_none=True)
    return peak


def allocator_peak(step: Callable[[], object], count_what_stays: bool = True) -> int:
    """Peak bytes allocated during `step()` and alive at once, from the allocator's events.
    count_what_stays=False leaves out the allocations still alive when it returns (new `.grad` tensors)."""
    with allocation_profile() as prof:
        step()
    events = profiler_allocations(prof)
    alive_at_end = {}  # address -> index of the allocation not freed by the end
    for i, (_, address, nbytes) in enumerate(events):
        if nbytes > 0:
            alive_at_end[address] = i
        else:
            alive_at_end.pop(address, None)
    left = set() if count_what_stays else set(alive_at_end.values())
    live = peak = 0
    for i, (_, _, nbytes) in enumerate(events):
        if i not in left:
            live += nbytes
            peak = max(peak, live)
    return peak
