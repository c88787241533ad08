"""The command line of every data_prep tool: prep_command (prepare a release: one-line failures, a lock on
--out, stop signals that leave a resumable state) and generator_command (write a release in the official
format: the tiny sets and the real-data ones). A prep command fails in one line (README "What a run
survives"): a full disk, a read-only or unwritable --out exits with 2 naming the path; Ctrl-C, SIGTERM or
SIGHUP exits with 130, 143 or 129 and says that running the same command again continues (every prep
resumes; every file is written atomically); a second prep into an --out that one is preparing is refused."""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import threading
import time
from pathlib import Path

from mpt.errors import UserError, cli
from mpt.rundir import storage_error
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
