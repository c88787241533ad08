"""The six ILSVRC12 CNNs of the paper's Table 1 (section 4.1), written as plain nn.Modules.

Every constructor is `fn(num_classes=1000, width=1.0, aux_logits=<default>) -> nn.Module`.
`width` multiplies every channel count and hidden FC size (rounded, at least 1): width=1 is the
reference network, width=1/16 or 1/32 a tiny CPU variant with the same topology. A global
adaptive average pool (and, for AlexNet/VGG and the auxiliary heads, adaptive pooling to the
reference grid) makes any input of 80x80 or more work; at the reference resolution the pooling
windows are exactly the reference ones.

Which reference each model follows:

- alexnet: Caffe's bvlc_alexnet (train_val.prototxt): 96-256-384-384-256 filters, conv2/4/5
  in two groups, LRN after conv1 and conv2, ceil-mode max pools, dropout after fc6 and fc7,
  227x227 crops; 60,965,224 parameters. Its fillers: weights N(0, 0.01), fc6/fc7 N(0, 0.005),
  biases 0.1 on conv2/4/5 and fc6/7, else 0.
- vgg16: VGG configuration D (Simonyan & Zisserman 2015, Table 1), 138,357,544 parameters,
  with NVCaffe 0.16 models/vgg16's fillers: "xavier" convolutions with bias 0.1, fully
  connected N(0, 0.01) with bias 0.
- googlenet: Inception v1 (Szegedy et al. 2015) as replicated by Caffe's bvlc_googlenet:
  biased convolutions, no batch norm, LRN after pool1 and conv2, 5x5 branches, max-pool
  projection, dropout 0.4, two auxiliary heads after 4a and 4d (loss weight 0.3 each,
  dropout 0.7), Caffe "xavier" weights (uniform, fan-in) with bias 0.2.
  6,998,552 parameters without the auxiliary heads, 13,378,280 with them. (torchvision's
  googlenet adds batch norm and uses 3x3 in the "5x5" branch, so its counts differ.)
- inception_v2: BN-Inception, the network of the batch-norm paper (Ioffe & Szegedy 2015,
  Figure 5): 5x5 replaced by two 3x3, 28x28 modules 3a-3c, stride-2 modules 3c and 4e,
  batch norm after every convolution, no LRN, no dropout, no auxiliary heads; as in the
  public Caffe prototxt models/default_googlenet_v2 (conv without bias, "xavier" weights).
  11,285,224 parameters; the Cadene pretrainedmodels `bninception` port has 11,295,240 because
  its convolutions keep the bias of the Caffe model it was converted from (ours + 10,016 conv
  biases, redundant before BN). The BN paper itself says 13.6M without a breakdown.
- inception_v3: NVCaffe 0.16 models/inception_v3/train_val.prototxt (NVIDIA's Caffe, which ran
  the paper's Caffe models): the v3 paper's Table 1 -- 3x3 stem ending in 288 filters, 3 x 35x35,
  5 x 17x17 (c7 = 128, 160, 160, 192, 192) and 2 x 8x8 modules -- BN eps 1e-4, "xavier" weights,
  no dropout, two auxiliary heads (loss1 after the 35->17 reduction, loss2 after 17->8; loss
  weight 0.3 each). Its final 7x7/1 pool leaves 2x2 of the 8x8 map, so the classifier takes
  8,192 features. 32,410,760 parameters without the heads, 38,526,552 with them (torchvision's
  TF-slim layout, a different net: 23,834,568 / 27,161,264).
- resnet50_preact: pre-activation ResNet-50 (He et al. 2016b, "Identity mappings"):
  BN-ReLU-conv ordering, stride on the 3x3 convolution, projection shortcuts without BN
  taking the pre-activated input, conv1-BN-ReLU stem, final BN-ReLU before pooling; laid out
  as fb.resnet.torch preresnet.lua / He's resnet-pre-act.lua. 25,549,352 parameters, the same
  as timm's `resnetv2_50` (torchvision's post-activation resnet50: 25,557,032).
  Kaiming-normal (fan-out) weights.

Auxiliary heads: in training mode with aux_logits=True the forward returns
`(logits, [aux_logits, ...])`; in eval mode, or with aux_logits=False, just `logits`.
Weight each auxiliary loss by AUX_WEIGHTS[name].
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import register
from mpt.errors import UserError

# Loss weight of each auxiliary classifier (GoogLeNet: bvlc_googlenet train_val.prototxt
# loss1/loss2 loss_weight 0.3; Inception v3: NVCaffe 0.16 models/inception_v3, loss1/loss2 0.3).
AUX_WEIGHTS = {"googlenet": 0.3, "inception_v3": 0.3}

# Training/eval crop of each model at full size (Inception v3 was designed for 299x299).
INPUT_SIZE = {
    "alexnet": 227,
    "vgg16": 224,
    "googlenet": 224,
    "inception_v2": 224,
    "inception_v3": 299,
    "resnet50_preact": 224,
}


# ----------------------------------------------------------------------------- helpers

def check_args(name: str, num_classes: int, width: float, aux_logits: bool, has_aux: bool):
    if not isinstance(num_classes, int) or num_classes < 1:
        raise UserError(f"model {name}: num_classes must be a positive integer, got {num_classes!r}")
    if not (isinstance(width, (int, float)) and math.isfinite(width) and width > 0):
        raise UserError(f"model {name}: width must be a positive number (1.0 = full size), got {width!r}")
    if aux_logits and not has_aux:
        raise UserError(f"model {name} has no auxiliary classifiers; set aux_logits=false")


def width_scaler(width: float):
    """Channel count at this width: rounded, at least 1."""
    return lambda ch: max(1, int(round(ch * width)))


def _pool_to(x: torch.Tensor, kernel: int, stride: int, ref_size: int, out: int) -> torch.Tensor:
    """Average-pool to an out x out grid. At the reference map size use the reference's fixed
    window (so full-size models match their reference exactly); elsewhere pool adaptively to the
    same grid so the FC sizes behind it hold for any input resolution."""
    if x.shape[-2] == ref_size and x.shape[-1] == ref_size:
        return F.avg_pool2d(x, kernel, stride)
    return F.adaptive_avg_pool2d(x, out)


def _same_max_pool(x: torch.Tensor, kernel: int = 3, stride: int = 2) -> torch.Tensor:
    """TF-"SAME" max pooling: output ceil(n/stride), padding split with the extra pixel at the
    end. On even maps this is exactly Caffe's ceil-mode unpadded pooling (the BN-Inception
    reference at 224); on odd maps it still matches the stride-2, pad-1 conv branches it is
    concatenated with (Caffe's pooling would be one pixel short there, e.g. 5x5 maps at 80x80)."""
    pads = []
    for n in (x.shape[-1], x.shape[-2]):  # F.pad order: last dim first
        total = max((math.ceil(n / stride) - 1) * stride + kernel - n, 0)
        pads += [total // 2, total - total // 2]
    if any(pads):
        x = F.pad(x, pads, value=float("-inf"))
    return F.max_pool2d(x, kernel, stride)


def _caffe_xavier_(w: torch.Tensor):
    # Caffe's "xavier" filler: U(-sqrt(3/fan_in), +sqrt(3/fan_in)) -- Kaiming-uniform with gain 1.
    nn.init.kaiming_uniform_(w, nonlinearity="linear")


def _aux_output(model: nn.Module, logits: torch.Tensor, aux: list[torch.Tensor]):
    return (logits, aux) if (model.training and model.aux_logits) else logits


class LRN(nn.Module):
    """Caffe's cross-channel local response normalisation (same formula as
    nn.LocalResponseNorm: alpha is divided by the window size). Computed in FP32 and returned
    in the input dtype: it sums squares of activations, and the paper (section 3) keeps such
    reductions in FP32 -- an FP16 square of an activation above 256 overflows."""

    fp32_compute = True  # impl=paper computes it on an FP32 cast of its input (mpt.precision.convert_model)

    def __init__(self, size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0):
        super().__init__()
        self.size, self.alpha, self.beta, self.k = size, alpha, beta, k

    def forward(self, x):
        return F.local_response_norm(x.float(), self.size, self.alpha, self.beta, self.k).to(x.dtype)


class ConvReLU(nn.Sequential):
    """Biased conv + ReLU (GoogLeNet has no batch norm)."""

    def __init__(self, cin, cout, kernel, stride=1, padding=0):
        super().__init__(nn.Conv2d(cin, cout, kernel, stride, padding), nn.ReLU(inplace=True))


class ConvBNReLU(nn.Sequential):
    """Conv (no bias: BN's beta replaces it) + BN + ReLU (Inception v2/v3)."""

    def __init__(self, cin, cout, kernel, stride=1, padding=0, eps=1e-5):
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride, padding, bias=False),
            nn.BatchNorm2d(cout, eps=eps),
            nn.ReLU(inplace=True),
        )


