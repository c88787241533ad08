"""The data the training parts read, written in the call's work folder: a tiny ILSVRC (resume, ddp) and
an ILSVRC of real photographs at ImageNet's sizes (e2e, and the photographs ssd_e2e cuts)."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from mpt.errors import UserError

REPO = Path(__file__).resolve().parents[3]


def tiny_data(work: Path) -> Path:
    """A tiny ILSVRC (4 classes, 64 training images) through the real generator and the real prep,
    made once per gpu_check invocation and shared by the parts that train."""
    from data_prep.imagenet import prepare
    from data_prep.imagenet.tiny import generate

    out = work / "tiny_imagenet"
    if not (out / "prepared.json").exists():
        arch = work / "tiny_archives"
        generate(arch, classes=4, train_per_class=16, val_per_class=4, size=40)
        prepare.prepare(arch, out, workers=1, log=lambda *a: None)
    return out


PHOTO_DIRS = ("data/mate-backgrounds", "/usr/share/backgrounds/mate/nature")  # repo copy first (a GPU image lacks the package)


def photo_source() -> Path:
    """The folder of the 12 mate-backgrounds nature photographs the end-to-end parts cut."""
    from data_prep.imagenet.real_photos import missing

    for d in PHOTO_DIRS:
        p = REPO / d
        if not missing(p):
            return p
    raise UserError(f"the end-to-end parts cut real photographs from Debian's mate-backgrounds: none of "
                    f"{', '.join(PHOTO_DIRS)} holds its 12 nature photographs (apt-get install mate-backgrounds, "
                    f"or copy /usr/share/backgrounds/mate/nature to {PHOTO_DIRS[0]} before the call)")


def _photo_jpegs(job) -> list[bytes]:
    """One worker's share of ImageNet-sized photographs: (photo path, count, seed) -> JPEG bytes (quality
    90), a quarter at 1000x750 and the rest at 500x375 (ILSVRC's typical sizes), each a random 4:3 cut of
    the photograph (40-100% of its height), portrait for one in five."""
    import io as _io

    import numpy as np
    from PIL import Image

    path, n, seed = job
    rng = np.random.default_rng(seed)
    out = []
    with Image.open(path) as src:
        src = src.convert("RGB")
        W, H = src.size
        for _ in range(n):
            w, h = (1000, 750) if rng.random() < 0.25 else (500, 375)
            if rng.random() < 0.2:
                w, h = h, w
            ch = int(rng.uniform(0.4, 1.0) * min(H, W * h / w))
            cw = int(ch * w / h)
            x, y = int(rng.integers(0, W - cw + 1)), int(rng.integers(0, H - ch + 1))
            buf = _io.BytesIO()
            src.crop((x, y, x + cw, y + ch)).resize((w, h), Image.BILINEAR).save(buf, "JPEG", quality=90)
            out.append(buf.getvalue())
    return out


def photo_imagenet(work: Path, train_per_class: int, val_per_class: int, workers: int) -> tuple[Path, float]:
    """An ILSVRC2012 of real photographs at ImageNet's sizes (class k: mate-backgrounds photograph k),
    written as the official archives and prepared by data_prep.imagenet, with `workers` processes; made
    once per call. -> (prepared folder, seconds)."""
    import multiprocessing as mp

    import numpy as np

    from data_prep.imagenet import prepare
    from data_prep.imagenet.real_photos import NAMES
    from data_prep.imagenet.tiny import wnid, write_archives

    out = work / "photo_imagenet"
    if (out / "prepared.json").exists():
        return out, 0.0
    t0 = time.time()
    src = photo_source()
    k = len(NAMES)
    per = train_per_class + val_per_class
    chunks = max(1, min(per, -(-per * k // (4 * workers))))  # ~4 jobs a worker
    jobs = [(str(src / f"{NAMES[c]}.jpg"), len(part), 1000 * c + j)
            for c in range(k) for j, part in enumerate(np.array_split(np.arange(per), chunks)) if len(part)]
    with mp.get_context("spawn").Pool(workers) as pool:
        done = pool.map(_photo_jpegs, jobs)
    per_class = [[] for _ in range(k)]
    for (path, _, seed), imgs in zip(jobs, done):
        per_class[seed // 1000].extend(imgs)
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(k), val_per_class)[rng.permutation(k * val_per_class)]
    val = {c: iter(per_class[c][train_per_class:]) for c in range(k)}
    arch = work / "photo_archives"
    write_archives(arch, [wnid(c) for c in range(k)], list(range(1, k + 1)), [f"photograph {n}" for n in NAMES],
                   [per_class[c][:train_per_class] for c in range(k)], [train_per_class] * k, labels,
                   (next(val[int(c)]) for c in labels), source="experiments.speed_memory.gpu_check")
    prepare.prepare(arch, out, workers=workers, log=lambda *a: None)
    shutil.rmtree(arch, ignore_errors=True)
    return out, round(time.time() - t0, 1)

