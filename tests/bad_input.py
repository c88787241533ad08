"""What the bad-input tests share: a damaged copy of a release's tar (rewrite_tar) and the check that a
command -- a data_prep or an experiment's -- fails as a user mistake should: one line on stderr, exit code 2."""
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from conftest import REPO


def retar(data: bytes, edit) -> bytes:
    """The tar (or tar.gz) `data` rewritten member by member through edit(name, bytes) -> (name, bytes),
    or None to drop the member; compressed as it was."""
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        members = [(m.name, t.extractfile(m).read()) for m in t if m.isfile()]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if data[:2] == b"\x1f\x8b" else "w") as t:
        for name, new in filter(None, (edit(n, d) for n, d in members)):
            info = tarfile.TarInfo(name)
            info.size = len(new)
            t.addfile(info, io.BytesIO(new))
    return buf.getvalue()


def rewrite_tar(path: Path, edit, dst: Path | None = None) -> None:
    """Rewrite the tar at `path` through retar's edit, in place or into `dst`."""
    Path(dst or path).write_bytes(retar(Path(path).read_bytes(), edit))


def assert_fails_in_one_line(module: str, *args: str, msg: str) -> str:
    """`python -m <module> ARGS...` exits with 2 and one stderr line holding msg; returns that line."""
    p = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, cwd=REPO,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and msg in lines[0], p.stderr[-3000:]
    return lines[0]


def assert_command_fails_in_one_line(module: str, archives: Path, out: Path, msg: str) -> None:
    """`python -m <module> --archives ARCHIVES --out OUT` exits with 2 and one stderr line holding msg."""
    assert_fails_in_one_line(module, "--archives", archives, "--out", out, msg=msg)
