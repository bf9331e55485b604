"""The seed example: a Conv2d-BatchNorm2d-ReLU-Linear network, trained with AMP, then optimized.

Run: `python examples/seed_net.py` (or `make demo`). It trains a few steps with mixed precision
(bfloat16 autocast on CPU, float16 + GradScaler on CUDA), optimizes the trained network for
inference with fxopt, checks the result against the original, and prints fxopt's report; then it
optimizes the same network for fine-tuning with frozen BatchNorm and prints that report too.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import fxopt


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


if __name__ == "__main__":
    main()
