"""Every paper profile starts: each experiment's paper grid cells, resolved as a cluster job resolves
them (slurm.grid.load -> the cell's `python -m experiments.<name> profile=paper ...` overrides ->
mpt.cli.main), with every model at the paper's size, run two optimizer steps, an evaluation and a
checkpoint on the CPU at batch 2 on the tiny data each data_prep tiny generator makes. A config, shape
or recipe error in a paper profile fails here instead of in a cluster job.

The only overrides are what a CPU forces (CPU_FORCED, checked for every case by
test_cpu_overrides_touch_only_what_cpu_forces): batch and steps, workers, device, data and output
paths, logging, and evaluation cut to a batch or two. Everything else -- recipe, input sizes, loss
scale, impl, the grid's numerics sampling at step 0 -- is the paper cell's. What follows the data
rather than the config: the ImageNet set has the paper's 1000 classes and the VOC set its 20, so those
heads are the paper's; the vocabularies of translation (120 subwords, paper 40K), Mandarin (the tiny
set's characters) and the bigLSTM (cut to 16,384 words, see lm_data) are the tiny data's. The speech
utterances are the shortest the generators speak (one word / one character; see librispeech_data).

FP16 runs on the CPU with half_math=auto (emulated FP16 dot products, mpt/half_math.py), the default
a user gets; PyTorch's own CPU FP16 convolution backward is ~100x slower than FP32 (a 128-px DCGAN
step took minutes with it).

Measured on 2 cores, one thread (2026-11-25): the default-suite part (7 heavy runs and the 34 config
checks, data included) 29 s; the slow part (26 runs) 917 s under a load of 2-3, most of it DeepSpeech 2
Mandarin (115-132 s a cell: 3 x 3520-cell GRUs, whose CPU backward accumulates weight gradients frame by
frame) and the numerics sample at step 0 of the large models (25-40 s each on a CPU).
"""
from __future__ import annotations

import functools
import json
import math
import shutil
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from mpt import config as C
from mpt import identity
from mpt import cli
from slurm import grid as G

pytestmark = [pytest.mark.usefixtures("one_thread"),
              # CPU PyTorch runs the bigLSTM's projected LSTMs without oneDNN and says so; expected here.
              pytest.mark.filterwarnings("ignore:LSTM with projections is not supported")]

STEPS, BATCH = 2, 2

# Config keys a CPU run may change from the paper cell, and nothing else: where the data and outputs
# are, how many examples and steps fit a CPU, logging, and how much of the evaluation runs.
CPU_FORCED = {
    "device", "out_dir", "task.data_root", "data_fingerprint", "wandb.mode", "train.progress", "train.log_every",
    "train.batch_size", "train.max_steps", "train.num_workers", "train.eval_max_batches",
    "task.eval_max_images",  # voc_detection: the devkit mAP over 2 test images
    "task.bleu_max_sentences",  # wmt_translation: BLEU of 2 greedy translations
    "task.eval_samples", "task.grid",  # dcgan: the SWD of 2 samples, a 4-image sample grid
    "task.backbone",  # voc_detection: where the ImageNet VGG-16 weights are (a random stand-in here)
}


# ------------------------------------------------------------------------------------------------
# the cases: every model of every paper grid, in the paper's precisions


def paper_grids() -> dict[str, list[Path]]:
    """{experiment: its grid files that have a paper profile}, for every experiment folder with a config.yaml
    (the real-data grids -- grid_gettext, grid_longer, grid_photos -- are CPU checks with a tiny profile only)."""
    return {cfg.parent.name: sorted(p for p in cfg.parent.glob("grid*.yaml") if "paper" in G.load_spec(p)["profiles"])
            for cfg in sorted((REPO / "experiments").glob("*/config.yaml"))}


@functools.lru_cache(maxsize=None)
def paper_cells(experiment: str) -> tuple[G.Cell, ...]:
    return tuple(c for path in paper_grids()[experiment] for c in G.load(path, "paper").cells)


