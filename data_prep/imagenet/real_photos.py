"""Real natural photographs in the official ILSVRC2012 archive format: one class per photographed scene.

    python -m data_prep.imagenet.real_photos --out DIR [--photos DIR --size 96 --train-per-class 100
                                                        --val-per-class 30 --seed 0]

The source is the 12 nature photographs of Debian's `mate-backgrounds` package (1.26.0-1 in Debian 12,
GPL-2+, in /usr/share/backgrounds/mate/nature; `apt-get install mate-backgrounds`, no other download):
a water drop (Aqua), a back-lit leaf (Blinds), dune grass by the sea (Dune), an orange gerbera
(FreshFlower), a red flower in a garden (Garden), a meadow of grass blades (GreenMeadow), a ladybird on
a stem among forget-me-nots (LadyBird), leaves with rain drops (RainDrops), a storm over a road (Storm),
dandelion seeds before orange flowers (TwoWings), a wooden board (Wood) and a yellow flower
(YellowFlower). Class k is photograph k in that order (WNID n0000000<k+1>). Four are green plants and
three orange-red flowers, so colour alone does not separate them.

Each photograph is scaled to a height of 480 px and cut into two disjoint regions: a vertical strip of
30% of the width (its place -- left, middle or right -- drawn per class from --seed) that only
validation images come from, and the rest, which only training images come from. An image is a
square crop lying wholly inside its region, of side 20-40% of the photograph's height (capped by the
region's width), flipped left-right with probability 1/2, its brightness and contrast scaled by
0.9-1.1, resized (bicubic) to size x size and JPEG-encoded; train and val images follow the same law.
So no validation pixel was ever seen in training: a model must recognise a scene from another part of
it, at another zoom. Train images are drawn class by class, then validation images, from one
generator seeded with --seed; the validation images are shuffled into one flat list as in the real
val tar. Written by the tiny generator's archive writer (data_prep.imagenet.tiny.write_archives), so

    python -m data_prep.imagenet --archives DIR --out DIR2

prepares it exactly as the real ImageNet. The output is byte-for-byte deterministic given the
arguments and the package's photographs. Chance is 1/12 (8.3%).

--imagenet-sizes writes images the size of ImageNet's instead (for the data-loading benchmark,
experiments/speed_memory/loader.py, where decoding and resizing cost what they cost on ILSVRC12):
non-square crops of the photographs at their own resolution, 4:3 (landscape three times in four,
else portrait 3:4), their long side drawn log-uniformly between 330 and 1000 px (Flickr's 500x375 and
500x333 and the larger images in the set's tail; a mean of ~300K pixels, somewhat above ILSVRC12's
~110K-200K, so the loader figure errs low), of height 35-75% of the photograph's (capped by the
region's width), flipped and jittered as above, JPEG quality 90. --size is not used then; the same
regions, so validation pixels are still never seen in training.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from mpt.errors import UserError

from ..command import generator_command
from .tiny import jpeg, wnid, write_archives

SOURCE = "data_prep.imagenet.real_photos"
PHOTOS = Path("/usr/share/backgrounds/mate/nature")  # where Debian's mate-backgrounds installs them
NAMES = ("Aqua", "Blinds", "Dune", "FreshFlower", "Garden", "GreenMeadow", "LadyBird", "RainDrops",
         "Storm", "TwoWings", "Wood", "YellowFlower")
HEIGHT = 480          # working height of every photograph (the smallest source is 1024 px high)
VAL_WIDTH = 0.3       # the held-out strip, as a fraction of the photograph's width
VAL_PLACES = (0.0, 0.35, 0.7)  # left edge of the strip: left, middle or right
SIDE = (0.2, 0.4)     # crop side as a fraction of the height
JITTER = (0.9, 1.1)   # brightness and contrast factors
# --imagenet-sizes: the long side of an image in pixels (log-uniform), and the height of its crop of the
# photograph (at the photograph's own resolution) as a fraction of the photograph's height
LONG_SIDE = (330, 1000)
SOURCE_HEIGHT = (0.35, 0.75)


def missing(photos: Path = PHOTOS) -> list[str]:
    """The source photographs not found under `photos` (empty when all 12 are there)."""
    return [f"{n}.jpg" for n in NAMES if not (Path(photos) / f"{n}.jpg").is_file()]


def load(photos: Path = PHOTOS, height: int | None = HEIGHT) -> list[np.ndarray]:
    """The 12 photographs as uint8 (height, w, 3) RGB arrays, in class order; height None: each at its
    own resolution (1024-1920 px high)."""
    gone = missing(photos)
    if gone:
        raise UserError(f"real_photos needs the 12 nature photographs of Debian's mate-backgrounds in {photos} "
                        f"({len(gone)} missing, e.g. {gone[0]}): apt-get install mate-backgrounds, or --photos DIR")
    out = []
    for n in NAMES:
        with Image.open(Path(photos) / f"{n}.jpg") as im:
            if height is None:
                out.append(np.asarray(im.convert("RGB")))
                continue
            w, h = im.size
            size = (round(w * height / h), height)
            im.draft("RGB", size)  # JPEG decodes at 1/2-1/8 scale when that is still >= size: faster
            out.append(np.asarray(im.convert("RGB").resize(size, Image.LANCZOS)))
    return out


def regions(width: int, place: float) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """(val column range, train column ranges) of a photograph `width` px wide whose val strip starts at
    `place` x width. The ranges are half-open and disjoint."""
    a = round(place * width)
    b = min(width, a + round(VAL_WIDTH * width))
    train = [(lo, hi) for lo, hi in ((0, a), (b, width)) if hi > lo]
    return (a, b), train


def held_out_splits(images: list[np.ndarray], rng: np.random.Generator):
    """Per photograph, (val column range, train column ranges): the held-out strip placed left, middle or
    right by one draw from `rng` per photograph (regions)."""
    places = [VAL_PLACES[int(i)] for i in rng.integers(0, len(VAL_PLACES), len(images))]
    return [regions(p.shape[1], place) for p, place in zip(images, places)], places


def crop(photo: np.ndarray, cols: list[tuple[int, int]], size: int, rng: np.random.Generator) -> np.ndarray:
    """One sample: a square crop wholly inside one of the column ranges `cols` (chosen in proportion to
    the places a crop can take there), flipped, jittered, resized to size x size uint8."""
    h = photo.shape[0]
    widest = max(hi - lo for lo, hi in cols)
    side = int(min(rng.uniform(*SIDE) * h, widest))
    fits = [(lo, hi) for lo, hi in cols if hi - lo >= side]
    places = np.array([hi - lo - side + 1 for lo, hi in fits], dtype=np.float64)
    lo, hi = fits[int(rng.choice(len(fits), p=places / places.sum()))]
    x = lo + int(rng.integers(0, hi - lo - side + 1))
    y = int(rng.integers(0, h - side + 1))
    img = Image.fromarray(photo[y:y + side, x:x + side]).resize((size, size), Image.BICUBIC)
    return flip_and_jitter(np.asarray(img, dtype=np.float32), rng)


def crop_imagenet_size(photo: np.ndarray, cols: list[tuple[int, int]], rng: np.random.Generator) -> np.ndarray:
    """One sample the size of an ImageNet image (--imagenet-sizes): a 4:3 or 3:4 crop wholly inside one
    of the column ranges `cols` (chosen in proportion to the places it can take there), resized to a
    long side drawn from LONG_SIDE, flipped, jittered; uint8 (h, w, 3)."""
    long_side = round(float(np.exp(rng.uniform(*np.log(LONG_SIDE)))))
    aspect = 4 / 3 if rng.random() < 0.75 else 3 / 4  # width / height
    h = photo.shape[0]
    widest = max(hi - lo for lo, hi in cols)
    ch = rng.uniform(*SOURCE_HEIGHT) * h
    cw = min(ch * aspect, widest)
    ch, cw = int(cw / aspect), int(cw)
    fits = [(lo, hi) for lo, hi in cols if hi - lo >= cw]
    places = np.array([hi - lo - cw + 1 for lo, hi in fits], dtype=np.float64)
    lo, hi = fits[int(rng.choice(len(fits), p=places / places.sum()))]
    x = lo + int(rng.integers(0, hi - lo - cw + 1))
    y = int(rng.integers(0, h - ch + 1))
    size = (long_side, round(long_side / aspect)) if aspect > 1 else (round(long_side * aspect), long_side)
    img = Image.fromarray(photo[y:y + ch, x:x + cw]).resize(size, Image.BICUBIC)
    return flip_and_jitter(np.asarray(img, dtype=np.float32), rng)


def flip_and_jitter(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A float32 (h, w, 3) image flipped left-right with probability 1/2, its brightness and contrast
    scaled by JITTER; uint8."""
    if rng.random() < 0.5:
        a = a[:, ::-1]
    brightness, contrast = rng.uniform(*JITTER, size=2)
    mean = a.mean()
    a = (a - mean) * contrast + mean * brightness
    return (np.clip(a, 0, 255) + 0.5).astype(np.uint8)


