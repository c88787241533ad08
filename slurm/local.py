"""The local backend: a grid's cells as processes of this machine, at most `--jobs` at once, the
stop signals sent on to them, a line as each ends. CPU cells start as forks of a process that imported
their modules once (slurm.forked); GPU cells and the rest as fresh interpreters.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mpt import REPO
from mpt.errors import UserError
from mpt.rundir import open_no_follow
from mpt.signals import HANGUP, detach_from_closed_terminal
from slurm.forked import FORKSERVER, Forked
from slurm.state import record_submission

if TYPE_CHECKING:
    from slurm.grid import Cell
    from slurm.submit import Submission


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
    # as a fork of a process that already imported them (slurm.forked), not as a fresh interpreter.
    preload: tuple[str, ...] = ()
    timeout: float | None = None  # seconds; past it the cell is stopped as by a stop signal (--cell-timeout)


# After --cell-timeout, a cell gets SIGTERM (checkpoint at the next step boundary); one still running this
# long after it is killed (a hung step, a leaked non-daemon thread), as SLURM's KillWait does.
KILL_AFTER_S = 60.0


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
        self.running: dict[str, tuple[list[subprocess.Popen | Forked], list[int]]] = {}
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
                    procs.append(Forked(t.name, t.argv, env, t.log, self.exits / f"{len(self.began)}-{r}"))
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
            record_submission(sub.record, [(c, jid) for s, c, jid in started if s is sub])
    bad = [n for n, rc in results.items() if rc != 0]
    print(f"{len(results) - len(bad)} cell(s) ended normally, {len(bad)} with errors"
          + (f" ({', '.join(bad)}; see {', '.join(logs)})" if bad else ""))
    for sub in subs:
        print(f"status: {sub.follow}")
    if bad:
        raise SystemExit(1)

