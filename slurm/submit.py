"""Send an experiment's grid to a SLURM cluster (job arrays) or run it on this machine.

    python -m slurm.submit experiments/ilsvrc_cnns/grid.yaml --profile tiny --backend local
    python -m slurm.submit experiments/ilsvrc_cnns/grid.yaml --profile paper --backend slurm \\
        --cluster mycluster --dry-run

Cells already completed (or diverged) are skipped, and so are cells whose job is still queued or
running; failed and interrupted cells are submitted again and resume from their checkpoints. Each
submission appends its cells, job ids and the git commit to <out_dir>/<experiment>/submissions.jsonl.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import io
import json
import multiprocessing
import os
import pathlib
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

from mpt import REPO
from mpt.errors import UserError, cli
from mpt.rundir import atomic_write_text, open_no_follow
from mpt.signals import HANGUP, detach_from_closed_terminal
from slurm import clusters, feed
from slurm.grid import Cell, Grid, load as load_grid, nodes_and_tasks
from slurm.state import FINAL, append_manifest, cell_state, latest_jobs, slurm_queue


# ------------------------------------------------------------------------------------------------
# SLURM backend


def _sbatch_message(err: BaseException) -> str:
    """sbatch's own words from a failed submission, on one line."""
    text = str(err).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    msgs = [ln.split("error:", 1)[-1].strip() for ln in lines if "error:" in ln] or lines[-1:]
    out = []
    for m in msgs:  # sbatch often says the same thing twice ("invalid partition" / "Invalid partition")
        if m.lower() not in (o.lower() for o in out):
            out.append(m)
    return "; ".join(out) or type(err).__name__


def submit_slurm(g: Grid, cells: list[Cell], cluster: clusters.Cluster, exp_dir: pathlib.Path,
                 submitted: list[tuple[Cell, str]]) -> None:
    """Submit `cells` as job arrays of at most cluster.max_array_size tasks; appends (cell, job id)
    to `submitted` as it goes, so a failure half-way still leaves a complete record."""
    for tool in ("sbatch", "srun", "scontrol"):
        if shutil.which(tool) is None:
            raise UserError(f"--backend slurm needs SLURM's {tool} on PATH (not found on this machine); "
                            "submit from a cluster login node, start a test cluster (slurm/local_cluster.sh) "
                            "or use --backend local")
    import submitit
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    from slurm.job import CellJob

    nodes, per_node = nodes_and_tasks(g.resources, cluster.gpus_per_node)
    params = clusters.sbatch_parameters(cluster, job_name=f"{g.experiment}-{g.profile}", nodes=nodes,
                                        tasks_per_node=per_node, gpus=g.resources.gpus, chdir=str(REPO))
    ex = submitit.SlurmExecutor(folder=exp_dir / "slurm_logs" / "%j", max_num_timeout=cluster.max_requeues,
                                python=cluster.python)
    try:
        ex.update_parameters(**params)
    except ValueError as e:
        raise UserError(f"cluster profile {cluster.name}: {str(e).splitlines()[0]}") from None
    size = cluster.max_array_size
    for i in range(0, len(cells), size):
        chunk = cells[i:i + size]
        jobs = []
        # submitit prints sbatch's stderr itself before raising; the one-line error below says it.
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                with ex.batch():
                    for c in chunk:
                        jobs.append(ex.submit(CellJob(c.experiment, c.overrides, str(c.run_dir), cluster.max_requeues)))
            except (FailedJobError, FailedSubmissionError, subprocess.CalledProcessError) as e:
                raise UserError(f"sbatch rejected the job: {_sbatch_message(e)}") from None
        submitted.extend((c, j.job_id) for c, j in zip(chunk, jobs))


# ------------------------------------------------------------------------------------------------
# local backend


