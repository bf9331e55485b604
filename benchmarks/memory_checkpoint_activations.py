"""checkpoint_activations vs eager, checkpoint_sequential and torch.compile's activation_memory_budget.

One training step (forward, sum loss, backward) of a deep MLP (24 x Linear-LayerNorm-GELU-Dropout,
width 512, batch 256), per variant: the allocator's peak (`fxopt.measure.measure_allocator_peak`:
torch.profiler memory events, which see into compiled code too; parameter gradients exist before
the step, so the figure is activations + temporaries), FLOPs (FlopCounterMode, eager variants) and the median step time.

    python benchmarks/memory_checkpoint_activations.py [--repeats 5] [--compile]

`--compile` adds torch.compile (Inductor) at the same budgets (20-30 s per compile on CPU).
"""
from __future__ import annotations

import argparse

import torch
from tabulate import tabulate
from torch.utils.checkpoint import checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

import device as dev
import fxopt
from fxopt import _torch_private

BUDGETS = (1.0, 0.5, 0.25)


def deep_mlp(depth: int = 24, width: int = 512, p: float = 0.1) -> torch.nn.Sequential:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU(), torch.nn.Dropout(p)]
    return torch.nn.Sequential(*layers)


def _step(forward, inputs: tuple) -> None:
    forward(*inputs).sum().backward()


def _flops(forward, inputs: tuple) -> int:
    with FlopCounterMode(display=False) as counter:
        _step(forward, inputs)
    return counter.get_total_flops()


def _median_seconds(forwards: list, inputs: tuple, repeats: int) -> list[float]:
    """Median step time of each forward, timed round-robin so a busy machine slows all alike."""
    steps = {i: lambda f=f: _step(f, inputs) for i, f in enumerate(forwards)}
    return [ms / 1e3 for ms in dev.round_robin_ms(steps, inputs[0].device, repeats, warmup=0).values()]


def _variants(model, inputs, compile_too: bool):
    yield "eager", model, model
    for budget in BUDGETS:
        opt = fxopt.optimize(model, inputs, mode="training", passes=["checkpoint_activations"], memory_budget=budget)
        yield f"fxopt budget {budget}", opt, opt
    for segments in (2, 4):
        yield (f"checkpoint_sequential {segments}", model,
               lambda x, s=segments: checkpoint_sequential(model, s, x, use_reentrant=False))
    if compile_too:
        for budget in (None, *BUDGETS):
            torch._dynamo.reset()  # noqa: SLF001 - each budget needs its own compile
            with _torch_private.activation_memory_budget(budget):
                compiled = torch.compile(model)
                _step(compiled, inputs)  # compile now, under this budget
            yield f"torch.compile budget {budget if budget is not None else 'default'}", model, compiled


def run(repeats: int, compile_too: bool = False, device=torch.device("cpu"), dtype=torch.float32) -> list[dict]:
    """One row per variant. Eager variants are timed round-robin at the end; a compiled one right
    after its compile (the next budget's `torch._dynamo.reset()` would recompile it)."""
    torch.manual_seed(0)
    model, inputs = dev.place(deep_mlp(), (torch.randn(256, 512),), device, dtype)
    rows, round_robin = [], []
    for name, owner, forward in _variants(model, inputs, compile_too):
        compiled = name.startswith("torch.compile")
        rows.append({"variant": name, "peak MB": dev.training_peak_bytes(owner, inputs, forward) / 1e6,
                     "FLOPs": None if compiled else _flops(forward, inputs),
                     "seconds": _median_seconds([forward], inputs, repeats)[0] if compiled else None})
        if not compiled:
            round_robin.append((rows[-1], forward))
    for (row, _), seconds in zip(round_robin, _median_seconds([f for _, f in round_robin], inputs, repeats)):
        row["seconds"] = seconds
    model.zero_grad(set_to_none=True)
    eager = dict(rows[0])
    return [{"variant": r["variant"], "peak MB": r["peak MB"], "peak / eager": r["peak MB"] / eager["peak MB"],
             "FLOPs / eager": r["FLOPs"] / eager["FLOPs"] if r["FLOPs"] is not None else None,
             "step ms": r["seconds"] * 1e3, "time / eager": r["seconds"] / eager["seconds"]} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="add torch.compile with activation_memory_budget")
    dev.add_arguments(parser)
    args = parser.parse_args()
    print(tabulate(run(args.repeats, args.compile, *dev.from_args(args)), headers="keys", floatfmt=".3g"))


if __name__ == "__main__":
    main()
