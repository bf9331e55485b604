"""A residual MLP (8 blocks of Linear-LayerNorm-GELU-Dropout, 256 wide) to watch checkpoint_activations work.

    fxopt inspect examples/deep_mlp.py:DeepMLP --input-shape 128x256 --mode training --memory-budget 0.5 \\
        --html deep_mlp.html
"""
from __future__ import annotations

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.act(self.norm(self.fc(x))))


class DeepMLP(nn.Module):
    def __init__(self, depth: int = 8, width: int = 256, classes: int = 10):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(torch.relu(self.blocks(x)))
