"""Stopping a run cleanly on a signal, and keeping DataLoader workers out of the way of the signals
meant for the main process (SLURM's pre-timeout signal, preemption, Ctrl-C)."""
from __future__ import annotations

import os
import signal


class _Stop:
    """Set from a signal handler (SLURM's pre-timeout signal, preemption, `kill`, Ctrl-C): the loop
    checkpoints at the next step boundary and returns with status "interrupted"."""

    def __init__(self):
        self.reason: str | None = None
        self.signum: int | None = None

    def request(self, reason: str = "signal", signum: int | None = None) -> None:
        self.reason, self.signum = reason, signum

    def clear(self) -> None:
        self.reason = self.signum = None


STOP = _Stop()
# The signals that stop a run cleanly: SLURM's pre-timeout signal (USR1 here; slurm.job uses USR2),
# SIGTERM (a plain `kill`, torchrun, scancel and most schedulers' preemption), SIGINT (Ctrl-C) and
# SIGHUP (the terminal or ssh session closed: its default action killed the run with no checkpoint).
HANGUP = (signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()  # no SIGHUP on Windows
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, *HANGUP)


def detach_from_closed_terminal(signum: int) -> None:
    """After SIGHUP, stdout and stderr that were the closed terminal go to /dev/null (what nohup does):
    a write to a hung-up terminal fails (EIO), and a print would fail the run before its checkpoint."""
    if signum not in HANGUP:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        try:
            if os.isatty(fd):
                os.dup2(null, fd)
        except OSError:
            pass
    os.close(null)


def install_stop_handlers(signals=STOP_SIGNALS) -> None:
    """Each signal asks the loop to checkpoint at the next step boundary and stop ("interrupted").
    A second Ctrl-C aborts at once (KeyboardInterrupt): the run then resumes from its last checkpoint."""

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and STOP.reason is not None:
            raise KeyboardInterrupt
        STOP.request(name, signum)
        detach_from_closed_terminal(signum)
        try:  # os.write, not print: a handler may run inside another print to the same stream
            os.write(2, f"{name}: checkpointing at the next step boundary, then stopping"
                        f"{' (Ctrl-C again: abort now)' if signum == signal.SIGINT else ''}\n".encode())
        except OSError:  # stderr gone (a closed pipe): the stop must still happen
            pass

    for s in signals:
        signal.signal(s, handler)


def worker_init(worker_id: int) -> None:
    """DataLoader workers get the stop signals meant for the main process: Ctrl-C and a closed
    terminal's SIGHUP reach the whole process group, and SLURM signals every process of a job step
    (USR2 before the time limit, SIGTERM at preemption, requeue and scancel). A worker killed by one
    fails the run mid-step ("DataLoader worker exited unexpectedly", no checkpoint), so workers ignore
    them and the main process stops the run at a step boundary with a checkpoint.

    SIGTERM from the main process itself must still end a worker: torch's DataLoader terminate()s a
    worker that did not exit when asked, and at interpreter exit multiprocessing terminate()s and then
    joins (no timeout) the workers of a loader still referenced, e.g. by an exception's traceback,
    which would hang forever on a worker ignoring SIGTERM. A Python handler cannot see the sender,
    so SIGTERM is blocked here and a thread takes it with sigwaitinfo, which can: it exits like
    torch's own worker handler when the sender is the main process (or the main process is gone),
    and drops it otherwise. A worker whose main process died also exits by torch's watchdog (it
    polls the parent every 5 s)."""
    for name in ("SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"):
        if hasattr(signal, name):  # no SIGUSR* on Windows
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # macOS, Windows: SIGTERM keeps torch's handling
        return
    import threading

    parent = os.getppid()

    def take_sigterm() -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == parent or os.getppid() != parent:
                os._exit(0)  # exit status 0, as torch's handler: the main process does not report it

    # Blocked before the thread starts, so it and every later thread of the worker inherit the mask
    # and a SIGTERM can only be taken by sigwaitinfo, not by torch's default-action handler.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=take_sigterm, name="pt_worker_sigterm", daemon=True).start()
