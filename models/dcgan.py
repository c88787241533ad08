"""DCGAN for CelebA faces (paper section 4.6, Figure 6).

The paper gives the shape only: a generator of 7 layers of fractionally-strided convolutions (leaky
ReLU, tanh on the last) and a discriminator of 6 convolutions and 2 fully-connected layers, trained
with Adam on 128x128 faces. Everything else follows Radford et al. 2016 (DCGAN): a 100-d latent (drawn
from N(0, 1) as in the PyTorch DCGAN example; Radford et al. draw it uniformly), batch norm in every layer
but the generator's output and the discriminator's input and output, weights from N(0, 0.02),
leaky-ReLU slope 0.2. Channel counts (64 at full resolution, doubling per halving, capped at 16x) and
the width of the hidden fully-connected layer are ours (the paper does not give them).

At 128 px: generator  z(100) -> 4x4 (project) -> 8 -> 16 -> 32 -> 64 -> 128 -> RGB  = 7 layers,
           discriminator RGB -> 128 (stride 1) -> 64 -> 32 -> 16 -> 8 -> 4  = 6 convs, then FC, FC.
Other sizes (the tiny profile's 32 px) use log2(size) - 2 up/down-sampling layers around the same
first and last layers.
"""
from __future__ import annotations

import math

import torch.nn as nn

from models import register
from mpt.errors import UserError

LATENT = 100
SLOPE = 0.2


def _levels(size: int) -> int:
    n = int(round(math.log2(size))) - 2
    if size < 8 or 2 ** (n + 2) != size:
        raise UserError(f"DCGAN image size {size} must be a power of two >= 8 (the paper's is 128)")
    return n


def init_weights(m: nn.Module) -> None:
    """Radford et al. 2016, section 4: all weights from N(0, 0.02); batch-norm scales N(1, 0.02)."""
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
        nn.init.normal_(m.weight, 0.0, 0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, size: int = 128, width: float = 1.0, latent: int = LATENT):
        super().__init__()
        n, c = _levels(size), max(4, round(64 * width))
        ch = [c * min(2 ** (n - 1 - i), 16) if i < n else c for i in range(n + 1)]  # channels at 4, 8, ..., size
        ch = [max(x, c) for x in ch]
        layers = [nn.ConvTranspose2d(latent, ch[0], 4, 1, 0, bias=False), nn.BatchNorm2d(ch[0]),
                  nn.LeakyReLU(SLOPE, inplace=True)]
        for i in range(n):  # fractionally-strided: each doubles the resolution
            layers += [nn.ConvTranspose2d(ch[i], ch[i + 1], 4, 2, 1, bias=False), nn.BatchNorm2d(ch[i + 1]),
                       nn.LeakyReLU(SLOPE, inplace=True)]
        layers += [nn.ConvTranspose2d(ch[n], 3, 3, 1, 1), nn.Tanh()]  # stride 1 at full size: RGB in [-1, 1]
        self.net = nn.Sequential(*layers)
        self.latent = latent
        self.apply(init_weights)

    def forward(self, z):
        return self.net(z.view(z.shape[0], -1, 1, 1))


class Discriminator(nn.Module):
    def __init__(self, size: int = 128, width: float = 1.0):
        super().__init__()
        n, c = _levels(size), max(4, round(64 * width))
        layers = [nn.Conv2d(3, c, 3, 1, 1), nn.LeakyReLU(SLOPE, inplace=True)]  # no batch norm on the input layer
        cin = c
        for i in range(n):
            cout = c * min(2 ** (i + 1), 16)
            layers += [nn.Conv2d(cin, cout, 4, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(SLOPE, inplace=True)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(cin * 16, cin), nn.LeakyReLU(SLOPE, inplace=True),
                                  nn.Linear(cin, 1))  # a logit: the loss applies the sigmoid in FP32 (3.3)
        self.apply(init_weights)

    def forward(self, x):
        return self.head(self.features(x)).view(-1)


@register("dcgan", batch_norm=True)
def dcgan(size: int = 128, width: float = 1.0) -> nn.ModuleDict:
    """Both networks by name, as the engine's named models."""
    return nn.ModuleDict({"generator": Generator(size, width), "discriminator": Discriminator(size, width)})
