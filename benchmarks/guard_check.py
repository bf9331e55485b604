"""Cost of fxopt's per-call guard check, against the forward it guards (issue #11 target: < 2%).

Builds Hugging Face ResNet-50 from its config (random weights) and a 100-module Conv-BN-ReLU
stack, and times at batch 1 what a result does on every call besides running its graph:
`first_failure()` of the guards, then `note_own_writes()`.

  - training: the guards on the model's state a training result checks
    (fxopt.guards.model_state_guards: every module's mode, class, hooks and settings, every parameter's
    requires_grad, every parameter's and buffer's identity);
  - inference: the guards of a real `fxopt.optimize(model, x, mode="inference")` result
    (the same, plus capture's call check and the values fold_conv_bn baked in).

One torch thread; medians of rounds of the calling thread's CPU time, in one process.

    python benchmarks/guard_check.py [--rounds 15]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn as nn

import fxopt
from fxopt.guards import GuardSet, model_state_guards


def median_seconds(fn, number: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(number):
            fn()
        times.append((time.thread_time() - start) / number)
    return statistics.median(times)


def resnet50() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig()).eval()  # the default config is ResNet-50


def stack() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                           for _ in range(33)]).eval()


def bound_guards(model: nn.Module, x: torch.Tensor, kind: str):
    if kind == "training":
        return GuardSet(model_state_guards(model, "benchmark")).bind(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fxopt.optimize(model, x, mode="inference")
    return result.variants[0].bound


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
        for kind in ("training", "inference"):
            bound = bound_guards(model, x, kind)
            assert bound.first_failure((x,), {}) is None

            def per_call(bound=bound):
                bound.first_failure((x,), {})
                bound.note_own_writes()

            check = median_seconds(per_call, 200, args.rounds)
            rows.append((name, modules, tensors, len(bound.guards), kind, check * 1e6, forward * 1e3,
                         100 * check / forward))
    print(f"{'model':18} {'modules':>7} {'tensors':>7} {'guards':>6} {'result':>9} {'check µs':>9} "
          f"{'forward ms':>10} {'check/forward':>13}")
    for name, modules, tensors, count, kind, check_us, forward_ms, percent in rows:
        print(f"{name:18} {modules:7d} {tensors:7d} {count:6d} {kind:>9} {check_us:9.1f} {forward_ms:10.2f} "
              f"{percent:12.3f}%")


if __name__ == "__main__":
    main()
