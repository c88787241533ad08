"""A table of a grid's cells: pending, running, completed, diverged, failed (or interrupted / not
submitted), with job ids, progress and the latest metric.

    python -m slurm.status experiments/ilsvrc_cnns/grid.yaml --profile tiny [--only model=alexnet]

It reads the run directories (summary.json, metrics.jsonl, job.json) and the submission manifest,
and asks squeue -- never sacct -- whether queued jobs are still there, so it works on clusters
without SLURM accounting (where sacct fails and submitit reports UNKNOWN) and on machines without
SLURM at all. Pass the same --set values as to slurm.submit (they may change the cells).
"""
from __future__ import annotations

import argparse
import json

from mpt.errors import cli
from slurm import grid
from slurm.state import cell_state, latest_jobs, slurm_queue

ORDER = ["running", "pending", "completed", "diverged", "failed", "interrupted", "not submitted"]


def collect(grid_path, profile: str, extra=(), only=()) -> tuple[grid.Grid, list[tuple[grid.Cell, object]], bool]:
    g = grid.load(grid_path, profile, list(extra), list(only))
    exp_dirs = sorted({c.run_dir.parent for c in g.cells})
    latest = latest_jobs(exp_dirs)
    needs_queue = any(not str(j["job_id"]).startswith("local:") for j in latest.values())
    queue = slurm_queue() if needs_queue else None
    rows = [(c, cell_state(c.run_dir, c.cell_id, latest.get(c.cell_id), queue)) for c in g.cells]
    return g, rows, needs_queue and queue is None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m slurm.status", description=__doc__.split("\n\n")[0])
    p.add_argument("grid")
    p.add_argument("--profile", required=True)
    p.add_argument("--only", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE", dest="extra")
    p.add_argument("--json", action="store_true", help="one JSON object per cell instead of the table")
    a = p.parse_args(argv)
    g, rows, no_queue = collect(a.grid, a.profile, a.extra, a.only)
    if a.json:
        for c, st in rows:
            print(json.dumps({"run_name": c.run_name, "cell_id": c.cell_id, "run_dir": str(c.run_dir), **c.axes,
                              **st.__dict__}))
        return
    head = ("cell", "state", "job", "step", "latest", "note")
    table = []
    for c, st in rows:
        step = "" if st.step is None else f"{st.step}/{st.total_steps if st.total_steps is not None else '?'}"
        note = st.error or ""
        if st.attempts > 1:
            note = f"{st.attempts} attempts" + (f"; {note}" if note else "")
        table.append((c.run_name, st.state, st.job_id or "-", step, st.latest or "-", note))
    widths = [max(len(r[i]) for r in [head, *table]) for i in range(len(head) - 1)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    print(fmt.format(*head))
    for r in table:
        print(fmt.format(*r))
    counts = {}
    for _, st in rows:
        counts[st.state] = counts.get(st.state, 0) + 1
    print(f"{len(rows)} cell(s): " + ", ".join(f"{counts[k]} {k}" for k in ORDER if k in counts))
    if no_queue:
        print("note: squeue unavailable here; running/pending are read from the run directories only")


if __name__ == "__main__":
    cli(main)()
