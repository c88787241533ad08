"""Prepared CelebA (data_prep.celeba) as a torch Dataset of image tensors for one split."""
from __future__ import annotations

from pathlib import Path

from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from mpt.errors import UserError

from .prepare import FOLDER, MARKER, PARTITION, read_partition

# Karras et al. 2018 (progressive_growing_of_gans, dataset_tool.py create_celeba): the 128x128 square
# centred at (89, 121) of the aligned 178x218 image -- the face, no resampling at 128 px.
CROP_BOX = (89 - 64, 121 - 64, 89 + 64, 121 + 64)


class CelebA(Dataset):
    def __init__(self, root, split: str, transform=None, cache: bool = False):
        root = Path(root)
        if not (root / MARKER).is_file():
            raise UserError(f"no prepared CelebA at {root}; run: python -m data_prep.celeba --archives DIR --out {root}"
                            f" (tiny data: python -m data_prep.celeba.tiny --out DIR first)")
        part = read_partition(root / "celeba" / PARTITION)
        self.files = [root / "celeba" / FOLDER / n for n, s in sorted(part.items()) if s == split]
        if not self.files:
            raise UserError(f"CelebA at {root} has no {split!r} images")
        self.transform, self.cache = transform, {} if cache else None

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        if self.cache is not None and i in self.cache:
            return self.cache[i]
        try:
            with Image.open(self.files[i]) as im:
                x = im.convert("RGB").crop(CROP_BOX)
        except (OSError, UnidentifiedImageError) as e:
            raise UserError(f"corrupt image {self.files[i]} ({type(e).__name__}); re-run data_prep.celeba --force") from None
        x = self.transform(x) if self.transform else x
        if self.cache is not None:  # deterministic transforms only (DCGAN uses no augmentation)
            self.cache[i] = x
        return x
