"""Worker processes that die with the prep (worker_pool): a killed prep leaves no orphan workers."""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time

from mpt.signals import HANGUP

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
    try:
        if ctx is not None:
            # Fork every worker now (a forked pool starts them all at its first task) with Ctrl-C, SIGHUP
            # and SIGTERM blocked: a terminal sends the first two to the whole group, and a worker not yet
            # past _worker_start would die of one half-started; and a handler that ran here during the fork
            # would run inside Python's after-fork callbacks, which print and ignore its exception (a
            # SIGTERM then vanished and the prep finished with exit 0). Blocked, not ignored: this process
            # gets a signal sent meanwhile as soon as the workers exist, when the mask is restored -- inside
            # this try, so that the pool is killed as for any other exception (left alive, its manager
            # thread closed its wake-up pipe while the interpreter's exit wrote to it: a traceback).
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, *HANGUP})
            try:
                pool.submit(int).result()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
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
