"""Run-directory files, written atomically (temp file + fsync + rename): a crash or a kill never
leaves a half-written checkpoint, summary or config behind, and never destroys the previous one."""
from __future__ import annotations

import datetime as _dt
import json
import os
import pathlib
import platform
import socket
import subprocess
import tempfile

from mpt.config import REPO  # mpt.config does not import torch


def atomic_write(path, write) -> None:
    """Call write(binary file) on a temporary file beside path, fsync, then rename over path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def atomic_torch_save(path, obj) -> None:
    import torch  # late: this module is also used by tools that never load torch (paper_tables)

    atomic_write(path, lambda f: torch.save(obj, f))


def append_jsonl(path, obj) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj, default=str) + "\n")


_RAISE = object()


def read_json(path, default=_RAISE):
    """The JSON in `path`; with `default`, that instead of an error when it is missing or unreadable
    (a file another process may be writing or may not have written yet)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        if default is _RAISE:
            raise
        return default


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def git_info() -> tuple[str, bool]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return commit or "unknown", dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def env_info(device, world_size: int = 1) -> dict:
    """What produced a number: code version, libraries, device and the TF32 switches."""
    import torch
    import torchvision

    commit, dirty = git_info()
    cuda = device.type == "cuda"
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device_name": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "hostname": socket.gethostname(),
        "world_size": world_size,
        "date": now(),
    }


def sampled_digest(path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's size, first and last MiB: tells two source archives apart (for a dataset's
    identity, mpt.config.data_fingerprint) in milliseconds, where hashing 150 GB would take minutes."""
    import hashlib

    path = pathlib.Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        if size > chunk:
            f.seek(max(chunk, size - chunk))
            h.update(f.read(chunk))
    return h.hexdigest()[:16]
