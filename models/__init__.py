"""A plain registry of models by name. Adding a model = one file + the @register decorator.

    from models import build, names
    net = build("resnet50_preact", num_classes=1000, width=1.0)
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch.nn as nn

from mpt.errors import UserError

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}
# Modules whose import registers models; imported lazily so `import models` stays cheap.
_MODULES = ["models.imagenet_cnns", "models.cifar_resnet", "models.lm", "models.dcgan", "models.detection",
            "models.deepspeech2", "models.seq2seq"]


def register(name: str):
    def deco(fn):
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def _load_all():
    for m in _MODULES:
        importlib.import_module(m)


def names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def build(name: str, **kwargs) -> nn.Module:
    _load_all()
    if name not in _REGISTRY:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kwargs)
