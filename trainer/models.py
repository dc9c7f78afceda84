"""Small reference models. Users bring their own through `model._target_`.

Every model takes `input_shape` (one sample's shape) and `num_classes`, which the model configs
interpolate from the data config, and returns logits. No dropout by default, so fp32 runs on
CPU are deterministic.
"""
from __future__ import annotations

import math
from typing import Sequence

from torch import nn


class MLP(nn.Module):
    """Flattens the input and applies Linear-ReLU blocks, then a linear classifier."""

    def __init__(self, input_shape: Sequence[int], num_classes: int,
                 hidden: Sequence[int] = (128, 128), dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """Conv-BN-ReLU stages (stride 2 after the first), global average pool, linear head.

    Takes (C, H, W) inputs; a 1-D shape is not an image and is refused at construction.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int,
                 channels: Sequence[int] = (32, 64), batch_norm: bool = True,
                 dropout: float = 0.0):
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"SmallCNN needs input_shape [C, H, W], got {list(input_shape)}")
        layers: list[nn.Module] = []
        c_in = input_shape[0]
        for i, c in enumerate(channels):
            layers.append(nn.Conv2d(c_in, c, 3, stride=1 if i == 0 else 2, padding=1,
                                    bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(c))
            layers.append(nn.ReLU(inplace=True))
            c_in = c
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(c_in, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)
