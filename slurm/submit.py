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
import contextlib
import io
import pathlib
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from mpt import REPO
from mpt.errors import UserError, cli
from slurm import clusters, plan
from slurm.grid import Cell, Grid, load as load_grid, nodes_and_tasks
from slurm.local import run_locally
from slurm.state import record_submission


# ------------------------------------------------------------------------------------------------
# SLURM backend


def sbatch_message(err: BaseException) -> str:
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
                raise UserError(f"sbatch rejected the job: {sbatch_message(e)}") from None
        submitted.extend((c, j.job_id) for c, j in zip(chunk, jobs))



# ------------------------------------------------------------------------------------------------
# the command


def _git() -> tuple[str, bool]:
    from mpt.rundir import git_info

    return git_info()


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


def _check(a: argparse.Namespace) -> None:
    """The arguments that go together, and the numbers that must be positive."""
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


def prepare(argv) -> Submission:
    """Parse a submission's arguments, load its grid, check it and print its plan."""
    a = _parser().parse_args(argv)
    _check(a)
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
    todo = plan.show(g, a.backend, cluster, a.force, a.dry_run)
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
            manifest = record_submission(sub.record, submitted)
        ids = sorted({jid.split("_")[0] for _, jid in submitted})
        print(f"submitted {len(submitted)} cell(s) as job(s) {', '.join(ids)}; manifest {manifest}")
        print(f"follow: {sub.follow}\nlogs: {sub.exp_dir / 'slurm_logs'}")
        return
    run_locally([sub], sub.args.jobs)


if __name__ == "__main__":
    cli(main)()