# ----------------------------------------------------------------------------- AlexNet

class AlexNet(nn.Module):
    """bvlc_alexnet (Caffe models/bvlc_alexnet/train_val.prototxt): 96-256-384-384-256 filters,
    conv2/4/5 in two groups (the two GPU towers of Krizhevsky et al. 2012), LRN after conv1 and
    conv2, max pools in Caffe's ceil mode, dropout 0.5 after fc6 and fc7."""

    def __init__(self, num_classes: int, width: float):
        super().__init__()
        # Grouped convolutions need even channel counts at every width.
        c = lambda ch: 2 * max(1, int(round(ch * width / 2)))  # noqa: E731
        c1, c2, c3, c4, c5, hidden = c(96), c(256), c(384), c(384), c(256), width_scaler(width)(4096)
        self.aux_logits = False
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, 11, stride=4), nn.ReLU(inplace=True), LRN(),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(c1, c2, 5, padding=2, groups=2), nn.ReLU(inplace=True), LRN(),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(c2, c3, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c3, c4, 3, padding=1, groups=2), nn.ReLU(inplace=True),
            nn.Conv2d(c4, c5, 3, padding=1, groups=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, ceil_mode=True),
        )
        # 6x6 is the map at 227x227; adaptive pooling keeps fc6's input size at other sizes.
        self.pool = nn.AdaptiveAvgPool2d(6)
        self.classifier = nn.Sequential(
            nn.Linear(c5 * 36, hidden), nn.ReLU(inplace=True), nn.Dropout(0.5),   # fc6, drop6
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(0.5),    # fc7, drop7
            nn.Linear(hidden, num_classes),                                       # fc8
        )
        # bvlc_alexnet train_val.prototxt fillers, layer by layer.
        convs = [m for m in self.features if isinstance(m, nn.Conv2d)]
        fcs = [m for m in self.classifier if isinstance(m, nn.Linear)]
        for layer, std, bias in zip(convs + fcs,
                                    [0.01] * 5 + [0.005, 0.005, 0.01],
                                    [0.0, 0.1, 0.0, 0.1, 0.1, 0.1, 0.1, 0.0]):
            nn.init.normal_(layer.weight, 0.0, std)
            nn.init.constant_(layer.bias, bias)

    def forward(self, x):
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


