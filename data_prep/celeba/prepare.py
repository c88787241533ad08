"""Turn the official CelebA release into the layout torchvision.datasets.CelebA reads.

Input (--archives DIR), as distributed on the CelebA Google Drive (mmlab.ie.cuhk.edu.hk/projects/CelebA.html):
    img_align_celeba.zip       202,599 aligned and cropped 178x218 JPEGs under img_align_celeba/
    list_eval_partition.txt    "<image> <0|1|2>": train 162,770 / valid 19,867 / test 19,962
    list_attr_celeba.txt       optional: count, 40 attribute names, "<image> <+-1 x 40>"
Output (--out OUT):
    OUT/celeba/img_align_celeba/<image>.jpg, OUT/celeba/list_eval_partition.txt [, list_attr_celeba.txt]
    OUT/prepared.json          completion marker (counts, partition sizes, sampled archive digests)

torchvision.datasets.CelebA(root=OUT) reads this folder when the release's other annotation files
(identity, boxes, landmarks) are copied beside it; our loader (dataset.py) needs only the images and
the partition file. The crop to faces happens at load time (task.py), not here.

Checks: the archive opens as a zip (a truncated download fails here), every image's CRC is verified as
it is extracted (a corrupt archive fails) and the image decodes whole as a 178x218 JPEG (the loader's
face crop assumes that size), the partition file names exactly the archive's images (no missing, extra
or duplicated names; splits 0/1/2 only), the attribute file (when present) the same images; the
official release's counts when the archive holds 202,599 images. Resumable: images already extracted
with the right size are kept (temp files of a killed run are removed); the marker is written last, and
a complete output is skipped.
"""
from __future__ import annotations

import datetime
import shutil
import time
import zipfile
import zlib
from pathlib import Path

from data_prep.archives import decode_image, safe_relpath
from data_prep.prepared import MARKER, already_prepared, sweep_temp_files
from data_prep.progress import Progress
from mpt.errors import UserError
from mpt.rundir import atomic_write_bytes, atomic_write_json, sampled_digest

ZIP = "img_align_celeba.zip"
PARTITION = "list_eval_partition.txt"
ATTR = "list_attr_celeba.txt"
FOLDER = "img_align_celeba"
SIZE = (178, 218)  # width, height of every aligned image
OFFICIAL = {"images": 202_599, "train": 162_770, "valid": 19_867, "test": 19_962}
SPLITS = {"0": "train", "1": "valid", "2": "test"}
_WHERE = "download it from the CelebA page (mmlab.ie.cuhk.edu.hk/projects/CelebA.html, Align&Cropped Images)"


def read_partition(path: Path) -> dict[str, str]:
    """image name -> train | valid | test; one-line errors for a malformed file."""
    out: dict[str, str] = {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is unreadable ({type(e).__name__}); {_WHERE}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or parts[1] not in SPLITS:
            raise UserError(f"{path} line {i} is not '<image> <0|1|2>': {line[:60]!r}")
        if parts[0] in out:
            raise UserError(f"{path} names {parts[0]} twice (line {i})")
        out[parts[0]] = SPLITS[parts[1]]
    return out


def read_attr_names(path: Path) -> tuple[list[str], list[str]]:
    """(attribute names, image names) of list_attr_celeba.txt."""
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        n, names = int(lines[0]), lines[1].split()
    except (OSError, UnicodeDecodeError, ValueError, IndexError) as e:
        raise UserError(f"{path} is not a CelebA attribute file ({type(e).__name__})") from None
    images = [ln.split()[0] for ln in lines[2:]]
    if len(images) != n or any(len(ln.split()) != len(names) + 1 for ln in lines[2:]):
        raise UserError(f"{path} says {n} images of {len(names)} attributes but holds {len(images)} rows "
                        "or rows of another length")
    return names, images


def _open_zip(path: Path) -> zipfile.ZipFile:
    if not path.is_file():
        raise UserError(f"no {ZIP} in {path.parent}; {_WHERE}")
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"{path} is truncated or not a zip ({e}); re-download it") from None


def check_image(data: bytes, what: str) -> None:
    """The bytes decode whole as a 178x218 JPEG, as the loader will decode them (a damaged body passes
    a look at the first bytes and the zip's CRC, which was computed over the damage)."""
    fmt, size = decode_image(data, what, f"re-download {ZIP}", "a JPEG")
    if fmt != "JPEG" or size != SIZE:
        raise UserError(f"{what} is a {size[0]}x{size[1]} {fmt} image; CelebA's aligned images are "
                        f"{SIZE[0]}x{SIZE[1]} JPEGs: re-download {ZIP}")


