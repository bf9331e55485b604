"""Recomputing a train-mode BatchNorm in a checkpointed region: from scratch, or replayed from its kept statistics.

A region recomputes its train-mode BatchNorms in the backward. Computing the batch statistics again is most of
the op; fxopt keeps them from the first run and only maps the input (`fxopt.checkpointing._batch_norm_replay`).
Variants, each one recomputation over an activation-sized tensor:

    train-mode op        native_batch_norm(training=True), running statistics given: the forward, and what a
                         region recomputed before (on copies of the running statistics)
    replay               native_batch_norm(training=False) with the kept mean, weight * invstd, variance 1, eps 0:
                         what a region recomputes now (the same bits, checked here)

Median milliseconds over round-robin rounds (benchmarks/device.py), and each as a ratio of the train-mode op.
Off CPU fxopt does not replay (cuDNN's kernel is another); the figures there only show what it would save.

    python benchmarks/batch_norm_replay.py [--shape 4,96,112,112] [--rounds 15] [--channels-last]
"""
from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

import device as dev
from fxopt.checkpointing._batch_norm_replay import KeptStatistics, replay


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,96,112,112", help="the activation's shape (default: MobileNetV2's "
                                                                 "largest, batch 4)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--channels-last", action="store_true")
    dev.add_arguments(parser)
    args = parser.parse_args()
    device, dtype = dev.from_args(args)
    shape = [int(s) for s in args.shape.split(",")]
    x = torch.randn(shape, device=device, dtype=dtype)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight, bias = (torch.randn(shape[1], device=device, dtype=dtype) for _ in range(2))
    running_mean, running_var = torch.zeros_like(weight), torch.ones_like(weight)
    out, mean, invstd = torch.ops.aten.native_batch_norm(x, weight, bias, running_mean, running_var, True, 0.1, 1e-5)
    kept = KeptStatistics.of(weight, mean, invstd)
    variants = {
        "train-mode op": lambda: torch.ops.aten.native_batch_norm(x, weight, bias, running_mean, running_var, True,
                                                                  0.1, 1e-5),
        "replay": lambda: replay(x, bias, kept),
    }
    same = torch.equal(replay(x, bias, kept), out)
    with torch.no_grad():
        ms = dev.round_robin_ms(variants, device, args.rounds)
    layout = "channels_last" if args.channels_last else "contiguous"
    print(f"{dev.describe(device, dtype)}; shape {tuple(shape)} {layout}; the replay equals the op's output: {same}")
    print(tabulate([[name, f"{t:.2f}", f"{t / ms['train-mode op']:.2f}x"] for name, t in ms.items()],
                   headers=["recomputation", "median ms", "vs train-mode op"]))


if __name__ == "__main__":
    main()
