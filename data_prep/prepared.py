"""A prepared folder: its marker (prepared.json), the skip of a complete output (already_prepared), the
check that the archives it came from are unchanged, reading it back (read_prepared), the removal of a killed
run's temp files and the check of a token-id file."""
from __future__ import annotations

import json
from pathlib import Path

from mpt.errors import UserError
from mpt.rundir import remove_stale_temp_files



MARKER = "prepared.json"  # OUT/prepared.json: written last, so its presence means OUT is complete



def already_prepared(out: Path, force: bool, log, describe=None, check=None,
                     sources: Path | None = None) -> dict | None:
    """The opening of every prepare(): the content of OUT/prepared.json when OUT is complete and not
    `force` -- after `check(info)` (which may raise a UserError, e.g. the archives changed) and, with
    `sources` (the folder of the archives), after the archives the marker records that lie there are
    found unchanged (changed_archives) -- said in one line naming `describe(info)` (default: the
    marker) -- or None when there is work to do."""
    marker = Path(out) / MARKER
    if force or not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
        if not isinstance(info, dict):
            raise ValueError(f"a JSON {type(info).__name__}, not an object")
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise UserError(f"{marker} is damaged ({type(e).__name__}: {str(e)[:80]}); pass --force to prepare "
                        f"{out} again") from None
    if check is not None:
        check(info)
    changed = changed_archives(info, sources) if sources is not None else []
    if changed:
        raise UserError(f"{changed[0]} changed since {out} was prepared from it (its size or digest differs from "
                        f"{marker}); pass --force to prepare {out} again from it")
    log(f"{out} is already prepared ({describe(info) if describe else MARKER}); pass --force to redo it")
    return info



def changed_archives(info, folder: Path) -> list[Path]:
    """The source archives a prepared.json records -- {"name", "bytes", "digest"} anywhere in it, or
    {"bytes", "digest"} under the archive's name -- that lie in `folder` with another size or sampled
    digest now: a re-run said "already prepared" over data made from an archive since replaced."""
    from mpt.rundir import sampled_digest

    out: list[Path] = []

    def walk(x, key=None):
        if isinstance(x, dict):
            name = x.get("name", key)
            if {"bytes", "digest"} <= set(x) and isinstance(name, str) and "/" not in name:
                path = Path(folder) / name
                if path.is_file() and (path.stat().st_size != x["bytes"] or sampled_digest(path) != x["digest"]):
                    out.append(path)
                return
            for k, v in x.items():
                walk(v, k)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(info)
    return out



class PreparedInfo(dict):
    """A prepared.json's content: a key it lacks (an edited or truncated file, another version's) is a
    one-line UserError naming the file and the fix, not a KeyError traceback mid-run."""

    def __init__(self, data: dict, path: Path, fix: str):
        super().__init__(data)
        self.path, self.fix = path, fix

    def __missing__(self, key):
        raise UserError(f"{self.path} has no {key!r} entry: it is damaged or was written by another version; {self.fix}")



def read_prepared(root, fix: str) -> PreparedInfo:
    """root/prepared.json (which must exist: callers say how to make it) as a PreparedInfo; unreadable
    JSON or not a mapping is a one-line UserError ending in `fix` (e.g. the prepare command with --force)."""
    path = Path(root) / MARKER
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} ({type(e).__name__}: {e}); {fix}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object; {fix}")
    return PreparedInfo(data, path, fix)



def check_id_file(path: Path, dtype, vocab_size: int, fix: str, sha256: str | None = None,
                  chunk: int = 1 << 24) -> None:
    """Every token id in the id file at `path` (`dtype`, e.g. "<u4") must be below `vocab_size`: an
    embedding lookup past its table is a traceback on the CPU and a device-side assert on a GPU. With
    `sha256` (the prefix a prep recorded), the bytes must still give it: a shard edited after its prep
    otherwise trains on other data under the same run identity. One pass; a one-line UserError naming
    the file and `fix`. Costs one read of the file (~1 GB/s)."""
    import hashlib

    import numpy as np

    dtype = np.dtype(dtype)
    h, top, n = hashlib.sha256(), -1, 0
    with open(path, "rb") as f:
        while block := f.read(chunk * dtype.itemsize):
            h.update(block)
            ids = np.frombuffer(block[: len(block) // dtype.itemsize * dtype.itemsize], dtype=dtype)
            if ids.size:
                top = max(top, int(ids.max()))
            n += len(block)
    if n % dtype.itemsize:
        raise UserError(f"{path} has {n} bytes, not a whole number of {dtype.itemsize}-byte ids; {fix}")
    if top >= vocab_size:
        raise UserError(f"{path} holds token id {top}, outside the vocabulary of {vocab_size:,}; {fix}")
    if sha256 is not None and not h.hexdigest().startswith(sha256):
        raise UserError(f"{path} changed since it was prepared (sha256 {h.hexdigest()[:len(sha256)]}, the prep "
                        f"recorded {sha256}); {fix}")



def sweep_temp_files(out: Path, log, skip=()) -> None:
    """Remove the temp files (`.<name>.*.tmp`, mpt.rundir.atomic_write's) that a prep killed mid-write
    left anywhere under OUT (folders named in `skip` are not walked: they hold no such files); call it
    when a prep starts work, before anything is written."""
    if Path(out).is_dir():
        stale = remove_stale_temp_files(out, recursive=True, skip=skip)
        if stale:
            log(f"removed {len(stale)} temp file(s) of an interrupted run under {out} (first: {stale[0]})")
