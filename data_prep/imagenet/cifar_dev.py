"""Real photographs from a train/<class>/*.jpg + test/<class>/*.jpg folder in the official ILSVRC2012 archive format.

    python -m data_prep.imagenet.cifar_dev --out DIR [--source ../shared/data/cifar10-dev.tar.gz
                                                      --train-per-class 500 --test-per-class 0 --seed 0
                                                      --val-from test]

The default source is the CIFAR-10 development subset (shared/data/cifar10-dev.tar.gz beside the
repository, shared/data/README.md: 32x32 colour JPEGs, train/<class>/0000..0999.jpg, the CIFAR-10 training
images 0-999 of each class, and test/<class>/0000..0199.jpg, its test images 0-199). --source is that
.tar.gz (read in place, never unpacked into the repository) or a folder of the same layout. Classes are
the train/ folder names in sorted order (class k: WNID n0000000<k+1>, its name in the devkit's words);
test/ must hold the same classes.

Train: the first --train-per-class images of each class in file-name order (500: 0000..0499 of the
development set, 5,000 images; 0: all). Validation: the first --test-per-class test images per class
(0: all, 2,000 there), shuffled into one flat, numbered list with --seed as in the real val tar; with
--val-from train, the train images after the first --train-per-class instead (0500..0999 there, 5,000
at 0): a validation split for choosing a recipe without looking at the test images. The
JPEG bytes go into the archives unchanged (no re-encoding) through the tiny generator's archive writer
(data_prep.imagenet.tiny.write_archives), so

    python -m data_prep.imagenet --archives DIR --out DIR2

prepares it exactly as the real ImageNet. The output is byte-for-byte a function of the source and the
arguments.
"""
from __future__ import annotations

import tarfile
from pathlib import Path, PurePosixPath

import numpy as np

from mpt import REPO
from mpt.errors import UserError

from ..command import generator_command
from .tiny import wnid, write_archives

SOURCE = "data_prep.imagenet.cifar_dev"
DEFAULT_SOURCE = REPO.parent / "shared" / "data" / "cifar10-dev.tar.gz"
SPLITS = ("train", "test")
IMAGE_ENDINGS = (".jpg", ".jpeg")


def read_source(source: Path) -> dict[str, dict[str, dict[str, bytes]]]:
    """{split: {class: {file name: JPEG bytes}}} of a .tar(.gz) or a folder laid out as
    <split>/<class>/<name>.jpg. Other files (a README, .DS_Store) are ignored; any other depth is an error."""
    source = Path(source)
    out: dict[str, dict[str, dict[str, bytes]]] = {s: {} for s in SPLITS}

    def add(rel: str, read) -> None:
        parts = PurePosixPath(rel).parts
        if not rel.lower().endswith(IMAGE_ENDINGS) or len(parts) < 1 or parts[0] not in SPLITS:
            return
        if len(parts) != 3:
            raise UserError(f"{source}: {rel} is not at <split>/<class>/<image>.jpg; the source must hold "
                            f"train/<class>/*.jpg and test/<class>/*.jpg")
        out[parts[0]].setdefault(parts[1], {})[parts[2]] = read()

    if source.is_dir():
        for path in sorted(source.rglob("*")):
            if path.is_file():
                add(path.relative_to(source).as_posix(), path.read_bytes)
    elif source.is_file():
        try:
            with tarfile.open(source) as tar:
                for m in tar:
                    if m.isfile():
                        add(m.name.removeprefix("./"), lambda m=m: tar.extractfile(m).read())
        except (tarfile.TarError, OSError, EOFError) as e:
            raise UserError(f"{source} is not a readable .tar(.gz) ({type(e).__name__}: {str(e).splitlines()[0]}); give the "
                            f"archive of shared/data/README.md or a folder of train/<class>/*.jpg") from None
    else:
        raise UserError(f"--source {source} does not exist; give shared/data/cifar10-dev.tar.gz (beside the "
                        f"repository) or a folder of train/<class>/*.jpg and test/<class>/*.jpg")
    for split in SPLITS:
        if not out[split]:
            raise UserError(f"{source} has no {split}/<class>/*.jpg images; it must hold train/ and test/ "
                            f"class folders of JPEGs")
    if sorted(out["train"]) != sorted(out["test"]):
        raise UserError(f"{source}: train/ and test/ hold different classes ({sorted(out['train'])} vs "
                        f"{sorted(out['test'])}); give both splits the same class folders")
    return out


