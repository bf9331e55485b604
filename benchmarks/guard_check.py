"""Cost of fxopt's per-call guard check, against the forward it guards (issue #11 target: < 2%).

Builds Hugging Face ResNet-50 from its config (random weights), binds the guards an optimized
result checks on every call (fxopt.guards.model_state_guards: every module's mode, class and
hooks, every parameter's identity and requires_grad; with --values, as an inference result,
also every parameter's and buffer's identity, storage and version), and times
`first_failure()` against the model's eager forward at batch 1. Also a 100-module
Conv-BN-ReLU stack. Medians of interleaved rounds, in one process.

    python benchmarks/guard_check.py [--rounds 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from fxopt.guards import GuardSet, model_state_guards


def median_seconds(fn, number: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times)


def resnet50() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig()).eval()  # the default config is ResNet-50


def stack() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                           for _ in range(33)]).eval()


def main() -> None:
    torch.set_num_threads(1)  # the machine is shared: one thread gives steadier figures
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rows = []
    for name, model, x in (("HF ResNet-50", resnet50(), torch.randn(1, 3, 224, 224)),
                           ("Conv-BN-ReLU x33", stack(), torch.randn(1, 8, 16, 16))):
        modules = sum(1 for _ in model.modules())
        tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
        with torch.no_grad():
            model(x)
            forward = median_seconds(lambda: model(x), 1, args.rounds)
        for values in (False, True):
            guards = GuardSet(model_state_guards(model, "benchmark", values=values))
            bound = guards.bind(model)
            assert bound.first_failure((x,), {}) is None
            check = median_seconds(lambda: bound.first_failure((x,), {}), 200, args.rounds)
            rows.append((name, modules, tensors, len(guards), "training" if not values else "inference",
                         check * 1e6, forward * 1e3, 100 * check / forward))
    print(f"{'model':18} {'modules':>7} {'tensors':>7} {'guards':>6} {'result':>9} {'check µs':>9} "
          f"{'forward ms':>10} {'check/forward':>13}")
    for name, modules, tensors, count, kind, check_us, forward_ms, percent in rows:
        print(f"{name:18} {modules:7d} {tensors:7d} {count:6d} {kind:>9} {check_us:9.1f} {forward_ms:10.2f} "
              f"{percent:12.3f}%")


if __name__ == "__main__":
    main()
