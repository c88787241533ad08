"""A plain registry of models by name. Adding a model = one file + the @register decorator
(`batch_norm=True` when the model has batch-norm layers: the launcher's plan reads it).

    from models import build, names
    net = build("resnet50_preact", num_classes=1000, width=1.0)
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch.nn as nn

from mpt.errors import UserError

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}
_BATCH_NORM: set[str] = set()  # the models with batch-norm layers (their default build)
# Modules whose import registers models; imported lazily so `import models` stays cheap.
_MODULES = ["models.imagenet_cnns", "models.cifar_resnet", "models.lm", "models.dcgan", "models.detection",
            "models.deepspeech2", "models.seq2seq"]


def register(name: str, *, batch_norm: bool = False):
    """Register a model builder under `name`. batch_norm: its default build has batch-norm layers (a fact
    the launcher's plan needs for its BN-batch note without building the model; tests/test_models.py
    checks it against the built model)."""
    def deco(fn):
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} registered twice")
        _REGISTRY[name] = fn
        if batch_norm:
            _BATCH_NORM.add(name)
        return fn

    return deco


def _load_all():
    for m in _MODULES:
        importlib.import_module(m)


def names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def has_batch_norm(name: str) -> bool:
    """Whether registered model `name` has batch-norm layers; False for a name the registry does not know."""
    _load_all()
    return name in _BATCH_NORM


def build(name: str, **kwargs) -> nn.Module:
    _load_all()
    if name not in _REGISTRY:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kwargs)
