"""Where each cell stands, read from files: the submission manifest, the run directory (summary.json,
metrics.jsonl, and job.json written by slurm.job) and, when there is one, the SLURM queue (squeue
talks to the controller; it needs no accounting database, unlike sacct).

States: completed, diverged (final results); running; pending (queued, or requeued and waiting);
failed (with its error); interrupted (stopped with a checkpoint and not queued: resubmit to resume);
not submitted.
"""
from __future__ import annotations

import getpass
import json
import os
import pathlib
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpt.rundir import FINAL, open_no_follow, read_json, read_rank_failures

if TYPE_CHECKING:
    from slurm.grid import Cell

MANIFEST = "submissions.jsonl"
_RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING"}
_PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESIZING", "RESV_DEL_HOLD"}


def manifest_path(exp_dir) -> pathlib.Path:
    return pathlib.Path(exp_dir) / MANIFEST


def append_manifest(exp_dir, record: dict) -> pathlib.Path:
    """One JSON line per submission; appended whole (O_APPEND) so concurrent submits do not interleave."""
    path = manifest_path(exp_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return path


def record_submission(record: dict, pairs: list[tuple[Cell, str]]) -> pathlib.Path | None:
    """Append a submission (`record`, and its cells with their job ids) to the manifest of each
    experiment directory it touched; the path of the last one written."""
    by_dir: dict[pathlib.Path, list] = {}
    for c, jid in pairs:
        by_dir.setdefault(c.run_dir.parent, []).append(
            {"cell_id": c.cell_id, "run_name": c.run_name, "run_dir": str(c.run_dir), "job_id": jid,
             "overrides": c.overrides})
    path = None
    for d, cells in by_dir.items():
        path = append_manifest(d, {**record, "cells": cells})
    return path


def latest_jobs(exp_dirs) -> dict[str, dict]:
    """cell_id -> {"job_id", "backend", "time"} of its most recent submission."""
    out: dict[str, dict] = {}
    for d in exp_dirs:
        p = manifest_path(d)
        if not p.exists():
            continue
        for line in p.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            for c in rec.get("cells", []):
                if c.get("job_id"):
                    out[c["cell_id"]] = {"job_id": c["job_id"], "backend": rec.get("backend"), "time": rec.get("time")}
    return out


def slurm_queue() -> dict[str, str] | None:
    """job id -> SLURM state of this user's jobs (array tasks expanded), or None without a reachable SLURM."""
    if shutil.which("squeue") is None:
        return None
    try:
        r = subprocess.run(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%i|%T"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    q = {}
    for line in r.stdout.splitlines():
        if "|" in line:
            jid, st = line.split("|", 1)
            q[jid.strip()] = st.strip()
    return q


def _local_alive(job_id: str) -> bool | None:
    """local:<host>:<pid> -> is it running (None: another host, cannot tell)."""
    try:
        _, host, pid = job_id.split(":")
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


# summary.json / job.json fields slurm.status reads, and their types (None is allowed for each).
_SUMMARY_TYPES = {"status": str, "step": int, "total_steps": int, "metrics": dict, "primary_metric": str, "error": str}
_JOB_TYPES = {"job_id": str, "state": str, "error": str, "log": str, "attempts": list}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _read_checked(p: pathlib.Path, types: dict) -> tuple[dict, str | None]:
    """A run-directory JSON file as a dict with only well-typed fields, and what was wrong with it
    (naming the file), so one damaged file gives a note in the table instead of a traceback."""
    if not p.exists():
        return {}, None
    d = read_json(p, default=None)
    if not isinstance(d, dict):
        return {}, f"{p} is unreadable (not a JSON object); running the cell again rewrites it"
    bad = []
    for k, tp in types.items():
        v = d.get(k)
        if v is None:
            continue
        ok = _is_number(v) and float(v).is_integer() if tp is int else isinstance(v, tp)
        if not ok:
            bad.append(f"{k}={v!r:.40}")
            d.pop(k)
        elif tp is int:
            d[k] = int(v)
    if isinstance(d.get("attempts"), list):
        d["attempts"] = [a for a in d["attempts"] if isinstance(a, dict)]
    return d, (f"{p} has wrong-typed field(s) {', '.join(bad)} (ignored)" if bad else None)


def _last_line(p: pathlib.Path, kind: str) -> dict | None:
    try:
        with open(p, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for ln in reversed(lines):
        try:
            d = json.loads(ln)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("kind") == kind:
            return d
    return None


@dataclass
class CellState:
    state: str
    job_id: str | None = None
    step: int | None = None
    total_steps: int | None = None
    latest: str = ""  # e.g. "top1=71.3" or "loss=2.301"
    error: str | None = None
    attempts: int = 0
    log: str | None = None


def rank_failure(run_dir: pathlib.Path, job: dict) -> tuple[int, str] | None:
    """(rank, one line) of the first failure a rank other than 0 recorded in this attempt
    (mpt.rundir.read_rank_failures); None when there is none. Only rank 0 writes summary.json, and
    rank 0 may have been killed while it waited for the failed rank (NCCL's timeout, srun's
    --kill-on-bad-exit), leaving a summary that still says "running"."""
    attempts = job.get("attempts") or []
    start = attempts[-1].get("start") if attempts else None
    # ISO-8601 times of one clock sort as strings; a record from an earlier attempt is history.
    recs = [r for r in read_rank_failures(run_dir).values()
            if not (isinstance(start, str) and isinstance(r.get("time"), str) and r["time"] < start)]
    if not recs:
        return None
    rec = min(recs, key=lambda r: r["rank"])
    more = f" (and {len(recs) - 1} more rank(s))" if len(recs) > 1 else ""
    return rec["rank"], (f"rank {rec['rank']} failed on {rec.get('host')} at step {rec.get('step')}: "
                         f"{rec.get('error')}{more}")


def cell_state(run_dir, cell_id: str, latest: dict | None, queue: dict[str, str] | None) -> CellState:
    run_dir = pathlib.Path(run_dir)
    summary, s_problem = _read_checked(run_dir / "summary.json", _SUMMARY_TYPES)
    job, j_problem = _read_checked(run_dir / "job.json", _JOB_TYPES)
    st = _cell_state(run_dir, summary, job, latest, queue)
    if st.state not in FINAL and st.state != "not submitted":
        failed = rank_failure(run_dir, job)
        # Not when rank 0's own summary already names that rank (mpt.record.RunRecord.record_failure).
        if failed and f"rank {failed[0]} failed" not in (st.error or ""):
            if st.state == "running":  # the other ranks are about to time out or be killed
                st.error = failed[1]
            else:
                st.state, st.error = "failed", failed[1]
    problems = "; ".join(x for x in (s_problem, j_problem) if x)
    if problems:
        st.error = f"{st.error}; {problems}" if st.error else problems
    return st


def _cell_state(run_dir: pathlib.Path, summary: dict, job: dict, latest: dict | None,
                queue: dict[str, str] | None) -> CellState:
    s_status = summary.get("status")
    jid = (latest or {}).get("job_id") or job.get("job_id")
    st = CellState("not submitted", jid, summary.get("step"), summary.get("total_steps"),
                   attempts=len(job.get("attempts", [])), log=job.get("log"))
    metrics = summary.get("metrics") or {}
    pm = summary.get("primary_metric")
    if pm and _is_number(metrics.get(pm)):
        st.latest = f"{pm}={metrics[pm]:.4g}"
    else:
        line = _last_line(run_dir / "metrics.jsonl", "train")
        if line and _is_number(line.get("loss")):
            st.latest = f"loss={line['loss']:.4g}"
            if isinstance(line.get("step"), int):
                st.step = max(st.step or 0, line["step"])

    if s_status in FINAL:
        st.state = s_status
        return st
    # Is the cell's latest job still alive?
    alive = None
    if jid and jid.startswith("local:"):
        alive = _local_alive(jid)
        q = "RUNNING" if alive else None
    else:
        q = queue.get(jid) if (queue is not None and jid) else None
        if queue is not None and jid:
            alive = q is not None
    if q in _RUNNING:
        st.state = "running"
        return st
    if q in _PENDING:
        st.state = "pending"
        return st
    job_is_latest = not jid or job.get("job_id") == jid
    if job_is_latest and (job.get("state") == "failed" or s_status == "failed"):
        st.state, st.error = "failed", summary.get("error") or job.get("error")
        return st
    if alive is False:  # known to have left the queue / exited
        if not job or not job_is_latest:
            st.state, st.error = "failed", f"job {jid} ended before the run started; see its log"
        elif job.get("state") in ("running",) or s_status == "running":
            st.state = "failed"
            st.error = (f"job {jid} ended without a result (killed: time limit without requeue, memory, "
                        f"node failure?){'; log ' + st.log if st.log else ''}")
        elif job.get("state") in ("interrupted", "requeued") or s_status == "interrupted":
            st.state, st.error = "interrupted", job.get("error") or summary.get("error")
        else:
            st.state = "failed"
            st.error = f"job {jid} ended in state {job.get('state')!r}"
        return st
    # No queue to ask (no SLURM here, or another host): trust the files.
    js = job.get("state")
    if js == "running" or s_status == "running":
        st.state = "running"
    elif js == "requeued":
        st.state = "pending"
    elif js == "interrupted" or s_status == "interrupted":
        st.state, st.error = "interrupted", job.get("error") or summary.get("error")
    elif jid:
        st.state = "pending"
    return st
