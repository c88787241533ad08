"""Turn the official PASCAL VOC archives into the VOCdevkit tree torchvision.datasets.VOCDetection reads.

Input (--archives DIR), as distributed on the VOC pages (host.robots.ox.ac.uk/pascal/VOC/):
    VOCtrainval_06-Nov-2007.tar   VOC2007 trainval: 5,011 images        (required)
    VOCtest_06-Nov-2007.tar       VOC2007 test: 4,952 images            (required: Table 2's test set)
    VOCtrainval_11-May-2012.tar   VOC2012 trainval: 11,540 detection images (optional: SSD's "07+12")
Output (--out OUT):
    OUT/VOCdevkit/VOC2007/{JPEGImages,Annotations,ImageSets/Main}/...   and the same for VOC2012
    OUT/prepared.json   completion marker: per set its image/object/difficult counts, the class list,
                        each archive's size and sampled digest (mpt.prepared.data_fingerprint reads it)

torchvision.datasets.VOCDetection(OUT, year="2007", image_set="test") reads this tree; so does our
loader (dataset.py). Only the detection parts are unpacked (JPEGImages, Annotations, ImageSets/Main):
segmentation masks and the layout/action lists are not needed for Table 2.

Checks: each archive opens as a tar and is read to its end (a truncated download fails), member
paths stay inside OUT (data_prep.archives.safe_relpath), every id of ImageSets/Main/<split>.txt has a
JPEG that decodes whole (a damaged body fails here, not in training) and a well-formed annotation
(root <annotation>, each <object> with a plain <name>, a numeric <bndbox> with xmin <= xmax and
ymin <= ymax, <difficult> 0/1) whose every box covers at least a pixel of the decoded image (a box
partly outside is normal -- VOC's 1-based coordinates put some at 0 or past the edge -- and the loader
clips it; one entirely outside or of no size would be dropped by training, so it is an error naming
the file and the object), every set holds objects, and the official counts hold for an archive of
the official size (more than 1,000 listed images; the tiny test archives record their own).
Resumable: files already unpacked with the right size are kept (temp files of a killed run are
removed); the marker is written last, and a complete output is skipped.
"""
from __future__ import annotations

import datetime
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from data_prep.archives import decode_image, safe_name, safe_relpath
from data_prep.prepared import MARKER, already_prepared, sweep_temp_files
from data_prep.progress import Progress
from mpt.errors import UserError
from mpt.rundir import atomic_write_bytes, atomic_write_json, sampled_digest

# archive -> (year, split, official image count)
ARCHIVES = {
    "VOCtrainval_06-Nov-2007.tar": ("2007", "trainval", 5011),
    "VOCtest_06-Nov-2007.tar": ("2007", "test", 4952),
    "VOCtrainval_11-May-2012.tar": ("2012", "trainval", 11540),
}
REQUIRED = ("VOCtrainval_06-Nov-2007.tar", "VOCtest_06-Nov-2007.tar")
KEEP = ("JPEGImages", "Annotations", "ImageSets/Main")
OFFICIAL_MIN = 1000  # an archive listing more images than this is held to the official count
VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
               "train", "tvmonitor")
_WHERE = "download it from host.robots.ox.ac.uk/pascal/VOC/ (voc2007 / voc2012 development kit pages)"


