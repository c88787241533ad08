"""A small real-image VOC release, made offline: real handwritten digits pasted onto real photographs.

    python -m data_prep.voc.real_digits --out DIR [--size 128 --trainval 240 --test 120 --seed 0]

Backgrounds are random crops (15-60% of the side, resized) of the two photographs that ship inside
scikit-learn (sklearn.datasets.load_sample_images: china.jpg, a temple, and flower.jpg; no download):
real textures, edges and colours that a detector must learn to ignore. Objects are real handwritten
digits of three classes, 0, 4 and 7 (sklearn.datasets.load_digits, the UCI set: 8x8 scans of 43
writers), upscaled bicubically and alpha-blended as dark or light strokes (whichever contrasts with
the crop), 1-3 per image; the box is the stroke's tight extent. Trainval and test draw disjoint digit
samples (the first 70% of each class for trainval). As in VOC: truncated at the border, difficult when
under 15 px. Written by the tiny generator's archive writer, so `python -m data_prep.voc` prepares it
exactly as the official archives. Deterministic given the arguments.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from mpt.errors import UserError

from ..command import generator_command
from .prepare import ARCHIVES
from .tiny import finish_object, place, write_release

DIGITS = (0, 4, 7)
CLASSES = tuple(f"digit{d}" for d in DIGITS)


class DigitScenes:
    def __init__(self):
        from sklearn.datasets import load_digits, load_sample_images

        self.photos = [np.asarray(im) for im in load_sample_images().images]
        d = load_digits()
        self.pool = {}
        for k in DIGITS:
            imgs = d.images[d.target == k] / 16.0
            cut = int(0.7 * len(imgs))
            self.pool[("trainval", k)], self.pool[("test", k)] = imgs[:cut], imgs[cut:]

    def __call__(self, rng: np.random.Generator, size: int, split: str):
        photo = self.photos[int(rng.integers(len(self.photos)))]
        h, w = photo.shape[:2]
        side = int(rng.uniform(0.15, 0.6) * min(h, w))
        y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        img = np.asarray(Image.fromarray(photo[y:y + side, x:x + side]).resize((size, size), Image.BILINEAR),
                         dtype=np.float64)
        objs, taken = [], []
        for _ in range(int(rng.integers(1, 4))):
            k = DIGITS[int(rng.integers(len(DIGITS)))]
            pool = self.pool[("test" if split == "test" else "trainval", k)]
            glyph = pool[int(rng.integers(len(pool)))]
            small = rng.random() < 0.1
            s = int(rng.integers(12, 17)) if small else int(rng.integers(size // 5, size // 2))
            box = place(rng, size, s, s, taken, border=0.1)
            if box is None:
                continue
            alpha = np.asarray(Image.fromarray((glyph * 255).astype(np.uint8)).resize((s, s), Image.BICUBIC),
                               dtype=np.float64) / 255.0
            x0, y0 = box[0], box[1]
            sx0, sy0 = max(0, -x0), max(0, -y0)  # the part of the glyph inside the image
            sx1, sy1 = min(s, size - x0), min(s, size - y0)
            a = alpha[sy0:sy1, sx0:sx1, None]
            region = img[y0 + sy0:y0 + sy1, x0 + sx0:x0 + sx1]
            ink = 0.0 if region.mean() > 110 else 255.0  # dark strokes on light crops, light on dark
            img[y0 + sy0:y0 + sy1, x0 + sx0:x0 + sx1] = region * (1 - a) + ink * a
            ys, xs = np.nonzero(alpha > 0.25)  # the stroke's tight box, in image pixels
            tight = (x0 + int(xs.min()), y0 + int(ys.min()), x0 + int(xs.max()) + 1, y0 + int(ys.max()) + 1)
            visible = (max(0, tight[0]), max(0, tight[1]), min(size, tight[2]), min(size, tight[3]))
            if visible[2] - visible[0] < 3 or visible[3] - visible[1] < 3:
                continue
            taken.append(tight)
            tw, th = tight[2] - tight[0], tight[3] - tight[1]
            objs.append(finish_object(f"digit{k}", tight, size, small or max(tw, th) < 15))
        return Image.fromarray(img.clip(0, 255).astype(np.uint8)), objs


def generate(out: Path, size: int = 128, trainval: int = 240, test: int = 120, seed: int = 0) -> dict[str, Path]:
    if size < 32 or min(trainval, test) < 2:
        raise UserError("--size must be >= 32, --trainval and --test >= 2")
    names = list(ARCHIVES)
    return write_release(Path(out), DigitScenes(), CLASSES, {names[0]: trainval, names[1]: test}, size, seed)


main = generator_command(
    "voc.real_digits", "Write a VOC release of real digits on real photographs (official tar format).", generate,
    options=[("--size", 128), ("--trainval", 240), ("--test", 120)])


if __name__ == "__main__":
    main()
