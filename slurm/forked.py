"""A local cell forked from multiprocessing's forkserver once that has imported the cells' modules
(torch, torchvision, the experiments' tasks), instead of a fresh interpreter: slurm.local starts CPU cells
this way. The fork is otherwise the fresh process: own session, environment, log, `ps` line, global RNGs,
exit code and stop signals.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pathlib
import runpy
import select
import signal
import sys
import threading
import time
import traceback

from mpt import REPO
from mpt.rundir import atomic_write_text, open_no_follow
from mpt.signals import HANGUP

FORKSERVER = "forkserver" in multiprocessing.get_all_start_methods()  # not on Windows: fresh processes there
# The signals that stop a grid: the launcher forwards them to its cells as SIGTERM, and the forkserver
# ignores them (it is in the launcher's process group: a closed terminal's SIGHUP or a `kill -- -PGID`
# reaches it too).
_GROUP_STOPS = (signal.SIGINT, signal.SIGTERM, *HANGUP)


def _start_forkserver() -> None:
    """Start multiprocessing's forkserver (if it is not running) with the group's stop signals ignored.
    It is the cells' parent but not their supervisor: the launcher tracks every cell by its own pid, so
    a forkserver that dies anyway (kill -9) loses no cell, and the next cell starts a new one. The
    signals are blocked while their handlers are swapped, so one that arrives meanwhile waits for the
    launcher's handler instead of being lost; the forkserver inherits the mask, its cells unblock it."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():  # handlers can be set in the main thread only
        forkserver.ensure_running()
        return
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP_STOPS)
    try:
        old = {s: signal.signal(s, signal.SIG_IGN) for s in _GROUP_STOPS}  # kept across exec
        try:
            forkserver.ensure_running()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _has_ended(pidfd: int | None, pid: int, start_time: str | None) -> bool:
    """Whether process `pid` has exited: its pidfd is readable (Linux >= 5.3), or else /proc says it is
    gone, a zombie, or another process with that pid (a different start time)."""
    if pidfd is not None:
        return bool(select.select([pidfd], [], [], 0)[0])
    st = _proc_stat(pid)
    return st is None or st[0] == "Z" or st[19] != start_time


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


class Forked:
    """One rank of a CPU cell, forked from multiprocessing's forkserver once that has imported the
    cells' modules: importing torch, torchvision and an experiment costs ~3 s of a 2-core machine's
    time per process, a third of a short tiny run. The fork is a process of its own as a fresh interpreter
    is (own session, environment, log, `ps` line, global RNGs; exit code and stop signals as before): the
    same run, bit for bit. What run_local uses of a subprocess.Popen: pid, poll(), returncode, send_signal().

    The cell is tracked by its own pid (a pidfd), not by the forkserver's status pipe: the forkserver is
    its parent and reaps it, but a forkserver that dies must not make a running cell look ended (its slot
    freed, its stop signals never sent, "exit 255"). The exit code comes from a file the cell writes
    atomically as it exits; a cell killed by a signal writes none, and its parent, the forkserver, reports
    it (-N); when that is gone too the code is lost and reported as 255."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: pathlib.Path | None,
                 exit_file: pathlib.Path):
        _start_forkserver()
        self._exit_file = exit_file
        self._p = multiprocessing.get_context("forkserver").Process(
            target=_forked_main, args=(argv, env, str(log) if log else None, str(exit_file)), name=name)
        self._p.start()
        self.pid, self.returncode = self._p.pid, None
        self._pidfd, self._start_time = None, None
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except AttributeError:  # no pidfd in this Python or kernel: /proc and the start time
            st = _proc_stat(self.pid)
            self._start_time = st[19] if st else None
        except ProcessLookupError:  # already ended (and reaped): only its exit file says how
            self._pidfd = -1
        except OSError:
            st = _proc_stat(self.pid)
            self._start_time = st[19] if st else None
        self._ended_at = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._pidfd != -1 and not _has_ended(self._pidfd, self.pid, self._start_time):
            return None
        self._ended_at = self._ended_at or time.monotonic()
        try:
            code = int(self._exit_file.read_text())
        except (OSError, ValueError):  # no exit file: killed by a signal; the forkserver saw how
            code = self._p.exitcode  # 255 when the forkserver is gone too
            if code is None and time.monotonic() - self._ended_at < 5:  # the server has yet to reap it
                return None
        self.returncode = 255 if code is None else code
        if self._pidfd not in (None, -1):
            os.close(self._pidfd)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is not None:  # never a signal to a pid that may belong to another process by now
            return
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd == -1:  # ended before it could be opened
                return
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signum)
            else:
                os.kill(self.pid, signum)


def _set_cmdline(argv: list[str]) -> None:
    """Make `ps` show `argv` for this process, as it would for a fresh `python -m MODULE ...`, not the
    forkserver's `python -c from multiprocessing.forkserver import main; ...`: /proc/<pid>/cmdline is
    the memory that held the process's arguments, so they are written over in place (what setproctitle
    does, without moving the environment: a title longer than the forkserver's own command line, a few
    hundred bytes, is cut). Nothing is written unless that memory holds what /proc shows."""
    import ctypes

    try:
        st = _proc_stat(os.getpid()) or []
        start, end = int(st[45]), int(st[46])  # fields 48 and 49: arg_start, arg_end
        with open("/proc/self/cmdline", "rb") as f:
            shown = f.read()
        if not start or end - start != len(shown) or ctypes.string_at(start, end - start) != shown:
            return
        title = "\0".join(argv).encode()[:end - start - 1]
        ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)
    except (OSError, ValueError, IndexError):
        pass


def _forked_main(argv: list[str], env: dict[str, str], log: str | None, exit_file: str) -> None:
    """In the fork: become `python -m MODULE ARGS` (argv) with `env`, its output appended to `log`, and
    leave its exit code in `exit_file`."""
    import random

    os.setsid()  # as start_new_session: a Ctrl-C reaches the cell only as the launcher's SIGTERM
    # The forkserver ignores (and inherited blocked) the stop signals; a fresh interpreter has their defaults.
    for s in _GROUP_STOPS:
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _GROUP_STOPS)
    _set_cmdline(argv)
    # The global RNGs are the forkserver's copies: every cell would draw the same np.random numbers.
    # Fresh entropy, as a fresh interpreter seeds them (random also reseeds itself at fork).
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    fd = open_no_follow(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT) if log else os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if env.get("OMP_NUM_THREADS"):  # torch read the variable when the server imported it, not here
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    module, args = argv[2], argv[3:]
    sys.argv = [module, *args]
    code, interrupted = 0, False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter reads it
        if e.code is None or isinstance(e.code, int):
            code = (e.code or 0) & 0xFF
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = -signal.SIGINT, True
    except BaseException:  # noqa: BLE001 -- an uncaught exception: its traceback, exit 1
        traceback.print_exc()
        code = 1
    # What an interpreter's exit runs, in its order: wait for non-daemon threads, then atexit functions.
    threading._shutdown()
    atexit._run_exitfuncs()  # multiprocessing ends a fork with os._exit: run what an exit would run
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError):
        atomic_write_text(exit_file, str(code))
    if interrupted:  # as the interpreter does after an uncaught KeyboardInterrupt: die of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)
