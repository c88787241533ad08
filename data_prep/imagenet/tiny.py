"""A tiny synthetic ILSVRC2012 in the official archive format, for tests and CPU demos.

    python -m data_prep.imagenet.tiny --out DIR [--classes 10 --train-per-class 64
                                                --val-per-class 16 --size 96 --seed 0]

writes DIR/ILSVRC2012_img_train.tar (one nested nXXXXXXXX.tar per class), DIR/ILSVRC2012_img_val.tar
(flat, shuffled ILSVRC2012_val_NNNNNNNN.JPEG) and DIR/ILSVRC2012_devkit_t12.tar.gz (a MATLAB
data/meta.mat with the real `synsets` struct fields, and the val ground truth), so the real
`python -m data_prep.imagenet` path is what the tests and the tiny profile exercise.

The images are learnable by a small CNN within a few dozen SGD steps, and stay so under the
ILSVRC training augmentation (random crop, horizontal flip): each class has its own colour pair
(hue), stripe orientation (horizontal or vertical, both unchanged by a horizontal flip) and stripe
frequency (unchanged by cropping); each image has its own stripe phase, colour jitter, a random
distractor disc and pixel noise, so a model must learn the class cues rather than memorise pixels.
Class WNIDs are synthetic (n00000001, ...); their ILSVRC2012_IDs are a random permutation, as in the
real devkit where the ID order is not the WNID order, so the WNID <-> ID mapping is exercised.
The output is byte-for-byte deterministic given the arguments.
"""
from __future__ import annotations

import colorsys
import gzip
import io
import tarfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from PIL import Image

from mpt.errors import UserError
from mpt.rundir import atomic_write

from ..command import generator_command
from .prepare import DEVKIT, TRAIN_TAR, VAL_TAR

MTIME = 1_325_376_000  # 2012-01-01: a fixed time in every archive header makes the output reproducible
DEVKIT_DIR = "ILSVRC2012_devkit_t12"
SYNSET_FIELDS = ("ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children",
                 "wordnet_height", "num_train_images")  # the fields of the real meta.mat, in order
_GOLDEN = 0.6180339887  # hue step: neighbouring class indices get far-apart hues
_FREQS = (3.0, 5.5, 9.0)  # stripe periods per 96 px


def wnid(k: int) -> str:
    return f"n{k + 1:08d}"


