"""The tiny profile learns real images: scikit-learn's handwritten digits, written
as official ILSVRC2012 archives by data_prep.imagenet.digits and prepared by data_prep.imagenet like
the real ImageNet, reach >= 90% top-1 with the unchanged tiny recipe of each Table 1 model.

The default suite checks one model (pre-activation ResNet-50, fp32, one seed), and what its
run leaves behind (the files, env.json, the metric kinds); the full check
(every model in fp32, fp16 and mixed) is `pytest -m slow tests/test_tiny_real.py` (several minutes;
the seed statistics: python -m experiments.ilsvrc_cnns.tiny_check)."""
from pathlib import Path

import pytest

from conftest import check_run_dir, tiny_overrides
from experiments.ilsvrc_cnns.tiny_check import MODELS

# Every test here runs real training, subprocesses or a cluster: left out of the fast tier.
pytestmark = pytest.mark.heavy

TARGET = 90.0  # top-1 %, chance is 10%; a linear classifier on the 8x8 pixels reaches ~96%


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    from data_prep.imagenet import prepare as prep
    from data_prep.imagenet.digits import generate

    arch = tmp_path_factory.mktemp("digits_archives")
    generate(arch)
    out = tmp_path_factory.mktemp("digits_prepared") / "imagenet"
    info = prep.prepare(arch, out, workers=2, log=lambda *a: None)
    assert (info["num_classes"], info["train_images"], info["val_images"]) == (10, 1437, 360)
    return out


def _top1(root, out_dir, model, precision, seed=0) -> dict:
    from mpt.cli import main

    s = main("ilsvrc_cnns", tiny_overrides(root, out_dir, f"model={model}", f"precision={precision}",
                                           f"seed={seed}"))
    assert s["status"] == "completed", s
    return s


def test_digits_archives_are_deterministic_and_stratified(tmp_path):
    from data_prep.imagenet.digits import generate, load, split

    a, b = generate(tmp_path / "a"), generate(tmp_path / "b")
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes(), name
    _, labels = load(8)
    train, val = split(labels, 0.2, 0)
    assert (len(train), len(val)) == (1437, 360) and not set(train) & set(val)
    counts = [int((labels[val] == k).sum()) for k in range(10)]
    assert min(counts) >= 35 and max(counts) <= 37, counts  # ~20% of each class


def test_tiny_resnet_learns_real_digits(digits, tmp_path):
    s = _top1(digits, tmp_path, "resnet50_preact", "fp32")
    assert s["metrics"]["top1"] >= TARGET, s["metrics"]
    check_run_dir(tmp_path, s)  # the default tier's fp32 tiny run (test_engine.py checks mixed)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16", "mixed"])
@pytest.mark.parametrize("model", MODELS)
def test_tiny_every_model_learns_real_digits(digits, tmp_path, model, precision):
    s = _top1(digits, tmp_path, model, precision)
    assert s["metrics"]["top1"] >= TARGET, (model, precision, s["metrics"], s["skipped_steps"])