@dataclass
class LocalTask:
    """One cell to run locally: one process per rank."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    world: int = 1
    gpus: int = 0
    log: pathlib.Path | None = None
    run_dir: pathlib.Path | None = None  # its summary.json names the result in the progress line
    weight: float = 1.0  # its expected length (the grid's hours), for the time-left estimate
    # Modules to import once for every cell: a CPU cell whose argv is `python -m MODULE ...` then starts
    # as a fork of a process that already imported them (_Forked), not as a fresh interpreter.
    preload: tuple[str, ...] = ()
    timeout: float | None = None  # seconds; past it the cell is stopped as by a stop signal (--cell-timeout)


FORKSERVER = "forkserver" in multiprocessing.get_all_start_methods()  # not on Windows: fresh processes there
# The signals that stop a grid: the launcher forwards them to its cells as SIGTERM, and the forkserver
# ignores them (it is in the launcher's process group: a closed terminal's SIGHUP or a `kill -- -PGID`
# reaches it too).
_GROUP_STOPS = (signal.SIGINT, signal.SIGTERM, *HANGUP)
# After --cell-timeout, a cell gets SIGTERM (checkpoint at the next step boundary); one still running this
# long after it is killed (a hung step, a leaked non-daemon thread), as SLURM's KillWait does.
KILL_AFTER_S = 60.0


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


class _Forked:
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

    def __init__(self, t: LocalTask, env: dict[str, str], exit_file: pathlib.Path):
        _start_forkserver()
        self._exit_file = exit_file
        self._p = multiprocessing.get_context("forkserver").Process(
            target=_forked_main, args=(t.argv, env, str(t.log) if t.log else None, str(exit_file)), name=t.name)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_cap(threads: int, world: int, gpus: int) -> int:
    """How many cells fit on this machine at once: cores / (threads x ranks), or GPUs / GPUs per run."""
    if gpus > 0:
        import torch

        return max(1, torch.cuda.device_count() // gpus)
    return max(1, (os.cpu_count() or 1) // (threads * world))


def _minutes(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"


def _result(t: LocalTask, code: int) -> str:
    """What a finished cell gives: its status and primary metric (summary.json), or its exit code."""
    try:
        s = json.loads((t.run_dir / "summary.json").read_text()) if t.run_dir else {}
        metric = s.get("primary_metric")
        value = (s.get("metrics") or {}).get(metric)
        what = f"{s.get('status') or ''}" + (f", {metric} {value:.4g}" if isinstance(value, (int, float)) else "")
    except (OSError, ValueError, TypeError):
        what = ""
    return (what or "done") if code == 0 else f"exit {code}" + (f" ({what})" if what else "")


def run_local(tasks: list[LocalTask], cap: int, started=None, say=print) -> dict[str, int]:
    """Run tasks with at most `cap` at once (submitit's local executor has no limit); returns
    name -> exit code (the worst of its ranks). SIGINT/SIGTERM/SIGHUP stop the running cells at a step
    boundary with a checkpoint (each such signal is sent on to every running cell as SIGTERM) and start no
    more. A cell past its `timeout` gets SIGTERM too, and SIGKILL KILL_AFTER_S later if it still runs.
    As each cell ends, one line: [k/N] name: result (its time; elapsed, and the time left estimated from
    the cells' weights)."""
    if cap < 1:
        raise UserError(f"--jobs {cap}: run at least one cell at a time")
    pool = _LocalPool(tasks, started, say)
    signals: list[int] = []
    old = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
        def stop(signum, frame):
            signals.append(signum)
            detach_from_closed_terminal(signum)

        old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, *HANGUP)}
    try:
        while pool.pending or pool.running:
            while (pool.pending and len(pool.running) < cap and not signals
                   and pool.pending[0].gpus <= len(pool.free_gpus)):
                pool.start(pool.pending.pop(0))
            pool.forward(signals)
            pool.enforce_timeouts()
            pool.reap()
            if signals and not pool.running:
                break
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if pool.exits is not None:
            shutil.rmtree(pool.exits, ignore_errors=True)
    if signals:
        raise UserError(f"stopped by signal: {len(pool.results)} cell(s) ended, {len(pool.pending)} not started; "
                        "submit again to resume")
    return pool.results


