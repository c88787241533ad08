"""A tiny CelebA release for tests and CPU demos: the official file names and formats
(img_align_celeba.zip of 178x218 JPEGs under img_align_celeba/, list_eval_partition.txt,
list_attr_celeba.txt) holding procedurally drawn faces.

    python -m data_prep.celeba.tiny --out DIR [--train 2000 --valid 200 --test 200 --seed 0]

Each face varies in what a face GAN must learn: background colour and shading, skin tone, head size
and pose (shifted, turned: features move off-centre), hair colour and style (short, long, fringe),
eye colour and spacing, eyebrows, nose, mouth (smiling or not), glasses. Faces are centred where the
real aligned faces are (around (89, 121)), so the same 128x128 crop applies. Deterministic given the
arguments (fixed zip times, seeded drawing).
"""
from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from mpt.errors import UserError
from mpt.rundir import atomic_write_bytes, atomic_write_text

from ..command import generator_command
from .prepare import ATTR, FOLDER, PARTITION, ZIP

W, H = 178, 218
SKIN = [(255, 224, 196), (241, 194, 155), (224, 172, 125), (198, 134, 86), (141, 85, 36), (92, 56, 30)]
HAIR = [(20, 18, 16), (70, 45, 25), (140, 95, 50), (222, 190, 120), (160, 60, 30), (130, 130, 130)]
EYES = [(60, 40, 20), (40, 90, 160), (60, 120, 70), (30, 30, 30)]
ATTRS = ["Black_Hair", "Blond_Hair", "Brown_Hair", "Gray_Hair", "Eyeglasses", "Smiling", "Bangs", "Pale_Skin"]


def _mix(a, b, t):
    return tuple(int(round(x + (y - x) * t)) for x, y in zip(a, b))


def draw_face(rng: np.random.Generator) -> tuple[Image.Image, dict]:
    bg0 = tuple(int(v) for v in rng.integers(40, 230, 3))
    bg1 = _mix(bg0, tuple(int(v) for v in rng.integers(0, 255, 3)), 0.5)
    im = Image.new("RGB", (W, H))
    px = np.linspace(0, 1, H)[:, None, None]
    im = Image.fromarray((np.array(bg0) * (1 - px) + np.array(bg1) * px).repeat(W, 1).astype(np.uint8))
    d = ImageDraw.Draw(im)
    skin_i = int(rng.integers(len(SKIN)))
    skin, hair_i = SKIN[skin_i], int(rng.integers(len(HAIR)))
    hair = HAIR[hair_i]
    cx, cy = 89 + rng.normal(0, 5), 121 + rng.normal(0, 4)
    rx, ry = rng.uniform(34, 44), rng.uniform(44, 54)
    turn = rng.uniform(-0.35, 0.35)  # pose: features shift towards one side
    style = int(rng.integers(3))  # 0 short, 1 long, 2 fringe
    if style == 1:  # long hair behind the head
        d.rectangle([cx - rx - 8, cy - ry * 0.4, cx + rx + 8, cy + ry * 1.1], fill=hair)
    d.ellipse([cx - rx - 6, cy - ry - 10, cx + rx + 6, cy + ry * 0.3], fill=hair)  # the top of the hair
    d.rectangle([cx - rx * 0.35, cy + ry * 0.7, cx + rx * 0.35, H], fill=_mix(skin, (0, 0, 0), 0.15))  # neck
    d.ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=skin)
    if style == 2:
        d.chord([cx - rx, cy - ry - 4, cx + rx, cy - ry * 0.15], 180, 360, fill=hair)
    fx = cx + turn * rx * 0.6
    ey, sep = cy - ry * 0.15, rng.uniform(0.34, 0.44) * rx
    eye = EYES[int(rng.integers(len(EYES)))]
    brow = _mix(hair, (0, 0, 0), 0.3)
    for s in (-1, 1):
        ex = fx + s * sep
        d.ellipse([ex - 7, ey - 4, ex + 7, ey + 4], fill=(245, 245, 245))
        d.ellipse([ex - 3.5, ey - 3.5, ex + 3.5, ey + 3.5], fill=eye)
        d.line([ex - 8, ey - 10 + rng.normal(0, 1), ex + 8, ey - 11], fill=brow, width=3)
    glasses = bool(rng.random() < 0.2)
    if glasses:
        for s in (-1, 1):
            ex = fx + s * sep
            d.ellipse([ex - 11, ey - 9, ex + 11, ey + 9], outline=(20, 20, 20), width=2)
        d.line([fx - sep + 11, ey, fx + sep - 11, ey], fill=(20, 20, 20), width=2)
    nose = _mix(skin, (0, 0, 0), 0.3)
    d.line([fx, ey + 4, fx + 4 * np.sign(turn + 1e-9), cy + ry * 0.3], fill=nose, width=2)
    my, mw = cy + ry * 0.52, rng.uniform(0.28, 0.4) * rx
    smiling = bool(rng.random() < 0.5)
    lips = _mix(skin, (150, 30, 40), 0.6)
    if smiling:
        d.chord([fx - mw, my - 8, fx + mw, my + 8], 0, 180, fill=lips)
    else:
        d.line([fx - mw, my, fx + mw, my], fill=lips, width=4)
    im = im.filter(ImageFilter.GaussianBlur(0.8))
    attrs = {"Black_Hair": hair_i == 0, "Blond_Hair": hair_i == 3, "Brown_Hair": hair_i in (1, 2),
             "Gray_Hair": hair_i == 5, "Eyeglasses": glasses, "Smiling": smiling, "Bangs": style == 2,
             "Pale_Skin": skin_i == 0}
    return im, attrs


