"""What every data_prep shares: its command line (prep_command), the command line of every generator of
a release in the official format (generator_command: the tiny sets and the real-data ones), the skip of
a complete output (already_prepared), the removal of a killed run's temp files (remove_stale_temp_files),
worker processes that die with the prep (worker_pool), the progress of a long step on stderr (Progress),
and names read from an archive are checked before anything is written.

A prep command fails in one line (README "What a run survives"): a full disk, a read-only or
unwritable --out exits with 2 naming the path; Ctrl-C, SIGTERM or SIGHUP exits with 130, 143 or 129
and says that running the same command again continues (every prep resumes; every file is written
atomically); a second prep into an --out that one is preparing is refused.

A member path or a class name taken from a downloaded (or tampered) archive becomes a path under
--out; an absolute path or a `..` component would write outside it (path traversal)."""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import errno
import io
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path, PurePosixPath

from mpt.errors import UserError, cli
from mpt.rundir import remove_stale_temp_files, storage_error
from mpt.signals import HANGUP, detach_from_closed_terminal


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
        src, out = a.pop(source.lstrip("-").replace("-", "_")), a.pop("out")
        return one_line_failures(lambda: _locked(out, lambda: prepare(src, out, **a)), out)

    return main


def _locked(out: Path, run):
    """run() holding an exclusive flock on the folder --out itself (no lock file: the output stays
    byte for byte the same): a second prep into the same --out is refused in one line instead of
    racing the first (a traceback and a temp file left behind, or one sweeping the other's temp files)."""
    import fcntl

    Path(out).mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(f"--out {out} is in use by another prep; wait for it to end (or stop it), "
                                f"then run this command again") from None
            # any other errno: a file system without flock (some Lustre mounts): unlocked, as a run goes on
        return run()
    finally:
        os.close(fd)


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that a prep
    stops the same way: temp files removed, workers killed, one line."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum


def _terminate(signum, frame):
    detach_from_closed_terminal(signum)
    raise Terminated(signum)


