"""What every data_prep shares: its command line (prep_command), the command line of every generator of
a release in the official format (generator_command: the tiny sets and the real-data ones), the skip of
a complete output (already_prepared), and names read from an archive are checked before anything is
written.

A member path or a class name taken from a downloaded (or tampered) archive becomes a path under
--out; an absolute path or a `..` component would write outside it (path traversal)."""
from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path, PurePosixPath

from mpt.errors import UserError, cli


def prep_command(name: str, description: str, prepare, *, source: str, source_help: str, out_help: str,
                 workers_help: str | None = None, extra=None):
    """main(argv) of `python -m data_prep.<name>`: the command line every data_prep shares -- the
    official release (`source`, e.g. --archives), --out, --force, with `workers_help` --workers, and
    `extra(parser)` for a set's own options -- then prepare(release, out, **the other options by
    name); a UserError is one line (mpt.errors.cli)."""
    p = argparse.ArgumentParser(prog=f"python -m data_prep.{name}", description=description)
    p.add_argument(source, required=True, type=Path, help=source_help)
    p.add_argument("--out", required=True, type=Path, help=out_help)
    p.add_argument("--force", action="store_true", help="redo a complete output from scratch")
    if workers_help:
        p.add_argument("--workers", type=int, default=8, help=workers_help)
    if extra is not None:
        extra(p)

    @cli
    def main(argv: list[str] | None = None) -> dict:
        a = vars(p.parse_args(argv))
        if a.get("workers", 1) < 1:
            raise UserError("--workers must be at least 1")
        return prepare(a.pop(source.lstrip("-")), a.pop("out"), **a)

    return main


def generator_command(name: str, description: str, generate, *, options=(), out_help: str | None = None,
                      seed_help: str | None = None, done=None):
    """main(argv) of `python -m data_prep.<name>`, a command that writes a release in the official
    format (a tiny set, or real data made offline): --out, the set's own `options` -- (flag, default)
    or (flag, default, help), typed by the default, in the order generate() takes them -- and --seed;
    then result = generate(out, *options, seed) and one line, `done(args, result, seconds)` or
    'wrote RESULT' (a dict's values joined). main returns the result; a UserError is one line."""
    p = argparse.ArgumentParser(prog=f"python -m data_prep.{name}", description=description)
    p.add_argument("--out", required=True, type=Path, help=out_help)
    dests = []
    for flag, default, *help_ in options:
        action = p.add_argument(flag, type=type(default), default=default, help=help_[0] if help_ else None)
        dests.append(action.dest)
    p.add_argument("--seed", type=int, default=0, help=seed_help)

    @cli
    def main(argv: list[str] | None = None):
        a = p.parse_args(argv)
        start = time.time()
        result = generate(a.out, *(getattr(a, d) for d in dests), a.seed)
        if done is not None:
            print(done(a, result, time.time() - start))
        else:
            print(f"wrote {', '.join(map(str, result.values())) if isinstance(result, dict) else result}")
        return result

    return main


MARKER = "prepared.json"  # OUT/prepared.json: written last, so its presence means OUT is complete


def already_prepared(out: Path, force: bool, log, describe=None, check=None) -> dict | None:
    """The opening of every prepare(): the content of OUT/prepared.json when OUT is complete and not
    `force` -- after `check(info)` (which may raise a UserError, e.g. the archives changed), said in
    one line naming `describe(info)` (default: the marker) -- or None when there is work to do."""
    marker = Path(out) / MARKER
    if force or not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    if check is not None:
        check(info)
    log(f"{out} is already prepared ({describe(info) if describe else MARKER}); pass --force to redo it")
    return info


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
