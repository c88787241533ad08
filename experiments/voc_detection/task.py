"""Task glue for Table 2 (section 4.2): SSD300 and Faster R-CNN (VGG-16) on PASCAL VOC, VOC2007 test mAP.

Batches are lists (images of any size, targets with any number of boxes): `collate` keeps them as
lists and the detectors' own transforms resize and normalise. Images stay uint8 through the loader
(SSD's already resized to its square input there) and become float in `loss` and `evaluate`
(model_input), on the device. The loss is the detector's sum of its
losses (SSD: softmax confidence with 3:1 hard negatives + smooth L1; Faster R-CNN: RPN and RoI-head
classification and box regression). `evaluate` runs the detector over this rank's share of VOC2007
test, gathers every detection on rank 0 and computes the 11-point AP (voc_eval.py) by the devkit's rule and
by py-faster-rcnn's; task.ap_rule says which is `mAP`, the other is reported beside it."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import get_bounding_boxes, query_size

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
    Saturation is torchvision's (a blend with the grey image) rather than OpenCV's HSV S channel x factor.
    Every step is pointwise (a pixel's output depends on that pixel alone), so SSDTrain applies it after
    the crop and resize, to 300 x 300 pixels instead of the whole photograph."""

    _transformed_types = (tv_tensors.Image,)

    def make_params(self, flat_inputs):
        draw = lambda lo, hi: float(torch.empty(()).uniform_(lo, hi)) if torch.rand(()) < 0.5 else None  # noqa: E731
        return {"brightness": draw(-32.0, 32.0), "contrast": draw(0.5, 1.5), "saturation": draw(0.5, 1.5),
                "hue": draw(-18.0, 18.0), "contrast_first": bool(torch.rand(()) < 0.5)}

    def transform(self, inpt, params):
        x = inpt.as_subclass(torch.Tensor)  # uint8, 0..255
        # brightness and contrast are functions of a value alone: one 256-entry table, composed
        lut = torch.arange(256, dtype=torch.float32)
        linear = lambda v, a, b: (v * a + b).round_().clamp_(0, 255)  # noqa: E731  (Caffe's convertTo)
        if params["brightness"] is not None:
            lut = linear(lut, 1.0, params["brightness"])
        if params["contrast"] is not None and params["contrast_first"]:
            lut = linear(lut, params["contrast"], 0.0)
        if params["brightness"] is not None or (params["contrast"] is not None and params["contrast_first"]):
            x = _lookup(x, lut)
        if params["saturation"] is not None:
            x = v2.functional.adjust_saturation(x, params["saturation"])
        if params["hue"] is not None:
            x = adjust_hue(x, params["hue"] / 180.0)
        if params["contrast"] is not None and not params["contrast_first"]:
            x = _lookup(x, linear(torch.arange(256, dtype=torch.float32), params["contrast"], 0.0))
        return tv_tensors.wrap(x, like=inpt) if isinstance(inpt, tv_tensors.Image) else x


