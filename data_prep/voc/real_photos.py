"""A VOC release of real photographs at VOC's sizes, made offline: photo patches pasted onto photo crops.

    python -m data_prep.voc.real_photos --out DIR [--photos DIR --size 500 --trainval 240 --test 120
                                                   --quality 90 --seed 0]

The source is the 12 nature photographs of Debian's mate-backgrounds (data_prep.imagenet.real_photos:
`apt-get install mate-backgrounds`, no other download). Images have VOC's shapes and JPEG settings:
the longer side --size (500), the shorter 375 or 333, one in six portrait, JPEG quality 90, so decoding
and augmenting them costs what VOC's do (the input-pipeline benchmark in
experiments/voc_detection/README.md reads them). Each background is a crop of one of 9 photographs,
resized to the image; objects are 1-4 patches cut from the 3 others (the classes: a flower, a
ladybird, wood grain) at 10-50% of the shorter side, aspect 1:2 to 2:1, pasted opaque; the box is the
patch. Trainval patches come from the left 70% of each class photograph, test patches from the rest,
so no test pixel of an object was seen in training. As in VOC: truncated at the border, difficult
when under 15 px (one object in twenty is drawn that small). Written by the tiny generator's archive
writer, so `python -m data_prep.voc` prepares it exactly as the official archives. Deterministic
given the arguments and the package's photographs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from mpt.errors import UserError

from ..command import generator_command
from ..imagenet.real_photos import NAMES, PHOTOS, load
from .prepare import ARCHIVES
from .tiny import finish_object, place, write_release

OBJECTS = {"flower": "FreshFlower", "ladybird": "LadyBird", "wood": "Wood"}  # class -> photograph
CLASSES = tuple(OBJECTS)
SHAPES = ((1.0, 0.75), (1.0, 0.666), (0.75, 1.0))  # (width, height) / --size: VOC's 500x375, 500x333, 375x500
SHAPE_P = (0.6, 0.25, 0.15)
TRAIN_PART = 0.7  # trainval patches: the left 70% of a class photograph's width; test: the rest


class PhotoScenes:
    def __init__(self, photos: Path):
        images = dict(zip(NAMES, load(photos)))  # 480 px high, uint8 RGB
        self.objects = {c: images[n] for c, n in OBJECTS.items()}
        self.backgrounds = [im for n, im in images.items() if n not in OBJECTS.values()]

    def __call__(self, rng: np.random.Generator, size: int, split: str):
        fw, fh = SHAPES[int(rng.choice(len(SHAPES), p=SHAPE_P))]
        w, h = round(fw * size), round(fh * size)
        photo = self.backgrounds[int(rng.integers(len(self.backgrounds)))]
        ph, pw = photo.shape[:2]
        side = rng.uniform(0.5, 1.0)  # the crop's height as a fraction of the photograph's, same aspect as w x h
        ch = int(side * ph)
        cw = min(pw, round(ch * w / h))
        y, x = int(rng.integers(0, ph - ch + 1)), int(rng.integers(0, pw - cw + 1))
        img = np.array(Image.fromarray(photo[y:y + ch, x:x + cw]).resize((w, h), Image.BILINEAR))
        objs, taken = [], []
        for _ in range(int(rng.integers(1, 5))):
            name = CLASSES[int(rng.integers(len(CLASSES)))]
            small = rng.random() < 0.05
            s = int(rng.integers(10, 15)) if small else int(rng.uniform(0.1, 0.5) * min(w, h))
            aspect = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))  # width / height
            ow, oh = max(4, round(s * aspect ** 0.5)), max(4, round(s / aspect ** 0.5))
            box = place(rng, (w, h), ow, oh, taken, border=0.1)
            if box is None:
                continue
            src = self.objects[name]
            sh, sw = src.shape[:2]
            lo, hi = (0, int(TRAIN_PART * sw)) if split != "test" else (int(TRAIN_PART * sw), sw)
            k = rng.uniform(0.3, 1.0)  # the patch: a k x (ow, oh)-shaped cut of the class photograph's part
            cut_h = max(4, int(k * min(sh, (hi - lo) * oh / ow)))
            cut_w = min(hi - lo, max(4, round(cut_h * ow / oh)))
            py, px = int(rng.integers(0, sh - cut_h + 1)), lo + int(rng.integers(0, hi - lo - cut_w + 1))
            patch = np.asarray(Image.fromarray(src[py:py + cut_h, px:px + cut_w]).resize((ow, oh), Image.BILINEAR))
            x0, y0, x1, y1 = box
            vx0, vy0, vx1, vy1 = max(0, x0), max(0, y0), min(w, x1), min(h, y1)  # the part inside the image
            img[vy0:vy1, vx0:vx1] = patch[vy0 - y0:vy1 - y0, vx0 - x0:vx1 - x0]
            taken.append(box)
            objs.append(finish_object(name, box, (w, h), small))
        return Image.fromarray(img), objs


def generate(out: Path, photos: str = str(PHOTOS), size: int = 500, trainval: int = 240, test: int = 120,
             quality: int = 90, seed: int = 0) -> dict[str, Path]:
    if size < 64 or min(trainval, test) < 2 or not 1 <= quality <= 100:
        raise UserError("voc.real_photos needs --size >= 64, --trainval and --test >= 2, 1 <= --quality <= 100")
    names = list(ARCHIVES)
    return write_release(Path(out), PhotoScenes(Path(photos)), CLASSES, {names[0]: trainval, names[1]: test},
                         size, seed, quality=quality)


main = generator_command(
    "voc.real_photos", "Write a VOC release of real photographs at VOC's sizes (official tar format).", generate,
    options=[("--photos", str(PHOTOS), "folder of the 12 mate-backgrounds nature photographs"),
             ("--size", 500, "the longer image side in pixels"), ("--trainval", 240), ("--test", 120),
             ("--quality", 90, "JPEG quality")])


if __name__ == "__main__":
    main()