def class_style(k: int) -> dict:
    """The class cues of class k (0-based): colours, orientation, frequency."""
    hue = (k * _GOLDEN) % 1.0
    sat = 0.55 + 0.35 * ((k // 7) % 2)  # a second colour axis once hues start to repeat
    return {
        "background": np.array(colorsys.hsv_to_rgb(hue, sat, 0.85)),
        "stripe": np.array(colorsys.hsv_to_rgb((hue + 0.15) % 1.0, sat, 0.35)),
        "vertical": k % 2 == 1,
        "cycles": _FREQS[(k // 2) % len(_FREQS)],
        "hue": hue,
    }


def describe(k: int) -> str:
    s = class_style(k)
    return (f"synthetic class {k}: hue {s['hue'] * 360:.0f} deg, "
            f"{'vertical' if s['vertical'] else 'horizontal'} stripes, {s['cycles']} cycles")


def render(k: int, n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """n images of class k as uint8 (n, size, size, 3)."""
    s = class_style(k)
    coord = np.arange(size, dtype=np.float32) / size
    phase = rng.uniform(0, 2 * np.pi, (n, 1, 1))
    along = coord[None, None, :] if s["vertical"] else coord[None, :, None]
    wave = 0.5 + 0.5 * np.sin(2 * np.pi * s["cycles"] * along + phase)  # (n, size|1, 1|size)
    wave = np.broadcast_to(wave, (n, size, size))[..., None]
    jitter = rng.normal(0, 0.03, (n, 1, 1, 3))  # per-image colour shift
    img = s["background"] * (1 - wave) + s["stripe"] * wave + jitter
    # A distractor: a disc of random colour and place, covering a few percent of the image.
    yy, xx = np.meshgrid(coord, coord, indexing="ij")
    centre = rng.uniform(0.15, 0.85, (n, 2, 1, 1))
    radius = rng.uniform(0.08, 0.16, (n, 1, 1))
    disc = ((yy - centre[:, 0]) ** 2 + (xx - centre[:, 1]) ** 2 < radius ** 2)[..., None]
    img = np.where(disc, rng.uniform(0, 1, (n, 1, 1, 3)), img)
    img = img + rng.normal(0, 0.05, img.shape)
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


def jpeg(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def class_jpegs(k: int, n: int, size: int, rng: np.random.Generator) -> list[bytes]:
    """n JPEG-encoded images of class k, rendered in chunks to bound memory for large settings."""
    out = []
    for start in range(0, n, 256):
        out += [jpeg(p) for p in render(k, min(256, n - start), size, rng)]
    return out


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), MTIME, 0o644
    tar.addfile(info, io.BytesIO(data))


def _tar_bytes(files: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in files:
            _add(tar, name, data)
    return buf.getvalue()


def meta_mat(wnids: list[str], ids: list[int], words: list[str], train_counts: list[int],
             source: str = "data_prep.imagenet.tiny") -> bytes:
    """meta.mat as MATLAB writes it: a struct array `synsets` (leaves first, then one internal
    node standing in for the WordNet hierarchy above the real 1000 leaves)."""
    import scipy.io

    n = len(wnids)
    rows = [(np.uint16(i), w, t, f"{t} (generated by {source})", np.uint16(0),
             np.zeros((1, 0)), np.uint16(0), np.uint16(c))
            for i, w, t, c in zip(ids, wnids, words, train_counts)]
    rows.append((np.uint16(n + 1), "n99999999", f"{source.rsplit('.', 1)[-1]} root",
                 "the parent of every class, not a class",
                 np.uint16(n), np.array(sorted(ids), dtype=np.uint16)[None, :], np.uint16(1), np.uint16(0)))
    synsets = np.empty((len(rows), 1), dtype=[(f, object) for f in SYNSET_FIELDS])
    for r, row in enumerate(rows):
        synsets[r, 0] = row
    buf = io.BytesIO()
    scipy.io.savemat(buf, {"synsets": synsets})
    raw = bytearray(buf.getvalue())
    # The 116-byte text header carries the creation time; a fixed one keeps the output reproducible.
    raw[:116] = f"MATLAB 5.0 MAT-file, written by {source}".encode().ljust(116, b" ")
    return bytes(raw)


def write_archives(out: Path, wnids: list[str], ids: list[int], words: list[str],
                   train_images: Iterable[list[bytes]], train_counts: list[int],
                   val_labels: Sequence[int], val_images: Iterable[bytes],
                   source: str = "data_prep.imagenet.tiny") -> dict[str, Path]:
    """Write an ILSVRC2012-format dataset into out; return {archive name: path}.

    Class k has WNID wnids[k], ILSVRC2012_ID ids[k] and description words[k]. train_images yields,
    class by class in that order, the JPEG bytes of its train images (train_counts[k] of them; a
    generator keeps memory bounded); val_images yields the JPEG bytes of the validation images in
    their final (shuffled) order, val_labels[i] being the class index of the i-th. The train tar
    holds one nested nXXXXXXXX.tar per class, the val tar flat ILSVRC2012_val_NNNNNNNN.JPEG, the
    devkit a MATLAB data/meta.mat and the val ground truth, as the real release. Every header time
    is fixed, so the output is byte-for-byte a function of the inputs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    def write_train(f):
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as outer:
            for k, images in enumerate(train_images):
                inner = _tar_bytes([(f"{wnids[k]}_{i + 1}.JPEG", data) for i, data in enumerate(images)])
                _add(outer, f"{wnids[k]}.tar", inner)

    def write_val(f):
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i, data in enumerate(val_images):
                _add(tar, f"ILSVRC2012_val_{i + 1:08d}.JPEG", data)

    def write_devkit(f):
        ground_truth = "".join(f"{ids[int(k)]}\n" for k in val_labels).encode()
        files = [
            (f"{DEVKIT_DIR}/readme.txt", f"Stand-in for the ILSVRC2012 devkit ({source}); "
             "not ImageNet.\n".encode()),
            (f"{DEVKIT_DIR}/data/meta.mat", meta_mat(wnids, ids, words, train_counts, source)),
            (f"{DEVKIT_DIR}/data/ILSVRC2012_validation_ground_truth.txt", ground_truth),
        ]
        # mtime=0 in the gzip header, for reproducibility.
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
            gz.write(_tar_bytes(files))

    paths = {name: out / name for name in (TRAIN_TAR, VAL_TAR, DEVKIT)}
    atomic_write(paths[TRAIN_TAR], write_train)
    atomic_write(paths[VAL_TAR], write_val)
    atomic_write(paths[DEVKIT], write_devkit)
    return paths


def generate(out: Path, classes: int = 10, train_per_class: int = 64, val_per_class: int = 16,
             size: int = 96, seed: int = 0) -> dict[str, Path]:
    """Write the three archives into out; return {archive name: path}."""
    if classes < 2 or train_per_class < 1 or val_per_class < 1 or size < 8:
        raise UserError("tiny ImageNet needs --classes >= 2, --train-per-class >= 1, "
                        "--val-per-class >= 1 and --size >= 8")
    if classes > 9_999_998:
        raise UserError("--classes must be below 9,999,999 (synthetic WNIDs are n00000001..)")
    rng = np.random.default_rng(seed)
    wnids = [wnid(k) for k in range(classes)]
    ids = [int(i) + 1 for i in rng.permutation(classes)]  # ILSVRC2012_ID of class k
    words = [describe(k) for k in range(classes)]
    # Validation: every class's images, shuffled into one flat, numbered list, as in the real tar.
    labels = np.repeat(np.arange(classes), val_per_class)
    val_labels = labels[rng.permutation(len(labels))]
    per_class = {k: iter(class_jpegs(k, val_per_class, size, rng)) for k in range(classes)}
    # Train images are rendered lazily, class by class, while the train tar is written.
    train = (class_jpegs(k, train_per_class, size, rng) for k in range(classes))
    return write_archives(out, wnids, ids, words, train, [train_per_class] * classes, val_labels,
                          (next(per_class[int(k)]) for k in val_labels))


main = generator_command(
    "imagenet.tiny", __doc__.split("\n\n")[0], generate, out_help="folder for the three archives",
    options=[("--classes", 10), ("--train-per-class", 64), ("--val-per-class", 16),
             ("--size", 96, "image side in pixels")],
    done=lambda a, _, s: (f"wrote a tiny ILSVRC2012 ({a.classes} classes, {a.classes * a.train_per_class} train, "
                          f"{a.classes * a.val_per_class} val images of {a.size}x{a.size}) to {a.out} in {s:.1f} s; "
                          f"next: python -m data_prep.imagenet --archives {a.out} --out DIR"))


if __name__ == "__main__":
    main()
