"""A tiny PASCAL VOC release for tests and CPU runs: the official archive names and layout
(VOCtrainval_06-Nov-2007.tar, VOCtest_06-Nov-2007.tar, VOCtrainval_11-May-2012.tar, each holding
VOCdevkit/VOC<year>/{JPEGImages/<id>.jpg, Annotations/<id>.xml, ImageSets/Main/<split>.txt and
<class>_<split>.txt}) with procedurally drawn objects.

    python -m data_prep.voc.tiny --out DIR [--size 128 --trainval 240 --test 120 --trainval12 240 --seed 0]

Three classes that differ in shape and colour family (red-ish circles, green-ish squares, blue-ish
triangles; hue, size and aspect jittered) on smooth noisy backgrounds; 1-3 objects per image. As in
VOC, an object cut by the image border is `truncated`, and very small objects (under 15 px) are
`difficult` (the devkit ignores them in the AP). Deterministic given the arguments.
"""
from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw

from mpt.errors import UserError
from mpt.rundir import atomic_write_bytes

from ..command import generator_command
from .prepare import ARCHIVES

CLASSES = ("circle", "square", "triangle")
_HUE = {"circle": (200, 50, 40), "square": (40, 170, 60), "triangle": (50, 70, 210)}

# (image, objects) for one scene; an object is {name, bbox (x0, y0, x1, y1) in pixels, exclusive
# end, clipped to the image}, truncated, difficult}
Render = Callable[[np.random.Generator, int, str], tuple[Image.Image, list[dict]]]


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter + 1e-9)


