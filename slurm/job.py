"""What runs on a compute node: one cell of a grid, in every task (DDP rank) of its job.

SLURM (submitit pickles a CellJob; `srun` starts one copy per task):
  * ranks: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT are set from SLURM_PROCID,
    SLURM_NTASKS, SLURM_LOCALID and the job's first node, so the engine sees torchrun's variables
    and stays cluster-agnostic (it picks NCCL on GPUs, gloo on CPUs; rank 0 alone writes files).
  * time limit: the job is submitted with --signal=USR2@<signal_delay_s>. submitit's own USR2
    handler would checkpoint from inside the signal handler, i.e. in the middle of a training step,
    so it is replaced here by one that only asks the engine to stop (mpt.signals.STOP): the loop
    saves its checkpoint at the next step boundary and returns "interrupted", then rank 0 runs
    `scontrol requeue` and the restarted job resumes from that checkpoint (same wandb run: its id is
    the cell id).
  * preemption / `scontrol requeue` / scancel: SLURM sends SIGTERM, then SIGKILL after KillWait.
    SIGTERM also stops the loop at a step boundary with a checkpoint; SLURM itself decides whether
    the job comes back (preemption, requeue) or not (scancel). A hard kill loses at most
    train.ckpt_every_minutes of work (periodic checkpoints).
Local backend: `python -m slurm.job` runs the same function in a plain process (SIGTERM/SIGINT stop).

Every attempt is recorded by rank 0 in <run_dir>/job.json (job id, host, start/end, outcome, error):
slurm.status reads it, so it needs no SLURM accounting.
"""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import signal
import socket
import subprocess
import sys

from mpt.rundir import atomic_write_json, now, read_json
from mpt.signals import HANGUP, detach_from_closed_terminal

JOB_FILE = "job.json"


def _one_line(e: BaseException) -> str:
    from mpt.errors import one_line  # e.g. raised in a DataLoader worker: its cause, not the traceback

    return one_line(e)


def read_job_file(run_dir) -> dict | None:
    """job.json, or None when it is missing or damaged (a new record is started then)."""
    rec = read_json(pathlib.Path(run_dir) / JOB_FILE, default=None)
    if not isinstance(rec, dict) or not isinstance(rec.get("attempts", []), list):
        return None
    return rec


def _write_job_file(run_dir: pathlib.Path, rec: dict) -> None:
    rec["updated"] = now()
    atomic_write_json(run_dir / JOB_FILE, rec)


def master_port(job_id: str) -> int:
    """A rendezvous port from the job id: jobs sharing a node do not collide."""
    return 20000 + int(job_id) % 20000


def _slurm_ranks() -> str:
    """Map SLURM's task variables to torchrun's; returns this task's job id for the records."""
    from submitit import JobEnvironment

    env = JobEnvironment()
    os.environ.setdefault("RANK", str(env.global_rank))
    os.environ.setdefault("WORLD_SIZE", str(env.num_tasks))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    os.environ.setdefault("MASTER_ADDR", env.hostnames[0])
    os.environ.setdefault("MASTER_PORT", str(master_port(os.environ["SLURM_JOB_ID"])))
    return env.job_id  # "<array>_<index>" for array tasks, as the manifest records it


class _Signals:
    """Install handlers that turn stop signals into mpt.signals.STOP requests (checkpoint at the next
    step boundary). `requeue` is set when the signal means "time is almost up, come back later"."""

    def __init__(self, stop, requeue_signals: tuple, stop_signals: tuple):
        self.stop, self.requeue, self.received = stop, False, []
        for s in requeue_signals:
            signal.signal(s, self._on_requeue)
        for s in stop_signals:
            signal.signal(s, self._on_stop)

    def _on_requeue(self, signum, frame):
        self.requeue = True
        self.received.append(signal.Signals(signum).name)
        self.stop.request(f"{signal.Signals(signum).name} (time limit or preemption): checkpoint and requeue")

    def _on_stop(self, signum, frame):
        self.received.append(signal.Signals(signum).name)
        self.stop.request(f"{signal.Signals(signum).name}")
        detach_from_closed_terminal(signum)


