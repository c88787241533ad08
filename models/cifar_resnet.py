"""The CIFAR-10 ResNet of He et al. 2016 ("Deep Residual Learning for Image Recognition", section 4.2):
not a model of the paper's tables, the small net of the ILSVRC experiment's `real` profile (real
photographs at 32 px on one CPU core; experiments/ilsvrc_cnns/config.yaml).

    from models import build
    net = build("resnet20_cifar", num_classes=10)      # 0.27M parameters ("0.27M" in He et al. Table 6)
    net = build("resnet8_cifar", num_classes=10)       # n = 1: 75K parameters (the `real` profile's)

As section 4.2 builds it: a 3x3 convolution of 16 filters, then three stages of n = 3 basic blocks
(two 3x3 convolutions, each followed by batch norm; ReLU after the first and after the sum) on 32x32,
16x16 and 8x8 maps with 16, 32 and 64 filters -- 6n + 2 = 20 weighted layers -- global average pooling
and a fully-connected classifier. The first convolution of stages 2 and 3 has stride 2; their shortcuts
are option A: identity on every second pixel, the new channels zero-padded (parameter-free: "all
shortcuts are identity" in section 4.2). He-normal (fan-out) convolution weights, BN gamma 1, beta 0,
as the ImageNet ResNet here and torchvision. `width` scales the three filter counts. Any input size
works (the final pooling is global); it was designed for 32x32.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import register
from models.imagenet_cnns import check_args, width_scaler, he_init


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride, self.pad = stride, cout - cin

    def shortcut(self, x):
        # Option A (He et al. 2016, section 3.3): subsample, and zero-pad the added channels.
        if self.stride > 1:
            x = x[:, :, ::self.stride, ::self.stride]
        return F.pad(x, (0, 0, 0, 0, 0, self.pad)) if self.pad > 0 else x

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, num_classes: int, width: float, n: int):
        super().__init__()
        c = width_scaler(width)
        self.aux_logits = False
        widths = (c(16), c(32), c(64))
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True))
        blocks, cin = [], widths[0]
        for stage, cout in enumerate(widths):
            for i in range(n):
                blocks.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        he_init(self)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


@register("resnet8_cifar", batch_norm=True)
def resnet8_cifar(num_classes: int = 10, width: float = 1.0, aux_logits: bool = False) -> nn.Module:
    """The same family at n = 1 (6n + 2 = 8 layers): section 4.2's design, shallower than its smallest (n = 3)."""
    check_args("resnet8_cifar", num_classes, width, aux_logits, has_aux=False)
    return CifarResNet(num_classes, width, n=1)


@register("resnet20_cifar", batch_norm=True)
def resnet20_cifar(num_classes: int = 10, width: float = 1.0, aux_logits: bool = False) -> nn.Module:
    check_args("resnet20_cifar", num_classes, width, aux_logits, has_aux=False)
    return CifarResNet(num_classes, width, n=3)
