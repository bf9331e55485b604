"""Device and dtype for every benchmark: `--device cpu|cuda`, `--dtype float32|bfloat16|float16`,
timing with CUDA events on CUDA (on CPU: the calling thread's CPU time when torch runs one thread, which
the other processes of a shared machine do not inflate as they do a wall clock; else perf_counter) and the peak memory of a training step
(`torch.cuda.max_memory_allocated` on CUDA; the allocator's events through the profiler on CPU,
`fxopt.measure.measure_allocator_peak`, which also sees inside torch.compile'd code).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fxopt.measure import measure_allocator_peak

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="model and input dtype (bfloat16/float16 for GPU runs)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU intra-op threads (default: torch's; 1 on a shared machine, where more measure the load)")


def from_args(args) -> tuple[torch.device, torch.dtype]:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    return device, DTYPES[args.dtype]


def describe(device: torch.device, dtype: torch.dtype) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    return f"{name}, {str(dtype).removeprefix('torch.')}"


def place(model: torch.nn.Module, inputs: tuple, device: torch.device, dtype: torch.dtype):
    """The model and its inputs on `device`, floating-point ones in `dtype` (token ids stay integers)."""
    moved = tuple(x.to(device, dtype) if x.is_floating_point() else x.to(device) for x in inputs)
    return model.to(device, dtype), moved


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a host clock times the work, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of `fn()`: CUDA events on CUDA (synchronized); on CPU the thread's CPU time when torch
    runs one thread (all the work is on this thread; preemption by other processes is not counted), else perf_counter."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    t = clock()
    fn()
    return (clock() - t) * 1e3


def round_robin_times(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int,
                      warmup: int = 1) -> dict[str, list[float]]:
    """Milliseconds of each callable in each round; a round calls every one once, so load hits all alike.

    Each round starts one callable further along, so none always runs right after the same neighbour
    (whose caches, allocations and clock state it would otherwise inherit every time).
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(warmup + rounds):
        start = round_ % len(names)
        for name in names[start:] + names[:start]:
            ms = time_ms(fns[name], device)
            if round_ >= warmup:
                times[name].append(ms)
    return times


def round_robin_ms(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int,
                   warmup: int = 1) -> dict[str, float]:
    """Median milliseconds of each callable over `round_robin_times`' rounds."""
    return {name: statistics.median(t) for name, t in round_robin_times(fns, device, rounds, warmup).items()}


def paired_ratio(times: dict[str, list[float]], baseline: str, name: str) -> float:
    """Median over rounds of baseline's time / name's time in the same round (> 1: name is faster). Pairing each
    round cancels load that drifts between rounds, which a ratio of the two medians does not."""
    return statistics.median(b / t for b, t in zip(times[baseline], times[name]))


def training_peak_bytes(model: torch.nn.Module, inputs: tuple, forward: Callable) -> int:
    """Peak bytes of activations and temporaries during one forward + backward of `forward(*inputs)`."""
    if inputs[0].device.type != "cuda":
        return measure_allocator_peak(model, inputs, forward)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients accumulate in place: not step memory
    forward(*inputs).float().sum().backward()  # warm-up (compiles, caches)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    forward(*inputs).float().sum().backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() - base