def _requeue(job_id: str) -> str | None:
    """scontrol requeue this job; returns an error message or None."""
    try:
        r = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"scontrol requeue {job_id} failed: {e}"
    if r.returncode != 0:
        return f"scontrol requeue {job_id} failed: {(r.stderr or r.stdout).strip()}"
    return None


def _job_identity(on_slurm: bool) -> tuple[str, int, str | None]:
    """(job id, restarts so far, log file) of this attempt."""
    if not on_slurm:
        return f"local:{socket.gethostname()}:{os.getpid()}", 0, os.environ.get("MPT_JOB_LOG")
    job_id = _slurm_ranks()
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    log = None
    try:
        from submitit import JobEnvironment

        log = str(JobEnvironment().paths.stdout).replace("%j", job_id)
    except Exception:  # noqa: BLE001 -- only a hint for slurm.status
        pass
    return job_id, restarts, log


class _Attempt:
    """This attempt's record in job.json (rank 0 keeps it; other ranks record nothing)."""

    def __init__(self, run_dir: pathlib.Path, rank: int, sigs, backend: str, job_id: str, log):
        self.run_dir, self.rank, self.sigs = run_dir, rank, sigs
        self.backend, self.job_id, self.log = backend, job_id, log
        self.rec: dict | None = None
        self.before: dict | None = None  # the record as this attempt found it
        self.ended: list = []  # the attempt's outcome as recorded when the summary said it

    def failed_to_resolve(self, e: Exception) -> None:
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _write_job_file(self.run_dir, {"backend": self.backend, "job_id": self.job_id, "state": "failed",
                                           "log": self.log, "error": _one_line(e), "attempts": []})

    def begin(self, cfg, world: int, restarts: int, overrides: list[str]) -> None:
        from mpt import identity

        if self.rank != 0:
            return
        per = cfg.train.batch_size / world
        print(f"[slurm.job] {identity.run_name(cfg)} job {self.job_id} attempt {restarts + 1}: {world} rank(s), "
              f"global batch {cfg.train.batch_size} = {world} x {per:g} per rank", file=sys.stderr, flush=True)
        self.before = read_job_file(self.run_dir)
        rec = copy.deepcopy(self.before) if self.before else {"cell_id": identity.cell_id(cfg)}
        rec.setdefault("attempts", [])
        # The cell's overrides as submitted: the run folder says which cell it is by itself (paper_tables' export
        # reads them where no submission record has them: a launcher killed before it wrote its manifest).
        rec.update(backend=self.backend, job_id=self.job_id, state="running", world_size=world, log=self.log,
                   error=None, overrides=list(overrides))
        rec["attempts"].append({"job_id": self.job_id, "restart": restarts, "host": socket.gethostname(),
                                "pid": os.getpid(), "start": now(), "end": None, "outcome": "running"})
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write_job_file(self.run_dir, rec)
        self.rec = rec

    def finish(self, state: str, error: str | None = None, step=None) -> None:
        if self.rec is None:
            return
        self.rec.update(state=state, error=error)
        self.rec["attempts"][-1].update(end=now(), outcome=state, step=step, signals=self.sigs.received or None)
        _write_job_file(self.run_dir, self.rec)

    def on_result(self, summary: dict) -> None:
        # The attempt's record follows the summary at once, not after the run's teardown (wandb's finish,
        # the loader workers: seconds): a kill then left the attempt "running" for good beside a
        # "completed" summary. An interrupted attempt may still become "requeued" (run_cell).
        self.ended.append(summary.get("status"))
        self.finish(summary.get("status"), summary.get("error"), summary.get("step"))

    def busy(self) -> None:
        """Another copy of this cell is running (e.g. after submit --force): its record stays."""
        if self.rank == 0:
            if self.before is not None:
                _write_job_file(self.run_dir, self.before)
            else:
                (self.run_dir / JOB_FILE).unlink(missing_ok=True)


