"""The backward of fxopt's masked relu (`fxopt.passes._relu_mask`) beside ATen's relu backward, side by side.

A masked relu keeps `output <= 0` as a bool mask instead of its output. Its backward has to give
ATen's bits (`threshold_backward(grad, output, 0)`: +0 where the mask is set, the gradient itself,
NaN and inf included, elsewhere). Variants, each one backward of a relu over an activation-sized tensor:

    ATen relu           threshold_backward(grad, output, 0): what torch.relu's backward runs
    relu_mask           hardtanh_backward(grad, mask as 0/1 in grad's dtype, -1, 1): what relu_mask runs
    torch.where         torch.where(mask, 0, grad): the same bits, the form relu_mask used before

Median milliseconds over round-robin rounds (fxopt/benchmarks/device.py), and each as a ratio of ATen's.

    python benchmarks/relu_mask_backward.py [--shape 4,96,112,112] [--rounds 15] [--device cuda] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

import device as dev


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,96,112,112", help="the activation's shape (default: MobileNetV2's "
                                                                 "largest, batch 4)")
    parser.add_argument("--rounds", type=int, default=15)
    dev.add_arguments(parser)
    args = parser.parse_args()
    device, dtype = dev.from_args(args)
    shape = [int(s) for s in args.shape.split(",")]
    output = torch.relu(torch.randn(shape, device=device, dtype=dtype))
    grad = torch.randn(shape, device=device, dtype=dtype)
    zeroed = output <= 0
    zero = torch.zeros((), device=device, dtype=dtype)
    variants = {
        "ATen relu": lambda: torch.ops.aten.threshold_backward(grad, output, 0),
        "relu_mask": lambda: torch.ops.aten.hardtanh_backward(grad, zeroed.view(torch.uint8).to(dtype), -1.0, 1.0),
        "torch.where": lambda: torch.where(zeroed, zero, grad),
    }
    same = torch.equal(variants["relu_mask"](), variants["ATen relu"]())
    ms = dev.round_robin_ms(variants, device, args.rounds)
    print(f"{dev.describe(device, dtype)}; shape {tuple(shape)}; relu_mask's result equals ATen's: {same}")
    print(tabulate([[name, f"{t:.2f}", f"{t / ms['ATen relu']:.2f}x"] for name, t in ms.items()],
                   headers=["backward", "median ms", "vs ATen relu"]))


if __name__ == "__main__":
    main()