@register("alexnet")
def alexnet(num_classes: int = 1000, width: float = 1.0, aux_logits: bool = False) -> nn.Module:
    check_args("alexnet", num_classes, width, aux_logits, has_aux=False)
    return AlexNet(num_classes, width)


# ----------------------------------------------------------------------------- VGG-D

_VGG_D = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


class VGG(nn.Module):
    def __init__(self, num_classes: int, width: float, cfg=_VGG_D):
        super().__init__()
        c = width_scaler(width)
        self.aux_logits = False
        layers, cin = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, c(v), 3, padding=1), nn.ReLU(inplace=True)]
                cin = c(v)
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(7)  # 7x7 at 224x224
        hidden = c(4096)
        self.classifier = nn.Sequential(
            nn.Linear(cin * 49, hidden), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(hidden, num_classes),
        )
        # NVCaffe 0.16 models/vgg16/train_val.prototxt fillers: convolutions "xavier" with bias
        # 0.1, fully connected layers N(0, 0.01) with bias 0.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                _caffe_xavier_(m.weight)
                nn.init.constant_(m.bias, 0.1)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


@register("vgg16")
def vgg16(num_classes: int = 1000, width: float = 1.0, aux_logits: bool = False) -> nn.Module:
    check_args("vgg16", num_classes, width, aux_logits, has_aux=False)
    return VGG(num_classes, width)


# ----------------------------------------------------------------------------- GoogLeNet