# (experiment, model, precision, impl, loss_scale): one cell of a paper grid each. fp32 and mixed for
# every model (with the paper's loss scale where the grid has one: SSD's 8, the bigLSTM's 128),
# fp16_storage for DeepSpeech 2 (how the paper ran it), and both impls where the grid has that axis.
CASES = [
    *[("ilsvrc_cnns", m, p, "autocast", "auto") for m in ("alexnet", "vgg16", "googlenet", "inception_v2",
                                                          "inception_v3", "resnet50_preact")
      for p in ("fp32", "mixed")],
    *[("voc_detection", m, p, "autocast", s) for m in ("ssd300_vgg16", "faster_rcnn_vgg16")
      for p, s in (("fp32", "auto"), ("mixed", "8"))],
    *[("deepspeech2", m, p, "paper", "auto") for m in ("english", "mandarin")
      for p in ("fp32", "mixed", "fp16_storage")],
    *[("wmt_translation", m, p, i, s) for m in ("nmt_lstm3", "nmt_lstm5")
      for p, i, s in (("fp32", "autocast", "auto"), ("mixed", "autocast", "auto"), ("mixed", "paper", "auto"))],
    *[("lm_biglstm", "biglstm", p, "paper", s) for p, s in (("fp32", "auto"), ("mixed", "128"))],
    *[("dcgan", "dcgan", p, i, "auto") for p, i in (("fp32", "autocast"), ("mixed", "autocast"), ("mixed", "paper"))],
]


def case_id(case) -> str:
    exp, model, prec, impl, scale = case
    return "-".join([exp, model, prec] + ([impl] if exp in ("wmt_translation", "dcgan") else [])
                    + ([f"S{scale}"] if scale not in ("auto", "dynamic") else []))


# In the default suite (heavy, 29 s with their data): the mixed cells -- config, shapes and the loss-
# scaled FP16 recipe at once -- of the cheap models (1-9 s each, measured). The rest is slow: VGG-16
# 12 s, the detectors 20-57 s, DeepSpeech 2 55-120 s, the bigLSTM 60-70 s a cell.
HEAVY = {"ilsvrc_cnns-alexnet-mixed", "ilsvrc_cnns-googlenet-mixed", "ilsvrc_cnns-inception_v2-mixed",
         "ilsvrc_cnns-inception_v3-mixed", "ilsvrc_cnns-resnet50_preact-mixed",
         "wmt_translation-nmt_lstm3-mixed-paper", "dcgan-dcgan-mixed-autocast"}


def find_cell(case) -> G.Cell:
    exp, model, prec, impl, scale = case
    for c in paper_cells(exp):
        if (c.cfg.model, c.cfg.precision, c.cfg.impl, c.cfg.loss_scale) == (model, prec, impl, scale):
            return c
    raise AssertionError(f"no paper cell {case_id(case)} in {[str(p) for p in paper_grids()[exp]]}")


def cpu_overrides(cell: G.Cell, data_root, out_dir, backbone=None) -> list[str]:
    exp, cfg = cell.experiment, cell.cfg
    ov = [f"task.data_root={data_root}", f"out_dir={out_dir}", "device=cpu", "wandb.mode=disabled",
          "train.progress=false", "train.log_every=1", "train.num_workers=0",
          # Faster R-CNN's paper batch is 2 images (2 micro-batches of 1): kept; every other batch is cut to 2.
          f"train.batch_size={min(BATCH, cfg.train.batch_size)}", f"train.max_steps={STEPS}",
          "train.eval_max_batches=1"]
    if exp == "voc_detection":
        ov += ["task.eval_max_images=2", f"task.backbone={backbone}"]
    elif exp == "wmt_translation":
        ov += ["task.bleu_max_sentences=2"]
    elif exp == "dcgan":
        ov += ["task.eval_samples=2", "task.grid=4"]
    return ov




