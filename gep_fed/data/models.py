"""Models whose forward treats examples independently (no BatchNorm).

``MnistCNN``: the GEP paper's MNIST model (two conv layers with max-pooling, one linear).
``resnet20_gn``: ResNet20 for 32x32 RGB with GroupNorm instead of BatchNorm, as in the paper.
``MLP``: a small multilayer perceptron for tabular or flattened inputs.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn


class MnistCNN(nn.Module):
    """conv5x5(16) - maxpool - conv5x5(32) - maxpool - linear, for 28x28 inputs (28,938 params)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc = nn.Linear(32 * (image_size // 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.tanh(self.conv1(x)), 2)
        x = F.max_pool2d(torch.tanh(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    """Fully connected layers with tanh; ``hidden=()`` gives logistic regression."""

    def __init__(self, in_features: int, num_classes: int, hidden: tuple[int, ...] = (64,)) -> None:
        super().__init__()
        widths = [in_features, *hidden]
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.out = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(16, channels), channels)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = _norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = _norm(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20GN(nn.Module):
    """ResNet20 (3 stages of 3 basic blocks, widths 16/32/64) with GroupNorm."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.norm1 = _norm(16)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            blocks = []
            for i in range(3):
                blocks.append(_BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = layers
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def resnet20_gn(in_channels: int = 3, num_classes: int = 10) -> ResNet20GN:
    return ResNet20GN(in_channels, num_classes)
