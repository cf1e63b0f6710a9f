"""Reference networks used by the examples and benchmarks."""

from __future__ import annotations

import torch
from torch import nn


class LeNet(nn.Module):
    """Paddle's ``paddle.vision.models.LeNet``, the network of Paddle's hapi training example.

    conv 1->6 (k3, p1), ReLU, max-pool 2; conv 6->16 (k5), ReLU, max-pool 2;
    then linear 400->120->84->num_classes. As in Paddle, the linear layers
    have no activation between them.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 3, stride=1, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(6, 16, 5, stride=1, padding=0),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
        )
        self.fc = nn.Sequential(nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))
