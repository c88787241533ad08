"""Task glue for Table 2 (section 4.2): SSD300 and Faster R-CNN (VGG-16) on PASCAL VOC, VOC2007 test mAP.

Batches are lists (images of any size, targets with any number of boxes): `collate` keeps them as
lists and the detectors' own transforms resize and normalise. The loss is the detector's sum of its
losses (SSD: softmax confidence with 3:1 hard negatives + smooth L1; Faster R-CNN: RPN and RoI-head
classification and box regression). `evaluate` runs the detector over this rank's share of VOC2007
test, gathers every detection on rank 0 and computes the 11-point AP (voc_eval.py) by the devkit's rule and
by py-faster-rcnn's; task.ap_rule says which is `mAP`, the other is reported beside it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchvision import tv_tensors
from torchvision.transforms import v2

from experiments.voc_detection.voc_eval import RULES, voc07_map
from mpt.config import added, infra
from mpt.errors import UserError
from mpt.task import Task as BaseTask

AUGMENTS = ("ssd", "flip", "none")


@dataclass
class TaskCfg:
    data_root: str = infra("data/voc")  # output of `python -m data_prep.voc`
    train_sets: list[str] = field(default_factory=lambda: ["2007_trainval", "2012_trainval"])
    test_set: str = "2007_test"
    image_size: int = 300  # SSD: the square input side; Faster R-CNN: the shorter side
    max_size: int = 1000  # Faster R-CNN: the longer side's cap (py-faster-rcnn MAX_SIZE)
    augment: str = "ssd"  # ssd: photometric distortion, zoom out, IoU crop, flip | flip | none
    train_difficult: bool = True  # SSD trains on difficult boxes (use_difficult_gt), py-faster-rcnn does not
    backbone: str = "scratch"  # scratch | a VGG-16 weights file (torchvision state dict or our vgg16 checkpoint)
    # The last VGG convolution kept fixed: both Caffe references train from conv3_1 on ("conv2_2"; SSD's
    # ssd_pascal.py freeze_layers, py-faster-rcnn's lr_mult 0); "" trains every layer (from scratch).
    freeze_through: str = added("")
    # Faster R-CNN: the RPN's training anchors must lie inside the image by this margin in pixels
    # (py-faster-rcnn's allowed_border 0, Ren et al. 2015 section 3.3); -1 keeps every anchor.
    rpn_allowed_border: int = added(-1)
    batch_norm: bool = False  # VGG-16-BN layers: the tiny profile's from-scratch variant, not the paper's model
    eval_max_images: int = 0  # 0 = the whole test set
    # Biases are weight-decayed in py-faster-rcnn (train.prototxt: no decay_mult, so 1), not in SSD
    # (decay_mult 0); both give them twice the learning rate (lr_mult 2).
    bias_decay: bool = False
    # Which VOC07 11-point rule `mAP` follows: devkit (VOCevaldet.m) | py-faster-rcnn (its voc_eval.py,
    # the rule behind the paper's Faster R-CNN number); the other is reported as mAP_<rule> too.
    ap_rule: str = "devkit"


def _difficult_too(inputs):
    """SanitizeBoundingBoxes drops the labels and the difficult flags of the boxes it removes."""
    target = inputs[1]
    return target["labels"], target["difficult"]


class SSDPhotometricDistort(v2.Transform):
    """SSD's photometric distortion (weiliu89/caffe ssd_pascal.py distort_param, applied by
    src/caffe/util/im_transforms.cpp ApplyDistort), each with probability 0.5: brightness + delta, delta in
    [-32, 32] of 255; contrast: the pixels x a factor in [0.5, 1.5] (no mean subtracted); saturation x
    [0.5, 1.5]; hue + [-18, 18] of OpenCV's 180 (+-36 degrees); contrast either right after brightness or
    last (one chance in two); channels never permuted (random_order_prob 0). torchvision's
    RandomPhotometricDistort permutes them with p = 0.5 and scales brightness instead of shifting it.
    Saturation is torchvision's (a blend with the grey image) rather than OpenCV's HSV S channel x factor."""

    _transformed_types = (tv_tensors.Image,)

    def make_params(self, flat_inputs):
        draw = lambda lo, hi: float(torch.empty(()).uniform_(lo, hi)) if torch.rand(()) < 0.5 else None  # noqa: E731
        return {"brightness": draw(-32.0, 32.0), "contrast": draw(0.5, 1.5), "saturation": draw(0.5, 1.5),
                "hue": draw(-18.0, 18.0), "contrast_first": bool(torch.rand(()) < 0.5)}

    def transform(self, inpt, params):
        x = inpt  # uint8, 0..255 (before ToDtype)
        linear = lambda img, a, b: tv_tensors.wrap((img.float() * a + b).round().clamp(0, 255).to(img.dtype), like=img)  # noqa: E731
        if params["brightness"] is not None:
            x = linear(x, 1.0, params["brightness"])
        if params["contrast"] is not None and params["contrast_first"]:
            x = linear(x, params["contrast"], 0.0)
        if params["saturation"] is not None:
            x = v2.functional.adjust_saturation(x, params["saturation"])
        if params["hue"] is not None:
            x = v2.functional.adjust_hue(x, params["hue"] / 180.0)
        if params["contrast"] is not None and not params["contrast_first"]:
            x = linear(x, params["contrast"], 0.0)
        return x


def check_augment(augment: str) -> None:
    if augment not in AUGMENTS:
        raise UserError(f"task.augment={augment!r}; choose one of: {', '.join(AUGMENTS)}")


def train_transform(augment: str):
    check_augment(augment)
    steps = []
    if augment == "ssd":
        # SSD's data augmentation (Liu et al. 2016, 2.2): photometric distortions, zoom out ("expand",
        # filled with the mean), a random crop whose IoU with some object is >= 0.1..0.9, a flip.
        # The zoom-out fill is the ImageNet mean in 0..255 (the image is still uint8 here).
        steps += [SSDPhotometricDistort(),
                  v2.RandomZoomOut(fill={tv_tensors.Image: (124, 116, 104), "others": 0}, side_range=(1.0, 4.0), p=0.5),
                  v2.RandomIoUCrop()]
    if augment in ("ssd", "flip"):
        steps.append(v2.RandomHorizontalFlip(0.5))  # py-faster-rcnn: TRAIN.USE_FLIPPED
    steps += [v2.SanitizeBoundingBoxes(labels_getter=_difficult_too), v2.ToDtype(torch.float32, scale=True)]
    return v2.Compose(steps)


def collate(samples):
    images, targets = zip(*samples)
    return list(images), list(targets)


class Task(BaseTask):
    prepared_data = ("voc", "voc")  # prepared.json's "dataset", by data_prep.voc
    primary_metric = "mAP"  # VOC2007 test, 11-point AP at IoU 0.5, percent
    channels_last = True  # a CNN on images: NHWC on CUDA (channels_last=auto)
    higher_is_better = True

    @classmethod
    def check(cls, cfg):
        c = cfg.task
        if c.ap_rule not in RULES:
            raise UserError(f"task.ap_rule={c.ap_rule!r}; choose one of: {', '.join(RULES)}")
        check_augment(c.augment)
        if cfg.impl != "autocast":
            # The paper impl casts every floating input of the model to FP16, the ground-truth boxes too.
            raise UserError("voc_detection runs impl=autocast only (impl=paper would cast the target boxes to FP16)")

    @dataclass(frozen=True)
    class Facts:
        classes: tuple[str, ...]  # the object classes in label order (label 0 is the background)

    @classmethod
    def read_facts(cls, cfg):
        from data_prep.voc.dataset import read_marker

        return cls.Facts(classes=tuple(read_marker(cfg.task.data_root)["classes"]))

    def datasets(self):
        from data_prep.voc.dataset import VOCDetectionSet

        c, classes = self.cfg.task, list(self.facts.classes)
        train = VOCDetectionSet(c.data_root, list(c.train_sets), classes, train_transform(c.augment),
                                keep_difficult=c.train_difficult)
        val = VOCDetectionSet(c.data_root, [c.test_set], classes, v2.ToDtype(torch.float32, scale=True))
        if c.eval_max_images:
            val = torch.utils.data.Subset(val, range(min(c.eval_max_images, len(val))))
        return train, val

    def build_model(self):
        import models

        cfg = self.cfg
        c = cfg.task
        kw = {"max_size": c.max_size, "rpn_allowed_border": c.rpn_allowed_border} \
            if cfg.model == "faster_rcnn_vgg16" else {}
        return models.build(cfg.model, num_classes=len(self.facts.classes) + 1, width=cfg.width, size=c.image_size,
                            backbone=c.backbone, batch_norm=c.batch_norm, freeze=c.freeze_through, **kw)

    collate = staticmethod(collate)

    def param_groups(self, model):
        # Both Caffe recipes give biases twice the learning rate (lr_mult 2); SSD's prototxt does not
        # decay them (decay_mult 0), py-faster-rcnn's does (no decay_mult: 1) -- task.bias_decay.
        cfg = self.cfg
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        bias_wd = cfg.optim.weight_decay if cfg.task.bias_decay else 0.0
        return [{"params": [p for n, p in named if not n.endswith(".bias")]},
                {"params": [p for n, p in named if n.endswith(".bias")], "lr": 2 * cfg.optim.lr, "weight_decay": bias_wd}]

    def loss(self, model, batch):
        images, targets = batch
        losses = model(images, [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets])
        return sum(losses.values()), len(images)

    def evaluate(self, ev):
        dets, gts = [], []
        for images, targets in ev.batches():  # train.eval_max_batches; task.eval_max_images cuts the set
            images = [im.to(ev.device) for im in images]
            with ev.autocast():
                out = ev.model(images)
            for o, t in zip(out, targets):
                dets.append({"image": t["index"], "boxes": o["boxes"].float().cpu().numpy(),
                             "scores": o["scores"].float().cpu().numpy(), "labels": o["labels"].cpu().numpy()})
                gts.append({"image": t["index"], "boxes": t["boxes"].cpu().numpy(), "labels": t["labels"].numpy(),
                            "difficult": t["difficult"].numpy()})
        if ev.world > 1:  # AP is not additive: every detection goes to one place
            box = [None] * ev.world
            dist.all_gather_object(box, (dets, gts))
            dets = [d for part in box for d in part[0]]
            gts = [g for part in box for g in part[1]]
        rule = self.cfg.task.ap_rule
        names = self.facts.classes
        mAP, aps = voc07_map(dets, gts, len(names), rule)
        out = {"mAP": round(mAP, 3), "detections": sum(len(d["scores"]) for d in dets)}
        for other in RULES:  # every rule's mAP, so a paper run gives both numbers
            m = mAP if other == rule else voc07_map(dets, gts, len(names), other)[0]
            out[f"mAP_{other.replace('-', '_')}"] = round(m, 3)
        out.update({f"AP/{n}": round(a, 3) for n, a in zip(names, aps) if a == a})  # NaN: no box of the class
        return out
