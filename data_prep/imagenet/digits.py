"""A small real image set in the official ILSVRC2012 archive format: scikit-learn's digits.

    python -m data_prep.imagenet.digits --out DIR [--size 96 --val-fraction 0.2 --seed 0]

The UCI handwritten digits that ship inside scikit-learn (sklearn.datasets.load_digits: 1,797
8x8 grey images of 0-9 written by 43 people, 16 grey levels; no download) upscaled (bicubic) to
size x size RGB JPEGs, split 80/20 stratified by class with a fixed seed (1,437 train / 360 val),
and written by the tiny generator's archive writer (data_prep.imagenet.tiny.write_archives), so

    python -m data_prep.imagenet --archives DIR --out DIR2

prepares it exactly as the real ImageNet. It is the real-data check of the tiny profile (a linear
classifier reaches about 96% on it): unlike the synthetic generator, its classes differ by shape,
not by colour or stripe frequency. Class k is the digit k (WNID n0000000<k+1>); the ILSVRC2012_IDs
are a fixed permutation, as in the real devkit. The output is byte-for-byte deterministic.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from mpt.errors import UserError

from ..command import generator_command
from .tiny import jpeg, wnid, write_archives

SOURCE = "data_prep.imagenet.digits"


def load(size: int = 96) -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits as uint8 (n, size, size, 3) RGB images (white strokes on black) and labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    grey = (d.images * (255.0 / 16.0) + 0.5).clip(0, 255).astype(np.uint8)  # 0..16 -> 0..255
    up = [np.asarray(Image.fromarray(g).resize((size, size), Image.BICUBIC)) for g in grey]
    return np.repeat(np.stack(up)[..., None], 3, axis=3), d.target.astype(np.int64)


def split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic stratified split: (train indices, val indices in shuffled order)."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    train, val = train_test_split(idx, test_size=val_fraction, stratify=labels, random_state=seed)
    return np.sort(train), val


def generate(out: Path, size: int = 96, val_fraction: float = 0.2, seed: int = 0) -> dict[str, Path]:
    """Write the three archives into out; return {archive name: path}."""
    if size < 8 or not 0 < val_fraction < 1:
        raise UserError("digits needs --size >= 8 and 0 < --val-fraction < 1")
    images, labels = load(size)
    train, val = split(labels, val_fraction, seed)
    classes = 10
    wnids = [wnid(k) for k in range(classes)]
    ids = [int(i) + 1 for i in np.random.default_rng(seed).permutation(classes)]
    words = [f"digit {k}" for k in range(classes)]
    per_class = [train[labels[train] == k] for k in range(classes)]
    return write_archives(
        out, wnids, ids, words,
        ([jpeg(images[i]) for i in members] for members in per_class), [len(m) for m in per_class],
        labels[val], (jpeg(images[i]) for i in val), source=SOURCE)


main = generator_command(
    "imagenet.digits", __doc__.split("\n\n")[0], generate, out_help="folder for the three archives",
    options=[("--size", 96, "image side in pixels"), ("--val-fraction", 0.2)],
    seed_help="seed of the stratified split",
    done=lambda a, _, s: (f"wrote scikit-learn's digits as an ILSVRC2012 ({a.size}x{a.size}) to {a.out} in "
                          f"{s:.1f} s; next: python -m data_prep.imagenet --archives {a.out} --out DIR"))


if __name__ == "__main__":
    main()
