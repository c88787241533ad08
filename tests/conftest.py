"""Shared fixtures: the tiny synthetic ImageNet, made by the real generator and the real prep."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.pop("WANDB_API_KEY", None)  # tests never go online


@pytest.fixture(scope="session")
def tiny_imagenet(tmp_path_factory) -> Path:
    from data_prep.imagenet import prepare as prep
    from data_prep.imagenet.tiny import generate

    arch = tmp_path_factory.mktemp("tiny_archives")
    generate(arch)  # the demo's default: 10 classes, 64 train / 16 val each, 96 px
    out = tmp_path_factory.mktemp("tiny_prepared") / "imagenet"
    prep.prepare(arch, out, workers=2, log=lambda *a: None)
    return out


def tiny_overrides(root, out_dir, *extra):
    """A tiny-profile ILSVRC run that writes under out_dir and logs nothing online."""
    return ["profile=tiny", f"task.data_root={root}", f"out_dir={out_dir}", "wandb.mode=disabled",
            "train.progress=false", *extra]


def run_interrupted(monkeypatch, main, overrides, at_step: int) -> dict:
    """Run `main(overrides)` with the engine asked to stop (as a SLURM signal would) while step
    `at_step` trains: the run checkpoints after that step and returns status "interrupted"."""
    from mpt import engine

    orig = engine.Run.train_step

    def train_step(self, micro):
        if self.step == at_step:
            engine.STOP.request("test")
        return orig(self, micro)

    monkeypatch.setattr(engine.Run, "train_step", train_step)
    try:
        return main(overrides)
    finally:
        engine.STOP.clear()
        monkeypatch.setattr(engine.Run, "train_step", orig)