class InceptionV1(nn.Module):
    """Four branches: 1x1 | 1x1 -> 3x3 | 1x1 -> 5x5 | 3x3 max-pool -> 1x1."""

    def __init__(self, cin, n1, r3, n3, r5, n5, pp):
        super().__init__()
        self.b1 = ConvReLU(cin, n1, 1)
        self.b3 = nn.Sequential(ConvReLU(cin, r3, 1), ConvReLU(r3, n3, 3, padding=1))
        self.b5 = nn.Sequential(ConvReLU(cin, r5, 1), ConvReLU(r5, n5, 5, padding=2))
        self.bp = nn.Sequential(nn.MaxPool2d(3, 1, padding=1), ConvReLU(cin, pp, 1))
        self.out_channels = n1 + n3 + n5 + pp

    def forward(self, x):
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], 1)


class GoogLeNetAux(nn.Module):
    """bvlc_googlenet loss1/loss2 head: 5x5/3 avg-pool (14x14 -> 4x4), 1x1 conv 128, fc 1024,
    dropout 0.7, classifier."""

    def __init__(self, cin, num_classes, c):
        super().__init__()
        self.conv = ConvReLU(cin, c(128), 1)
        self.fc = nn.Linear(c(128) * 16, c(1024))
        self.drop = nn.Dropout(0.7)
        self.classifier = nn.Linear(c(1024), num_classes)

    def forward(self, x):
        x = self.conv(_pool_to(x, 5, 3, ref_size=14, out=4))
        x = self.drop(F.relu(self.fc(torch.flatten(x, 1)), inplace=True))
        return self.classifier(x)


# (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj) -- Szegedy et al. 2015, Table 1.
_GOOGLENET = {
    "3a": (64, 96, 128, 16, 32, 32), "3b": (128, 128, 192, 32, 96, 64),
    "4a": (192, 96, 208, 16, 48, 64), "4b": (160, 112, 224, 24, 64, 64),
    "4c": (128, 128, 256, 24, 64, 64), "4d": (112, 144, 288, 32, 64, 64),
    "4e": (256, 160, 320, 32, 128, 128),
    "5a": (256, 160, 320, 32, 128, 128), "5b": (384, 192, 384, 48, 128, 128),
}


class GoogLeNet(nn.Module):
    def __init__(self, num_classes: int, width: float, aux_logits: bool):
        super().__init__()
        c = width_scaler(width)
        self.aux_logits = aux_logits
        # Caffe pools in ceil mode: 112 -> 56 -> 28 -> 14 -> 7 at 224x224.
        self.stem = nn.Sequential(
            ConvReLU(3, c(64), 7, stride=2, padding=3),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            LRN(),
            ConvReLU(c(64), c(64), 1),
            ConvReLU(c(64), c(192), 3, padding=1),
            LRN(),
            nn.MaxPool2d(3, 2, ceil_mode=True),
        )
        cin = c(192)
        blocks = {}
        for name, spec in _GOOGLENET.items():
            blocks[name] = InceptionV1(cin, *(c(v) for v in spec))
            cin = blocks[name].out_channels
        self.inc3 = nn.Sequential(blocks["3a"], blocks["3b"], nn.MaxPool2d(3, 2, ceil_mode=True))
        self.inc4a = blocks["4a"]
        self.inc4bcd = nn.Sequential(blocks["4b"], blocks["4c"], blocks["4d"])
        self.inc4e = nn.Sequential(blocks["4e"], nn.MaxPool2d(3, 2, ceil_mode=True))
        self.inc5 = nn.Sequential(blocks["5a"], blocks["5b"])
        if aux_logits:
            self.aux1 = GoogLeNetAux(blocks["4a"].out_channels, num_classes, c)
            self.aux2 = GoogLeNetAux(blocks["4d"].out_channels, num_classes, c)
        self.pool = nn.AdaptiveAvgPool2d(1)  # = Caffe's 7x7/1 average pool at 224x224
        self.drop = nn.Dropout(0.4)
        self.fc = nn.Linear(cin, num_classes)
        # bvlc_googlenet fillers: "xavier" weights; bias 0.2 on convolutions and the aux
        # heads' hidden FC, 0 on classifiers.
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                _caffe_xavier_(m.weight)
                nn.init.constant_(m.bias, 0.2)
        for fc in [self.fc] + ([self.aux1.classifier, self.aux2.classifier] if aux_logits else []):
            nn.init.zeros_(fc.bias)

    def forward(self, x):
        x = self.inc4a(self.inc3(self.stem(x)))
        aux = []
        if self.training and self.aux_logits:
            aux.append(self.aux1(x))
        x = self.inc4bcd(x)
        if self.training and self.aux_logits:
            aux.append(self.aux2(x))
        x = self.inc5(self.inc4e(x))
        logits = self.fc(self.drop(torch.flatten(self.pool(x), 1)))
        return _aux_output(self, logits, aux)


