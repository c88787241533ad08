"""Run-directory files, written atomically (temp file + fsync + rename): a crash or a kill never
leaves a half-written checkpoint, summary or config behind, and never destroys the previous one.

Files get the mode the umask allows (0644 under the usual 022, 0664 under a group's 002), so results
on shared storage are readable by the group. A full disk, a read-only or unwritable folder is a
one-line UserError naming the path, not a library's traceback."""
from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import pathlib
import platform
import re
import socket
import subprocess
import tempfile

from mpt import REPO
from mpt.errors import UserError

# What a write can fail with that the user fixes (errno -> what it is, the fix): the storage itself
# (freeing space or choosing another folder), a size or name limit, or the process's open-file limit.
_ELSEWHERE = "free space or choose a writable folder (out_dir=... for runs, --out for data_prep)"
_STORAGE_ERRNOS = {
    errno.ENOSPC: ("No space left on device", _ELSEWHERE), errno.EDQUOT: ("Disk quota exceeded", _ELSEWHERE),
    errno.EROFS: ("Read-only file system", _ELSEWHERE), errno.EACCES: ("Permission denied", _ELSEWHERE),
    errno.EPERM: ("Operation not permitted", _ELSEWHERE), errno.ENOTDIR: ("Not a directory", _ELSEWHERE),
    errno.EFBIG: ("File too large", "the file system or `ulimit -f` limits a file's size: raise the limit or "
                                    "choose another folder (out_dir=... for runs, --out for data_prep)"),
    errno.ENAMETOOLONG: ("File name too long", "choose a shorter name or folder (out_dir=... for runs, --out "
                                               "for data_prep)"),
    errno.EMFILE: ("Too many open files", "raise the limit (`ulimit -n`, e.g. to 4096) or use fewer workers"),
    errno.ENFILE: ("Too many open files in the system", "close other programs' files or raise fs.file-max"),
}


def storage_error(e: BaseException, path) -> UserError | None:
    """A UserError for a write that failed on the storage or a limit (disk full, quota, read-only,
    permissions, a file or name too long, too many open files), found anywhere in the exception's
    chain (torch.save reports a full disk as "unexpected pos" with the OSError as its context); None
    for any other error."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            what, fix = _STORAGE_ERRNOS[e.errno]
            return UserError(f"{what}: {path}; {fix}")
        e = e.__cause__ or e.__context__
    return None


def check_path_length(key: str, value, longest) -> None:
    """A one-line UserError when `longest` (the longest path a run makes from the value of `key`) is
    longer than the file system allows (ENAMETOOLONG): a name over NAME_MAX bytes or a path over
    PATH_MAX, the limits of the deepest folder of it that exists (255 and 4096 on Linux)."""
    path = os.path.abspath(longest)
    base = path
    while not os.path.isdir(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    try:
        name_max, path_max = os.pathconf(base, "PC_NAME_MAX"), os.pathconf(base, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    long_name = max((len(p.encode()) for p in path.split(os.sep)), default=0)
    if long_name > name_max:
        why = f"a name in it has {long_name:,} bytes, the file system allows {name_max}"
    elif len(path.encode()) >= path_max:
        why = f"a path under it has {len(path.encode()):,} bytes, the file system allows {path_max - 1}"
    else:
        return
    v = str(value)
    shown = v if len(v) <= 60 else f"{v[:40]}...{v[-15:]} ({len(v):,} characters)"
    raise UserError(f"{key}={shown} is too long ({why}); choose a shorter {key}")


def open_no_follow(path, flags: int, mode: int = 0o666) -> int:
    """os.open of a file this project appends to or locks in a shared folder (a run's .lock and
    metrics.jsonl, a grid's manifest and logs), refusing a symbolic link there: run folders are
    group-writable under umask 002, and a link planted in one made the run truncate or append to its
    target. A UserError naming the path (and a storage error's one line) instead of an OSError."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{path} is a symbolic link, where this writes a file of its own; remove the link "
                            "(a link there would make the write change whatever it points to)") from None
        raise storage_error(e, path) or e from None


def umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux: /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, but only a fallback)
    os.umask(mask)
    return mask


def atomic_write(path, write) -> None:
    """Call write(binary file) on a temporary file beside path, fsync, then rename over path. The
    file gets 0666 minus the umask, as open() would give it (mkstemp alone makes it 0600)."""
    path = pathlib.Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        err = storage_error(e, path)
        if err is not None:
            raise err from None
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


def state_checksum(obj) -> str:
    """A digest of a checkpoint's contents: every tensor's dtype, shape and bytes and every other
    value, in a fixed walk. torch.load does not check the CRCs of the zip it reads, so flipped bytes
    inside a tensor load as other weights; the digest stored in the checkpoint catches them.
    Costs one read of every byte (about 1 GB/s); a GPU tensor is copied to the host for it."""
    import hashlib

    import torch

    h = hashlib.blake2b(digest_size=16)

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(x.shape)};".encode())
            h.update(t.view(torch.uint8).numpy())
        elif isinstance(x, dict):
            h.update(f"D{len(x)};".encode())
            for k in sorted(x, key=lambda k: (type(k).__name__, repr(k))):
                h.update(f"{type(k).__name__}:{k!r}=".encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)};".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"{type(x).__name__}:{x!r};".encode())

    walk(obj)
    return h.hexdigest()