def changed_keys(a, b) -> set[str]:
    fa, fb = identity.flatten(C.to_dict(a)), identity.flatten(C.to_dict(b))
    return {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


def test_cases_cover_every_paper_model():
    """Every model of every experiment's paper grids has its fp32 and mixed case here (a new experiment
    or model must come with its cases), and every case is a cell of a paper grid."""
    have = {(e, m, p) for e, m, p, _, _ in CASES}
    grids = paper_grids()
    assert set(grids) >= {"ilsvrc_cnns", "voc_detection", "deepspeech2", "wmt_translation", "lm_biglstm", "dcgan"}
    for exp in grids:
        cells = paper_cells(exp)
        assert cells, f"{exp} has no paper grid"
        for model in {c.cfg.model for c in cells}:
            for prec in ("fp32", "mixed"):
                assert (exp, model, prec) in have, f"no case for {exp} {model} {prec}"
    assert HEAVY <= {case_id(c) for c in CASES}
    for case in CASES:
        find_cell(case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cpu_overrides_touch_only_what_cpu_forces(case, tmp_path):
    """The CPU run differs from the paper cell in CPU_FORCED keys only, at the paper's width."""
    cell = find_cell(case)
    cfg = C.resolve(cell.experiment, cell.overrides + cpu_overrides(cell, tmp_path / "data", tmp_path / "runs",
                                                                    tmp_path / "vgg16.pth"))
    assert cfg.profile == "paper" and cfg.width == 1.0
    assert changed_keys(cell.cfg, cfg) <= CPU_FORCED, changed_keys(cell.cfg, cfg) - CPU_FORCED


# ------------------------------------------------------------------------------------------------
# tiny data, from each data_prep tiny generator and the real prep


def _quiet(*_):
    pass


@pytest.fixture(scope="module")
def imagenet_data(tmp_path_factory):
    """The paper's 1000 classes (so the classifiers have their paper shape), one image of each."""
    from data_prep.imagenet import prepare as prep
    from data_prep.imagenet.tiny import generate

    arch = tmp_path_factory.mktemp("pp_imagenet_arch")
    generate(arch, classes=1000, train_per_class=1, val_per_class=1, size=16)
    out = tmp_path_factory.mktemp("pp_imagenet") / "imagenet"
    with pytest.MonkeyPatch.context() as mp:
        # A 1000-class devkit makes prep expect the official release (a 148 GB train tar of 1,281,167
        # images): this one has one image per class.
        mp.setattr(prep, "check_official_sizes", lambda archives, log: None)
        mp.setitem(prep.OFFICIAL_COUNTS, "train", 1000)
        mp.setitem(prep.OFFICIAL_COUNTS, "val", 1000)
        info = prep.prepare(arch, out, workers=2, log=_quiet)
    assert info["num_classes"] == 1000
    return out


@pytest.fixture(scope="module")
def voc_data(tmp_path_factory):
    """The tiny generator's scenes with its shapes named as the 20 VOC classes in turn (every class
    appears), so the detectors' heads have the paper's 21 outputs; VOC07 trainval, VOC07 test and VOC12
    trainval, as SSD's recipe reads."""
    from data_prep.voc import prepare as prep
    from data_prep.voc.prepare import VOC_CLASSES
    from data_prep.voc.tiny import render_shapes, write_release

    names = iter(range(10 ** 6))

    def render(rng, size, split):
        im, objs = render_shapes(rng, size, split)
        for o in objs:
            o["name"] = VOC_CLASSES[next(names) % len(VOC_CLASSES)]
        return im, objs

    arch = tmp_path_factory.mktemp("pp_voc_arch")
    counts = dict(zip(prep.ARCHIVES, (12, 4, 8)))  # VOC07 trainval, VOC07 test, VOC12 trainval
    write_release(arch, render, VOC_CLASSES, counts, 64, 0)
    out = tmp_path_factory.mktemp("pp_voc")
    info = prep.prepare(arch, out, log=_quiet)
    assert info["classes"] == list(VOC_CLASSES)
    return out


@pytest.fixture(scope="module")
def vgg16_weights(tmp_path_factory):
    """A stand-in for torchvision's vgg16-397923af.pth (the recipes' task.backbone): its keys and
    shapes, random values -- what the weights are does not matter for starting."""
    import torchvision

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in torchvision.models.vgg16().state_dict().items()}
    g = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("pp_vgg") / "vgg16-397923af.pth"
    torch.save({k: torch.randn(s, generator=g) * 0.01 for k, s in shapes.items()}, path)
    return path


def _need_espeak():
    from data_prep.speech import have_espeak

    if not have_espeak():
        pytest.skip("espeak-ng is not installed (setup.sh installs it as root); the tiny speech sets are spoken by it")


# The speech nets' GRUs (3 x 2624 / 3 x 3520 cells) cost a CPU a fraction of a second per frame at
# batch 2 (the backward accumulates weight gradients frame by frame), so the utterances are the
# shortest the tiny generators speak: one word (English, ~0.5-1 s) or one character (Mandarin, 1-1.7 s
# with espeak-ng's pauses). The nets accept any length; CTC needs only frames >= characters.
@pytest.fixture(scope="module")
def librispeech_data(tmp_path_factory):
    """All three training subsets of the English recipe and dev-clean, one-word utterances."""
    _need_espeak()
    import numpy as np

    from data_prep.librispeech import prepare as prep
    from data_prep.librispeech.tiny import DEV_VARIANTS, TRAIN_VARIANTS, WORDS, write_subset

    arch = tmp_path_factory.mktemp("pp_ls_arch")
    rng = np.random.default_rng(0)
    for k, (subset, n) in enumerate((("train-clean-100", 4), ("train-clean-360", 2), ("train-other-500", 2),
                                     ("dev-clean", 2))):
        voices = DEV_VARIANTS if subset == "dev-clean" else TRAIN_VARIANTS
        write_subset(arch / f"{subset}.tar.gz", subset, [str(w) for w in rng.choice(WORDS, n)], voices, rng,
                     1000 + 100 * k)
    out = tmp_path_factory.mktemp("pp_ls")
    prep.prepare(arch, out, log=_quiet)
    return out


@pytest.fixture(scope="module")
def aishell_data(tmp_path_factory):
    """The tiny AISHELL-1 release with one-character sentences."""
    _need_espeak()
    from data_prep.aishell import prepare as prep
    from data_prep.aishell import tiny

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "sentences", lambda rng, n: [[str(c)] for c in rng.choice(list(tiny.CHARS), n)])
        arch = tiny.generate(tmp_path_factory.mktemp("pp_ai_arch"), train=4, dev=2, test=1, per_speaker=4).parent
    out = tmp_path_factory.mktemp("pp_ai")
    prep.prepare(arch, out, log=_quiet)
    return out


