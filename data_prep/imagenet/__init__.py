"""ILSVRC2012 (ImageNet) for the paper's Table 1: preparation from the official archives
(`python -m data_prep.imagenet`), a tiny synthetic stand-in in the same format
(`python -m data_prep.imagenet.tiny`), and the dataset class over the prepared folder.
See README.md.
"""
from __future__ import annotations

__all__ = ["ImageNetFolder", "prepare", "generate"]


def __getattr__(name):
    # Lazy, so `python -m data_prep.imagenet[.tiny]` does not import torchvision first.
    if name == "ImageNetFolder":
        from .dataset import ImageNetFolder
        return ImageNetFolder
    if name == "prepare":
        from .prepare import prepare
        return prepare
    if name == "generate":
        from .tiny import generate
        return generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