@register("googlenet")
def googlenet(num_classes: int = 1000, width: float = 1.0, aux_logits: bool = True) -> nn.Module:
    check_args("googlenet", num_classes, width, aux_logits, has_aux=True)
    return GoogLeNet(num_classes, width, aux_logits)


# ----------------------------------------------------------------------------- BN-Inception

class InceptionV2(nn.Module):
    """BN-Inception module (Ioffe & Szegedy 2015, Figure 5). stride=2 makes the grid-reduction
    form (3c, 4e): no 1x1 branch, stride-2 3x3 convs, and a max-pool pass-through."""

    def __init__(self, cin, n1, r3, n3, rd, nd, pool, pp, stride=1):
        super().__init__()
        self.stride = stride
        self.b1 = ConvBNReLU(cin, n1, 1) if n1 else None
        self.b3 = nn.Sequential(ConvBNReLU(cin, r3, 1), ConvBNReLU(r3, n3, 3, stride, 1))
        self.bd = nn.Sequential(ConvBNReLU(cin, rd, 1), ConvBNReLU(rd, nd, 3, 1, 1),
                                ConvBNReLU(nd, nd, 3, stride, 1))
        self.pool_kind = pool
        self.bp = ConvBNReLU(cin, pp, 1) if pp else None
        self.out_channels = n1 + n3 + nd + (pp if pp else cin)

    def forward(self, x):
        outs = [self.b1(x)] if self.b1 is not None else []
        outs += [self.b3(x), self.bd(x)]
        if self.stride == 2:
            outs.append(_same_max_pool(x, 3, 2))
        else:
            # Caffe averages include the zero padding (count_include_pad).
            p = F.avg_pool2d(x, 3, 1, 1) if self.pool_kind == "avg" else F.max_pool2d(x, 3, 1, 1)
            outs.append(self.bp(p))
        return torch.cat(outs, 1)


# (1x1, 3x3 reduce, 3x3, double-3x3 reduce, double-3x3, pool, pool proj, stride):
# Ioffe & Szegedy 2015, Figure 5; same numbers in models/default_googlenet_v2/train_val.prototxt.
_BN_INCEPTION = [
    ("3a", (64, 64, 64, 64, 96, "avg", 32, 1)),
    ("3b", (64, 64, 96, 64, 96, "avg", 64, 1)),
    ("3c", (0, 128, 160, 64, 96, "max", 0, 2)),
    ("4a", (224, 64, 96, 96, 128, "avg", 128, 1)),
    ("4b", (192, 96, 128, 96, 128, "avg", 128, 1)),
    ("4c", (160, 128, 160, 128, 160, "avg", 128, 1)),
    ("4d", (96, 128, 192, 160, 192, "avg", 128, 1)),
    ("4e", (0, 128, 192, 192, 256, "max", 0, 2)),
    ("5a", (352, 192, 320, 160, 224, "avg", 128, 1)),
    ("5b", (352, 192, 320, 192, 224, "max", 128, 1)),
]