def _lookup(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """lut[x] for a uint8 image x (3 x H x W) and a table of 256 values in 0..255 (np.take: twice as fast
    as torch's indexing, which wants int64 indices, or float arithmetic)."""
    return torch.from_numpy(np.take(lut.to(torch.uint8).numpy(), x.numpy()))


_HUE_OFFSET = torch.tensor([3.0, 2.0, 4.0]).view(3, 1, 1)
_HUE_SIGN = torch.tensor([1.0, -1.0, -1.0]).view(3, 1, 1)
_HUE_BIAS = torch.tensor([-1.0, 2.0, 2.0]).view(3, 1, 1)


def adjust_hue(img: torch.Tensor, factor: float) -> torch.Tensor:
    """torchvision's adjust_hue for a uint8 RGB image (3 x H x W; its RGB -> HSV, hue + factor of the
    circle, HSV -> RGB, its float-to-uint8 rule), in a third of its time: a hue shift keeps each pixel's
    max and min, so the output is min + (max - min) x the fully saturated colour of the new hue.
    Equal to torchvision's but for float rounding: at most 1 level, in about 1e-5 of the values (tests)."""
    x = img.float()
    r, g, b = x.unbind(0)
    maxc = torch.maximum(torch.maximum(r, g), b)
    minc = torch.minimum(torch.minimum(r, g), b)
    c = maxc - minc
    is_r = maxc == r  # torchvision's order: red first, then green
    is_g = (maxc == g) & ~is_r
    is_b = ~(is_r | is_g)
    h = (g - b) * is_r + (b - r + 2.0 * c) * is_g + (r - g + 4.0 * c) * is_b  # hue in sixths of the circle, x c
    h = h.div_(torch.where(c == 0, 1.0, c)).add_(6.0 * factor)
    h = h.sub_(h.div(6.0).floor_().mul_(6.0))  # into [0, 6)
    pure = (h - _HUE_OFFSET).abs_().mul_(_HUE_SIGN).add_(_HUE_BIAS).clamp_(0.0, 1.0)
    return pure.mul_(c).add_(minc).mul_(255.999 / 255.0).to(torch.uint8)  # torchvision's to_dtype(scale=True)


class FastIoUCrop(v2.RandomIoUCrop):
    """torchvision's RandomIoUCrop with the same random draws in the same order and the same float32
    arithmetic, so the same crops (tests/test_voc.py), in a fraction of its time: its loop runs up to 40
    trials per drawn IoU threshold, each with a dozen small tensor operations and a box_iou call. Here
    the 40 trials of a threshold are drawn as one block (torch.rand(2) k times is torch.rand(2k), both
    serial on the CPU generator) and evaluated at once in NumPy; the generator is then rewound and
    advanced by exactly what torchvision's loop would have drawn."""

    def make_params(self, flat_inputs):
        orig_h, orig_w = query_size(flat_inputs)
        boxes = get_bounding_boxes(flat_inputs)
        xyxy = v2.functional.convert_bounding_box_format(boxes.as_subclass(torch.Tensor), boxes.format,
                                                         tv_tensors.BoundingBoxFormat.XYXY).numpy()
        f32 = np.float32
        cx, cy = f32(0.5) * (xyxy[:, 0] + xyxy[:, 2]), f32(0.5) * (xyxy[:, 1] + xyxy[:, 3])
        area = (xyxy[:, 2] - xyxy[:, 0]) * (xyxy[:, 3] - xyxy[:, 1])
        lo, span = f32(self.min_scale), f32(self.max_scale - self.min_scale)
        while True:
            min_iou = self.options[int(torch.randint(low=0, high=len(self.options), size=(1,)))]
            if min_iou >= 1.0:  # leave the image as it is
                return {}
            state = torch.get_rng_state()
            u = torch.rand(4 * self.trials).numpy()  # a trial draws 2 (scales) or 4 (and the offsets)
            r = lo + span * u  # float32, as torchvision's `min_scale + (max_scale - min_scale) * torch.rand(2)`
            sizes_w, sizes_h = (f32(orig_w) * r).astype(np.int64), (f32(orig_h) * r).astype(np.int64)
            starts, p = [], 0  # where each trial's draws start: the aspect check decides how many it takes
            for _ in range(self.trials):
                starts.append(p)
                p += 4 if self.min_aspect_ratio <= sizes_w[p] / sizes_h[p + 1] <= self.max_aspect_ratio else 2
            at = np.array(starts)
            at = at[np.diff(np.append(at, p)) == 4]  # the trials that passed the aspect check
            new_w, new_h = sizes_w[at], sizes_h[at + 1]
            left = (f32(orig_w) - new_w.astype(f32)) * u[at + 2]
            top = (f32(orig_h) - new_h.astype(f32)) * u[at + 3]
            left, top = left.astype(np.int64), top.astype(np.int64)
            right, bottom = left + new_w, top + new_h
            c = [v.astype(f32)[:, None] for v in (left, top, right, bottom)]  # exact: < 2**24
            inside = (c[0] < cx) & (cx < c[2]) & (c[1] < cy) & (cy < c[3])  # trials x boxes
            # torchvision.ops.box_iou against each crop, operation by operation in float32
            iw = (np.minimum(xyxy[:, 2], c[2]) - np.maximum(xyxy[:, 0], c[0])).clip(min=0)
            ih = (np.minimum(xyxy[:, 3], c[3]) - np.maximum(xyxy[:, 1], c[1])).clip(min=0)
            inter = iw * ih
            with np.errstate(invalid="ignore", divide="ignore"):
                iou = inter / (area + (c[2] - c[0]) * (c[3] - c[1]) - inter)
            best = np.where(inside, iou, -np.inf).max(axis=1, initial=-np.inf)
            ok = (new_w > 0) & (new_h > 0) & inside.any(axis=1) & ~(best < f32(min_iou))
            hit = int(np.argmax(ok)) if ok.any() else None
            torch.set_rng_state(state)  # rewind, then draw what torchvision's loop drew
            torch.rand(p if hit is None else int(at[hit]) + 4)
            if hit is not None:
                return dict(top=int(top[hit]), left=int(left[hit]), height=int(new_h[hit]), width=int(new_w[hit]),
                            is_within_crop_area=torch.from_numpy(inside[hit].copy()))


def _window(img: torch.Tensor, pad: list[int], crop: dict, fill: tuple[int, ...]):
    """The crop window of the zoomed-out canvas (the image at (pad left, pad top) on a `fill` canvas),
    built directly, uint8, 3 x h x w in HWC memory (what the uint8 resize is fast on): the canvas itself
    (up to 4 x 4 the image) is never made. Returns (window, the image's rows and columns in it:
    ((y0, y1), (x0, x1)), half-open, empty when the window holds none of the image)."""
    h, w = img.shape[-2:]
    left, top, right, bottom = pad
    ch, cw = top + h + bottom, left + w + right
    y0, x0 = crop.get("top", 0), crop.get("left", 0)
    wh, ww = crop.get("height", ch), crop.get("width", cw)
    # the image's rectangle in window coordinates, clipped to the window
    iy0, ix0 = max(top - y0, 0), max(left - x0, 0)
    iy1, ix1 = min(top + h - y0, wh), min(left + w - x0, ww)
    rect = ((iy0, iy1), (ix0, ix1))
    if (iy0, ix0, iy1, ix1) == (0, 0, wh, ww):  # the window lies inside the image: a view
        return img[:, y0 - top:y0 - top + wh, x0 - left:x0 - left + ww], rect
    out = torch.empty(wh, ww, 3, dtype=torch.uint8)
    row = torch.tensor(fill, dtype=torch.uint8).repeat(ww).view(ww, 3)  # rows are copied whole: fast
    if iy1 <= iy0 or ix1 <= ix0:  # no image pixel in the window
        out[:] = row
        return out.permute(2, 0, 1), ((0, 0), (0, 0))
    out[:iy0] = row
    out[iy1:] = row
    out[iy0:iy1, :ix0] = row[:ix0]
    out[iy0:iy1, ix1:] = row[ix1:]
    out[iy0:iy1, ix0:ix1] = img[:, iy0 + y0 - top:iy1 + y0 - top, ix0 + x0 - left:ix1 + x0 - left].permute(1, 2, 0)
    return out.permute(2, 0, 1), rect


def _touched(span: tuple[int, int], length: int, size: int) -> tuple[int, int]:
    """The output pixels [lo, hi) of a bilinear resize (align_corners=False, no antialiasing) of `length`
    pixels to `size` that read any input pixel in `span` (half-open)."""
    a, b = span
    if b <= a:
        return 0, 0
    src = ((torch.arange(size, dtype=torch.float64) + 0.5) * (length / size) - 0.5).clamp_(min=0).floor_()
    hit = ((src >= a - 1) & (src <= b - 1)).nonzero()
    return (int(hit[0]), int(hit[-1]) + 1) if len(hit) else (0, 0)


class SSDTrain:
    """SSD300's training transform: the law of v2.Compose([SSDPhotometricDistort(), RandomZoomOut(mean fill,
    side 1-4, p 0.5), RandomIoUCrop(), RandomHorizontalFlip(0.5), SanitizeBoundingBoxes]) followed by the
    model's resize to size x size -- the same random draws in the same order, hence the same boxes -- done
    in a cheaper order on uint8: the geometry is worked out on the boxes, only the crop window is built,
    it is resized (bilinear, no antialiasing, as the detector's own transform) to size x size, then
    distorted (pointwise; the zoom-out fill left as it is) and flipped there. Pixels differ from that
    pipeline's by the rounding of resizing uint8 and distorting after the resize (tests/test_voc.py
    bounds it). `ssd=False` leaves out the distortion, zoom out and crop (augment=flip); `flip=False` the
    flip too (augment=none). Output: the uint8 image, size x size, and the boxes in its pixels (the
    model's resize is then the identity)."""

    FILL = (124, 116, 104)  # the zoom-out fill: the ImageNet mean in 0..255 (SSD: the mean pixel)

    def __init__(self, size: int, ssd: bool = True, flip: bool = True):
        self.size, self.ssd, self.flip = size, ssd, flip
        self.distort = SSDPhotometricDistort()
        self.zoom = v2.RandomZoomOut(fill={tv_tensors.Image: self.FILL, "others": 0}, side_range=(1.0, 4.0), p=0.5)
        self.crop = FastIoUCrop()
        self.sanitize = v2.SanitizeBoundingBoxes(labels_getter=_difficult_too)

    def __call__(self, img, target):
        boxes = target["boxes"]
        pad, crop, flip, colour = [0, 0, 0, 0], {}, False, None
        if self.ssd:  # the draws of the Compose, in its order
            colour = self.distort.make_params([img])
            if torch.rand(1) < self.zoom.p:  # RandomZoomOut: skipped when torch.rand(1) >= p
                pad = self.zoom.make_params([boxes])["padding"]
                boxes = v2.functional.pad(boxes, pad)
            crop = self.crop.make_params([boxes])
            if crop:
                boxes = self.crop.transform(boxes, crop)
        if self.flip:
            flip = bool(torch.rand(1) < 0.5)  # RandomHorizontalFlip(0.5): skipped when torch.rand(1) >= p
        window, (rows, cols) = _window(img.as_subclass(torch.Tensor), pad, crop, self.FILL)
        if flip:
            boxes = v2.functional.horizontal_flip(boxes)
        _, target = self.sanitize(None, {**target, "boxes": boxes})
        # the detector's resize (GeneralizedRCNNTransform / SSD's): bilinear, no antialiasing; boxes x the
        # ratio it computes (float32 division), so that its own resize is then the identity
        h, w = window.shape[-2:]
        x = torch.nn.functional.interpolate(window[None], size=(self.size, self.size), mode="bilinear",
                                            align_corners=False)[0]
        ratio = torch.tensor([self.size] * 4, dtype=torch.float32) / torch.tensor([w, h, w, h], dtype=torch.float32)
        target["boxes"] = tv_tensors.wrap(target["boxes"] * ratio, like=target["boxes"],
                                          canvas_size=(self.size, self.size))
        if colour is not None:
            # SSD distorts the photograph before the zoom out: the mean fill stays as it is. Only the
            # output pixels that read some image pixel are distorted (those on the border blend both).
            (y0, y1), (x0, x1) = _touched(rows, h, self.size), _touched(cols, w, self.size)
            if (y0, y1, x0, x1) == (0, self.size, 0, self.size):
                x = self.distort.transform(x, colour)
            elif y1 > y0 and x1 > x0:
                x[:, y0:y1, x0:x1] = self.distort.transform(x[:, y0:y1, x0:x1], colour)
        if flip:
            x = x.flip(-1)
        return tv_tensors.Image(x), target


def check_augment(augment: str) -> None:
    if augment not in AUGMENTS:
        raise UserError(f"task.augment={augment!r}; choose one of: {', '.join(AUGMENTS)}")


def train_transform(augment: str, size: int | None = None):
    """The training transform of task.augment. Images stay uint8 (model_input scales them on the
    device). With `size` (SSD: its square input side) the loader also resizes, as the model would, so
    that the distortion runs on size x size pixels; without (Faster R-CNN: each image at its own size,
    resized by the model) SSD's augmentation is the plain v2 pipeline."""
    check_augment(augment)
    if size is not None:
        return SSDTrain(size, ssd=augment == "ssd", flip=augment != "none")
    steps = []
    if augment == "ssd":
        # SSD's data augmentation (Liu et al. 2016, 2.2): photometric distortions, zoom out ("expand",
        # filled with the mean), a random crop whose IoU with some object is >= 0.1..0.9, a flip.
        # The zoom-out fill is the ImageNet mean in 0..255 (the image is still uint8 here).
        steps += [SSDPhotometricDistort(),
                  v2.RandomZoomOut(fill={tv_tensors.Image: SSDTrain.FILL, "others": 0}, side_range=(1.0, 4.0), p=0.5),
                  FastIoUCrop()]
    if augment in ("ssd", "flip"):
        steps.append(v2.RandomHorizontalFlip(0.5))  # py-faster-rcnn: TRAIN.USE_FLIPPED
    steps.append(v2.SanitizeBoundingBoxes(labels_getter=_difficult_too))
    return v2.Compose(steps)


def model_input(images: list[torch.Tensor]) -> list[torch.Tensor]:
    """The loader's uint8 images as the detectors take them: float32 in 0..1 (their transforms normalise by
    ImageNet's mean and std and resize). On the device, after the copy: a quarter of the bytes travel."""
    return [v2.functional.to_dtype(im, torch.float32, scale=True) for im in images]


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
        # SSD's input is a square: the loader resizes to it (train_transform); Faster R-CNN's model resizes
        size = c.image_size if self.cfg.model == "ssd300_vgg16" else None
        train = VOCDetectionSet(c.data_root, list(c.train_sets), classes, train_transform(c.augment, size),
                                keep_difficult=c.train_difficult)
        val = VOCDetectionSet(c.data_root, [c.test_set], classes)  # uint8, each at its own size
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
        losses = model(model_input(images), [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets])
        return sum(losses.values()), len(images)

    def evaluate(self, ev):
        dets, gts = [], []
        for images, targets in ev.batches():  # train.eval_max_batches; task.eval_max_images cuts the set
            images = model_input([im.to(ev.device) for im in images])
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
