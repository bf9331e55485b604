"""`fxopt bench`: eager vs fxopt (vs `torch.compile(backend="fxopt")`), side by side in one process.

Each variant runs the same step: a forward under `no_grad` in inference; forward, a sum loss
and backward in training (gradients cleared between steps). Runs are interleaved round by round,
so drift in the machine's speed hits every variant alike; the table shows the spread of the
rounds (min, quartiles, max around the median) and the per-round speedup over eager. In training the peak memory of one step is measured with `fxopt.measure.measure_peak`
(live storages, parameters/buffers/inputs/gradients excluded); it cannot see inside a compiled
graph, so the compiled variant has no peak figure. The timing runs with a set number of torch threads
(`torch_threads`; the command line's default is one on CPU, see `fxopt bench --threads`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from tabulate import tabulate

from ..measure import measure_peak
from ..tree import flatten_tensors
from .api import optimize
from .cli_inspect import human_bytes
from .cli_progress import Progress


@dataclasses.dataclass
class Variant:
    name: str
    module: Callable
    setup_seconds: float
    times: list[float] = dataclasses.field(default_factory=list)
    peak_bytes: int | None = None


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to `n` inside, and given back after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _step(module, inputs: tuple, training: bool) -> Callable[[], None]:
    def step():
        if not training:
            with torch.no_grad():
                module(*inputs)
            return
        loss = sum(t.float().sum() for t in flatten_tensors(module(*inputs)) if t.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
    return step


def _build_variants(model, inputs, mode: str, passes, options: dict, compile_: bool, progress: Progress):
    progress.phase("optimizing with fxopt")
    start = time.perf_counter()
    variants = [Variant("eager", model, 0.0),
                Variant("fxopt", optimize(model, inputs, mode=mode, passes=passes, **options),
                        time.perf_counter() - start)]
    if compile_:
        progress.phase("compiling with torch.compile(backend='fxopt') (first call)")
        backend_options = {**options, **({"passes": list(passes)} if passes is not None else {})}
        compiled = torch.compile(model, backend="fxopt", options=backend_options)
        start = time.perf_counter()
        _step(compiled, inputs, mode == "training")()
        variants.append(Variant("torch.compile(backend='fxopt')", compiled, time.perf_counter() - start))
    return variants


def run_bench(model: torch.nn.Module, inputs: tuple, mode: str, passes, options: dict, compile_: bool,
              repeats: int, warmup: int, progress: Progress) -> list[Variant]:
    training = mode == "training"
    variants = _build_variants(model, inputs, mode, passes, options, compile_, progress)
    steps = {v.name: _step(v.module, inputs, training) for v in variants}
    rounds = warmup + repeats
    progress.phase(f"timing {len(variants)} variants, {warmup} warm-up + {repeats} timed runs each")
    for r in range(rounds):
        progress.step("timing", r + 1, rounds)
        for v in variants:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            steps[v.name]()
            if r >= warmup:
                v.times.append(time.perf_counter() - start)
    if training:
        progress.phase("measuring peak memory")
        for v in variants:
            if v.name in ("eager", "fxopt"):
                model.zero_grad(set_to_none=True)
                v.peak_bytes = measure_peak(steps[v.name], model, inputs)
        model.zero_grad(set_to_none=True)
    progress.finish()
    return variants


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def bench_table(variants: list[Variant], training: bool) -> str:
    """Per variant: median latency with min / quartiles / max over the rounds, and the speedup over eager
    (median of the per-round ratios -- rounds are interleaved -- and their quartiles)."""
    eager = variants[0]
    headers = ["variant", "median latency", "min", "q1–q3", "max", "speedup vs eager (q1–q3)", "setup"]
    if training:
        headers += ["peak memory", "vs eager"]
    rows = []
    for v in variants:
        q1, median, q3 = _quartiles(v.times)
        ratios = [e / t for e, t in zip(eager.times, v.times)]
        r1, r2, r3 = _quartiles(ratios)
        row = [v.name, f"{median * 1e3:.3f} ms", f"{min(v.times) * 1e3:.3f} ms", f"{q1 * 1e3:.3f}–{q3 * 1e3:.3f} ms",
               f"{max(v.times) * 1e3:.3f} ms", f"{r2:.2f}x ({r1:.2f}–{r3:.2f})",
               "-" if v is eager else f"{v.setup_seconds:.2f} s"]
        if training:
            known = v.peak_bytes is not None
            row += [f"{human_bytes(v.peak_bytes)} ({v.peak_bytes:,} B)" if known else "not measured",
                    f"{v.peak_bytes / eager.peak_bytes:.3f}x" if known and eager.peak_bytes else "-"]
        rows.append(row)
    return tabulate(rows, headers=headers)