def one_line_failures(run, out):
    """run() -- a prep writing into `out` -- with its failures said in one line instead of a traceback:
    a full disk, a quota, a read-only or unwritable folder is a UserError naming the path (exit 2 through
    mpt.errors.cli); Ctrl-C, SIGTERM or SIGHUP (a closed terminal) prints 'interrupted' and exits with
    128 + the signal (130, 143, 129). What was written stays consistent: every file is written
    atomically and the marker last."""
    main_thread = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, *HANGUP)} if main_thread else {}
    try:
        return run()
    except (KeyboardInterrupt, Terminated) as e:
        signum = signal.Signals(e.signum) if isinstance(e, Terminated) else signal.SIGINT
        with contextlib.suppress(OSError):  # stderr was the closed terminal: the exit status says it
            print(f"interrupted ({signum.name}); run the same command again to continue where it stopped "
                  f"(finished work in {out} is kept)", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    except OSError as e:
        err = storage_error(e, e.filename or out)  # a write() into a full disk names no file
        if err is None:
            raise
        raise err from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def generator_command(name: str, description: str, generate, *, options=(), out_help: str | None = None,
                      seed_help: str | None = None, done=None):
    """main(argv) of `python -m data_prep.<name>`, a command that writes a release in the official
    format (a tiny set, or real data made offline): --out, the set's own `options` -- (flag, default)
    or (flag, default, help), typed by the default (a bool: a switch, off unless given), in the order
    generate() takes them -- and --seed; then result = generate(out, *options, seed) and one line,
    `done(args, result, seconds)` or 'wrote RESULT' (a dict's values joined). main returns the result; a UserError is one line."""
    p = argparse.ArgumentParser(prog=f"python -m data_prep.{name}", description=description)
    p.add_argument("--out", required=True, type=Path, help=out_help)
    dests = []
    for flag, default, *help_ in options:
        if isinstance(default, bool):  # a switch: given or not
            action = p.add_argument(flag, action="store_true", help=help_[0] if help_ else None)
        else:
            action = p.add_argument(flag, type=type(default), default=default, help=help_[0] if help_ else None)
        dests.append(action.dest)
    p.add_argument("--seed", type=int, default=0, help=seed_help)

    @cli
    def main(argv: list[str] | None = None):
        a = p.parse_args(argv)
        start = time.time()
        # a full, read-only or too long --out is one line, as for a prep
        result = one_line_failures(lambda: generate(a.out, *(getattr(a, d) for d in dests), a.seed), a.out)
        if done is not None:
            print(done(a, result, time.time() - start))
        else:
            print(f"wrote {', '.join(map(str, result.values())) if isinstance(result, dict) else result}")
        return result

    return main


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


def rgb_tensor(data: bytes):
    """Encoded image bytes as a uint8 (3, H, W) RGB tensor (HWC in memory): libjpeg-turbo through
    torchvision's decoder, ~2/3 of PIL's time on photographs; PIL for what it refuses (a PNG named .JPEG,
    as ILSVRC's train set holds one) or once torchvision drops it. torchvision deprecates its decoders from
    0.29 (pinned here; their successor, torchcodec, is not a dependency): that warning is silenced. A
    damaged file raises PIL's OSError."""
    import warnings

    import torch
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    try:
        from torchvision.io import ImageReadMode, decode_image as tv_decode

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return tv_decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except (ImportError, RuntimeError):
        pass
    with Image.open(io.BytesIO(data)) as im:
        return pil_to_tensor(im.convert("RGB"))


def decode_image(data, what: str, fix: str, kind: str = "an image") -> tuple[str, tuple[int, int]]:
    """(format, (width, height)) of an image -- its bytes or a path -- decoded in full, as a loader will
    decode it; a one-line UserError naming `what` and `fix` for one that does not decode: a damaged body
    passes a look at its first bytes and an archive's CRC (computed over the damage), then fails a
    training run mid-epoch."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
            im.load()
            return im.format, im.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise UserError(f"{what} does not decode as {kind} ({str(e)[:80]}); {fix}") from None


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


@contextlib.contextmanager
def tar_gz_writer(fileobj):
    """A tar.gz being written to `fileobj` whose bytes depend on its members only: with add_member's
    fixed times, and 0 for the gzip header's time (tarfile's "w:gz" writes the current time there, so
    every generation of the same release had new bytes, digests and data_fingerprint)."""
    import gzip
    import tarfile

    with gzip.GzipFile(filename="", mode="wb", fileobj=fileobj, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        yield tf


def add_member(tf, name: str, data: bytes) -> None:
    """Add a file to a tar being written, with fixed times and modes (deterministic archives)."""
    import tarfile

    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tf.addfile(info, io.BytesIO(data))


def sweep_temp_files(out: Path, log, skip=()) -> None:
    """Remove the temp files (`.<name>.*.tmp`, mpt.rundir.atomic_write's) that a prep killed mid-write
    left anywhere under OUT (folders named in `skip` are not walked: they hold no such files); call it
    when a prep starts work, before anything is written."""
    if Path(out).is_dir():
        stale = remove_stale_temp_files(out, recursive=True, skip=skip)
        if stale:
            log(f"removed {len(stale)} temp file(s) of an interrupted run under {out} (first: {stale[0]})")


# ------------------------------------------------------------------ progress

PROGRESS_ENV = "DATA_PREP_PROGRESS"  # seconds between progress lines, or "off"
_EVERY_TTY, _EVERY_LOG = 1.0, 30.0


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _amount(x: float, unit: str) -> str:
    if unit == "bytes":  # a stream read from an archive: its position, in decimal units as `ls -h --si`
        for div, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if x >= div:
                return f"{x / div:.1f} {name}"
        return f"{x:.0f} B"
    return f"{x:,.0f}"


class Progress:
    """The progress of one long step of a prep, on stderr (the prep's own lines stay on stdout): count /
    total, rate, elapsed and ~left. A terminal sees one line redrawn in place at most every second; a log
    file or a pipe gets a whole line every 30 s and no carriage return. A step done before its first
    interval -- every tiny set -- prints nothing. DATA_PREP_PROGRESS=SECONDS sets the interval (both
    cases), =off silences it. Our own rather than tqdm (which the training loop uses): tqdm redraws with
    carriage returns in a log file too, or (disable=None) prints nothing there, where a multi-hour prep
    run under nohup or a scheduler most needs its lines.

    Use as a context manager; `add(n)` counts work done, `set(x)` gives the position reached (the bytes
    of an archive read so far). Thread-safe."""

    def __init__(self, what: str, total: float | None = None, unit: str = "", stream=None):
        self.what, self.total, self.unit = what, total, unit
        self.stream = sys.stderr if stream is None else stream
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError, OSError):
            self.tty = False
        self.every = progress_interval(self.tty)
        self.done, self.printed, self.shown = 0, False, None
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, n: float = 1) -> None:
        self.set(self.done + n)

    def set(self, done: float) -> None:
        with self.lock:
            self.done = done
            if self.every is not None:
                now = time.monotonic()
                if now - self.last >= self.every:
                    self.last = now
                    self._write(self.line(now), final=False)

    def line(self, now: float | None = None) -> str:
        elapsed = (time.monotonic() if now is None else now) - self.t0
        unit = f" {self.unit}" if self.unit and self.unit != "bytes" else ""
        parts = [f"{self.what}: {_amount(self.done, self.unit)}"
                 + (f"/{_amount(self.total, self.unit)}{unit} ({100 * self.done / self.total:.0f}%)" if self.total
                    else unit)]
        if elapsed > 0:
            rate = self.done / elapsed
            parts.append(f"{_amount(rate, self.unit)}/s" if self.unit == "bytes"
                         else f"{rate:,.1f}{unit}/s" if rate < 10 else f"{rate:,.0f}{unit}/s")
        parts.append(f"{_duration(elapsed)} elapsed")
        if self.total and 0 < self.done < self.total and elapsed > 0:
            parts.append(f"~{_duration((self.total - self.done) * elapsed / self.done)} left")
        return ", ".join(parts)

    def _write(self, text: str, final: bool) -> None:
        with contextlib.suppress(OSError, ValueError):  # stderr was a closed terminal (SIGHUP): go on silently
            if self.tty:
                # carriage return, the text, then clear to the end of the line (a shorter line leaves no tail)
                self.stream.write(f"\r{text}\x1b[K" + ("\n" if final else ""))
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        self.printed, self.shown = True, self.done

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind, value, tb) -> None:
        """A step that printed progress ends with its final count; one stopped by an error or a signal
        only ends a redrawn line, so that the one-line error starts on a line of its own."""
        with self.lock:
            if not self.printed:
                return
            if kind is None and (self.tty or self.done != self.shown):
                self._write(self.line(), final=True)
            elif self.tty:
                with contextlib.suppress(OSError, ValueError):
                    self.stream.write("\n")
                    self.stream.flush()


def progress_interval(tty: bool) -> float | None:
    """Seconds between progress lines (None: none): DATA_PREP_PROGRESS (off or 0: none), else 1 s on a
    terminal, 30 s otherwise; a bad value is a one-line error naming the variable."""
    raw = os.environ.get(PROGRESS_ENV, "").strip()
    if not raw:
        return _EVERY_TTY if tty else _EVERY_LOG
    if raw.lower() == "off":
        return None
    try:
        every = float(raw)
        if not 0 <= every < float("inf"):
            raise ValueError
    except ValueError:
        raise UserError(f"{PROGRESS_ENV}={raw!r} is not a number of seconds; set it to e.g. 10, or to off "
                        f"(or 0) to silence the progress lines") from None
    return every or None


# ------------------------------------------------------------------ worker processes

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _worker_start(parent: int, initializer, initargs) -> None:
    """The first thing a pool worker does: die with the prep (a killed prep left its workers running for
    half an hour), and leave Ctrl-C and a closed terminal's SIGHUP to the prep (a terminal sends them to
    every process of the job)."""
    for s in (signal.SIGINT, *HANGUP):
        signal.signal(s, signal.SIG_IGN)
    # Forked with these signals blocked (worker_pool): one sent to the whole group while this worker
    # started is discarded here, now that it is ignored, instead of killing the worker mid-start.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, *HANGUP})
    # SIGTERM keeps the prep's handler (a worker sent one stops with Terminated, as before): forked with
    # it blocked too, it is unblocked once the handler can run outside the fork's callbacks.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if sys.platform.startswith("linux"):
        # The kernel sends SIGKILL when the parent dies, by any signal, SIGKILL included.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
    if initializer is not None:
        initializer(*initargs)


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


@contextlib.contextmanager
def worker_pool(workers: int, initializer=None, initargs=()):
    """A ProcessPoolExecutor of `workers` processes (None for workers <= 1: work in this process) whose
    workers die with this process -- killed by any signal, SIGKILL included -- and are killed at once when
    the block ends by an exception (Ctrl-C, SIGTERM, an error), rather than finishing their tasks first."""
    if workers <= 1:
        yield None
        return
    ctx = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_start,
                                                  initargs=(os.getpid(), initializer, initargs))
    if ctx is not None:
        # Fork every worker now (a forked pool starts them all at its first task) with Ctrl-C, SIGHUP and
        # SIGTERM blocked: a terminal sends the first two to the whole group, and a worker not yet past
        # _worker_start would die of one half-started; and a handler that ran here during the fork would
        # run inside Python's after-fork callbacks, which print and ignore its exception (a SIGTERM then
        # vanished and the prep finished with exit 0). Blocked, not ignored: this process gets a signal
        # sent meanwhile as soon as the workers exist, when the mask is restored.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, *HANGUP})
        try:
            pool.submit(int).result()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    try:
        yield pool
    except BaseException:
        _kill_pool(pool)
        raise
    pool.shutdown(wait=True)


def _kill_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Kill the pool's workers and end its threads without waiting on a pipe a killed worker left half
    written. The pool's manager thread sees its workers die and cleans up after them itself (it closes
    the task pipe's reading end, which frees a feeder thread blocked writing a task no worker reads). It
    is left to do so alone -- closing the same pipe ends here too raced it: one descriptor closed twice,
    a traceback printed by the thread. Only if it is still blocked after the workers are dead -- reading
    the rest of a result a worker was sending when it died, from a pipe whose writing end this process
    also holds, so it never sees end-of-file -- is that writing end closed here: end-of-file frees it.
    (No public kill before Python 3.14's kill_workers; _processes: pid -> multiprocessing.Process,
    _result_queue the pool's result queue, _executor_manager_thread the manager.)"""
    procs, thread = list((pool._processes or {}).values()), pool._executor_manager_thread
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.join(5.0)
    if thread is not None:
        thread.join(2.0)
        if thread.is_alive():
            with contextlib.suppress(OSError, AttributeError):
                pool._result_queue._writer.close()
            thread.join(10.0)
    pool.shutdown(wait=False, cancel_futures=True)
