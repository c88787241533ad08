"""Table 2's detectors on a VGG-16 base, assembled from torchvision's detection building blocks.

    ssd300_vgg16       Multibox SSD300 (Liu et al. 2016): VGG-16 through conv5_3 with pool5 3x3/1, the
                       dilated conv6 and conv7 (fc6/fc7 "reduced"), L2-normalised conv4_3 (scale 20)
                       and four extra blocks: 6 feature maps (38, 19, 10, 5, 3, 1 at 300 px), 8,732
                       default boxes; torchvision's SSD (matching, hard negative mining 3:1, smooth L1,
                       NMS 0.45) with SSDHead and DefaultBoxGenerator.
    faster_rcnn_vgg16  Faster R-CNN (Ren et al. 2015) as py-faster-rcnn's VGG-16 end-to-end model: conv5_3
                       (stride 16) shared by the RPN (3 scales x 3 ratios) and a RoI-pooling (7x7) head
                       with fc6/fc7 (4096); torchvision's FasterRCNN, RPN, RoIHeads, AnchorGenerator.

`width` multiplies every channel count (the tiny CPU variant keeps the topology); `size` is the input
side (SSD: 300; Faster R-CNN: the shorter side, 600). At full width the parameter counts are the
published ones (tests/test_voc.py). `backbone="scratch"` initialises the VGG base randomly; a path loads
ImageNet weights: torchvision's VGG-16 state dict or a checkpoint of our Table 1 `vgg16`
(experiments/ilsvrc_cnns, same layer names), as both recipes start from ImageNet VGG-16.

Why heads return FP32 (section 3.3): the losses (softmax, smooth L1), box decoding and NMS reduce in
FP32; the CPU also has no FP16 kernels for torchvision's NMS and RoI pooling.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.detection.faster_rcnn import FasterRCNN
from torchvision.models.detection.ssd import SSD
from torchvision.models.detection.anchor_utils import AnchorGenerator, DefaultBoxGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.roi_heads import RoIHeads
from torchvision.models.detection.rpn import RegionProposalNetwork, RPNHead
from torchvision.models.detection.ssd import SSDHead
from torchvision.ops import RoIPool

from models import register
from mpt.errors import UserError

# torchvision's VGG-16 layout: features.<i> are the 13 convolutions (ReLU and max-pool in between),
# classifier.0 / classifier.3 are fc6 / fc7.
_VGG_D = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _scaler(width: float):
    if not (isinstance(width, (int, float)) and math.isfinite(width) and width > 0):
        raise UserError(f"width must be a positive number (1.0 = full size), got {width!r}")
    return lambda ch: max(1, int(round(ch * width)))


def vgg16_features(width: float, batch_norm: bool = False) -> nn.Sequential:
    """VGG-16's convolutional layers (torchvision's vgg16 / vgg16_bn layout)."""
    c, layers, cin = _scaler(width), [], 3
    for v in _VGG_D:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, c(v), 3, padding=1), *([nn.BatchNorm2d(c(v))] if batch_norm else []),
                       nn.ReLU(inplace=True)]
            cin = c(v)
    return nn.Sequential(*layers)


def _pools(feats: nn.Sequential) -> list[int]:
    return [i for i, m in enumerate(feats) if isinstance(m, nn.MaxPool2d)]


VGG_CONVS = ("conv1_1", "conv1_2", "conv2_1", "conv2_2", "conv3_1", "conv3_2", "conv3_3", "conv4_1", "conv4_2",
             "conv4_3", "conv5_1", "conv5_2", "conv5_3")


def freeze_through(vgg_layers, last: str) -> None:
    """Fix the VGG convolutions conv1_1 .. `last` (lr_mult 0 in both Caffe references: SSD's ssd_pascal.py
    freeze_layers conv1_1-conv2_2, py-faster-rcnn's VGG-16 train.prototxt likewise); "" fixes none.
    `vgg_layers`: the VGG modules in order (their BatchNorm layers, if any, follow their convolution)."""
    if not last:
        return
    if last not in VGG_CONVS:
        raise UserError(f"task.freeze_through={last!r}: name a VGG-16 convolution ({', '.join(VGG_CONVS)}), "
                        f"or '' to train every layer")
    n, k = VGG_CONVS.index(last) + 1, 0
    for m in vgg_layers:
        if isinstance(m, nn.Conv2d):
            k += 1
            if k > n:
                break
        for p in m.parameters(recurse=False):
            p.requires_grad_(False)


def _check_init(backbone: str, batch_norm: bool) -> None:
    if backbone != "scratch" and batch_norm:
        raise UserError("batch_norm=true is the tiny profile's from-scratch variant; ImageNet weights "
                        "(task.backbone) load into the paper's plain VGG-16 (task.batch_norm=false)")


def read_vgg16_weights(path, features: nn.Sequential, fc_shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The VGG-16 tensors of a weights file (features.<i>.* and classifier.0/3.*), checked against this
    width's shapes: a one-line error for a missing file, another network, or another width."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"backbone weights {p} not found; give torchvision's VGG-16 state dict "
                        f"(vgg16-397923af.pth) or a checkpoint.pt of experiments/ilsvrc_cnns model=vgg16, "
                        f"or backbone=scratch")
    try:
        sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- any unreadable file is the same user mistake
        raise UserError(f"backbone weights {p} are not a torch state dict ({type(e).__name__})") from None
    if isinstance(sd, dict) and isinstance(sd.get("model"), dict):
        sd = sd["model"]  # our engine's checkpoint.pt: {"model": state_dict, "optimizers": ...}
    if not isinstance(sd, dict):
        raise UserError(f"backbone weights {p} hold a {type(sd).__name__}, not a state dict")
    sd = {k.removeprefix("module."): v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    want = {f"features.{k}": v.shape for k, v in features.state_dict().items()}
    want.update(fc_shapes)
    out = {}
    for k, shape in want.items():
        if k not in sd:
            raise UserError(f"backbone weights {p} lack {k}: not a VGG-16 (torchvision layout) state dict")
        if tuple(sd[k].shape) != tuple(shape):
            raise UserError(f"backbone weights {p}: {k} is {tuple(sd[k].shape)}, this model (width) needs "
                            f"{tuple(shape)}; use weights of the same width or backbone=scratch")
        out[k] = sd[k].float()
    return out


def _he_init(module: nn.Module) -> None:
    """He et al. 2015 initialisation of a ReLU body trained from scratch (backbone=scratch): without
    batch norm, Xavier's variance halves at every ReLU and 15 layers deep the gradients vanish. (Both
    recipes start their VGG layers from ImageNet weights instead, and SSD's new layers from Xavier.)"""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)


def caffe_xavier_init(module: nn.Module) -> None:
    """Caffe's "xavier" filler on every convolution, bias 0: uniform in +-sqrt(3 / fan_in) (its default
    variance_norm FAN_IN; torch's xavier_uniform_ averages fan_in and fan_out instead). SSD's extra layers
    and multibox heads start from it (ssd_pascal.py via model_libs.py ConvBNLayer / CreateMultiBoxHead)."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_uniform_(m.weight, a=1.0)  # gain 1: bound sqrt(3 / fan_in)
            nn.init.zeros_(m.bias)


class FP32Out(nn.Module):
    """Runs a head and returns its outputs in FP32 (see the module docstring: losses, decoding and NMS
    in FP32, section 3.3)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, *args):
        return _float(self.head(*args))


