"""The seed example: a Conv2d-BatchNorm2d-ReLU-Linear network, trained with AMP, then optimized.

Run: `python examples/seed_net.py` (or `make demo`). It trains a few steps with mixed precision
(bfloat16 autocast on CPU, float16 + GradScaler on CUDA), optimizes the trained network for
inference with fxopt, checks the result against the original, and prints fxopt's report; then it
optimizes the same network for fine-tuning with frozen BatchNorm and prints that report too.
Last, what was gained, on a fresh batch: inference latency (median of interleaved runs) and the
peak memory of one fine-tuning step (fxopt.measure), before and after.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn

import fxopt
from fxopt.measure import measure_peak


class SeedNet(nn.Module):
    """Conv-BN-ReLU feature extractor and a linear classifier, for 3x32x32 images."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(32 * 32 * 32, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        return self.fc(x.flatten(1))


def train_with_amp(model: nn.Module, steps: int = 3, batch: int = 16) -> None:
    device = next(model.parameters()).device
    use_cuda = device.type == "cuda"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda", enabled=use_cuda)
    dtype = torch.float16 if use_cuda else torch.bfloat16
    model.train()
    for _ in range(steps):
        images = torch.randn(batch, 3, 32, 32, device=device)
        labels = torch.randint(0, 10, (batch,), device=device)
        with torch.autocast(device.type, dtype=dtype):
            loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def median_latency(models: dict[str, nn.Module], batch: torch.Tensor, rounds: int = 30) -> dict[str, float]:
    """Median seconds of a no-grad forward per model, the models taking turns each round."""
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for r in range(rounds + 3):
            for name, model in models.items():
                start = time.perf_counter()
                model(batch)
                if r >= 3:  # warm-up rounds
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def step_peak(model: nn.Module, batch: torch.Tensor) -> int:
    """Peak bytes of activations and temporaries during one training step (fxopt.measure)."""
    model.zero_grad(set_to_none=True)
    peak = measure_peak(lambda: model(batch).sum().backward(), model, (batch,))
    model.zero_grad(set_to_none=True)
    return peak


def main() -> None:
    torch.manual_seed(0)
    model = SeedNet()
    train_with_amp(model)
    model.eval()
    example = torch.randn(8, 3, 32, 32)

    fast = fxopt.optimize(model, example, verify=True)
    print(fast.fxopt_report)
    with torch.no_grad():
        print(f"\nmax |optimized - original| on a new batch: {(fast(example) - model(example)).abs().max():.2e}\n")

    model.train()
    model.bn1.eval()  # fine-tuning with frozen BatchNorm statistics
    finetune = fxopt.optimize(model, example, mode="training", verify=True)
    print(finetune.fxopt_report)

    fresh = torch.randn(8, 3, 32, 32)  # not the batch fxopt saw
    model.eval()
    latency = median_latency({"eager": model, "fxopt": fast}, fresh)
    model.train()
    model.bn1.eval()
    peaks = {"eager": step_peak(model, fresh), "fxopt": step_peak(finetune, fresh)}
    print("\nWhat fxopt changed, on a fresh batch of 8x3x32x32:")
    print(f"  inference latency (median of 30): {latency['eager'] * 1e3:.3f} ms -> {latency['fxopt'] * 1e3:.3f} ms "
          f"({latency['eager'] / latency['fxopt']:.2f}x eager's speed)")
    print(f"  fine-tuning step peak memory:     {peaks['eager'] / 2**20:.2f} MiB -> {peaks['fxopt'] / 2**20:.2f} MiB "
          f"({peaks['fxopt'] / peaks['eager']:.2f}x)")


if __name__ == "__main__":
    main()