class BNInception(nn.Module):
    def __init__(self, num_classes: int, width: float):
        super().__init__()
        c = width_scaler(width)
        self.aux_logits = False
        self.stem = nn.Sequential(
            ConvBNReLU(3, c(64), 7, stride=2, padding=3),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            ConvBNReLU(c(64), c(64), 1),
            ConvBNReLU(c(64), c(192), 3, padding=1),
            nn.MaxPool2d(3, 2, ceil_mode=True),
        )
        cin, blocks = c(192), []
        for _, (n1, r3, n3, rd, nd, pool, pp, stride) in _BN_INCEPTION:
            blk = InceptionV2(cin, c(n1) if n1 else 0, c(r3), c(n3), c(rd), c(nd), pool,
                              c(pp) if pp else 0, stride)
            blocks.append(blk)
            cin = blk.out_channels
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        # default_googlenet_v2 fillers: "xavier" weights, BN gamma 1 / beta 0, classifier bias 0.
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                _caffe_xavier_(m.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


@register("inception_v2", batch_norm=True)
def inception_v2(num_classes: int = 1000, width: float = 1.0, aux_logits: bool = False) -> nn.Module:
    check_args("inception_v2", num_classes, width, aux_logits, has_aux=False)
    return BNInception(num_classes, width)


# ----------------------------------------------------------------------------- Inception v3
# NVCaffe 0.16 models/inception_v3/train_val.prototxt, the net the paper's Inception v3 row ran in
# NVIDIA's Caffe: the topology of Szegedy et al. 2016, Table 1 (conv 3x3 stem ending in 288 filters,
# 3 x figure-5 modules, 5 x figure-6, 2 x figure-7), Caffe "xavier" weights, no conv biases, BN eps 1e-4.

def _cbr3(cin, cout, kernel, stride=1, padding=0):
    return ConvBNReLU(cin, cout, kernel, stride, padding, eps=1e-4)


def _avg3(x):
    # Caffe's padded 3x3/1 average divides by 9 everywhere (the padding is counted).
    return F.avg_pool2d(x, 3, 1, 1)


def _fac(cin, mid, cout, pairs):
    """1x1 to `mid`, then `pairs` of (1x7, 7x1) convolutions; the last one outputs `cout`."""
    layers, ch = [_cbr3(cin, mid, 1)], mid
    for i in range(pairs):
        out = cout if i == pairs - 1 else mid
        layers += [_cbr3(ch, mid, (1, 7), padding=(0, 3)), _cbr3(mid, out, (7, 1), padding=(3, 0))]
        ch = out
    return nn.Sequential(*layers)


class InceptionFig5(nn.Module):
    """35x35 module 3A-3C: 1x1 64 | 1x1 64 -> 3x3 96 | 1x1 48 -> 3x3 64 -> 3x3 64 | avg -> 1x1 64."""

    def __init__(self, cin, c):
        super().__init__()
        self.p1 = _cbr3(cin, c(64), 1)
        self.p2 = nn.Sequential(_cbr3(cin, c(64), 1), _cbr3(c(64), c(96), 3, padding=1))
        self.p3 = nn.Sequential(_cbr3(cin, c(48), 1), _cbr3(c(48), c(64), 3, padding=1),
                                _cbr3(c(64), c(64), 3, padding=1))
        self.p4 = _cbr3(cin, c(64), 1)
        self.out_channels = c(64) + c(96) + c(64) + c(64)

    def forward(self, x):
        return torch.cat([self.p1(x), self.p2(x), self.p3(x), self.p4(_avg3(x))], 1)


class Reduction3R(nn.Module):
    """35x35 -> 17x17: 1x1 64 -> 3x3 96 -> 3x3/2 96 | 3x3/2 384 | max 3x3/2."""

    def __init__(self, cin, c):
        super().__init__()
        self.p1 = nn.Sequential(_cbr3(cin, c(64), 1), _cbr3(c(64), c(96), 3, padding=1),
                                _cbr3(c(96), c(96), 3, stride=2))
        self.p2 = _cbr3(cin, c(384), 3, stride=2)
        self.out_channels = c(96) + c(384) + cin

    def forward(self, x):
        return torch.cat([self.p1(x), self.p2(x), F.max_pool2d(x, 3, 2)], 1)


class InceptionFig6(nn.Module):
    """17x17 module 4A-4E with factorised 7x7s (c7 = 128, 160, 160, 192, 192):
    1x1 192 | 1x1 c7 -> 1x7 -> 7x1 192 | 1x1 c7 -> (1x7 -> 7x1) x 2 -> 192 | avg -> 1x1 192."""

    def __init__(self, cin, c7, c):
        super().__init__()
        self.p1 = _cbr3(cin, c(192), 1)
        self.p2 = _fac(cin, c7, c(192), pairs=1)
        self.p3 = _fac(cin, c7, c(192), pairs=2)
        self.p4 = _cbr3(cin, c(192), 1)
        self.out_channels = 4 * c(192)

    def forward(self, x):
        return torch.cat([self.p1(x), self.p2(x), self.p3(x), self.p4(_avg3(x))], 1)


class Reduction4R(nn.Module):
    """17x17 -> 8x8: 1x1 192 -> 3x3/2 320 | 1x1 192 -> 1x7 -> 7x1 -> 3x3/2 192 | max 3x3/2."""

    def __init__(self, cin, c):
        super().__init__()
        self.p1 = nn.Sequential(_cbr3(cin, c(192), 1), _cbr3(c(192), c(320), 3, stride=2))
        self.p2 = nn.Sequential(_fac(cin, c(192), c(192), pairs=1), _cbr3(c(192), c(192), 3, stride=2))
        self.out_channels = c(320) + c(192) + cin

    def forward(self, x):
        return torch.cat([self.p1(x), self.p2(x), F.max_pool2d(x, 3, 2)], 1)


class InceptionFig7(nn.Module):
    """8x8 module 5A-5B with expanded outputs: 1x1 320 | 1x1 384 -> (1x3 | 3x1) 384 |
    1x1 448 -> 3x3 384 -> (1x3 | 3x1) 384 | avg -> 1x1 192."""

    def __init__(self, cin, c):
        super().__init__()
        self.p1 = _cbr3(cin, c(320), 1)
        self.p2 = _cbr3(cin, c(384), 1)
        self.p2a = _cbr3(c(384), c(384), (1, 3), padding=(0, 1))
        self.p2b = _cbr3(c(384), c(384), (3, 1), padding=(1, 0))
        self.p3 = nn.Sequential(_cbr3(cin, c(448), 1), _cbr3(c(448), c(384), 3, padding=1))
        self.p3a = _cbr3(c(384), c(384), (1, 3), padding=(0, 1))
        self.p3b = _cbr3(c(384), c(384), (3, 1), padding=(1, 0))
        self.p4 = _cbr3(cin, c(192), 1)
        self.out_channels = c(320) + 4 * c(384) + c(192)

    def forward(self, x):
        p2, p3 = self.p2(x), self.p3(x)
        return torch.cat([self.p1(x), self.p2a(p2), self.p2b(p2), self.p3a(p3), self.p3b(p3),
                          self.p4(_avg3(x))], 1)


class InceptionV3Aux(nn.Module):
    """loss1 (after 3R, 17x17) / loss2 (after 4R, 8x8) head: 5x5/3 average pool (to 5x5 / 2x2),
    1x1 conv 128 + BN + ReLU, fc 1024 + ReLU, classifier; no dropout."""

    def __init__(self, cin, num_classes, c, ref_size, grid):
        super().__init__()
        self.ref_size, self.grid = ref_size, grid
        self.conv = _cbr3(cin, c(128), 1)
        self.fc = nn.Linear(c(128) * grid * grid, c(1024))
        self.classifier = nn.Linear(c(1024), num_classes)

    def forward(self, x):
        x = self.conv(_pool_to(x, 5, 3, ref_size=self.ref_size, out=self.grid))
        return self.classifier(F.relu(self.fc(torch.flatten(x, 1)), inplace=True))


class InceptionV3(nn.Module):
    def __init__(self, num_classes: int, width: float, aux_logits: bool):
        super().__init__()
        c = width_scaler(width)
        self.aux_logits = aux_logits
        self.stem = nn.Sequential(
            _cbr3(3, c(32), 3, stride=2), _cbr3(c(32), c(32), 3), _cbr3(c(32), c(64), 3, padding=1),
            nn.MaxPool2d(3, 2),
            _cbr3(c(64), c(80), 3), _cbr3(c(80), c(192), 3, stride=2), _cbr3(c(192), c(288), 3, padding=1),
        )
        blocks, cin = [], c(288)
        for _ in range(3):
            blocks.append(InceptionFig5(cin, c))
            cin = blocks[-1].out_channels
        blocks.append(Reduction3R(cin, c))
        self.mixed_3 = nn.Sequential(*blocks)
        cin = blocks[-1].out_channels
        if aux_logits:
            self.aux1 = InceptionV3Aux(cin, num_classes, c, ref_size=17, grid=5)
        blocks = []
        for c7 in (128, 160, 160, 192, 192):
            blocks.append(InceptionFig6(cin, c(c7), c))
            cin = blocks[-1].out_channels
        blocks.append(Reduction4R(cin, c))
        self.mixed_4 = nn.Sequential(*blocks)
        cin = blocks[-1].out_channels
        if aux_logits:
            self.aux2 = InceptionV3Aux(cin, num_classes, c, ref_size=8, grid=2)
        m5a = InceptionFig7(cin, c)
        m5b = InceptionFig7(m5a.out_channels, c)
        self.mixed_5 = nn.Sequential(m5a, m5b)
        # The reference pools the 8x8 map with a 7x7/1 window, leaving 2x2: the classifier sees
        # 4 x 2048 features (8,192), not the 2,048 of the v3 paper's 8x8 pool.
        self.fc = nn.Linear(m5b.out_channels * 4, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                _caffe_xavier_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.mixed_3(self.stem(x))
        aux = [self.aux1(x)] if (self.training and self.aux_logits) else []
        x = self.mixed_4(x)
        if self.training and self.aux_logits:
            aux.append(self.aux2(x))
        x = _pool_to(self.mixed_5(x), 7, 1, ref_size=8, out=2)
        logits = self.fc(torch.flatten(x, 1))
        return _aux_output(self, logits, aux)


@register("inception_v3", batch_norm=True)
def inception_v3(num_classes: int = 1000, width: float = 1.0, aux_logits: bool = True) -> nn.Module:
    check_args("inception_v3", num_classes, width, aux_logits, has_aux=True)
    return InceptionV3(num_classes, width, aux_logits)


# ----------------------------------------------------------------------------- pre-act ResNet-50

class PreActBottleneck(nn.Module):
    """BN-ReLU-conv1x1, BN-ReLU-conv3x3 (stride), BN-ReLU-conv1x1 (x4), plus the shortcut.

    preact="shared": the unit's first BN-ReLU also feeds the projection shortcut (the first unit
    of a stage, where the shortcut changes shape -- He et al. 2016b, section 3.2 and Figure 5);
    preact="none": the input is already activated (first unit after the conv1-BN-ReLU stem);
    preact="residual": identity shortcut, BN-ReLU only on the residual path."""

    def __init__(self, cin, mid, cout, stride, preact):
        super().__init__()
        self.preact = preact
        self.bn1 = nn.BatchNorm2d(cin) if preact != "none" else None
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
        self.shortcut = None
        if preact != "residual":
            self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        if self.preact == "residual":
            shortcut, out = x, F.relu(self.bn1(x))
        else:
            out = F.relu(self.bn1(x)) if self.bn1 is not None else x
            shortcut = self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        out = self.conv3(F.relu(self.bn3(out)))
        return out + shortcut


def he_init(model: nn.Module) -> None:
    """He et al. 2015 ("MSRA") init of a ResNet, as in fb.resnet.torch and torchvision: convolutions
    normal with fan-out, batch norms gamma 1, beta 0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class PreActResNet(nn.Module):
    def __init__(self, num_classes: int, width: float, depths=(3, 4, 6, 3)):
        super().__init__()
        c = width_scaler(width)
        self.aux_logits = False
        self.stem = nn.Sequential(
            nn.Conv2d(3, c(64), 7, 2, 3, bias=False), nn.BatchNorm2d(c(64)), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        units, cin = [], c(64)
        for stage, n in enumerate(depths):
            mid, cout = c(64 * 2 ** stage), c(256 * 2 ** stage)
            for i in range(n):
                if i > 0:
                    units.append(PreActBottleneck(cout, mid, cout, 1, "residual"))
                else:
                    units.append(PreActBottleneck(cin, mid, cout, 1 if stage == 0 else 2,
                                                  "none" if stage == 0 else "shared"))
            cin = cout
        self.units = nn.Sequential(*units)
        # Pre-activation leaves the last unit's sum un-normalised: a final BN-ReLU precedes
        # the pooling (He et al. 2016b, section 3.2).
        self.final = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(inplace=True))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        he_init(self)

    def forward(self, x):
        x = self.final(self.units(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


@register("resnet50_preact", batch_norm=True)
def resnet50_preact(num_classes: int = 1000, width: float = 1.0, aux_logits: bool = False) -> nn.Module:
    check_args("resnet50_preact", num_classes, width, aux_logits, has_aux=False)
    return PreActResNet(num_classes, width)