def generate(out: Path, train: int = 2000, valid: int = 200, test: int = 200, seed: int = 0) -> Path:
    if min(train, valid, test) < 1:
        raise UserError("--train, --valid and --test must each be at least 1")
    rng = np.random.default_rng(seed)
    return write_release(out, (draw_face(rng) for _ in range(train + valid + test)), ATTRS, train, valid)


def write_release(out: Path, images, attrs: list[str], train: int, valid: int) -> Path:
    """Write `images` -- (178x218 PIL image, {attribute: bool}) pairs, train then valid then test --
    as img_align_celeba.zip, list_eval_partition.txt and list_attr_celeba.txt in `out`. Fixed zip
    times, so the same images give the same bytes."""
    out = Path(out)
    buf, part, rows = io.BytesIO(), [], []
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(zipfile.ZipInfo(f"{FOLDER}/", (2015, 1, 1, 0, 0, 0)), b"")
        for i, (im, a) in enumerate(images):
            name = f"{i + 1:06d}.jpg"
            jb = io.BytesIO()
            im.save(jb, format="JPEG", quality=90)
            zf.writestr(zipfile.ZipInfo(f"{FOLDER}/{name}", (2015, 1, 1, 0, 0, 0)), jb.getvalue())
            part.append(f"{name} {0 if i < train else 1 if i < train + valid else 2}")
            rows.append(name + "  " + " ".join("1" if a[k] else "-1" for k in attrs))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / ZIP, buf.getvalue())
    atomic_write_text(out / PARTITION, "\n".join(part) + "\n")
    atomic_write_text(out / ATTR, "\n".join([str(len(rows)), " ".join(attrs)] + rows) + "\n")
    return out


main = generator_command(
    "celeba.tiny", "Write a tiny CelebA release (procedural faces) in the official format.", generate,
    options=[("--train", 2000), ("--valid", 200), ("--test", 200)],
    done=lambda a, _, s: (f"wrote {a.out / ZIP}, {PARTITION} and {ATTR}; "
                          f"next: python -m data_prep.celeba --archives {a.out} --out DIR"))


if __name__ == "__main__":
    main()
