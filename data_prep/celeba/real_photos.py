"""Real photographs in the official CelebA format, for checking the DCGAN recipe on real images.

    python -m data_prep.celeba.real_photos --out DIR [--photos DIR --train 2000 --valid 200 --test 200 --seed 0]

No real face ships offline (CelebA, LFW and Olivetti are all downloads), so this writes the nearest real
thing: crops of the 12 nature photographs of Debian's `mate-backgrounds` (the photographs and their
train/held-out split of data_prep.imagenet.real_photos: a vertical strip of 30% of each photograph's
width, placed per photograph from --seed, that only the valid and test images come from). Every image
is a square crop of one photograph (side 20-40% of its height, flipped, brightness/contrast jittered,
drawn by imagenet.real_photos.crop) resized to 128x128 and placed at the 128x128 face box of a 178x218
aligned image (data_prep.celeba.dataset.CROP_BOX), the rest of the frame filled with the same crop
stretched; photographs are drawn uniformly per image. list_attr_celeba.txt has one attribute per
photograph (which one the image comes from). So the GAN must learn the colours, textures and shapes of
real photographs, and its samples are compared (SWD) with crops of strips it never saw.

    python -m data_prep.celeba --archives DIR --out DIR2

prepares it exactly as the real CelebA. Byte-for-byte deterministic given the arguments and the photographs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from mpt.errors import UserError

from ..command import generator_command
from ..imagenet import real_photos
from .dataset import CROP_BOX
from .prepare import ATTR, PARTITION, ZIP
from .tiny import H, W, write_release


def generate(out: Path, photos: str = str(real_photos.PHOTOS), train: int = 2000, valid: int = 200,
             test: int = 200, seed: int = 0) -> Path:
    if min(train, valid, test) < 1:
        raise UserError("--train, --valid and --test must each be at least 1")
    images = real_photos.load(Path(photos))
    rng = np.random.default_rng(seed)
    split, _ = real_photos.held_out_splits(images, rng)
    side = CROP_BOX[2] - CROP_BOX[0]

    def draw(i: int):
        k = int(rng.integers(len(images)))
        cols = split[k][1] if i < train else [split[k][0]]  # train regions, or the held-out strip
        sq = Image.fromarray(real_photos.crop(images[k], cols, side, rng))
        frame = sq.resize((W, H), Image.BICUBIC)
        frame.paste(sq, CROP_BOX[:2])
        return frame, {n: j == k for j, n in enumerate(real_photos.NAMES)}

    return write_release(out, (draw(i) for i in range(train + valid + test)), list(real_photos.NAMES), train, valid)


main = generator_command(
    "celeba.real_photos", __doc__.split("\n\n")[0], generate,
    options=[("--photos", str(real_photos.PHOTOS), "folder of the 12 mate-backgrounds nature photographs"),
             ("--train", 2000), ("--valid", 200), ("--test", 200)],
    seed_help="seed of the held-out strips, the crops and the photograph of each image",
    done=lambda a, _, s: (f"wrote {a.out / ZIP}, {PARTITION} and {ATTR} (real photograph crops) in {s:.1f} s; "
                          f"next: python -m data_prep.celeba --archives {a.out} --out DIR"))


if __name__ == "__main__":
    main()