def first(images: dict[str, bytes], n: int, what: str) -> list[bytes]:
    """The first n images in file-name order (all for n = 0); too few is an error naming the class."""
    names = sorted(images)
    if n > len(names):
        raise UserError(f"{what} has {len(names)} images, fewer than the {n} asked; lower the count "
                        f"(0 takes all)")
    return [images[k] for k in names[:n or None]]


def generate(out: Path, source: str = str(DEFAULT_SOURCE), train_per_class: int = 500,
             test_per_class: int = 0, val_from: str = "test", seed: int = 0) -> dict[str, Path]:
    """Write the three archives into out; return {archive name: path}."""
    if train_per_class < 0 or test_per_class < 0:
        raise UserError("cifar_dev needs --train-per-class >= 0 and --test-per-class >= 0 (0 takes all)")
    if val_from not in SPLITS:
        raise UserError(f"--val-from {val_from!r}: give test (the test images) or train (the train images "
                        f"after the first --train-per-class)")
    if val_from == "train" and train_per_class == 0:
        raise UserError("--val-from train takes the train images after the first --train-per-class: give "
                        "--train-per-class > 0 (0 leaves none)")
    data = read_source(Path(source))
    names = sorted(data["train"])
    classes = len(names)
    if classes < 2:
        raise UserError(f"{source} has {classes} class folder; a classification set needs at least 2")
    rng = np.random.default_rng(seed)
    wnids = [wnid(k) for k in range(classes)]
    ids = [int(i) + 1 for i in rng.permutation(classes)]  # ILSVRC2012_ID of class k, as in the real devkit
    words = [f"{n} ({Path(source).name})" for n in names]  # the class folder name and where it came from
    train = [first(data["train"][n], train_per_class, f"{source} train/{n}") for n in names]
    if val_from == "train":  # the train images left after the first train_per_class of each class
        rest = {n: dict(sorted(data["train"][n].items())[train_per_class:]) for n in names}
        for n in names:
            if not rest[n]:
                raise UserError(f"{source} train/{n} has no images after the first {train_per_class}; lower "
                                f"--train-per-class to leave some for --val-from train")
        val = [first(rest[n], test_per_class, f"{source} train/{n} after the first {train_per_class}") for n in names]
    else:
        val = [first(data["test"][n], test_per_class, f"{source} test/{n}") for n in names]
    labels = np.concatenate([np.full(len(v), k) for k, v in enumerate(val)])
    val_labels = labels[rng.permutation(len(labels))]
    taken = [iter(v) for v in val]
    return write_archives(out, wnids, ids, words, train, [len(t) for t in train], val_labels,
                          (next(taken[int(k)]) for k in val_labels), source=SOURCE)


main = generator_command(
    "imagenet.cifar_dev", __doc__.split("\n\n")[0], generate, out_help="folder for the three archives",
    options=[("--source", str(DEFAULT_SOURCE), "a .tar.gz or folder of train/<class>/*.jpg and test/<class>/*.jpg"),
             ("--train-per-class", 500, "the first N train images of each class (0: all)"),
             ("--test-per-class", 0, "the first N validation images of each class (0: all)"),
             ("--val-from", "test", "the validation images: test, or train (the train images after the first "
                                    "--train-per-class: a split for choosing a recipe)")],
    seed_help="seed of the val order and the ILSVRC2012_ID permutation",
    done=lambda a, r, s: (f"wrote {a.source} as an ILSVRC2012 to {a.out} in {s:.1f} s; "
                          f"next: python -m data_prep.imagenet --archives {a.out} --out DIR"))


if __name__ == "__main__":
    main()