def generate(out: Path, photos: str = str(PHOTOS), size: int = 96, train_per_class: int = 100,
             val_per_class: int = 30, imagenet_sizes: bool = False, seed: int = 0) -> dict[str, Path]:
    """Write the three archives into out; return {archive name: path}."""
    if size < 8 or train_per_class < 1 or val_per_class < 1:
        raise UserError("real_photos needs --size >= 8, --train-per-class >= 1 and --val-per-class >= 1")
    images = load(Path(photos), height=None if imagenet_sizes else HEIGHT)
    if imagenet_sizes:
        crop_ = lambda photo, cols, _, g: crop_imagenet_size(photo, cols, g)  # noqa: E731
    else:
        crop_ = crop
    rng = np.random.default_rng(seed)
    classes = len(NAMES)
    split, places = held_out_splits(images, rng)
    wnids = [wnid(k) for k in range(classes)]
    ids = [int(i) + 1 for i in rng.permutation(classes)]  # ILSVRC2012_ID of class k, as in the real devkit
    words = [f"photograph {n} (mate-backgrounds), val strip at {p:.0%} of the width" for n, p in zip(NAMES, places)]
    train = [[jpeg(crop_(images[k], split[k][1], size, rng)) for _ in range(train_per_class)] for k in range(classes)]
    val = {k: [jpeg(crop_(images[k], [split[k][0]], size, rng)) for _ in range(val_per_class)] for k in range(classes)}
    labels = np.repeat(np.arange(classes), val_per_class)
    val_labels = labels[rng.permutation(len(labels))]
    taken = {k: iter(v) for k, v in val.items()}
    return write_archives(out, wnids, ids, words, train, [train_per_class] * classes, val_labels,
                          (next(taken[int(k)]) for k in val_labels), source=SOURCE)


main = generator_command(
    "imagenet.real_photos", __doc__.split("\n\n")[0], generate, out_help="folder for the three archives",
    options=[("--photos", str(PHOTOS), "folder of the 12 mate-backgrounds nature photographs"),
             ("--size", 96, "image side in pixels"), ("--train-per-class", 100), ("--val-per-class", 30),
             ("--imagenet-sizes", False, "ImageNet-sized 4:3 images, 330-1000 px on the long side, instead of "
                                         "--size squares")],
    seed_help="seed of the val strips, the crops and the val order",
    done=lambda a, _, s: (f"wrote 12 real photographs as an ILSVRC2012 ({12 * a.train_per_class} train, "
                          f"{12 * a.val_per_class} val images of "
                          f"{'330-1000 px on the long side' if a.imagenet_sizes else f'{a.size}x{a.size}'}) to {a.out} "
                          f"in {s:.1f} s; next: python -m data_prep.imagenet --archives {a.out} --out DIR"))


if __name__ == "__main__":
    main()