def run_cell(experiment: str, overrides: list[str], run_dir: str, backend: str, max_requeues: int = 100) -> dict:
    """Run (or resume) one cell in this process; the same code for every rank."""
    run_dir = pathlib.Path(run_dir)
    on_slurm = backend == "slurm"
    job_id, restarts, log = _job_identity(on_slurm)
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if cpus:  # before torch is imported: intra-op threads = the cores SLURM gave this task
        os.environ.setdefault("OMP_NUM_THREADS", cpus)

    from mpt import cli, config, identity
    from mpt.rundir import RunDirBusy
    from mpt.signals import STOP

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Before anything slow: a signal from now on stops the loop at a step boundary.
    if on_slurm:
        sigs = _Signals(STOP, (signal.SIGUSR2,), (signal.SIGTERM, *HANGUP))
    else:
        sigs = _Signals(STOP, (), (signal.SIGTERM, signal.SIGINT, *HANGUP))
    attempt = _Attempt(run_dir, rank, sigs, backend, job_id, log)
    try:
        cfg = config.resolve(experiment, overrides)
        if identity.run_dir(cfg).resolve() != run_dir.resolve():
            raise RuntimeError(f"cell resolves to {identity.run_dir(cfg)} but was submitted as {run_dir}: the "
                               "experiment's config changed since submission; resubmit the grid")
    except Exception as e:
        attempt.failed_to_resolve(e)
        raise
    attempt.begin(cfg, world, restarts, overrides)
    try:
        summary = cli.main(experiment, list(overrides), attempt.on_result)
    except RunDirBusy:
        attempt.busy()
        raise
    except Exception as e:
        attempt.finish("failed", _one_line(e))
        raise
    status, step = summary.get("status"), summary.get("step")
    if status != "interrupted":
        if attempt.ended != [status]:  # a result kept from an earlier attempt: the run did not finish in this one
            attempt.finish(status, summary.get("error"), step)
        return summary
    if sigs.requeue and on_slurm and rank == 0:
        if restarts >= max_requeues:
            attempt.finish("interrupted", f"not requeued: {restarts} restarts >= max_requeues {max_requeues}", step)
            return summary
        err = _requeue(os.environ["SLURM_JOB_ID"])
        if err is None:
            attempt.finish("requeued", None, step)
            print(f"[slurm.job] checkpointed at step {step} and requeued job {job_id}", file=sys.stderr, flush=True)
            # Like submitit after a requeue: leave without a result file; SLURM restarts the job.
            raise SystemExit(-1)
        print(f"[slurm.job] {err}", file=sys.stderr, flush=True)
        attempt.finish("interrupted", err, step)
        return summary
    if attempt.ended != [status]:
        attempt.finish("interrupted", summary.get("error"), step)
    return summary


class CellJob:
    """The callable submitit pickles for a SLURM job (one per cell)."""

    def __init__(self, experiment: str, overrides: list[str], run_dir: str, max_requeues: int = 100):
        self.experiment, self.overrides, self.run_dir = experiment, list(overrides), str(run_dir)
        self.max_requeues = max_requeues

    def __call__(self) -> dict:
        return run_cell(self.experiment, self.overrides, self.run_dir, "slurm", self.max_requeues)

    def checkpoint(self, *args, **kwargs):
        # Reached only if USR2 arrives in the first seconds of a job, before run_cell installed its
        # own handlers: nothing to save yet, so submitit requeues the job unchanged.
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)

    def __repr__(self) -> str:
        return f"CellJob({self.experiment}, {self.run_dir})"


def main(argv=None) -> None:
    """`python -m slurm.job --experiment NAME --run-dir DIR -- key=value ...` (the local backend)."""
    from mpt.errors import cli

    p = argparse.ArgumentParser(prog="python -m slurm.job", description="Run one grid cell in this process.")
    p.add_argument("--experiment", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    summary = cli(run_cell)(a.experiment, a.overrides, a.run_dir, "local")
    print(f"[slurm.job] {summary.get('status')}: {summary.get('run_name')} {summary.get('metrics')}",
          file=sys.stderr, flush=True)
    if summary.get("status") in ("failed",):
        raise SystemExit(1)
    if summary.get("status") == "interrupted":
        raise SystemExit(3)


if __name__ == "__main__":
    main()
