"""Task glue for Table 1: ImageNet folders, the paper's augmentation, cross-entropy (with the
auxiliary heads of GoogLeNet / Inception v3), single-centre-crop top-1 / top-5."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchvision import transforms as tv_transforms

from mpt.config import infra
from mpt.errors import UserError
from mpt.task import Task as BaseTask

from data_prep.imagenet.pipeline import DECODES, MEAN, EncodedBatch, collate, decode_on_device, normalise

AUGMENTS = ("caffe", "torchvision", "pad")


@dataclass
class TaskCfg:
    data_root: str = infra("data/imagenet")  # output of `python -m data_prep.imagenet`
    crop: int = 224
    resize: int = 256
    # caffe: images warped to resize x resize, random crop + flip (the paper's Caffe models);
    # torchvision: RandomResizedCrop + flip (the torchvision reference, the paper's ResNet-50);
    # pad: images at crop x crop, padded by (resize - crop) / 2 pixels of the mean colour on each side,
    # random crop + flip; evaluation sees the whole image (He et al. 2016's CIFAR-10 setup, section 4.2).
    # Its images are decoded once and held in memory (data_prep.imagenet.dataset.DecodedImages).
    augment: str = "caffe"
    # the random horizontal flip of every augmentation; false for the tiny profile, whose few epochs on
    # a small set (e.g. handwritten digits, which a mirror turns into other shapes) it only slows down
    flip: bool = True
    aux_weight: float = -1.0  # -1: the model's published default (models.imagenet_cnns.AUX_WEIGHTS)
    label_smoothing: float = 0.0
    dropout: float = -1.0  # -1: each model's published rate; 0 turns dropout off (e.g. DDP equivalence checks)
    # reference: each model's published initialisation. kaiming: He-normal (fan-in) weights and zero
    # biases -- for the tiny profile, where the Caffe models' fixed-std Gaussians (std 0.01, designed
    # for full width) shrink the signal of a 1/16-width net to nothing and it never leaves chance.
    init: str = "reference"
    # Batch-norm statistics over the whole global batch (torch SyncBatchNorm) instead of each GPU's
    # share. On for a BN model whose per-GPU batch in the grid is below its reference's BN batch
    # (BN-Inception: 32 images on one device, our paper grid 32 over 8 GPUs = 4 each). Needs GPUs
    # with more than one rank; a no-op in a one-process run.
    sync_bn: bool = False
    # Where the JPEGs are decoded (augment caffe / torchvision; data_prep.imagenet.pipeline). cpu: in the
    # loader's workers, libjpeg-turbo with DCT-domain downscaling. gpu: the workers read the files and
    # draw the crops, nvJPEG decodes each batch on the GPU -- for nodes with few cores per GPU.
    decode: str = "cpu"


def transforms(c: TaskCfg, train: bool):
    """augment=pad's per-sample work on DecodedImages' uint8 (3, crop, crop) tensors: uint8 out, as every
    augmentation's (the device normalises: data_prep.imagenet.pipeline.normalise)."""
    if c.augment != "pad":
        raise UserError(f"transforms() is augment=pad's; task.augment={c.augment!r} runs ImagePipeline")
    flip = [tv_transforms.RandomHorizontalFlip()] if c.flip else []
    if train:
        return tv_transforms.Compose([PadCrop(c.crop, (c.resize - c.crop) // 2), *flip])
    return None


class PadCrop:
    """He et al.'s random crop of a uint8 (3, H, W) tensor padded by `pad` pixels of the mean colour per side
    (their zero padding of the mean-subtracted image). The same random numbers, in the same order, as
    torchvision's RandomCrop(size, padding=pad, fill=mean colour) on the PIL image, and the same pixels: a
    run gets the crops it got when the images were decoded every epoch. A few tensor operations instead of
    torchvision's tensor RandomCrop (~5x the time here; and it takes no colour as the fill)."""

    def __init__(self, size: int, pad: int):
        self.size, self.pad = size, pad
        self.fill = torch.tensor([round(255 * m) for m in MEAN], dtype=torch.uint8)[:, None, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        p, (h, w) = self.pad, x.shape[-2:]
        canvas = self.fill.expand(x.shape[0], h + 2 * p, w + 2 * p).clone()
        canvas[:, p:p + h, p:p + w] = x
        if (h + 2 * p, w + 2 * p) == (self.size, self.size):  # RandomCrop draws nothing then
            return canvas
        i = torch.randint(0, h + 2 * p - self.size + 1, size=(1,)).item()
        j = torch.randint(0, w + 2 * p - self.size + 1, size=(1,)).item()
        return canvas[:, i:i + self.size, j:j + self.size]


class Task(BaseTask):
    prepared_data = ("ILSVRC2012", "imagenet")  # prepared.json's "dataset", by data_prep.imagenet
    primary_metric = "top1"
    channels_last = True  # a CNN on images: NHWC on CUDA (channels_last=auto)
    graphable = True  # fixed crops, one loss: train.cuda_graphs can capture the step (not task.decode=gpu)
    higher_is_better = True
    data_files = ("classes.json",)  # the class list beside the marker: part of the run identity

    @classmethod
    def check(cls, cfg):
        c = cfg.task
        if c.augment not in AUGMENTS:
            raise UserError(f"unknown task.augment={c.augment!r}; choose one of: {', '.join(AUGMENTS)}")
        if c.augment == "pad" and (c.resize < c.crop or (c.resize - c.crop) % 2):
            raise UserError(f"task.augment=pad pads (task.resize - task.crop) / 2 pixels per side: give a task.resize "
                            f">= task.crop={c.crop} that differs from it by an even number (e.g. {c.crop + 8}), "
                            f"not {c.resize}")
        if c.decode not in DECODES:
            raise UserError(f"unknown task.decode={c.decode!r}; choose one of: {', '.join(DECODES)}")
        if c.decode == "gpu" and cfg.train.cuda_graphs:
            raise UserError("task.decode=gpu decodes each batch's JPEGs inside the step (nvJPEG, host-side "
                            "sizes), which a CUDA graph cannot replay: use task.decode=cpu or train.cuda_graphs=false")
        if c.decode == "gpu" and c.augment == "pad":
            raise UserError("task.decode=gpu decodes JPEGs on the GPU; task.augment=pad holds its images decoded "
                            "in memory: set task.decode=cpu")
        if c.init not in ("reference", "kaiming"):
            raise UserError(f"unknown task.init={c.init!r}; choose one of: reference, kaiming")

    @dataclass(frozen=True)
    class Facts:
        num_classes: int  # ILSVRC12's 1,000; the prepared data's classes.json

    @classmethod
    def read_facts(cls, cfg):
        from data_prep.imagenet.dataset import prepared_classes

        return cls.Facts(num_classes=len(prepared_classes(cfg.task.data_root)))

    @property
    def aux_weight(self) -> float:
        """The auxiliary heads' loss weight (GoogLeNet, Inception v3): task.aux_weight, or the model's own."""
        from models.imagenet_cnns import AUX_WEIGHTS

        c = self.cfg.task
        return c.aux_weight if c.aux_weight >= 0 else AUX_WEIGHTS.get(self.cfg.model, 0.0)

    # Samples leave the workers as uint8 (or, task.decode=gpu, as encoded files): see images().
    collate = staticmethod(collate)

    def datasets(self):
        from data_prep.imagenet.dataset import DecodedImages, ImageNetFolder
        from data_prep.imagenet.pipeline import ImagePipeline

        c = self.cfg.task
        if c.augment == "pad":  # small images, every one seen each epoch: decoded once, held as uint8 tensors
            return tuple(DecodedImages(ImageNetFolder(c.data_root, split), c.crop, transform=transforms(c, split == "train"))
                         for split in ("train", "val"))
        return tuple(ImageNetFolder(c.data_root, split, loader=ImagePipeline(c.data_root, c.augment, split == "train",
                                                                             c.crop, c.resize, c.flip, c.decode))
                     for split in ("train", "val"))

    def images(self, x, device: torch.device) -> torch.Tensor:
        """The model's input from a batch's images on the device: the GPU decode's JPEGs decoded and
        cropped there, uint8 normalised there (after the copy, a quarter of float32's bytes)."""
        if isinstance(x, EncodedBatch):
            from mpt.precision import channels_last_pays

            x = decode_on_device(x, device)
            if channels_last_pays(self.cfg, device, self.channels_last):
                x = x.contiguous(memory_format=torch.channels_last)
        return normalise(x)

    def build_model(self):
        import models
        from models.imagenet_cnns import AUX_WEIGHTS

        cfg = self.cfg
        kw = {"aux_logits": self.aux_weight > 0} if cfg.model in AUX_WEIGHTS else {}
        model = models.build(cfg.model, num_classes=self.facts.num_classes, width=cfg.width, **kw)
        if cfg.task.init == "kaiming":
            for m in model.modules():
                if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                    torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                    if m.bias is not None:
                        torch.nn.init.zeros_(m.bias)
        if cfg.task.sync_bn and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            if not torch.cuda.is_available():
                raise UserError("task.sync_bn=true needs GPUs (SyncBatchNorm syncs CUDA tensors only); "
                                "set task.sync_bn=false for a CPU run")
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if cfg.task.dropout >= 0:
            for m in model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = cfg.task.dropout
        return model

    def loss(self, model, batch):
        x, y = batch
        out = model(self.images(x, y.device))
        aux = []
        if isinstance(out, tuple):  # GoogLeNet / Inception v3 in training: (logits, [aux logits])
            out, aux = out
        loss = F.cross_entropy(out.float(), y, label_smoothing=self.cfg.task.label_smoothing)
        for a in aux:
            loss = loss + self.aux_weight * F.cross_entropy(a.float(), y, label_smoothing=self.cfg.task.label_smoothing)
        return loss, y.shape[0]

    def eval_sums(self, model, batch):
        x, y = batch
        logits = model(self.images(x, y.device)).float()
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hit = top.eq(y[:, None])
        return {"n": y.shape[0], "top1": hit[:, 0].sum().item(), "top5": hit.any(dim=1).sum().item(),
                "loss": F.cross_entropy(logits, y, reduction="sum").item()}

    def eval_metrics(self, s):
        n = max(s.get("n", 0), 1)
        return {"top1": 100.0 * s["top1"] / n, "top5": 100.0 * s["top5"] / n, "loss": s["loss"] / n}