def _members(zf: zipfile.ZipFile, path: Path) -> dict[str, zipfile.ZipInfo]:
    out = {}
    for info in zf.infolist():
        # A member name becomes a file under OUT: refuse '..', absolute or odd paths before writing.
        safe_relpath(info.filename, "member path", path)
        if info.is_dir():
            continue
        parts = info.filename.split("/")
        if len(parts) != 2 or parts[0] != FOLDER or not parts[1].lower().endswith(".jpg"):
            raise UserError(f"{path} holds {info.filename!r}; the official archive holds only {FOLDER}/<image>.jpg")
        out[parts[1]] = info
    if not out:
        raise UserError(f"{path} holds no {FOLDER}/*.jpg images")
    return out


def prepare(archives: Path, out: Path, force: bool = False, log=print) -> dict:
    archives, out = Path(archives), Path(out)
    if (info := already_prepared(out, force, log, sources=archives)) is not None:
        return info
    marker = out / MARKER
    t0 = time.time()
    zpath, ppath, apath = archives / ZIP, archives / PARTITION, archives / ATTR
    if not ppath.is_file():
        raise UserError(f"no {PARTITION} in {archives}; {_WHERE} (Eval/list_eval_partition.txt)")
    zf = _open_zip(zpath)
    members = _members(zf, zpath)
    part = read_partition(ppath)
    missing, extra = sorted(set(part) - set(members)), sorted(set(members) - set(part))
    if missing or extra:
        what = (f"{len(missing)} images not in the archive (first {missing[0]})" if missing else
                f"{len(extra)} archive images not in it (first {extra[0]})")
        raise UserError(f"{ppath} disagrees with {zpath}: {what}")
    counts = {s: sum(1 for v in part.values() if v == s) for s in SPLITS.values()}
    if len(members) == OFFICIAL["images"] and any(counts[s] != OFFICIAL[s] for s in counts):
        raise UserError(f"{ppath} splits {counts} differ from the official {OFFICIAL}")
    attr_names = None
    if apath.is_file():
        attr_names, attr_images = read_attr_names(apath)
        if sorted(attr_images) != sorted(members):
            raise UserError(f"{apath} disagrees with {zpath}: it lists {len(attr_images)} images, the archive "
                            f"{len(members)}, or other names")
    dest = out / "celeba" / FOLDER
    marker.unlink(missing_ok=True)  # first: a marker must never stand over a half-removed output
    if force and (out / "celeba").exists():
        shutil.rmtree(out / "celeba")
    dest.mkdir(parents=True, exist_ok=True)
    sweep_temp_files(out, log)  # an image write killed half-way (kill -9) leaves its temp file
    kept = written = 0
    with Progress("celeba", len(members), "images") as progress:
        for name in sorted(members):
            info, target = members[name], dest / name
            if target.is_file() and target.stat().st_size == info.file_size:
                kept += 1  # extracted by an earlier, interrupted run (each file is written atomically)
                progress.total -= 1  # only listed: the rate and ~left are those of the images decoded
                continue
            try:
                data = zf.read(info)  # verifies the CRC: a corrupt archive fails here
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
                raise UserError(f"{zpath} is corrupt at {info.filename} ({e}); re-download it") from None
            check_image(data, f"{zpath}: {info.filename}")
            atomic_write_bytes(target, data)
            written += 1
            progress.add()
    shutil.copyfile(ppath, out / "celeba" / PARTITION)
    if attr_names is not None:
        shutil.copyfile(apath, out / "celeba" / ATTR)
    info = {"dataset": "celeba", "images": len(members), **counts, "attributes": len(attr_names or []),
            "archive": {"name": ZIP, "bytes": zpath.stat().st_size, "digest": sampled_digest(zpath)},
            "partition_digest": sampled_digest(ppath), "official": len(members) == OFFICIAL["images"],
            "skipped": kept, "seconds": round(time.time() - t0, 1),
            "prepared_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    atomic_write_json(marker, info)
    log(f"prepared {len(members)} CelebA images ({counts}) in {out} ({kept} kept from an earlier run)")
    return info
