"""prune_dead_grads: measured peak memory and step time, eager vs fxopt, side by side in one process.

(a) an MLP body with a large auxiliary head whose output is declared non-differentiable
    (`differentiable_outputs=[0]`; the loss reads only the main output, as in eager)
(b) trainable stem -> 4 frozen Conv-BN(eval)-ReLU -> trainable head, batch 8, 32 channels, 32x32

Peak bytes: `fxopt.measure.measure_peak` (live storages during forward + backward, parameters,
inputs and gradients excluded; deterministic on CPU). Time: median of `repeats` steps, wall
clock and process CPU time (the steadier one when other jobs share the machine).
Targets (issue 5): fxopt peak <= 0.6x eager on both.

    python benchmarks/memory_prune_dead_grads.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
from tabulate import tabulate

import device as dev
import fxopt
from fxopt.measure import measure_peak

TARGET = 0.6


class AuxMLP(nn.Module):
    def __init__(self, width: int = 1024, aux_width: int = 4096):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(512, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.head = nn.Linear(width, 10)
        self.aux = nn.Sequential(nn.Linear(width, aux_width), nn.GELU(), nn.Linear(aux_width, aux_width), nn.GELU(),
                                 nn.Linear(aux_width, width))

    def forward(self, x):
        h = self.body(x)
        return self.head(h), self.aux(h)


def conv_bn_relu(c: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())


class FrozenMiddle(nn.Module):
    def __init__(self, c: int = 32, blocks: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.body = nn.Sequential(*[conv_bn_relu(c) for _ in range(blocks)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))

    def forward(self, x):
        return self.head(self.body(self.stem(x)))


def aux_mlp():
    torch.manual_seed(0)
    return AuxMLP().train(), (torch.randn(64, 512),), {"differentiable_outputs": [0]}


def frozen_middle():
    torch.manual_seed(0)
    model = FrozenMiddle().train()
    model.body.eval()
    for p in model.body.parameters():
        p.requires_grad_(False)
    return model, (torch.randn(8, 3, 32, 32),), {}


SCENARIOS = {"(a) MLP + large aux head, aux non-differentiable": aux_mlp,
             "(b) stem -> 4 frozen Conv-BN(eval)-ReLU -> head": frozen_middle}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _step(model: nn.Module, inputs: tuple):
    def step():
        out = model(*inputs)  # every output stays alive through backward, as in a real loop
        _first(out).float().sum().backward()
        return out
    return step


def _median_ms(variants: dict[str, nn.Module], inputs: tuple, repeats: int) -> dict[str, tuple[float, float]]:
    """(median wall ms, median process-CPU ms) of a step of each variant, runs interleaved.

    CPU time (all threads of this process) is the steadier figure on a machine shared with other jobs.
    """
    steps = {name: _step(model, inputs) for name, model in variants.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(repeats + 1):  # the first round warms up
        for name, model in variants.items():
            model.zero_grad(set_to_none=True)
            wall, cpu = time.perf_counter(), time.process_time()
            steps[name]()
            dev.synchronize(inputs[0].device)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
            model.zero_grad(set_to_none=True)
    return {name: (statistics.median(w for w, _ in t[1:]) * 1e3, statistics.median(c for _, c in t[1:]) * 1e3)
            for name, t in times.items()}


def _peak(model: nn.Module, inputs: tuple) -> int:
    model.zero_grad(set_to_none=True)
    peak = measure_peak(_step(model, inputs), model, inputs)
    model.zero_grad(set_to_none=True)
    return peak


def run(repeats: int, device=torch.device("cpu"), dtype=torch.float32) -> list[dict]:
    rows = []
    for scenario, make in SCENARIOS.items():
        model, inputs, options = make()
        model, inputs = dev.place(model, inputs, device, dtype)
        variants = {
            "eager": model,
            "fxopt prune_dead_grads only": fxopt.optimize(model, inputs, mode="training",
                                                          passes=["prune_dead_grads"], **options),
            "fxopt default training pipeline": fxopt.optimize(model, inputs, mode="training", **options),
        }
        peaks = {name: _peak(candidate, inputs) for name, candidate in variants.items()}
        times = _median_ms(variants, inputs, repeats)
        for variant in variants:
            ratio = peaks[variant] / peaks["eager"]
            (wall, cpu), (eager_wall, eager_cpu) = times[variant], times["eager"]
            rows.append({"scenario": scenario, "variant": variant, "peak MiB": peaks[variant] / 2**20,
                         "peak / eager": ratio, "median step ms": wall, "time / eager": wall / eager_wall,
                         "median CPU ms": cpu, "CPU / eager": cpu / eager_cpu,
                         "target <= 0.6x": "-" if variant == "eager" else ("met" if ratio <= TARGET else "missed")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    dev.add_arguments(parser)
    args = parser.parse_args()
    print(tabulate(run(args.repeats, *dev.from_args(args)), headers="keys", floatfmt=".3g"))


if __name__ == "__main__":
    main()