LM_VOCAB = 16_384


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    """The tiny 1B Word release prepared with a 16,384-word vocabulary file (its own words, then filler
    words), as one prepares with Jozefowicz et al.'s 1b_word_vocab.txt. The vocabulary is CUT from the
    benchmark's 793,471 words: the embedding and softmax tables (2 x 812M parameters) with their
    gradients, Adagrad state and FP32 masters do not fit a CPU test. 16,384 leaves room for the paper's
    8192 sampled negatives. The LSTMs (2 x 8192 cells projected to 1024) and the 1024-d embeddings are
    full size."""
    from data_prep.lm1b import prepare as prep
    from data_prep.lm1b.tiny import generate

    archive = generate(tmp_path_factory.mktemp("pp_lm_arch"), train_per_shard=2, heldout_per_shard=2)
    plain = tmp_path_factory.mktemp("pp_lm_plain")
    prep.prepare(archive, plain, workers=1, log=_quiet)
    words = prep.load_vocab(plain / prep.VOCAB)
    words += [f"filler{i:05d}" for i in range(LM_VOCAB - len(words))]
    vocab = plain / "vocab_16k.txt"
    vocab.write_text("".join(w + "\n" for w in words))
    out = tmp_path_factory.mktemp("pp_lm")
    info = prep.prepare(archive, out, vocab=vocab, workers=1, log=_quiet)
    assert info["vocab_size"] == LM_VOCAB
    return out


@pytest.fixture(scope="module")
def wmt_data(tmp_path_factory):
    from data_prep.wmt15 import prepare as prep
    from data_prep.wmt15.tiny import generate

    arch = generate(tmp_path_factory.mktemp("pp_wmt_arch"), train=200, dev=8, test=8)
    out = tmp_path_factory.mktemp("pp_wmt")
    prep.prepare(arch, out, vocab=120, log=_quiet)
    return out


@pytest.fixture(scope="module")
def celeba_data(tmp_path_factory):
    from data_prep.celeba import prepare as prep
    from data_prep.celeba.tiny import generate

    arch = generate(tmp_path_factory.mktemp("pp_celeba_arch"), train=8, valid=4, test=1)
    out = tmp_path_factory.mktemp("pp_celeba")
    prep.prepare(arch, out, log=_quiet)
    return out


DATA = {("ilsvrc_cnns", None): "imagenet_data", ("voc_detection", None): "voc_data",
        ("deepspeech2", "english"): "librispeech_data", ("deepspeech2", "mandarin"): "aishell_data",
        ("lm_biglstm", None): "lm_data", ("wmt_translation", None): "wmt_data", ("dcgan", None): "celeba_data"}


# ------------------------------------------------------------------------------------------------
# the runs


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c), marks=pytest.mark.heavy if case_id(c) in HEAVY
                                               else pytest.mark.slow) for c in CASES])
def test_paper_profile_starts(case, request, tmp_path):
    cell = find_cell(case)
    exp = cell.experiment
    root = request.getfixturevalue(DATA.get((exp, cell.cfg.model)) or DATA[(exp, None)])
    backbone = request.getfixturevalue("vgg16_weights") if exp == "voc_detection" else None
    args = cell.overrides + cpu_overrides(cell, root, tmp_path / "runs", backbone)
    cfg = C.resolve(exp, args)
    assert changed_keys(cell.cfg, cfg) <= CPU_FORCED
    t0 = time.time()
    try:
        s = cli.main(exp, args)
        print(f"\n{case_id(case)}: {time.time() - t0:.1f} s")
        assert s["status"] == "completed", s.get("error")
        assert s["step"] == STEPS and s["primary_metric"] in s["metrics"], s
        lines = [json.loads(x) for x in (identity.run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
        losses = [x["loss"] for x in lines if x["kind"] == "train"]
        assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), losses
    finally:
        # The checkpoints of the paper-size models are 0.2-1.7 GB each; pytest keeps three sessions' tmp.
        shutil.rmtree(tmp_path / "runs", ignore_errors=True)
