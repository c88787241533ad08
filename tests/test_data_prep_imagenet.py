"""data_prep.imagenet: the tiny generator writes the official archive format, the prep turns it into
the ImageFolder layout with its checks, re-runs are safe, and damage gives one-line errors."""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from PIL import Image

from data_prep.imagenet import prepare as prep
from data_prep.imagenet.dataset import ImageNetFolder
from data_prep.imagenet.tiny import generate
from mpt.errors import UserError

REPO = Path(__file__).resolve().parents[1]
TINY = dict(classes=6, train_per_class=12, val_per_class=6, size=64, seed=3)


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("archives")
    generate(out, **TINY)
    return out


@pytest.fixture(scope="module")
def prepared(archives, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "imagenet"
    prep.prepare(archives, out, workers=2, log=quiet)
    return out


def copy_archives(archives: Path, to: Path) -> Path:
    to.mkdir()
    for name in prep.ARCHIVES:
        shutil.copy(archives / name, to / name)
    return to


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ the generator


def test_tiny_archives_have_the_official_format(archives):
    with tarfile.open(archives / prep.TRAIN_TAR) as outer:
        members = outer.getmembers()
        assert [m.name for m in members] == [f"n{k:08d}.tar" for k in range(1, 7)]
        with tarfile.open(fileobj=outer.extractfile(members[0])) as inner:
            names = inner.getnames()
    assert len(names) == 12 and all(n.startswith("n00000001_") and n.endswith(".JPEG") for n in names)
    with tarfile.open(archives / prep.VAL_TAR) as val:
        assert val.getnames() == [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(1, 37)]
        img = Image.open(val.extractfile(val.getmembers()[0]))
        assert img.format == "JPEG" and img.size == (64, 64)
    with tarfile.open(archives / prep.DEVKIT, "r:gz") as devkit:
        meta = devkit.extractfile("ILSVRC2012_devkit_t12/data/meta.mat").read()
        gt = devkit.extractfile("ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt").read()
    synsets = scipy.io.loadmat(io.BytesIO(meta), squeeze_me=True)["synsets"]
    assert {"ILSVRC2012_ID", "WNID", "words", "num_children"} <= set(synsets.dtype.names)
    assert len(synsets) == 7  # 6 leaves + 1 internal node, which must not become a class
    assert len(gt.split()) == 36


def test_tiny_generator_is_deterministic(archives, tmp_path):
    generate(tmp_path / "same", **TINY)
    generate(tmp_path / "other", **{**TINY, "seed": 4})
    for name in prep.ARCHIVES:
        assert digest(tmp_path / "same" / name) == digest(archives / name), name
    assert digest(tmp_path / "other" / prep.VAL_TAR) != digest(archives / prep.VAL_TAR)


# ------------------------------------------------------------------ preparation


def test_prepare_layout_counts_and_classes(archives, prepared):
    info = json.loads((prepared / prep.MARKER).read_text())
    assert (info["num_classes"], info["train_images"], info["val_images"]) == (6, 72, 36)
    assert info["standard"] is False
    assert info["archives"] == prep.archive_sizes(prep.find_archives(archives))
    assert not (prepared / prep.PARTIAL).exists()

    classes = json.loads((prepared / prep.CLASSES).read_text())
    wnids = [c["wnid"] for c in classes]
    assert wnids == sorted(wnids) == sorted(p.name for p in (prepared / "train").iterdir())
    assert sorted(c["ilsvrc_id"] for c in classes) == list(range(1, 7))
    assert [c["ilsvrc_id"] for c in classes] != list(range(1, 7))  # the mapping is really exercised

    # Every val image sits in the folder of its ground-truth class.
    _, gt = prep.read_devkit(archives / prep.DEVKIT)
    wnid_of = {c["ilsvrc_id"]: c["wnid"] for c in classes}
    val = sorted((prepared / "val").glob("*/*.JPEG"))
    assert len(val) == 36
    for path in val:
        index = int(path.stem.rsplit("_", 1)[1])
        assert path.parent.name == wnid_of[gt[index - 1]]
    for wnid in wnids:
        assert len(list((prepared / "train" / wnid).glob(f"{wnid}_*.JPEG"))) == 12

    train = ImageNetFolder(prepared, "train")
    assert train.num_classes == 6 and len(train) == 72 and train.classes == wnids
    x, y = ImageNetFolder(prepared, "val")[0]
    assert x.size == (64, 64) and 0 <= y < 6


def test_note_for_a_non_standard_dataset(archives, tmp_path):
    lines = []
    prep.prepare(archives, tmp_path / "out", workers=1, log=lines.append)
    assert any("non-standard (tiny)" in line for line in lines)


def test_rerun_skips_and_force_redoes(archives, tmp_path):
    out = tmp_path / "out"
    prep.prepare(archives, out, workers=1, log=quiet)
    before = snapshot(out)
    assert prep.prepare(archives, out, log=quiet)["skipped"] is True
    assert snapshot(out) == before  # nothing rewritten

    redone = prep.prepare(archives, out, force=True, workers=1, log=quiet)
    assert redone["skipped"] is False
    after = snapshot(out)
    images = [k for k in before if k.endswith(".JPEG")]
    assert sorted(k for k in after if k.endswith(".JPEG")) == images
    assert all(after[k][0] == before[k][0] and after[k][1] != before[k][1] for k in images)


def test_resume_after_a_crash(archives, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = prep._prepare_class
    calls = []

    def crash_on_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the process dies mid-way through the train classes
        return real(*args)

    monkeypatch.setattr(prep, "_prepare_class", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(archives, out, workers=1, log=quiet)
    monkeypatch.setattr(prep, "_prepare_class", real)
    assert not (out / prep.MARKER).exists()
    assert len(list((out / "train").iterdir())) == 2
    # A half-written class left in the temp area, as a kill during a copy would leave it.
    junk = out / prep.PARTIAL / "train" / "n00000006"
    junk.mkdir(parents=True, exist_ok=True)
    (junk / "n00000006_1.JPEG").write_bytes(b"half")
    with pytest.raises(UserError, match="no prepared ImageNet"):
        ImageNetFolder(out, "train")

    lines = []
    info = prep.prepare(archives, out, workers=1, log=lines.append)
    assert any("resuming" in line for line in lines)
    assert any("2 already done" in line for line in lines)
    assert (info["train_images"], info["val_images"]) == (72, 36)
    assert len(ImageNetFolder(out, "train")) == 72
    assert not (out / prep.PARTIAL).exists()


def test_refuses_to_overwrite_foreign_folders(archives, tmp_path):
    (tmp_path / "out" / "train" / "somebody_else").mkdir(parents=True)
    with pytest.raises(UserError, match="did not write"):
        prep.prepare(archives, tmp_path / "out", log=quiet)


# ------------------------------------------------------------------ errors


def test_missing_archive_cli_error(archives, tmp_path):
    src = copy_archives(archives, tmp_path / "src")
    (src / prep.TRAIN_TAR).unlink()
    r = subprocess.run([sys.executable, "-m", "data_prep.imagenet", "--archives", str(src),
                        "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert str(src / prep.TRAIN_TAR) in r.stderr and "image-net.org" in r.stderr
    assert "registration" in r.stderr


def test_truncated_train_tar(archives, tmp_path):
    src = copy_archives(archives, tmp_path / "src")
    path = src / prep.TRAIN_TAR
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2 + 100)  # mid-way through a class tar's data
    with pytest.raises(UserError, match=r"ILSVRC2012_img_train\.tar is truncated or corrupt.*re-download"):
        prep.prepare(src, tmp_path / "out", workers=1, log=quiet)
    assert not (tmp_path / "out" / prep.MARKER).exists()


def test_train_tar_cut_between_classes_is_a_count_error(archives, tmp_path):
    src = copy_archives(archives, tmp_path / "src")
    path = src / prep.TRAIN_TAR
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1].offset  # the header of the last class tar
    with open(path, "r+b") as f:
        f.truncate(last)
    with pytest.raises(UserError, match="has 5 class tars, expected 6"):
        prep.prepare(src, tmp_path / "out", workers=1, log=quiet)


def test_corrupt_devkit_and_val(archives, tmp_path):
    src = copy_archives(archives, tmp_path / "src")
    (src / prep.DEVKIT).write_bytes(b"not a gzip file")
    with pytest.raises(UserError, match="ILSVRC2012_devkit_t12.tar.gz is truncated or corrupt"):
        prep.prepare(src, tmp_path / "out", log=quiet)
    shutil.copy(archives / prep.DEVKIT, src / prep.DEVKIT)
    with open(src / prep.VAL_TAR, "r+b") as f:
        f.truncate(5000)
    with pytest.raises(UserError, match="ILSVRC2012_img_val.tar"):
        prep.prepare(src, tmp_path / "out", log=quiet)


def test_official_checks_for_a_1000_class_devkit(tmp_path, monkeypatch):
    src = tmp_path / "src"
    generate(src, classes=1000, train_per_class=1, val_per_class=1, size=8, seed=0)
    with pytest.raises(UserError, match="147,897,477,120: the download is incomplete"):
        prep.prepare(src, tmp_path / "out", log=quiet)
    monkeypatch.setattr(prep, "OFFICIAL_SIZES", {})  # get past the size check to the counts
    with pytest.raises(UserError, match="gave 1,000 train images, expected 1,281,167"):
        prep.prepare(src, tmp_path / "out", workers=2, log=quiet)


def test_corrupt_jpeg_names_the_file(prepared, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(prepared, out)
    victim = sorted((out / "val").glob("*/*.JPEG"))[0]
    victim.write_bytes(victim.read_bytes()[:200])  # a truncated JPEG
    ds = ImageNetFolder(out, "val")
    index = [p for p, _ in ds.samples].index(str(victim))
    with pytest.raises(UserError, match=rf"{victim}.*--force"):
        ds[index]


def test_unprepared_folder(tmp_path):
    with pytest.raises(UserError, match=rf"no prepared ImageNet at {tmp_path} \(missing prepared.json\); "
                                        r"run: python -m data_prep.imagenet --archives <dir> --out"):
        ImageNetFolder(tmp_path, "train")


# ------------------------------------------------------------------ learnability


def test_tiny_classes_are_learnable(prepared):
    """Nearest class mean on 8x8 pixels of centre crops beats chance (1/6) by a wide margin; the
    CNN check (random crop + flip, a few dozen SGD steps) lives with the experiment's tests."""

    def features(split):
        ds = ImageNetFolder(prepared, split)
        x = np.stack([np.asarray(Image.open(p).convert("RGB").crop((6, 6, 58, 58)).resize((8, 8)),
                                 dtype=np.float32).ravel() for p, _ in ds.samples])
        return x, np.array(ds.targets)

    xt, yt = features("train")
    xv, yv = features("val")
    means = np.stack([xt[yt == c].mean(0) for c in range(6)])
    pred = ((xv[:, None] - means[None]) ** 2).sum(-1).argmin(1)
    assert (pred == yv).mean() >= 0.8


def test_digits_prepare_like_imagenet_with_every_label_right(tmp_path):
    """data_prep.imagenet.digits -> the official archives -> the real prep: 1,437 / 360 images in 10
    class folders, and every image sits in its digit's folder (each prepared image, shrunk back to
    8x8, is nearest to a scikit-learn digit of that class)."""
    from sklearn.datasets import load_digits

    from data_prep.imagenet.digits import generate as digits

    digits(tmp_path / "arch", size=32)
    info = prep.prepare(tmp_path / "arch", tmp_path / "out", workers=2, log=quiet)
    assert (info["num_classes"], info["train_images"], info["val_images"]) == (10, 1437, 360)
    d = load_digits()
    ref = d.images.reshape(len(d.images), -1) * (255.0 / 16.0)
    for split in ("train", "val"):
        ds = ImageNetFolder(tmp_path / "out", split)
        assert [c["words"] for c in json.loads((tmp_path / "out" / prep.CLASSES).read_text())] == \
            [f"digit {k}" for k in range(10)]
        for path, label in ds.samples:
            small = np.asarray(Image.open(path).convert("L").resize((8, 8), Image.BOX), dtype=np.float64)
            nearest = int(np.argmin(((ref - small.reshape(1, -1)) ** 2).sum(axis=1)))
            assert d.target[nearest] == label, (path, label, d.target[nearest])


@pytest.mark.parametrize("name", ["/etc/x", "../x", "a/../../x", "a\\b", ""])
def test_unsafe_archive_names_are_refused(name):
    from data_prep.archives import safe_name, safe_relpath
    from mpt.errors import UserError
    with pytest.raises(UserError, match="unsafe member"):
        safe_relpath(name, "member", "x.tar")
    with pytest.raises(UserError, match="unsafe class"):
        safe_name(name, "class", "x.tar")
    assert safe_relpath("a/b.jpg", "member", "x.tar") == "a/b.jpg"


@pytest.mark.parametrize("where", ["val", "train"])
def test_prep_decodes_every_image_it_copies(archives, tmp_path, where):
    """A JPEG whose body is cut (its header and the tar's checks pass) was copied as is and failed
    only when training reached it; the prep decodes every image and names the damaged one."""
    from bad_input import retar, rewrite_tar

    src = copy_archives(archives, tmp_path / "src")
    victim = []

    def cut(name, data):
        if name.endswith(".JPEG") and not victim:
            victim.append(name.rsplit("/", 1)[-1])
            return name, data[: len(data) // 2]
        return name, data

    if where == "val":
        rewrite_tar(src / prep.VAL_TAR, cut)
    else:
        rewrite_tar(src / prep.TRAIN_TAR, lambda n, d: (n, retar(d, cut)) if n.endswith(".tar") and not victim
                    else (n, d))
    assert len(victim) == 1
    with pytest.raises(UserError, match=rf"{victim[0]} does not decode as an image .*re-download it from "
                                        r"https://image-net"):
        prep.prepare(src, tmp_path / "out", workers=1, log=quiet)
    assert not (tmp_path / "out" / prep.MARKER).exists()