def append_jsonl(path, obj) -> None:
    """One line appended with a single write; a full disk is a one-line error (the torn line it may
    leave is dropped by read_jsonl when the run resumes)."""
    try:
        with os.fdopen(open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") as f:
            f.write(json.dumps(obj, default=str) + "\n")
    except OSError as e:
        err = storage_error(e, path)
        if err is not None:
            raise err from None
        raise


def read_jsonl(path) -> tuple[list[dict], int]:
    """The JSON objects of a JSON-lines file and how many lines could not be read: a line torn by a
    crash or a full disk in the middle of an append (the last one, normally) is skipped, not fatal."""
    good, bad = [], 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                bad += 1
                continue
            if isinstance(obj, dict):
                good.append(obj)
            else:
                bad += 1
    return good, bad


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


RANK_FAILURE = "failure.rank"  # <run dir>/failure.rank<r>.json: why rank r > 0 ended (error.rank<r>.txt: traceback)
FINAL = ("completed", "diverged")  # a run's final statuses: kept as they are by every later invocation


def read_rank_failures(run_dir) -> dict[int, dict]:
    """{rank: record} of the failure records ranks other than 0 left in run_dir (mpt.engine writes
    them; rank 0 and slurm.status read them). Unreadable or malformed records are skipped."""
    out = {}
    for f in sorted(pathlib.Path(run_dir).glob(f"{RANK_FAILURE}*.json")):
        rec = read_json(f, default=None)
        if isinstance(rec, dict) and isinstance(rec.get("rank"), int):
            out[rec["rank"]] = rec
    return out


def read_json_or_none(path):
    """A JSON file's content, or None when it is missing, unreadable or not valid JSON (a summary
    cut short by a full disk on an old version, edited by hand, or not written yet)."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


# atomic_write's temp files: tempfile.mkstemp(prefix=".<name>.", suffix=".tmp") adds 8 characters of
# [a-z0-9_]. Only these are swept: a user's own hidden `.notes.tmp` under --out is not ours to delete.
_TEMP_NAME = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


def remove_stale_temp_files(folder, recursive: bool = False, skip=()) -> list[str]:
    """Delete the temp files atomic_write leaves when a process is killed mid-write (`.<name>.XXXXXXXX.tmp`,
    checkpoint-sized at paper scale) in `folder` -- and, `recursive`, in every folder below it except
    those named in `skip` (a data_prep's tree of many small files). Only call it where no other live
    process writes (a run holds its directory's RunLock; a data_prep owns its --out): a live writer's
    temp file must not vanish. Returns the names removed (relative to `folder`)."""
    folder = pathlib.Path(folder)
    removed = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d not in skip] if recursive else []
        for name in filenames:
            if _TEMP_NAME.fullmatch(name):
                p = pathlib.Path(dirpath, name)
                try:
                    p.unlink()
                    removed.append(str(p.relative_to(folder)))
                except FileNotFoundError:
                    pass
    return removed


class RunDirBusy(UserError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """An exclusive lock on a run directory (fcntl.flock on <dir>/.lock), so that two processes
    never write the same run (e.g. after `slurm.submit --force` while the first job still runs).
    A second process is refused at once with a one-line error naming the holder (host, pid, start
    time) -- waiting would only make it redo or return what the first one produced. The kernel
    releases the lock when its holder dies (kill -9 included), so no stale lock survives a crash.
    File systems without flock support (some Lustre mounts) get a warning and no lock."""

    NAME = ".lock"

    def __init__(self, folder):
        self.path = pathlib.Path(folder) / self.NAME
        self.fd = None

    def acquire(self) -> "RunLock":
        import fcntl
        import warnings

        fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise RunDirBusy(f"run directory {self.path.parent} is in use by {holder}; wait for it to end "
                                "or stop it (a second copy would write the same files)") from None
            os.close(fd)
            warnings.warn(f"cannot lock {self.path} ({e.strerror}); two copies of this run could write it at once")
            return self
        try:  # who holds it, for the error above; the lock itself works without (e.g. on a full disk)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now()}\n".encode(), 0)
        except OSError:
            pass
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


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


def env_info(device, world_size: int = 1, cfg=None) -> dict:
    """What produced a number: code version, libraries, device, the TF32 switches and what computes
    FP16/BF16 dot products (`half_math`: what auto picks on this device and why; with the run's config,
    `half_math_used`: emulated | native | device | none)."""
    import torch
    import torchvision

    from mpt import precision
    from mpt.half_math import half_math_info

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
        "device_name": (torch.cuda.get_device_name(device) if cuda
                        else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"),
        "cpu": f"{cpu_model()}, {os.cpu_count()} cores",  # the host's CPU by name: CPU timings differ 2-3x by model
        **precision.backend_flags(),
        "hostname": socket.gethostname(),
        "world_size": world_size,
        "date": now(),
        "half_math": half_math_info(device),
        **({"half_math_used": precision.half_math_used(cfg, device)} if cfg is not None else {}),
    }


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's, as lscpu shows it), else what platform knows."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def files_digest(root, files) -> str:
    """sha256 of `files` (in the order given), each as its path relative to `root` and its bytes: names the code
    that made something (a results file on a machine without git state, a tiny dataset release)."""
    import hashlib

    root = pathlib.Path(root)
    h = hashlib.sha256()
    for f in files:
        h.update(str(pathlib.Path(f).relative_to(root)).encode() + b"\0" + pathlib.Path(f).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def sampled_digest(path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's size, first and last MiB: tells two source archives apart (for a dataset's
    identity, mpt.prepared.data_fingerprint) in milliseconds, where hashing 150 GB would take minutes."""
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