def _wh(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else size


def place(rng: np.random.Generator, size: int | tuple[int, int], w: int, h: int, taken: list, border: float = 0.15):
    """A box (x0, y0, x1, y1) for a w x h object in an image of side `size` (or width x height) overlapping
    no taken box by IoU > 0.2; it may stick out of the image by up to `border` of its size (a truncated
    object). None if no place was found."""
    width, height = _wh(size)
    for _ in range(30):
        x0 = int(rng.integers(-int(border * w), width - w + int(border * w) + 1))
        y0 = int(rng.integers(-int(border * h), height - h + int(border * h) + 1))
        box = (x0, y0, x0 + w, y0 + h)
        if all(_iou(box, t) < 0.2 for t in taken):
            return box
    return None


def finish_object(name: str, box, size: int | tuple[int, int], difficult: bool) -> dict:
    x0, y0, x1, y1 = box
    width, height = _wh(size)
    clipped = (max(0, x0), max(0, y0), min(width, x1), min(height, y1))
    return {"name": name, "bbox": clipped, "truncated": int(clipped != tuple(box)), "difficult": int(difficult)}


def background(rng: np.random.Generator, size: int) -> np.ndarray:
    c0, c1 = rng.integers(60, 200, 3), rng.integers(60, 200, 3)
    t = np.linspace(0, 1, size)[:, None, None]
    img = c0 * (1 - t) + c1 * t
    img = np.repeat(img, size, axis=1) if img.shape[1] == 1 else img
    img = img + rng.normal(0, 12, (size, size, 3))
    return img.clip(0, 255).astype(np.uint8)


def render_shapes(rng: np.random.Generator, size: int, split: str) -> tuple[Image.Image, list[dict]]:
    im = Image.fromarray(background(rng, size))
    d = ImageDraw.Draw(im)
    objs, taken = [], []
    for _ in range(int(rng.integers(1, 4))):
        name = CLASSES[int(rng.integers(len(CLASSES)))]
        small = rng.random() < 0.1  # VOC marks objects too small to judge as difficult
        s = int(rng.integers(9, 15)) if small else int(rng.integers(size // 6, size // 2))
        w, h = s, max(6, int(s * rng.uniform(0.75, 1.3)))
        box = place(rng, size, w, h, taken)
        if box is None:
            continue
        taken.append(box)
        col = tuple(int(np.clip(c + rng.normal(0, 25), 0, 255)) for c in _HUE[name])
        x0, y0, x1, y1 = box
        if name == "circle":
            d.ellipse([x0, y0, x1 - 1, y1 - 1], fill=col)
        elif name == "square":
            d.rectangle([x0, y0, x1 - 1, y1 - 1], fill=col)
        else:
            d.polygon([((x0 + x1) / 2, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)], fill=col)
        objs.append(finish_object(name, box, size, small))
    return im, objs


def annotation_xml(year: str, image_id: str, size: tuple[int, int], objs: list[dict]) -> bytes:
    """A VOC annotation: 1-based inclusive pixel coordinates, as the devkit writes them."""
    w, h = size
    parts = [f"<annotation>\n\t<folder>VOC{year}</folder>\n\t<filename>{image_id}.jpg</filename>\n"
             f"\t<size>\n\t\t<width>{w}</width>\n\t\t<height>{h}</height>\n\t\t<depth>3</depth>\n\t</size>\n"
             f"\t<segmented>0</segmented>\n"]
    for o in objs:
        x0, y0, x1, y1 = o["bbox"]
        parts.append(f"\t<object>\n\t\t<name>{o['name']}</name>\n\t\t<pose>Unspecified</pose>\n"
                     f"\t\t<truncated>{o['truncated']}</truncated>\n\t\t<difficult>{o['difficult']}</difficult>\n"
                     f"\t\t<bndbox>\n\t\t\t<xmin>{x0 + 1}</xmin>\n\t\t\t<ymin>{y0 + 1}</ymin>\n"
                     f"\t\t\t<xmax>{x1}</xmax>\n\t\t\t<ymax>{y1}</ymax>\n\t\t</bndbox>\n\t</object>\n")
    parts.append("</annotation>\n")
    return "".join(parts).encode()


def _tar_bytes(files: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_release(out: Path, render: Render, classes: tuple[str, ...], counts: dict[str, int], size: int,
                  seed: int, quality: int = 92) -> dict[str, Path]:
    """The three archives, `counts[archive]` images each, scenes drawn by `render` (JPEG `quality`).
    Trainval lists are split in half into train and val, as VOC's are."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for k, (name, (year, split, _)) in enumerate(ARCHIVES.items()):
        n = counts.get(name, 0)
        if n <= 0:
            continue
        rng = np.random.default_rng([seed, k])
        base = f"VOCdevkit/VOC{year}"
        files, ids, present = [], [], []
        for i in range(n):
            image_id = f"{i + 1 + 100000 * (split == 'test'):06d}" if year == "2007" else f"2008_{i + 1:06d}"
            im, objs = render(rng, size, split)
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=quality)
            files += [(f"{base}/JPEGImages/{image_id}.jpg", buf.getvalue()),
                      (f"{base}/Annotations/{image_id}.xml", annotation_xml(year, image_id, im.size, objs))]
            ids.append(image_id)
            present.append({o["name"] for o in objs})
        lists = {split: ids} if split == "test" else {"trainval": ids, "train": ids[::2], "val": ids[1::2]}
        for sp, sp_ids in lists.items():
            files.append((f"{base}/ImageSets/Main/{sp}.txt", "".join(f"{i}\n" for i in sp_ids).encode()))
            for c in classes:  # the per-class lists: 1 = present, -1 = absent
                flag = {i: (1 if c in p else -1) for i, p in zip(ids, present)}
                files.append((f"{base}/ImageSets/Main/{c}_{sp}.txt",
                              "".join(f"{i} {flag[i]:2d}\n" for i in sp_ids).encode()))
        paths[name] = out / name
        atomic_write_bytes(paths[name], _tar_bytes(files))
    return paths


def generate(out: Path, size: int = 128, trainval: int = 240, test: int = 120, trainval12: int = 240,
             seed: int = 0) -> dict[str, Path]:
    if size < 32 or min(trainval, test) < 2 or trainval12 < 0:
        raise UserError("--size must be >= 32, --trainval and --test >= 2, --trainval12 >= 0")
    names = list(ARCHIVES)
    return write_release(Path(out), render_shapes, CLASSES,
                         {names[0]: trainval, names[1]: test, names[2]: trainval12}, size, seed)


main = generator_command(
    "voc.tiny", "Write a tiny PASCAL VOC release (the official tar format).", generate,
    options=[("--size", 128, "image side in pixels"), ("--trainval", 240, "VOC2007 trainval images"),
             ("--test", 120, "VOC2007 test images"),
             ("--trainval12", 240, "VOC2012 trainval images (0: no 2012 archive)")])


if __name__ == "__main__":
    main()