class _LocalPool:
    """run_local's cells: those not started, those running (their processes and GPUs), their results."""

    def __init__(self, tasks: list[LocalTask], started, say):
        self.tasks, self.started, self.say = tasks, started, say
        self.pending = list(tasks)
        self.t0, self.began, self.total, self.done_weight = time.monotonic(), {}, sum(t.weight for t in tasks), 0.0
        self.running: dict[str, tuple[list[subprocess.Popen | _Forked], list[int]]] = {}
        self.results: dict[str, int] = {}
        self.free_gpus: list[int] = []
        if any(t.gpus for t in tasks):
            import torch

            self.free_gpus = list(range(torch.cuda.device_count()))
            if max(t.gpus for t in tasks) > len(self.free_gpus):
                raise UserError(f"a run needs {max(t.gpus for t in tasks)} GPU(s); this machine has "
                                f"{len(self.free_gpus)}")
        preload = list(dict.fromkeys(m for t in tasks for m in t.preload))
        self.fork = bool(preload) and FORKSERVER
        if self.fork:  # what the forkserver imports when it starts (the first fork); a running one keeps its own
            multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
        # the forked cells' exit codes
        self.exits = pathlib.Path(tempfile.mkdtemp(prefix="mpt-cells-")) if self.fork else None
        self.forwarded = 0  # stop signals sent on to the running cells so far
        self.stopping: dict[str, float] = {}  # cells past their timeout -> when they were sent SIGTERM
        self.killed: set[str] = set()

    def start(self, t: LocalTask) -> None:
        """Start a cell's ranks: forked from the preloaded server where it can, else fresh processes."""
        gpus = [self.free_gpus.pop(0) for _ in range(t.gpus)]
        port = str(_free_port())
        envs = []
        for r in range(t.world):
            env = {**os.environ, **t.env, "RANK": str(r), "WORLD_SIZE": str(t.world),
                   "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            if t.log:
                env["MPT_JOB_LOG"] = str(t.log)
            if t.gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            envs.append(env)
        # Opened here for either start (a log that cannot be appended to is a one-line error); a
        # forked cell opens it again itself.
        logf = (os.fdopen(open_no_follow(t.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") if t.log
                else subprocess.DEVNULL)
        procs = []
        if self.fork and t.preload and not t.gpus and t.argv[1:2] == ["-m"]:
            try:
                for r, env in enumerate(envs):
                    procs.append(_Forked(t, env, self.exits / f"{len(self.began)}-{r}"))
            except (EOFError, OSError) as e:  # the server died, e.g. a preloaded module failed at import
                for p in procs:
                    p.send_signal(signal.SIGKILL)
                procs, self.fork = [], False
                self.say(f"the preloaded start failed ({type(e).__name__}: {e}); the cells start as fresh processes")
        if not procs:
            # Own session: a Ctrl-C reaches the cells only as the SIGTERM forwarded below.
            procs = [subprocess.Popen(t.argv, env=env, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT,
                                      start_new_session=True) for env in envs]
        if t.log:
            logf.close()
        self.running[t.name] = (procs, gpus)
        self.began[t.name] = (time.monotonic(), t)
        if self.started is not None:
            self.started(t, procs[0].pid)

    def forward(self, signals: list[int]) -> None:
        """Every stop signal, not only the first, reaches every running cell (as SIGTERM)."""
        if len(signals) > self.forwarded:
            if not self.forwarded:
                self.say(f"stopping {len(self.running)} running cell(s) at their next step boundary (checkpoint) ...")
            for procs, _ in self.running.values():
                for p in procs:
                    p.send_signal(signal.SIGTERM)
            self.forwarded = len(signals)

    def enforce_timeouts(self) -> None:
        """A cell past its timeout: SIGTERM (a checkpoint at its next step), SIGKILL KILL_AFTER_S later."""
        for name in list(self.running):
            start, t = self.began[name]
            procs = self.running[name][0]
            if t.timeout is not None and name not in self.stopping and time.monotonic() - start > t.timeout:
                self.say(f"  {name}: past --cell-timeout {t.timeout:g} s: stopping it at its next step boundary "
                         "(checkpoint)")
                self.stopping[name] = time.monotonic()
                for p in procs:
                    p.send_signal(signal.SIGTERM)
            elif (name in self.stopping and name not in self.killed
                  and time.monotonic() - self.stopping[name] > KILL_AFTER_S and any(p.poll() is None for p in procs)):
                self.say(f"  {name}: still running {KILL_AFTER_S:g} s after its timeout's SIGTERM: killed")
                self.killed.add(name)
                for p in procs:
                    p.send_signal(signal.SIGKILL)

    def reap(self) -> None:
        """Cells whose ranks all ended: their result (the worst exit code), their GPUs back, one line each."""
        for name in list(self.running):
            procs, gpus = self.running[name]
            if not all(p.poll() is not None for p in procs):
                continue
            self.results[name] = max((p.returncode for p in procs), key=abs)
            self.free_gpus.extend(gpus)
            del self.running[name]
            start, t = self.began[name]
            now_, self.done_weight = time.monotonic(), self.done_weight + t.weight
            elapsed = now_ - self.t0
            left = elapsed * (self.total - self.done_weight) / self.done_weight if self.done_weight > 0 else 0.0
            why = f", stopped at its --cell-timeout {t.timeout:g} s" if name in self.stopping else ""
            self.say(f"  [{len(self.results)}/{len(self.tasks)}] {name}: {_result(t, self.results[name])}{why} "
                     f"({_minutes(now_ - start)}; {_minutes(elapsed)} elapsed"
                     + (f", ~{_minutes(left)} left)" if len(self.results) < len(self.tasks) else ")"))


# ------------------------------------------------------------------------------------------------
# the command


def _git() -> tuple[str, bool]:
    from mpt.rundir import git_info

    return git_info()


def _fmt_hours(h: float) -> str:
    return f"{h:,.0f}" if h >= 100 else f"{h:.3g}"


def plan(g: Grid, force: bool, queue_needed: bool, feed_on: clusters.Cluster | None = None
         ) -> tuple[list[Cell], dict[str, int], list[str]]:
    """Which cells to submit: not those completed or diverged, nor (unless force) those whose job is
    still queued or running. Returns (todo, skipped counts by state, one printable line per cell);
    with `feed_on` (a GPU cluster), each line ends with whether the cell's loader feeds its GPUs
    (slurm/feed.py)."""
    exp_dirs = sorted({c.run_dir.parent for c in g.cells})
    latest = latest_jobs(exp_dirs)
    queue = slurm_queue() if queue_needed or any(
        not str(j["job_id"]).startswith("local:") for j in latest.values()) else None
    todo, skipped, lines = [], {}, []
    width = max(len(c.run_name) for c in g.cells)
    lwidth = max(len(c.label) for c in g.cells)
    world = g.resources.world
    for c in g.cells:
        st = cell_state(c.run_dir, c.cell_id, latest.get(c.cell_id), queue)
        if st.state in FINAL or (st.state in ("running", "pending") and not force):
            skipped[st.state] = skipped.get(st.state, 0) + 1
            note = f"skip ({st.state}" + (f", job {st.job_id})" if st.job_id and st.state not in FINAL else ")")
        else:
            todo.append(c)
            note = "submit" if st.state == "not submitted" else f"submit ({st.state}: resumes)"
        b, accum = c.cfg.train.batch_size, c.cfg.train.accum_steps
        split = f" ({accum} micro-batches of {b // world // accum})" if accum > 1 else ""
        lines.append(f"  {c.run_name:<{width}}  {c.label:<{lwidth}}  batch {b} = {world} x {b // world}{split}"
                     f"{bn_batch_note(c.cfg, world, 'GPU' if g.resources.gpus else 'rank')}  {note}"
                     + (f"  data: {feed.feed_note(c.cfg, feed_on, world)}" if feed_on else ""))
    return todo, skipped, lines


@functools.lru_cache(maxsize=None)
def has_batchnorm(model: str) -> bool:
    """Whether the registered model has batch-norm layers. Built at 1/64 width on the CPU: cheap, and
    the meta device would first import half of torch (tens of seconds on a loaded machine)."""
    import torch

    import models

    try:
        m = models.build(model, width=1 / 64)
    except Exception:  # noqa: BLE001 -- not a registry model, or one that needs other arguments: nothing to say
        return False
    return any(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in m.modules())


def bn_batch_note(cfg, world: int, unit: str = "GPU") -> str:
    """", BN batch N ..." -- the images each batch-norm layer normalises over in one step on a run of
    several ranks: the per-rank micro-batch, or all ranks' with task.sync_bn (SyncBatchNorm). Empty for
    one-rank runs (the BN batch is the batch; and no need to import torch for them)."""
    if world <= 1 or not has_batchnorm(cfg.model):
        return ""
    per_rank = cfg.train.batch_size // world // max(cfg.train.accum_steps, 1)
    if getattr(cfg.task, "sync_bn", False):
        return f", BN batch {per_rank * world} (synced over {world})"
    return f", BN batch {per_rank} per {unit}"


def print_plan(g: Grid, todo, skipped, lines, backend: str, cluster: clusters.Cluster | None, full: bool) -> None:
    res = g.resources
    where = f"cluster {cluster.name}" if cluster else f"this machine ({socket.gethostname()})"
    print(f"{g.path} profile {g.profile}, backend {backend} on {where}: {len(g.cells)} cell(s), {len(todo)} to submit"
          + (f", skipped: {', '.join(f'{n} {k}' for k, n in skipped.items())}" if skipped else ""))
    if full or len(lines) <= 50:
        print("\n".join(lines))
    hours = sum(res.hours_for(c.cfg.model) for c in todo)
    if res.gpus:
        nodes = ""
        if cluster:
            n, per_node = nodes_and_tasks(res, cluster.gpus_per_node)
            nodes = f" on {n} node(s) x {per_node}"
        print(f"resources per run: {res.gpus} GPU(s), one rank each (NCCL){nodes}")
        print(f"estimated: {_fmt_hours(hours)} run-hours x {res.gpus} GPUs = {_fmt_hours(hours * res.gpus)} GPU-hours "
              f"for {len(todo)} run(s)")
    else:
        print(f"resources per run: CPU only, {res.world} process(es)" + (" (gloo)" if res.world > 1 else ""))
        print(f"estimated: {_fmt_hours(hours)} run-hours, 0 GPU-hours for {len(todo)} run(s)")
    if cluster:
        n_arrays = -(-len(todo) // cluster.max_array_size)
        part = cluster.cpu_partition if (not res.gpus and cluster.cpu_partition) else cluster.partition
        print(f"sbatch: partition {part or '(default)'}, {cluster.cpus_per_task} CPU(s) and {cluster.mem_gb_per_task:g} GB "
              f"per task, time limit {cluster.time_min} min (USR2 {cluster.signal_delay_s} s before: checkpoint + "
              f"requeue), {n_arrays} array(s) of <= {cluster.max_array_size}, <= {cluster.array_parallelism} at once")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slurm.submit", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("grid", help="grid file, e.g. experiments/ilsvrc_cnns/grid.yaml")
    p.add_argument("--profile", required=True, help="grid profile, e.g. tiny or paper")
    p.add_argument("--backend", required=True, choices=["slurm", "local"],
                   help="slurm: job arrays via submitit; local: this machine")
    p.add_argument("--cluster", help="cluster profile for --backend slurm: slurm/clusters/<name>.yaml or a path")
    p.add_argument("--dry-run", action="store_true", help="print the cells, resources and GPU-hours; submit nothing")
    p.add_argument("--only", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="only cells with these values (same key twice: either value)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE", dest="extra",
                   help="extra config overrides for every cell, e.g. task.data_root=/data/imagenet")
    p.add_argument("--force", action="store_true", help="also resubmit cells that look queued or running")
    p.add_argument("--jobs", type=int, help="local backend: cells at once (default: cores / (threads x ranks))")
    p.add_argument("--threads", type=int, help="local backend: CPU threads per process (default: the grid's)")
    p.add_argument("--cell-timeout", type=float, metavar="SECONDS",
                   help="local backend: stop a cell running longer (checkpoint, as Ctrl-C; killed 60 s later if "
                        "it still runs); on SLURM the cluster profile's time limit does this")
    return p


@dataclass
class Submission:
    """One parsed and planned submission: its arguments, grid, cluster and the cells to run."""

    args: argparse.Namespace
    grid: Grid
    cluster: clusters.Cluster | None
    todo: list[Cell]
    record: dict
    follow: str

    @property
    def exp_dir(self) -> pathlib.Path:
        return self.todo[0].run_dir.parent


def prepare(argv) -> Submission:
    """Parse a submission's arguments, load its grid, check it and print its plan."""
    a = _parser().parse_args(argv)
    if a.backend == "slurm" and not a.cluster:
        raise UserError("--backend slurm needs --cluster <name> (a profile in slurm/clusters/, e.g. local)")
    if a.backend == "local" and a.cluster:
        raise UserError("--cluster is for --backend slurm; the local backend runs on this machine")
    if a.backend == "slurm" and (a.jobs is not None or a.threads is not None or a.cell_timeout is not None):
        raise UserError("--jobs/--threads/--cell-timeout are for --backend local; on SLURM use the cluster profile")
    if a.cell_timeout is not None and not a.cell_timeout > 0:  # also NaN
        raise UserError(f"--cell-timeout {a.cell_timeout:g}: give a positive number of seconds "
                        "(leave it out for no limit)")
    for flag, n in (("--jobs", a.jobs), ("--threads", a.threads)):
        if n is not None and n < 1:
            raise UserError(f"{flag} {n}: give at least one (leave it out for the default)")
    cluster = clusters.load(a.cluster) if a.backend == "slurm" else None
    extra = list(a.extra)
    if cluster and cluster.ckpt_every_minutes is not None:  # an infrastructure key: same cells
        extra.insert(0, f"train.ckpt_every_minutes={cluster.ckpt_every_minutes}")
    g = load_grid(a.grid, a.profile, extra, a.only)
    if cluster:
        nodes_and_tasks(g.resources, cluster.gpus_per_node)  # fails early on GPUs the cluster lacks
    for c in g.cells:  # the engine would fail at start; say it now
        if c.cfg.train.batch_size % g.resources.world:
            raise UserError(f"{c.run_name}: global batch train.batch_size={c.cfg.train.batch_size} does not divide "
                            f"over {g.resources.world} ranks")
    feed_on = cluster if a.dry_run and cluster and g.resources.gpus else None
    todo, skipped, lines = plan(g, a.force, a.backend == "slurm", feed_on)
    print_plan(g, todo, skipped, lines, a.backend, cluster, a.dry_run)
    if feed_on:
        print(feed.sources(g.cells, cluster, g.resources.world))
    if not todo:
        print("nothing to submit")
    commit, dirty = _git()
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "grid": str(g.path), "profile": g.profile,
              "backend": a.backend, "cluster": cluster.name if cluster else None, "git_commit": commit,
              "git_dirty": dirty, "argv": sys.argv[1:] if argv is None else list(argv)}
    follow = f"python -m slurm.status {g.path} --profile {g.profile}" + (f" --set {' '.join(a.extra)}" if a.extra else "")
    return Submission(a, g, cluster, todo, record, follow)


def main(argv=None) -> None:
    sub = prepare(argv)
    if sub.args.dry_run or not sub.todo:
        return
    if sub.args.backend == "slurm":
        submitted: list[tuple[Cell, str]] = []
        try:
            submit_slurm(sub.grid, sub.todo, sub.cluster, sub.exp_dir, submitted)
        finally:
            manifest = _record(sub.record, submitted)
        ids = sorted({jid.split("_")[0] for _, jid in submitted})
        print(f"submitted {len(submitted)} cell(s) as job(s) {', '.join(ids)}; manifest {manifest}")
        print(f"follow: {sub.follow}\nlogs: {sub.exp_dir / 'slurm_logs'}")
        return
    run_locally([sub], sub.args.jobs)


def run_locally(subs: list[Submission], jobs: int | None = None) -> None:
    """Run the planned cells of one or several local submissions in one pool of `jobs` processes,
    the longest first by each grid's `hours`: a pool per grid would leave cores idle at every grid's
    tail (the demo runs eleven grids). Each submission's manifest records the cells it started."""
    subs = [s for s in subs if s.todo]
    if not subs:
        return
    entries = []  # (hours, task, submission, cell)
    for sub in subs:
        g, threads = sub.grid, sub.args.threads or sub.grid.resources.threads
        res, log_dir = g.resources, sub.exp_dir / "local_logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        for c in sub.todo:
            name = c.run_name if len(subs) == 1 else f"{c.experiment}/{c.run_name}"
            t = LocalTask(name, [sys.executable, "-m", "slurm.job", "--experiment", c.experiment,
                                 "--run-dir", str(c.run_dir), "--", *c.overrides],
                          env={"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)},
                          world=res.world, gpus=res.gpus, log=log_dir / f"{c.run_name}.log", run_dir=c.run_dir,
                          weight=max(res.hours_for(c.axes.get("model", "")), 1e-6),
                          preload=("torch", "torchvision", "torchaudio", "mpt.cli",
                                   f"experiments.{c.experiment}.task"),
                          timeout=getattr(sub.args, "cell_timeout", None))
            entries.append((t.weight, t, sub, c))
    if len(subs) > 1:
        entries.sort(key=lambda e: -e[0])  # stable: a grid's own order within equal estimates
    cap = jobs if jobs is not None else min(
        default_cap(s.args.threads or s.grid.resources.threads, s.grid.resources.world, s.grid.resources.gpus)
        for s in subs)
    by_name = {t.name: (sub, c) for _, t, sub, c in entries}
    started: list[tuple[Submission, Cell, str]] = []
    threads = sorted({s.args.threads or s.grid.resources.threads for s in subs})
    logs = sorted({str(s.exp_dir / "local_logs") for s in subs})
    print(f"running {len(entries)} cell(s), at most {cap} at once, {'/'.join(map(str, threads))} thread(s) each; "
          f"logs in {', '.join(logs)}")
    try:
        results = run_local([t for _, t, _, _ in entries], cap, started=lambda t, pid: started.append(
            (*by_name[t.name], f"local:{socket.gethostname()}:{pid}")))
    finally:
        for sub in subs:
            _record(sub.record, [(c, jid) for s, c, jid in started if s is sub])
    bad = [n for n, rc in results.items() if rc != 0]
    print(f"{len(results) - len(bad)} cell(s) ended normally, {len(bad)} with errors"
          + (f" ({', '.join(bad)}; see {', '.join(logs)})" if bad else ""))
    for sub in subs:
        print(f"status: {sub.follow}")
    if bad:
        raise SystemExit(1)


def _record(record: dict, pairs: list[tuple[Cell, str]]) -> pathlib.Path | None:
    """Append the submission to the manifest of each experiment directory it touched."""
    by_dir: dict[pathlib.Path, list] = {}
    for c, jid in pairs:
        by_dir.setdefault(c.run_dir.parent, []).append(
            {"cell_id": c.cell_id, "run_name": c.run_name, "run_dir": str(c.run_dir), "job_id": jid,
             "overrides": c.overrides})
    path = None
    for d, cells in by_dir.items():
        path = append_manifest(d, {**record, "cells": cells})
    return path


if __name__ == "__main__":
    cli(main)()