def _float(x):
    if isinstance(x, torch.Tensor):
        return x.float()
    if isinstance(x, dict):
        return {k: _float(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_float(v) for v in x)
    return x


# ----------------------------------------------------------------------------------------- SSD300


def ssd_map_sizes(size: int) -> list[int]:
    """Feature-map sides of SSD's six sources at input `size` (38, 19, 10, 5, 3, 1 at 300); a source
    whose side would be < 1 (small tiny inputs) is left out with the blocks after it."""
    h = math.ceil((size // 2 // 2) / 2)  # pool3 in ceil mode, as in SSD's Caffe model
    sizes = [h, h // 2]  # conv4_3, conv7 (pool5 is 3x3 stride 1)
    for stride2 in (True, True, False, False):  # conv8, conv9: 3x3/2 pad 1; conv10, conv11: 3x3 valid
        h = (sizes[-1] - 1) // 2 + 1 if stride2 else sizes[-1] - 2
        if h < 1:
            break
        sizes.append(h)
    return sizes


class SSDVGG(nn.Module):
    """SSD's VGG-16 base + extra layers; returns the feature maps SSD predicts from."""

    # (1x1 channels, 3x3 channels, stride, padding) of the extra blocks conv8 .. conv11 (Liu et al. Fig. 2)
    EXTRAS = ((256, 512, 2, 1), (128, 256, 2, 1), (128, 256, 1, 0), (128, 256, 1, 0))

    def __init__(self, width: float, size: int, batch_norm: bool = False):
        super().__init__()
        c = _scaler(width)
        feats = vgg16_features(width, batch_norm)
        p = _pools(feats)
        feats[p[2]].ceil_mode = True  # pool3: 75 -> 38 at 300 px
        self.vgg = feats[:p[3]]  # conv1_1 .. relu4_3
        self.l2_scale = nn.Parameter(torch.full((c(512),), 20.0))  # conv4_3's L2 norm, scale 20 (Liu et al. 3.1)
        self.conv5 = nn.Sequential(
            *feats[p[3]:p[4]],  # pool4, conv5_1 .. relu5_3
            nn.MaxPool2d(3, 1, 1),  # pool5
            nn.Conv2d(c(512), c(1024), 3, padding=6, dilation=6), nn.ReLU(inplace=True),  # conv6 (atrous fc6)
            nn.Conv2d(c(1024), c(1024), 1), nn.ReLU(inplace=True))  # conv7 (fc7)
        self.n_maps = len(ssd_map_sizes(size))
        extras, cin = [], c(1024)
        for mid, cout, stride, pad in self.EXTRAS[: self.n_maps - 2]:
            extras.append(nn.Sequential(nn.Conv2d(cin, c(mid), 1), nn.ReLU(inplace=True),
                                        nn.Conv2d(c(mid), c(cout), 3, stride, pad), nn.ReLU(inplace=True)))
            cin = c(cout)
        self.extras = nn.ModuleList(extras)
        self.out_channels = [c(512), c(1024)] + [c(e[1]) for e in self.EXTRAS[: self.n_maps - 2]]
        _he_init(self)

    def load_imagenet(self, path, width: float) -> None:
        """VGG-16 convolutions as they are; fc6/fc7 subsampled into conv6/conv7 as SSD's
        "VGG_ILSVRC_16_layers_fc_reduced" (Liu et al. 3: every 4th output, fc6's 7x7 every 3rd tap)."""
        feats = vgg16_features(width)
        c = _scaler(width)
        sd = read_vgg16_weights(path, feats, {"classifier.0.weight": (c(4096), c(512) * 49),
                                              "classifier.0.bias": (c(4096),),
                                              "classifier.3.weight": (c(4096), c(4096)),
                                              "classifier.3.bias": (c(4096),)})
        convs = [m for m in list(self.vgg) + list(self.conv5)[:7] if isinstance(m, nn.Conv2d)]
        idx = [i for i, m in enumerate(feats) if isinstance(m, nn.Conv2d)]
        with torch.no_grad():
            for m, i in zip(convs, idx):
                m.weight.copy_(sd[f"features.{i}.weight"])
                m.bias.copy_(sd[f"features.{i}.bias"])
            conv6, conv7 = self.conv5[8], self.conv5[10]
            n6, n7 = conv6.out_channels, conv7.out_channels
            fc6 = sd["classifier.0.weight"].view(-1, c(512), 7, 7)
            conv6.weight.copy_(fc6[:: fc6.shape[0] // n6][:n6, :, ::3, ::3])
            conv6.bias.copy_(sd["classifier.0.bias"][:: fc6.shape[0] // n6][:n6])
            fc7 = sd["classifier.3.weight"]
            step7 = fc7.shape[0] // n7
            conv7.weight.copy_(fc7[::step7, ::step7][:n7, :n6, None, None])
            conv7.bias.copy_(sd["classifier.3.bias"][::step7][:n7])

    def forward(self, x):
        x = self.vgg(x)
        # L2 normalisation of conv4_3 (its activations are much larger than the later maps'); in FP32
        # because the sum of squares of 512 channels overflows FP16 easily (3.3: reductions in FP32).
        out = [(F.normalize(x.float(), dim=1) * self.l2_scale.view(1, -1, 1, 1)).to(x.dtype)]
        x = self.conv5(x)
        out.append(x)
        for block in self.extras:
            x = block(x)
            out.append(x)
        return OrderedDict((str(i), f) for i, f in enumerate(out))


class FP32DefaultBoxes(DefaultBoxGenerator):
    """Default boxes in FP32 whatever the feature maps' dtype: under FP16 autocast the base class would
    build them in FP16 (box coordinates up to 300 px rounded to 0.25 px) for FP32 box decoding."""

    def forward(self, image_list, feature_maps):
        shapes = [f.new_empty((0, 0) + tuple(f.shape[-2:]), dtype=torch.float32) for f in feature_maps]
        return super().forward(image_list, shapes)


def ssd_anchors(size: int, n_maps: int) -> DefaultBoxGenerator:
    if n_maps == 6:
        # SSD300's VOC prior boxes (Caffe ssd_pascal.py): min sizes 30, 60, 111, 162, 213, 264 and max
        # 315 px at 300 -> scales 0.1 .. 1.05; 2 or 4 extra ratios; steps 8, 16, 32, 64, 100, 300; not
        # clipped to the image (clip: false; torchvision clips by default).
        return FP32DefaultBoxes([[2], [2, 3], [2, 3], [2, 3], [2], [2]],
                                scales=[0.1, 0.2, 0.37, 0.54, 0.71, 0.88, 1.05],
                                steps=[8, 16, 32, 64, 100, 300] if size == 300 else None, clip=False)
    # Fewer maps (a small tiny input): the same ratios, scales spread evenly over the objects' range
    # (clipped, torchvision's default, as this tiny variant has always run).
    ratios = ([[2]] + [[2, 3]] * (n_maps - 1))[:n_maps]
    return FP32DefaultBoxes(ratios, scales=[0.1 + 0.85 * k / n_maps for k in range(n_maps + 1)])


@register("ssd300_vgg16")
def ssd300_vgg16(num_classes: int = 21, width: float = 1.0, size: int = 300, backbone: str = "scratch",
                 batch_norm: bool = False, freeze: str = "") -> nn.Module:
    """num_classes counts the background (VOC: 21). batch_norm: VGG-16-BN layers (not the paper's model:
    the tiny profile's from-scratch variant, see experiments/voc_detection/README.md). freeze: the last
    VGG convolution kept fixed (freeze_through)."""
    if size < 32:
        raise UserError(f"ssd300_vgg16: size={size} is too small (>= 32 px)")
    _check_init(backbone, batch_norm)
    body = SSDVGG(width, size, batch_norm)
    anchors = ssd_anchors(size, body.n_maps)
    head = SSDHead(body.out_channels, anchors.num_anchors_per_location(), num_classes)
    if backbone != "scratch":  # the paper's recipe: ImageNet VGG-16, Caffe's xavier for every new layer
        body.load_imagenet(backbone, width)
        caffe_xavier_init(body.extras)
        caffe_xavier_init(head)
    freeze_through(body.vgg, freeze)
    return SSD(body, anchors, (size, size), num_classes, image_mean=list(IMAGENET_MEAN),
               image_std=list(IMAGENET_STD), head=FP32Out(head),
               # SSD's test settings (Caffe ssd_pascal.py): confidence 0.01, NMS 0.45, top 200, 400 candidates
               score_thresh=0.01, nms_thresh=0.45, detections_per_img=200, topk_candidates=400)


# ---------------------------------------------------------------------------------- Faster R-CNN


class VGGConv5(nn.Module):
    """VGG-16 through relu5_3 (stride 16), the feature map shared by the RPN and the RoI head."""

    def __init__(self, width: float, batch_norm: bool = False):
        super().__init__()
        feats = vgg16_features(width, batch_norm)
        self.body = feats[:_pools(feats)[4]]
        self.out_channels = _scaler(width)(512)
        _he_init(self)

    def forward(self, x):
        return OrderedDict([("0", self.body(x))])


class RoIPool7(nn.Module):
    """py-faster-rcnn's RoI max pooling: 7x7 bins on conv5_3 (spatial scale 1/16), in torchvision's
    box_roi_pool interface. Pooled in FP32: torchvision has no FP16 RoIPool kernel on the CPU, and the
    proposals are FP32; the pooled features go back in the feature map's dtype for fc6."""

    def __init__(self):
        super().__init__()
        self.pool = RoIPool(7, 1.0 / 16)

    def forward(self, features, proposals, image_shapes):
        x = features["0"]
        return self.pool(x.float(), [p.float() for p in proposals]).to(x.dtype)


class CaffeRoIHeads(RoIHeads):
    """torchvision's RoIHeads with py-faster-rcnn's RoI box loss: smooth L1 with sigma 1 (beta = 1 /
    sigma^2 = 1; train.prototxt loss_bbox has no sigma), where torchvision uses beta 1/9 (sigma 3, which
    py-faster-rcnn uses for the RPN only: torchvision's RPN loss already matches). Same normalisation as
    both: the sum over foreground RoIs / all sampled RoIs. Inference is torchvision's."""

    box_beta = 1.0

    def forward(self, features, proposals, image_shapes, targets=None):
        if not self.training:
            return super().forward(features, proposals, image_shapes, targets)
        proposals, _, labels, regression_targets = self.select_training_samples(proposals, targets)
        x = self.box_head(self.box_roi_pool(features, proposals, image_shapes))
        class_logits, box_regression = self.box_predictor(x)
        labels, regression_targets = torch.cat(labels), torch.cat(regression_targets)
        fg = torch.where(labels > 0)[0]
        box_regression = box_regression.reshape(len(labels), -1, 4)[fg, labels[fg]]
        box_loss = F.smooth_l1_loss(box_regression, regression_targets[fg], beta=self.box_beta, reduction="sum")
        return [], {"loss_classifier": F.cross_entropy(class_logits, labels),
                    "loss_box_reg": box_loss / labels.numel()}


class InsideAnchorsRPN(RegionProposalNetwork):
    """torchvision's RPN, trained as py-faster-rcnn's anchor_target_layer.py trains it: anchors that
    cross the image border by more than `allowed_border` pixels (0 there) get no target, neither object
    nor background (label -1: left out of the 256 sampled per image). Ren et al. 2015, section 3.3:
    cross-boundary anchors left in make training not converge. Proposals at inference are torchvision's
    (clipped to the image). Unlike py-faster-rcnn, an object's best-matching anchor is chosen among all
    anchors before the outside ones are dropped, so an object whose best anchor crosses the border gets
    its positives from the IoU >= 0.7 rule only."""

    allowed_border = 0

    def forward(self, images, features, targets=None):
        self._image_sizes = images.image_sizes  # (h, w) of each image before padding, for the targets
        return super().forward(images, features, targets)

    def assign_targets_to_anchors(self, anchors, targets):
        labels, matched = super().assign_targets_to_anchors(anchors, targets)
        b = self.allowed_border
        for lab, a, (h, w) in zip(labels, anchors, self._image_sizes):
            outside = (a[:, 0] < -b) | (a[:, 1] < -b) | (a[:, 2] >= w + b) | (a[:, 3] >= h + b)
            lab[outside] = -1.0
        return labels, matched


@register("faster_rcnn_vgg16")
def faster_rcnn_vgg16(num_classes: int = 21, width: float = 1.0, size: int = 600, backbone: str = "scratch",
                      max_size: int = 1000, batch_norm: bool = False, freeze: str = "",
                      rpn_allowed_border: int = -1) -> nn.Module:
    """num_classes counts the background. `size` is the shorter image side (600 in py-faster-rcnn);
    anchors are 128, 256, 512 px at 600 and scale with it (a 128-px tiny image gets 27, 55, 109).
    freeze: the last VGG convolution kept fixed (freeze_through). rpn_allowed_border: the RPN trains only
    on anchors inside the image by at most this many pixels (py-faster-rcnn: 0); -1 trains on all."""
    c = _scaler(width)
    _check_init(backbone, batch_norm)
    body = VGGConv5(width, batch_norm)
    fc = nn.Sequential(nn.Flatten(), nn.Linear(c(512) * 49, c(4096)), nn.ReLU(inplace=True), nn.Dropout(0.5),
                       nn.Linear(c(4096), c(4096)), nn.ReLU(inplace=True), nn.Dropout(0.5))
    if backbone != "scratch":
        sd = read_vgg16_weights(backbone, vgg16_features(width), {
            "classifier.0.weight": fc[1].weight.shape, "classifier.0.bias": fc[1].bias.shape,
            "classifier.3.weight": fc[4].weight.shape, "classifier.3.bias": fc[4].bias.shape})
        with torch.no_grad():
            for k, v in body.body.state_dict().items():
                v.copy_(sd[f"features.{k}"])
            for i, j in ((1, 0), (4, 3)):
                fc[i].weight.copy_(sd[f"classifier.{j}.weight"])
                fc[i].bias.copy_(sd[f"classifier.{j}.bias"])
    freeze_through(body.body, freeze)
    k = size / 600
    anchors = AnchorGenerator(sizes=(tuple(max(4, round(s * k)) for s in (128, 256, 512)),),
                              aspect_ratios=((0.5, 1.0, 2.0),))
    predictor = FastRCNNPredictor(c(4096), num_classes)
    # py-faster-rcnn's initialisation of the new layers: Gaussian std 0.01 (cls, RPN), 0.001 (bbox).
    for m, std in ((predictor.cls_score, 0.01), (predictor.bbox_pred, 0.001)):
        nn.init.normal_(m.weight, std=std)
        nn.init.zeros_(m.bias)
    model = FasterRCNN(
        body, None, min_size=size, max_size=max(max_size, size), image_mean=list(IMAGENET_MEAN),
        image_std=list(IMAGENET_STD), rpn_anchor_generator=anchors, rpn_head=FP32Out(RPNHead(c(512), 9)),
        # py-faster-rcnn config.py (TRAIN/TEST): RPN pre/post-NMS 12000/2000 (train) and 6000/300 (test), NMS 0.7,
        # 256 anchors per image (half positive), IoU 0.7 / 0.3; 128 RoIs per image (25% foreground,
        # IoU >= 0.5); box targets normalised by (0.1, 0.1, 0.2, 0.2); test NMS 0.3, score 0.05, 100 per image.
        rpn_pre_nms_top_n_train=12000, rpn_post_nms_top_n_train=2000, rpn_pre_nms_top_n_test=6000,
        rpn_post_nms_top_n_test=300, rpn_nms_thresh=0.7, rpn_fg_iou_thresh=0.7, rpn_bg_iou_thresh=0.3,
        rpn_batch_size_per_image=256, rpn_positive_fraction=0.5,
        box_head=fc, box_predictor=FP32Out(predictor),
        box_score_thresh=0.05, box_nms_thresh=0.3, box_detections_per_img=100, box_fg_iou_thresh=0.5,
        box_bg_iou_thresh=0.5, box_batch_size_per_image=128, box_positive_fraction=0.25,
        bbox_reg_weights=(10.0, 10.0, 5.0, 5.0))
    # FasterRCNN's constructor accepts only RoIAlign poolers; the RoI head calls any module alike.
    model.roi_heads.box_roi_pool = RoIPool7()
    model.roi_heads.__class__ = CaffeRoIHeads  # its box loss only (no new state): see CaffeRoIHeads
    if rpn_allowed_border >= 0:
        model.rpn.__class__ = InsideAnchorsRPN  # its training targets only: see InsideAnchorsRPN
        model.rpn.allowed_border = rpn_allowed_border
    return model
