"""Turn the official ILSVRC2012 archives into the ImageFolder layout torchvision reads.

Table 1 of the paper (section 4.1) trains six CNNs on ILSVRC12 and reports single-crop top-1 on
the 50,000 validation images; this module produces exactly that train/val split from the three
archives image-net.org distributes, without unpacking the 140 GB train tar to a temporary copy:
images are read out of the tars in place and written once, to their final class folder.

Output (see README.md):
    OUT/train/<wnid>/<wnid>_<n>.JPEG        1,281,167 images in 1000 folders
    OUT/val/<wnid>/ILSVRC2012_val_<8 digits>.JPEG   50,000 images, foldered by the devkit ground truth
    OUT/classes.json    [{"wnid", "words", "ilsvrc_id"}] in sorted-wnid order = ImageFolder class index
    OUT/prepared.json   completion marker (counts, archive sizes), written last and atomically

Crash safety: a class is written into OUT/.partial/ and renamed into place only when complete, so a
folder under train/ or val/ is always whole; a re-run after a crash keeps the finished classes and
redoes the rest. A complete output (prepared.json present) is skipped unless force=True.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import gzip
import io
import json
import os
import shutil
import tarfile
import threading
import time
import zlib
from pathlib import Path, PurePosixPath

from data_prep.archives import decode_image, safe_name, safe_relpath
from data_prep.prepared import MARKER, already_prepared, sweep_temp_files
from data_prep.progress import Progress
from mpt.errors import UserError
from mpt.rundir import sampled_digest, atomic_write_json

TRAIN_TAR = "ILSVRC2012_img_train.tar"
VAL_TAR = "ILSVRC2012_img_val.tar"
DEVKIT = "ILSVRC2012_devkit_t12.tar.gz"
ARCHIVES = (TRAIN_TAR, VAL_TAR, DEVKIT)
# Paths inside the devkit, matched by suffix so the top folder's name does not matter.
DEVKIT_META = "data/meta.mat"
DEVKIT_GT = "data/ILSVRC2012_validation_ground_truth.txt"

CLASSES = "classes.json"
PARTIAL = ".partial"  # in-progress work; outside train/ and val/ so ImageFolder never sees it
STATE = "archives.json"  # inside PARTIAL: which archives the partial work came from

# The official release (image-net.org, ILSVRC2012): checked whenever the devkit lists 1000 classes.
OFFICIAL_COUNTS = {"classes": 1000, "train": 1_281_167, "val": 50_000}
OFFICIAL_SIZES = {TRAIN_TAR: 147_897_477_120, VAL_TAR: 6_744_924_160}

# File endings torchvision's ImageFolder accepts (case-insensitive); anything else in an image tar
# would be silently ignored by ImageFolder and shift the counts, so it is an error here.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

_BUF = 1 << 20  # tar read buffer: the default 10 KiB means 14 M read calls for the train tar
_WHERE = "download it from https://image-net.org (registration required; ILSVRC2012 downloads page)"


def _redownload(archive: Path, what: str) -> UserError:
    return UserError(f"{archive} {what}; re-download it from https://image-net.org "
                     "(registration required) and run again")


class _Reading:
    """Turn the many ways a damaged archive fails into one UserError naming the archive."""

    def __init__(self, archive: Path):
        self.archive = archive

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if exc is None or isinstance(exc, UserError):
            return False
        if isinstance(exc, (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)):
            raise _redownload(self.archive, f"is truncated or corrupt ({exc})") from None
        return False


# ------------------------------------------------------------------ inputs


def find_archives(archives_dir: Path) -> dict[str, Path]:
    """The three archives by name; a missing one is a UserError naming the exact file expected."""
    archives_dir = Path(archives_dir)
    if not archives_dir.is_dir():
        raise UserError(f"--archives {archives_dir} is not a directory; it must hold "
                        f"{', '.join(ARCHIVES)} (from https://image-net.org, registration required)")
    found = {}
    for name in ARCHIVES:
        path = archives_dir / name
        if not path.is_file():
            raise UserError(f"missing {path}: {_WHERE}")
        found[name] = path
    return found


def archive_sizes(archives: dict[str, Path]) -> dict[str, int]:
    return {name: archives[name].stat().st_size for name in ARCHIVES}


def read_devkit(devkit: Path) -> tuple[list[dict], list[int]]:
    """Classes (leaf synsets of meta.mat, sorted by WNID) and the val ground truth (ILSVRC2012_IDs).

    meta.mat's `synsets` struct array holds the 1000 leaf classes (num_children == 0,
    ILSVRC2012_ID 1..1000) followed by the WordNet internal nodes, which are not classes.
    """
    import scipy.io  # only needed here; keeps `--help` fast

    meta_raw = gt_raw = None
    with _Reading(devkit), tarfile.open(devkit, mode="r:gz") as tar:
        for member in tar:
            safe_relpath(member.name, "member path", devkit)
            if member.isfile() and member.name.endswith(DEVKIT_META):
                meta_raw = tar.extractfile(member).read()
            elif member.isfile() and member.name.endswith(DEVKIT_GT):
                gt_raw = tar.extractfile(member).read()
    for raw, name in ((meta_raw, DEVKIT_META), (gt_raw, DEVKIT_GT)):
        if raw is None:
            raise UserError(f"{devkit} has no {name}; is it the ILSVRC2012 development kit "
                            "(Task 1 & 2)? re-download it from https://image-net.org")
    try:
        synsets = scipy.io.loadmat(io.BytesIO(meta_raw), squeeze_me=True)["synsets"]
        classes = []
        for s in synsets.ravel():
            if int(s["num_children"]) == 0:
                # A WNID becomes a folder name under OUT/train and OUT/val: checked before anything is written.
                wnid = safe_name(str(s["WNID"]), "WNID in " + DEVKIT_META, devkit)
                classes.append({"wnid": wnid, "words": str(s["words"]),
                                "ilsvrc_id": int(s["ILSVRC2012_ID"])})
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise _redownload(devkit, f"has an unreadable {DEVKIT_META} ({type(e).__name__}: {e})")
    try:
        gt = [int(line) for line in gt_raw.decode("ascii").split()]
    except ValueError as e:
        raise _redownload(devkit, f"has a malformed {DEVKIT_GT} ({e})")

    classes.sort(key=lambda c: c["wnid"])  # ImageFolder's class index is the sorted folder name
    ids = {c["ilsvrc_id"] for c in classes}
    if not classes or len(ids) != len(classes) or len({c["wnid"] for c in classes}) != len(classes):
        raise _redownload(devkit, f"lists {len(classes)} leaf classes with repeated ids or WNIDs")
    bad = sorted(set(gt) - ids)
    if bad:
        raise _redownload(devkit, f"ground truth uses ILSVRC2012_ID {bad[0]}, not a class of meta.mat")
    return classes, gt


def check_official_sizes(archives: dict[str, Path], log) -> None:
    """Catch an incomplete download in a second, instead of after an hour of unpacking."""
    for name, expected in OFFICIAL_SIZES.items():
        size = archives[name].stat().st_size
        if size < expected:
            raise _redownload(archives[name], f"is {size:,} bytes but the official archive is "
                              f"{expected:,}: the download is incomplete")
        if size != expected:
            log(f"warning: {archives[name]} is {size:,} bytes, the official archive is "
                f"{expected:,}; going on, the image counts are checked at the end")


# ------------------------------------------------------------------ output state


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES)


def _count_files(folder: Path) -> int:
    return sum(1 for _ in os.scandir(folder))


def _reset_output(out: Path, log) -> None:
    """Remove everything this tool writes under OUT; the marker first, so a crash in here can
    never leave a 'complete' marker above a half-deleted output."""
    (out / MARKER).unlink(missing_ok=True)
    for name in (CLASSES,):
        (out / name).unlink(missing_ok=True)
    for name in (PARTIAL, "train", "val"):
        if (out / name).exists():
            log(f"removing {out / name}")
            shutil.rmtree(out / name)


def _start(out: Path, sizes: dict[str, int], force: bool, log) -> None:
    """Bring OUT into a state from which the work can (re)start safely."""
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / PARTIAL / STATE
    if force:
        _reset_output(out, log)
    elif state_path.is_file():
        previous = json.loads(state_path.read_text())
        if previous != sizes:
            # Finished class folders of a different set of archives must not be mixed in.
            log(f"{out} holds partial work from different archives; starting over")
            _reset_output(out, log)
        else:
            log(f"resuming the interrupted preparation in {out}")
    elif (out / "train").exists() or (out / "val").exists():
        raise UserError(f"{out} already has train/ or val/ that this tool did not write (no "
                        f"{MARKER} or {PARTIAL}/); choose an empty --out, or pass --force to replace them")
    (out / PARTIAL).mkdir(exist_ok=True)
    # A killed write of the marker, classes.json or the state leaves a temp file; the images are
    # written in .partial class folders, renamed into train/ and val/ only when whole (not walked).
    sweep_temp_files(out, log, skip=("train", "val"))
    atomic_write_json(state_path, sizes)
    # Leftovers of a crash: class folders that were never renamed into place.
    for leftover in ("train", "val"):
        if (out / PARTIAL / leftover).exists():
            shutil.rmtree(out / PARTIAL / leftover)
    (out / "train").mkdir(exist_ok=True)


# ------------------------------------------------------------------ train


def _write_members(tar: tarfile.TarFile, folder: Path, wnid: str, archive: Path) -> int:
    """Copy every image of one per-class tar into folder (already created); return the count."""
    names = set()
    for member in tar:
        safe_relpath(member.name, f"member path in {wnid}.tar", archive)
        if not member.isfile():
            continue
        name = PurePosixPath(member.name).name
        if not _is_image(name) or name in names:
            raise _redownload(archive, f"has an unexpected member {member.name!r} in {wnid}.tar")
        names.add(name)
        _copy_image(tar.extractfile(member), folder / name, f"{archive}: {wnid}.tar/{name}", archive)
    return len(names)


def _copy_image(src, dest: Path, what: str, archive: Path) -> None:
    """Write one image member to dest once it decodes in full (data_prep.archives.decode_image): a damaged
    JPEG copied as is failed only when training reached it, possibly hours in."""
    data = src.read()
    decode_image(data, what, f"{archive.name} is damaged: re-download it from https://image-net.org")
    with open(dest, "wb") as f:
        f.write(data)


def _member_names(tar: tarfile.TarFile) -> list[str]:
    return [PurePosixPath(m.name).name for m in tar if m.isfile()]


def _prepare_class(train_tar: Path, member: tarfile.TarInfo, out: Path) -> tuple[str, int, bool]:
    """Write one class (one nested nXXXXXXXX.tar) to OUT/train/<wnid>; return (wnid, count, skipped)."""
    wnid = PurePosixPath(member.name).name[: -len(".tar")]
    final = out / "train" / wnid
    with _Reading(train_tar), tarfile.open(train_tar, mode="r:") as outer:
        if final.is_dir():
            # Finished by an interrupted earlier run: it was renamed into place only when whole,
            # so matching file names are enough to trust it.
            with tarfile.open(fileobj=outer.extractfile(member), mode="r|", bufsize=_BUF) as inner:
                names = _member_names(inner)
            if sorted(names) == sorted(p.name for p in os.scandir(final)):
                return wnid, len(names), True
            shutil.rmtree(final)
        tmp = out / PARTIAL / "train" / wnid
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        with tarfile.open(fileobj=outer.extractfile(member), mode="r|", bufsize=_BUF) as inner:
            count = _write_members(inner, tmp, wnid, train_tar)
    os.rename(tmp, final)  # the whole class appears at once
    return wnid, count, False


def prepare_train(train_tar: Path, out: Path, wnids: set[str], workers: int, log) -> dict[str, int]:
    """OUT/train/<wnid>/ for every per-class tar inside the train tar; returns images per class."""
    with _Reading(train_tar), tarfile.open(train_tar, mode="r:") as outer:
        members = [m for m in outer.getmembers() if m.isfile()]  # headers only: 1000 seeks
    seen = set()
    for m in members:
        safe_relpath(m.name, "member path", train_tar)
        name = PurePosixPath(m.name).name
        if not name.endswith(".tar"):
            raise UserError(f"{train_tar} has an unexpected member {m.name!r} (expected one "
                            f"nXXXXXXXX.tar per class); is it really {TRAIN_TAR}? re-download it")
        wnid = name[: -len(".tar")]
        if wnid not in wnids:
            raise UserError(f"{train_tar} has class {wnid}, which the devkit does not list; "
                            "the train tar and devkit do not belong together, re-download them")
        if wnid in seen:
            raise _redownload(train_tar, f"holds {name} twice")
        seen.add(wnid)
    (out / PARTIAL / "train").mkdir(parents=True, exist_ok=True)

    counts: dict[str, int] = {}
    skipped = 0
    start = time.time()
    lock = threading.Lock()
    # Counted in bytes of the train tar (each class tar's size), not in classes: a class finished by an
    # interrupted earlier run is only listed again, so the rate and ~left are those of the real work.
    progress = Progress("imagenet train", sum(m.size for m in members), "bytes")

    def done(result, member):
        nonlocal skipped
        wnid, count, was_skipped = result
        with lock:
            counts[wnid] = count
            skipped += was_skipped
        if was_skipped:
            progress.total -= member.size
        else:
            progress.add(member.size)

    # Threads, not processes: the work is file I/O (reads release the GIL), and each task opens
    # its own handle on the tar, so no state is shared between them.
    with progress:
        if workers <= 1:
            for m in members:
                done(_prepare_class(train_tar, m, out), m)
        else:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                futures = {pool.submit(_prepare_class, train_tar, m, out): m for m in members}
                try:
                    for future in concurrent.futures.as_completed(futures):
                        done(future.result(), futures[future])
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
    log(f"train: {len(counts)}/{len(members)} classes, {sum(counts.values()):,} images ({skipped} already done), "
        f"{time.time() - start:.0f} s")
    return counts


# ------------------------------------------------------------------ val


def prepare_val(val_tar: Path, out: Path, gt: list[int], id_to_wnid: dict[int, str],
                log) -> dict[str, int]:
    """OUT/val/<wnid>/ILSVRC2012_val_NNNNNNNN.JPEG, foldered by the devkit ground truth
    (line i of the ground truth is the ILSVRC2012_ID of ILSVRC2012_val_<i>.JPEG)."""
    final = out / "val"
    if final.is_dir():
        # Renamed into place only when whole (see below): count and reuse it.
        counts = {d.name: _count_files(Path(d.path)) for d in os.scandir(final) if d.is_dir()}
        if sum(counts.values()) == len(gt):
            log(f"val: {len(gt):,} images already done")
            return counts
        shutil.rmtree(final)
    tmp = out / PARTIAL / "val"
    if tmp.exists():
        shutil.rmtree(tmp)
    for wnid in id_to_wnid.values():
        (tmp / wnid).mkdir(parents=True)
    counts = dict.fromkeys(id_to_wnid.values(), 0)
    seen = set()
    start = time.time()
    # Stream mode ("r|"): one sequential pass over the 6.7 GB tar.
    with _Reading(val_tar), tarfile.open(val_tar, mode="r|", bufsize=_BUF) as tar, \
            Progress("imagenet val", len(gt), "images") as progress:
        for member in tar:
            safe_relpath(member.name, "member path", val_tar)
            if not member.isfile():
                continue
            name = PurePosixPath(member.name).name
            stem = name.rsplit(".", 1)[0]
            try:
                index = int(stem.rsplit("_", 1)[1])
            except (IndexError, ValueError):
                index = -1
            if not (_is_image(name) and stem.startswith("ILSVRC2012_val_") and 1 <= index <= len(gt)):
                raise UserError(f"{val_tar} has an unexpected member {member.name!r} (expected "
                                f"ILSVRC2012_val_00000001.JPEG .. ILSVRC2012_val_{len(gt):08d}.JPEG "
                                "matching the devkit's ground truth); re-download the val tar and devkit")
            if index in seen:
                raise _redownload(val_tar, f"holds {name} twice")
            seen.add(index)
            wnid = id_to_wnid[gt[index - 1]]
            _copy_image(tar.extractfile(member), tmp / wnid / name, f"{val_tar}: {name}", val_tar)
            counts[wnid] += 1
            progress.add()
    os.rename(tmp, final)
    log(f"val: {len(seen):,} images, {time.time() - start:.0f} s")
    return counts


# ------------------------------------------------------------------ checks


def check_counts(classes: list[dict], gt: list[int], train: dict[str, int], val: dict[str, int],
                 archives: dict[str, Path]) -> bool:
    """The official counts for a 1000-class devkit, consistency otherwise. Returns `standard`."""
    n_train, n_val = sum(train.values()), sum(val.values())
    wnids = [c["wnid"] for c in classes]
    missing = [w for w in wnids if w not in train]
    if missing:
        raise UserError(f"{archives[TRAIN_TAR]} has {len(train)} class tars, expected {len(wnids)} "
                        f"(missing {missing[0]}{' and more' if len(missing) > 1 else ''}); "
                        "the archive is probably truncated: re-download it")
    empty = [w for w in wnids if train[w] == 0] + [w for w in wnids if val.get(w, 0) == 0]
    if empty:
        raise UserError(f"class {empty[0]} has no train or no val images; the archives are "
                        "incomplete or do not belong together: re-download them")
    if n_val != len(gt):
        raise UserError(f"{archives[VAL_TAR]} has {n_val:,} images, expected {len(gt):,} (one per "
                        "line of the devkit's ground truth); the archive is probably truncated: re-download it")
    standard = len(classes) == OFFICIAL_COUNTS["classes"]
    if standard:
        for what, found, archive in (("train", n_train, TRAIN_TAR), ("val", n_val, VAL_TAR)):
            expected = OFFICIAL_COUNTS[what]
            if found != expected:
                raise UserError(f"{archives[archive]} gave {found:,} {what} images, expected "
                                f"{expected:,} (official ILSVRC2012); re-download it")
    return standard


# ------------------------------------------------------------------ main entry


def prepare(archives_dir: Path, out: Path, force: bool = False, workers: int = 8,
            log=print) -> dict:
    """Prepare OUT from the archives in archives_dir; return the content of OUT/prepared.json.

    A complete output is skipped (returned with "skipped": True) unless force.
    """
    archives_dir, out = Path(archives_dir), Path(out)
    marker = out / MARKER

    def same_archives(info):
        present = [n for n in ARCHIVES if (archives_dir / n).is_file()]
        changed = [n for n in present if (archives_dir / n).stat().st_size != info["archives"].get(n)]
        if changed:
            raise UserError(f"{out} was prepared from a different {changed[0]} (size differs from "
                            f"{marker}); pass --force to prepare it again")
        shutil.rmtree(out / PARTIAL, ignore_errors=True)  # a crash right after the marker

    info = already_prepared(out, force, log, check=same_archives, describe=lambda i: (
        f"{i['train_images']:,} train, {i['val_images']:,} val images, {i['num_classes']} classes"))
    if info is not None:
        return {**info, "skipped": True}

    archives = find_archives(archives_dir)
    sizes = archive_sizes(archives)
    classes, gt = read_devkit(archives[DEVKIT])
    if len(classes) == OFFICIAL_COUNTS["classes"]:
        check_official_sizes(archives, log)
    else:
        log(f"note: the devkit lists {len(classes)} classes, not the official 1000: this is a "
            "non-standard (tiny) dataset; checking it for consistency only")
    start = time.time()
    _start(out, sizes, force, log)
    id_to_wnid = {c["ilsvrc_id"]: c["wnid"] for c in classes}
    val = prepare_val(archives[VAL_TAR], out, gt, id_to_wnid, log)
    train = prepare_train(archives[TRAIN_TAR], out, set(id_to_wnid.values()), workers, log)
    standard = check_counts(classes, gt, train, val, archives)

    atomic_write_json(out / CLASSES, classes)
    info = {
        "dataset": "ILSVRC2012",
        "layout": "imagefolder",  # OUT/{train,val}/<wnid>/<image>; class index = sorted wnid
        "standard": standard,
        "num_classes": len(classes),
        "train_images": sum(train.values()),
        "val_images": sum(val.values()),
        "archives": sizes,
        # what the run identity (mpt.prepared.data_fingerprint) tells datasets apart by
        "archive_digests": {n: sampled_digest(p) for n, p in archives.items()},
        "prepared_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - start, 1),
    }
    atomic_write_json(marker, info)  # last: its presence means the output is complete
    shutil.rmtree(out / PARTIAL, ignore_errors=True)
    log(f"prepared {out}: {info['train_images']:,} train and {info['val_images']:,} val images in "
        f"{info['num_classes']} classes ({'official ILSVRC2012' if standard else 'non-standard (tiny) set'}), "
        f"{info['seconds']} s")
    return {**info, "skipped": False}