def parse_annotation(data: bytes, source) -> list[dict]:
    """The objects of one VOC annotation: [{name, bbox (xmin, ymin, xmax, ymax), difficult, truncated}].
    Coordinates stay as written (VOC's 1-based pixel indices). One-line errors for malformed XML."""
    try:
        root = ET.fromstring(data)
    except ET.ParseError as e:
        raise UserError(f"{source} is malformed XML ({e}); re-download the archive") from None
    if root.tag != "annotation":
        raise UserError(f"{source}: root element is <{root.tag}>, not <annotation>")
    objs = []
    for o in root.iter("object"):
        name = (o.findtext("name") or "").strip()
        box = o.find("bndbox")
        try:
            xmin, ymin, xmax, ymax = (float(box.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax"))
            difficult = int(o.findtext("difficult") or 0)
            truncated = int(o.findtext("truncated") or 0)
        except (AttributeError, TypeError, ValueError):
            raise UserError(f"{source}: object {name!r} lacks a numeric <bndbox> (xmin ymin xmax ymax) or "
                            f"a 0/1 <difficult>") from None
        if not name:
            raise UserError(f"{source}: an <object> has no <name>")
        safe_name(name, "class name", source)
        if xmax < xmin or ymax < ymin or difficult not in (0, 1):
            raise UserError(f"{source}: object {name!r} has box ({xmin}, {ymin}, {xmax}, {ymax}) or difficult="
                            f"{difficult}; expected xmin <= xmax, ymin <= ymax, difficult 0 or 1")
        objs.append({"name": name, "bbox": (xmin, ymin, xmax, ymax), "difficult": difficult, "truncated": truncated})
    return objs


def image_size(jpg: Path, archive: str) -> tuple[int, int]:
    """(width, height) of a JPEG decoded in full, as the loader will decode it; a one-line error for one
    that does not decode (a damaged body passes a look at its first bytes, then fails in training)."""
    fmt, size = decode_image(jpg, str(jpg), f"re-download {archive}", "a JPEG")
    if fmt != "JPEG":
        raise UserError(f"{jpg} is a {fmt} image, not a JPEG; re-download {archive}")
    return size


def check_box(obj: dict, k: int, size: tuple[int, int], source, fix: str) -> None:
    """Object k's box must cover at least one pixel of the w x h image: the loader clips VOC's box
    (xmin - 1, ymin - 1, xmax, ymax) to the image, and training drops a box less than a pixel wide or
    high (torchvision's SanitizeBoundingBoxes) -- silently, down to a loss of exactly 0."""
    (w, h), (x0, y0, x1, y1) = size, obj["bbox"]
    dx, dy = min(x1, w) - max(x0 - 1, 0), min(y1, h) - max(y0 - 1, 0)
    if dx < 1 or dy < 1:
        where = "entirely outside" if dx <= 0 or dy <= 0 else "less than a pixel inside"
        raise UserError(f"{source}: object {k} ({obj['name']}) has box ({x0:g}, {y0:g}, {x1:g}, {y1:g}), {where} "
                        f"the {w}x{h} image; training would drop it: {fix}")


def _wanted(rel: str, year: str) -> bool:
    """Whether a member belongs to the detection tree of VOC<year>."""
    base = f"VOCdevkit/VOC{year}/"
    return rel.startswith(base) and any(rel[len(base):].startswith(k + "/") for k in KEEP)


def unpack(path: Path, year: str, out: Path, log=print) -> tuple[int, int]:
    """Unpack VOC<year>'s detection files of one archive into out; (written, kept) files."""
    if not path.is_file():
        raise UserError(f"no {path.name} in {path.parent}; {_WHERE}")
    written = kept = 0
    try:
        # Counted in bytes of the tar: where the member just read ends (offset_data + size).
        with tarfile.open(path, "r:") as tf, Progress(f"voc {path.name}", path.stat().st_size, "bytes") as progress:
            for m in tf:
                progress.set(m.offset_data + m.size)
                rel = safe_relpath(m.name[2:] if m.name.startswith("./") else m.name, "member path", path)
                if not m.isfile() or not _wanted(rel, year):
                    continue
                target = out / rel
                if target.is_file() and target.stat().st_size == m.size:
                    kept += 1  # unpacked by an earlier, interrupted run (each file is written atomically)
                    continue
                f = tf.extractfile(m)
                data = f.read() if f is not None else b""
                if len(data) != m.size:
                    raise EOFError(f"{m.name} is short")
                atomic_write_bytes(target, data)
                written += 1
    except (tarfile.TarError, EOFError, OSError) as e:
        raise UserError(f"{path} is truncated or not a tar ({type(e).__name__}: {e}); re-download it") from None
    return written, kept


def check_split(out: Path, year: str, split: str, archive: str, expected: int) -> dict:
    """Every listed id has a JPEG and a well-formed annotation; the official count for the official archive."""
    root = out / "VOCdevkit" / f"VOC{year}"
    lst = root / "ImageSets" / "Main" / f"{split}.txt"
    if not lst.is_file():
        raise UserError(f"{archive} holds no VOCdevkit/VOC{year}/ImageSets/Main/{split}.txt; it is not the "
                        f"official archive: {_WHERE}")
    ids = [ln.strip() for ln in lst.read_text().splitlines() if ln.strip()]
    if len(set(ids)) != len(ids):
        raise UserError(f"{lst} lists an image twice")
    if len(ids) > OFFICIAL_MIN and len(ids) != expected:
        raise UserError(f"{lst} lists {len(ids)} images; the official {archive} has {expected}: re-download it")
    names: dict[str, int] = {}
    objects = difficult = 0
    with Progress(f"voc {year} {split}: checking", len(ids), "images") as progress:  # every JPEG is decoded
        for i in ids:
            safe_name(i, "image id", lst)
            jpg, xml = root / "JPEGImages" / f"{i}.jpg", root / "Annotations" / f"{i}.xml"
            if not jpg.is_file() or not xml.is_file():
                raise UserError(f"{archive}: image {i} of {split}.txt has no {'JPEG' if not jpg.is_file() else 'annotation'}"
                                f"; the archive is incomplete: re-download it")
            size = image_size(jpg, archive)
            for k, o in enumerate(parse_annotation(xml.read_bytes(), xml)):
                check_box(o, k, size, xml, f"re-download {archive} or remove the object")
                names[o["name"]] = names.get(o["name"], 0) + 1
                objects += 1
                difficult += o["difficult"]
            progress.add()
    if objects == 0:
        raise UserError(f"{archive}: the {len(ids)} images of {split}.txt hold no object; "
                        f"there is nothing to detect: {_WHERE}")
    return {"images": len(ids), "objects": objects, "difficult": difficult, "official": len(ids) == expected,
            "per_class": dict(sorted(names.items()))}


def prepare(archives: Path, out: Path, force: bool = False, log=print) -> dict:
    archives, out = Path(archives), Path(out)
    if (info := already_prepared(out, force, log, sources=archives)) is not None:
        return info
    marker = out / MARKER
    t0 = time.time()
    for name in REQUIRED:
        if not (archives / name).is_file():
            raise UserError(f"no {name} in {archives}; {_WHERE}")
    present = [n for n in ARCHIVES if (archives / n).is_file()]
    marker.unlink(missing_ok=True)
    sweep_temp_files(out, log)
    sets, arch_info, written, kept = {}, [], 0, 0
    for name in present:
        year, split, expected = ARCHIVES[name]
        w, k = unpack(archives / name, year, out, log)
        written, kept = written + w, kept + k
        sets[f"{year}_{split}"] = check_split(out, year, split, name, expected)
        path = archives / name
        arch_info.append({"name": name, "bytes": path.stat().st_size, "digest": sampled_digest(path)})
        log(f"  VOC{year} {split}: {sets[f'{year}_{split}']['images']} images, "
            f"{sets[f'{year}_{split}']['objects']} objects")
    found = set().union(*(s["per_class"] for s in sets.values()))
    # VOC's own class order where the names are VOC's (label k = VOC_CLASSES[k-1], 0 = background);
    # other names (a generator's) after them, sorted.
    classes = [c for c in VOC_CLASSES if c in found] + sorted(found - set(VOC_CLASSES))
    official = all(s["official"] for s in sets.values())
    if official and classes != list(VOC_CLASSES):
        raise UserError(f"{archives}: the official archives name the 20 VOC classes, these name {classes}")
    info = {"dataset": "voc", "sets": sets, "classes": classes, "archives": arch_info, "official": official,
            "skipped": kept, "seconds": round(time.time() - t0, 1),
            "prepared_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    atomic_write_json(marker, info)
    what = ", ".join(f"{k} {v['images']}" for k, v in sets.items())
    log(f"prepared VOC ({what}; {len(classes)} classes) "
        f"in {out} ({written} files written, {kept} kept from an earlier run)")
    return info
