"""The prepared ILSVRC2012 as a torchvision ImageFolder, with errors a user can act on; DecodedImages
holds a small set's split decoded once, in memory.

Class indices come from OUT/classes.json (sorted WNIDs, the order ImageFolder itself would use),
so train and val always agree on them, and a missing class folder is reported instead of silently
shifting every later index.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder

from mpt.errors import UserError

from ..prepared import read_prepared
from .prepare import CLASSES, MARKER

SPLITS = ("train", "val")


def _redo_hint(root: Path) -> str:
    return f"re-run: python -m data_prep.imagenet --archives <dir> --out {root} --force"


def damaged(path: str, root: Path, e: Exception) -> UserError:
    return UserError(f"cannot read image {path} ({type(e).__name__}: {e}); the prepared "
                     f"ImageNet is damaged, {_redo_hint(root)}")


def load_rgb(path: str, root: Path) -> Image.Image:
    """torchvision's PIL loader, but a damaged file is a UserError naming it (a module-level
    function plus functools.partial, so DataLoader workers can pickle it)."""
    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            return img.convert("RGB")  # forces the full decode, so truncation shows up here
    except (OSError, ValueError, SyntaxError) as e:  # PIL's decode errors; UnidentifiedImageError is an OSError
        raise damaged(path, root, e) from None


def _no_marker(root: Path) -> UserError:
    return UserError(f"no prepared ImageNet at {root} (missing {MARKER}); run: "
                     f"python -m data_prep.imagenet --archives <dir> --out {root}")


def prepared_classes(root) -> list[str]:
    """The prepared class list of `root` (WNIDs in index order, from classes.json)."""
    root = Path(root)
    if not (root / MARKER).is_file():
        raise _no_marker(root)
    path = root / CLASSES
    try:
        return [c["wnid"] for c in json.loads(path.read_text())]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read {path} ({e}); {_redo_hint(root)}") from None


class ImageNetFolder(ImageFolder):
    """ImageNetFolder(root, "train" | "val", transform) over the output of python -m data_prep.imagenet.
    Items are PIL images by default; `loader` (path -> sample) replaces that, e.g. the uint8 pipeline
    (data_prep.imagenet.pipeline.ImagePipeline), which decodes and crops in one step."""

    def __init__(self, root, split: str, transform=None, target_transform=None, loader=None):
        root = Path(root)
        if split not in SPLITS:
            raise UserError(f"unknown ImageNet split {split!r}; use one of {', '.join(SPLITS)}")
        if not (root / MARKER).is_file():
            raise _no_marker(root)
        self.split = split
        self.info = read_prepared(root, _redo_hint(root))
        try:
            super().__init__(root / split, transform=transform, target_transform=target_transform,
                             loader=loader or functools.partial(load_rgb, root=root))
        except FileNotFoundError as e:  # a class folder missing or emptied after preparation
            raise UserError(f"the prepared ImageNet at {root} is damaged ({str(e).splitlines()[0]}); "
                            f"{_redo_hint(root)}") from None
        expected = self.info[f"{split}_images"]
        if len(self.samples) != expected:
            raise UserError(f"{root / split} has {len(self.samples):,} images but {root / MARKER} "
                            f"records {expected:,}; the prepared ImageNet is damaged, {_redo_hint(root)}")

    def find_classes(self, directory):
        # Called by ImageFolder.__init__ with root/split; the class list is the prepared one.
        wnids = prepared_classes(Path(directory).parent)
        return wnids, {w: i for i, w in enumerate(wnids)}

    @property
    def num_classes(self) -> int:
        return len(self.classes)


# What DecodedImages may hold: a small set's split (the CIFAR-10 development subset's 5,000 train images at
# 32 px are 15 MB); ImageNet's 1.28M at 224 px would be 193 GB.
DECODED_LIMIT_BYTES = 4 << 30


class DecodedImages(Dataset):
    """A prepared split decoded once: every image fitted to size x size (torchvision's Resize((size, size)),
    the identity for images of that size) and held in memory as one uint8 tensor (N, 3, size, size).
    Item i is (transform(images[i]), class index) -- the transform works on uint8 CHW tensors. For sets of
    small images read every epoch (CIFAR-scale photographs): decoding a JPEG and a PIL round trip per
    sample and epoch cost more than the augmentation itself."""

    def __init__(self, folder: ImageNetFolder, size: int, transform=None):
        from torchvision.transforms import Resize
        from torchvision.transforms.functional import pil_to_tensor

        need = len(folder) * 3 * size * size
        if need > DECODED_LIMIT_BYTES:
            raise UserError(f"{folder.root}: {len(folder):,} images at {size}x{size} need {need / 2**30:.1f} GiB "
                            f"decoded in memory (over {DECODED_LIMIT_BYTES / 2**30:.0f} GiB); task.augment=pad is "
                            f"for small images: use a smaller task.crop or another task.augment")
        fit = Resize((size, size), antialias=True)
        self.images = torch.empty(len(folder), 3, size, size, dtype=torch.uint8)
        for k, (path, _) in enumerate(folder.samples):
            self.images[k] = pil_to_tensor(fit(folder.loader(path)))
        self.targets = list(folder.targets)
        self.classes, self.split, self.info = folder.classes, folder.split, folder.info
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        x = self.images[i]
        return (self.transform(x) if self.transform is not None else x), self.targets[i]

    @property
    def num_classes(self) -> int:
        return len(self.classes)
