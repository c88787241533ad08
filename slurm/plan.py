"""A submission's plan, printed before anything runs: which cells to submit and which to skip (and
why), each cell's batch split and BN batch, the resources and GPU-hours, the sbatch settings, and on a
dry run for a GPU cluster whether each cell's loader feeds its GPUs (slurm/feed.py).
"""
from __future__ import annotations

import socket

from slurm import clusters, feed
from slurm.grid import Cell, Grid, nodes_and_tasks
from slurm.state import FINAL, cell_state, latest_jobs, slurm_queue


def show(g: Grid, backend: str, cluster: clusters.Cluster | None, force: bool, dry_run: bool) -> list[Cell]:
    """Print the plan of submitting grid `g` and return the cells to submit. The feed column and its
    sources are a dry run's, on a GPU cluster only: they say nothing of CPU runs or this machine."""
    feed_on = cluster if dry_run and cluster and g.resources.gpus else None
    todo, skipped, lines = decide(g, force, backend == "slurm", feed_on)
    print_plan(g, todo, skipped, lines, backend, cluster, dry_run)
    if feed_on:
        print(feed.sources(g.cells, cluster, g.resources.world))
    if not todo:
        print("nothing to submit")
    return todo


def decide(g: Grid, force: bool, queue_needed: bool, feed_on: clusters.Cluster | None = None
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


def bn_batch_note(cfg, world: int, unit: str = "GPU") -> str:
    """", BN batch N ..." -- the images each batch-norm layer normalises over in one step on a run of
    several ranks: the per-rank micro-batch, or all ranks' with task.sync_bn (SyncBatchNorm). Empty for
    one-rank runs (the BN batch is the batch; and no need to import the model registry for them)."""
    if world <= 1:
        return ""
    import models

    # The registry's fact, not a model built here: whether the model's default build has BN layers.
    # (A detection model built with task.batch_norm=true has them too; its grids run one rank.)
    if not models.has_batch_norm(cfg.model):
        return ""
    per_rank = cfg.train.batch_size // world // max(cfg.train.accum_steps, 1)
    if getattr(cfg.task, "sync_bn", False):
        return f", BN batch {per_rank * world} (synced over {world})"
    return f", BN batch {per_rank} per {unit}"


def _fmt_hours(h: float) -> str:
    return f"{h:,.0f}" if h >= 100 else f"{h:.3g}"


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

