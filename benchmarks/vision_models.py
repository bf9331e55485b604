"""Torchvision-style ResNet and MobileNetV2, written out because torchvision does not import here.

Same layer structure as torchvision's `resnet18`/`resnet50` and `mobilenet_v2` (Conv-BN-ReLU
blocks, residual adds, depthwise convs), so graph-level rewrites see the patterns they would see
there; weights are random, BN statistics calibrated on random batches so activations stay O(1).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def conv_bn(c_in: int, c_out: int, kernel: int = 3, stride: int = 1, groups: int = 1, act=nn.ReLU) -> nn.Sequential:
    layers = [nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(c_out)]
    return nn.Sequential(*layers, act(inplace=True)) if act else nn.Sequential(*layers)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn(c_in, width, 3, stride), conv_bn(width, width, 3, act=None))
        self.shortcut = (conv_bn(c_in, width, 1, stride, act=None) if stride != 1 or c_in != width
                         else nn.Identity())

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        c_out = width * self.expansion
        self.body = nn.Sequential(conv_bn(c_in, width, 1), conv_bn(width, width, 3, stride),
                                  conv_bn(width, c_out, 1, act=None))
        self.shortcut = (conv_bn(c_in, c_out, 1, stride, act=None) if stride != 1 or c_in != c_out
                         else nn.Identity())

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, block: type, depths: tuple[int, ...], num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1))
        stages, c_in = [], 64
        for i, depth in enumerate(depths):
            width = 64 * 2 ** i
            for j in range(depth):
                stages.append(block(c_in, width, 2 if j == 0 and i > 0 else 1))
                c_in = width * block.expansion
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))


class InvertedResidual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, expand: int):
        super().__init__()
        hidden = c_in * expand
        layers = [conv_bn(c_in, hidden, 1, act=nn.ReLU6)] if expand != 1 else []
        layers += [conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6), conv_bn(hidden, c_out, 1, act=None)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2(nn.Module):
    # (expansion, channels, repeats, first stride), as in torchvision
    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        layers, c_in = [conv_bn(3, 32, 3, 2, act=nn.ReLU6)], 32
        for expand, c_out, repeats, stride in self.SETTINGS:
            for j in range(repeats):
                layers.append(InvertedResidual(c_in, c_out, stride if j == 0 else 1, expand))
                c_in = c_out
        layers.append(conv_bn(c_in, 1280, 1, act=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x):
        return self.head(self.features(x))


def calibrate(model: nn.Module, shape: tuple[int, ...], batches: int = 2) -> nn.Module:
    """Fill BN running statistics from random batches (cumulative average), then switch to eval."""
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            m.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(shape))
    return model.eval()


def resnet18() -> nn.Module:
    return ResNet(BasicBlock, (2, 2, 2, 2))


def resnet50() -> nn.Module:
    return ResNet(Bottleneck, (3, 4, 6, 3))


def mobilenet_v2() -> nn.Module:
    return MobileNetV2()
