"""Models that write their training step themselves (Keras' train_step): a GAN, two losses, an LM."""

from __future__ import annotations

import torch
from torch import nn

from hapi import Model

NOISE, POINT = 4, 2


class Pair(nn.Module):
    """A GAN's two networks in one module, so that ``Model(Pair())`` holds (and saves) both."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(NOISE, 16), nn.ReLU(), nn.Linear(16, POINT))
        self.discriminator = nn.Sequential(nn.Linear(POINT, 16), nn.ReLU(), nn.Linear(16, 1))


class GAN(Model):
    """Two optimizers: the discriminator steps on real vs fake, then the generator on fooling it."""

    def train_step(self, batch):
        (real,) = batch[:1]
        optimizer_g, optimizer_d = self.optimizers
        networks = self.network
        bce = nn.functional.binary_cross_entropy_with_logits
        fake = networks.generator(torch.randn(len(real), NOISE, device=real.device))
        scores = networks.discriminator(torch.cat([real, fake.detach()]))
        truth = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)]).to(real.device)
        d_loss = bce(scores, truth)
        self.backward(d_loss)
        self.optimizer_step(optimizer_d)
        g_loss = bce(networks.discriminator(fake), torch.ones(len(real), 1, device=real.device))
        self.backward(g_loss)
        optimizer_d.zero_grad()  # the generator's loss also reached the discriminator
        self.optimizer_step(optimizer_g)
        return {"d_loss": d_loss, "g_loss": g_loss}


def gan_model(seed: int = 0) -> GAN:
    torch.manual_seed(seed)
    model = GAN(Pair())
    model.prepare(
        [
            torch.optim.Adam(model.network.generator.parameters(), lr=1e-3),
            torch.optim.SGD(model.network.discriminator.parameters(), lr=0.05, momentum=0.9),
        ]
    )
    return model


def real_points(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    points = torch.randn(n, POINT, generator=generator) * 0.5 + torch.tensor([2.0, -1.0])
    return points, torch.zeros(n, dtype=torch.long)
