"""What every data_prep shares: names read from an archive are checked before anything is written.

A member path or a class name taken from a downloaded (or tampered) archive becomes a path under
--out; an absolute path or a `..` component would write outside it (path traversal)."""
from __future__ import annotations

import io
from pathlib import PurePosixPath

from mpt.errors import UserError


def safe_relpath(name: str, what: str, source) -> str:
    """`name` (a member path like 'a/b.jpg') as a relative POSIX path that stays inside the output
    folder, or a one-line UserError naming the archive. `what` says what the name is."""
    bad = (not name or "\x00" in name or "\\" in name or name.startswith("/")
           or any(part in ("..",) for part in PurePosixPath(name).parts))
    if bad:
        raise UserError(f"{source}: unsafe {what} {name!r} (absolute, '..' or odd characters); "
                        f"the archive is damaged or tampered with: download it again")
    return str(PurePosixPath(name))


def safe_name(name: str, what: str, source) -> str:
    """A single path component (a class id such as a WNID, a speaker id): no separators at all."""
    if not name or "/" in name or name in (".", "..") or "\\" in name or "\x00" in name:
        raise UserError(f"{source}: unsafe {what} {name!r} (must be a plain name); "
                        f"the archive is damaged or tampered with: download it again")
    return name


def add_member(tf, name: str, data: bytes) -> None:
    """Add a file to a tar being written, with fixed times and modes (deterministic archives)."""
    import tarfile

    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tf.addfile(info, io.BytesIO(data))
