"""A run's directory, owned by one object: RunRecord claims it (lock, identity), writes everything in
it (config.yaml, env.json, metrics.jsonl, summary.json, checkpoint.pt, the failure records) and reads
it back at resume. Every file is written atomically (mpt.rundir); only rank 0 writes, except a rank's
own failure record.

    <out_dir>/<experiment>/<model>-<precision>-s<seed>-<cell id>/
        config.yaml      the resolved config (the run's identity: mpt.identity.cell_id)
        env.json         what produced it: code version, libraries, device, math flags
        metrics.jsonl    one line per log step, evaluation and numerics sample
        summary.json     status, progress, final metrics (rewritten as the run goes)
        checkpoint.pt    the latest state, with a checksum verified at resume
        error.txt, failure.rank<r>.json, error.rank<r>.txt   why a run or a rank failed
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

from mpt import config, identity
from mpt.config_parse import safe_load
from mpt.errors import UserError, one_line
from mpt.ranks import to_cpu
from mpt.rundir import (FINAL, RANK_FAILURE, RunLock, append_jsonl, atomic_torch_save, atomic_write_bytes,
                        atomic_write_json, atomic_write_text, now, read_json_or_none, read_jsonl,
                        read_rank_failures, remove_stale_temp_files, state_checksum, storage_error)


class RunRecord:
    def __init__(self, cfg, task, rank: int, world: int):
        self.cfg, self.rank, self.world, self.main = cfg, rank, world, rank == 0
        self.dir = identity.run_dir(cfg)
        self.name = identity.run_name(cfg)
        self.cell = identity.cell_id(cfg)
        self.created = time.time()
        self.lock: RunLock | None = None  # held by rank 0 from claim() to release()
        self.prev_summary: dict | None = None  # the summary an earlier invocation left (read under the lock)
        self.env: dict | None = None  # env.json, once written
        self.wandb = None  # mpt.wandb_log.WandbLogger, once the run is set up (open_wandb)
        # What every summary.json starts with: the cell this directory holds.
        self.head = {"experiment": cfg.experiment, "model": cfg.model, "precision": cfg.precision, "impl": cfg.impl,
                     "loss_scale": cfg.loss_scale, "tf32": cfg.tf32, "seed": cfg.seed, "profile": cfg.profile,
                     "cell_id": self.cell, "run_name": self.name, "primary_metric": task.primary_metric,
                     "higher_is_better": task.higher_is_better}

    # -- claim -------------------------------------------------------------------------------------
    def check_identity(self) -> None:
        """A run directory holds one config: continuing it with another (other data, another recipe)
        would mix two runs in one result. Checked before anything in it is written."""
        import yaml

        path = self.dir / "config.yaml"
        if not path.is_file():
            return
        try:
            stored = safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            stored = None
        diff = identity.config_difference(stored, self.cfg) if isinstance(stored, dict) else "config.yaml unreadable"
        if diff:
            raise UserError(f"run directory {self.dir} holds another config ({diff}); use another out_dir "
                            "or delete that directory to start over")

    def claim(self) -> None:
        """Rank 0: create the directory, lock it against a second copy of this run (RunLock), read what
        an earlier invocation left, and delete the temp files of a writer killed mid-write."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise (storage_error(e, self.dir) or UserError(f"cannot create the run directory {self.dir}: "
                                                           f"{e.strerror}; set out_dir= to a writable folder")) from None
        self.lock = RunLock(self.dir).acquire()
        path = self.dir / "summary.json"
        prev = read_json_or_none(path)
        if path.exists() and not isinstance(prev, dict):
            print(f"warning: {path} is unreadable; it is rewritten as the run goes on", file=sys.stderr)
            prev = None
        self.prev_summary = prev
        stale = remove_stale_temp_files(self.dir)
        if stale:
            print(f"removed {len(stale)} temp file(s) of an interrupted write in {self.dir}", file=sys.stderr)
        # A rank's failure record from an earlier attempt is history once this attempt starts (ranks
        # start within seconds of each other: a record older than a minute before us is not this one's).
        for f in self.dir.glob(f"{RANK_FAILURE}*"):
            with contextlib.suppress(OSError):
                if f.stat().st_mtime < self.created - 60:
                    f.unlink()

    def final_result(self) -> dict | None:
        """The summary an earlier invocation left when it is a final result (completed, diverged): kept
        as it is, nothing in the directory is written again."""
        return self.prev_summary if (self.prev_summary or {}).get("status") in FINAL else None

    def write_start(self, env: dict) -> None:
        """config.yaml and env.json: what this run is and what produced it."""
        self.env = env
        if self.main:
            atomic_write_text(self.dir / "config.yaml", config.dump_yaml(self.cfg))
            atomic_write_json(self.dir / "env.json", env)

    def open_wandb(self) -> None:
        from mpt.wandb_log import WandbLogger

        self.wandb = WandbLogger(self.cfg, self.dir, self.cell[:32], self.name, config.to_dict(self.cfg), self.rank) \
            if self.main else WandbLogger(self.cfg, self.dir, "", "", {}, rank=self.rank)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # -- metrics and summary -------------------------------------------------------------------------
    def log(self, line: dict) -> None:
        """One metrics.jsonl line (and its wandb copy): kind train | eval | numerics."""
        if self.main:
            append_jsonl(self.dir / "metrics.jsonl", line)
            self.wandb.log({k: v for k, v in line.items() if k not in ("kind",)} if line["kind"] != "eval"
                           else {f"eval/{k}": v for k, v in line.items() if k not in ("kind", "step")}, line["step"])

    def write_summary(self, progress: dict, **kw) -> dict:
        """summary.json: the cell, then `progress` (step, total_steps, skipped_steps,
        skipped_per_optimizer, final_loss_scale, activation_bytes), then the status and results in kw."""
        s = {"status": "running", **self.head, "metrics": {}, "step": 0, "total_steps": None, "skipped_steps": 0,
             "skipped_per_optimizer": {}, "final_loss_scale": None, "throughput": None, "peak_gpu_mem_bytes": None,
             "activation_bytes": None, "wall_time_s": None, "error": None, "env": self.env}
        s.update(progress)
        s.update(kw)
        s["updated"] = now()
        if self.main:
            atomic_write_json(self.dir / "summary.json", s)
        return s

    def image(self, fname: str, png: bytes, name: str, caption: str, step: int) -> str:
        """An evaluation's image, <run dir>/fname, and its wandb copy (rank 0 only)."""
        atomic_write_bytes(self.dir / fname, png)
        self.wandb.image(name, self.dir / fname, step, caption)
        return fname

    # -- checkpoint ----------------------------------------------------------------------------------
    def save(self, state: dict, rank_state: dict) -> None:
        """checkpoint.pt: `state` (the same on every rank) plus every rank's `rank_state` (its random
        streams and task state), gathered on rank 0. A collective: every rank calls it at the same step."""
        mine = to_cpu(rank_state)
        ranks = [mine]
        if self.world > 1:
            ranks = [None] * self.world if self.main else None
            dist.gather_object(mine, ranks, dst=0)
        if self.main:
            state = {**state, "cell_id": self.cell, "ranks": ranks}
            state["checksum"] = state_checksum(state)  # verified at resume: damaged bytes are refused
            atomic_torch_save(self.dir / "checkpoint.pt", state)

    def load(self) -> dict | None:
        """The checkpoint, verified (checksum, cell), or None when there is none. Without one, the
        metric lines of a run that died before its first checkpoint are deleted."""
        path = self.dir / "checkpoint.pt"
        if not path.exists():
            if self.main and (self.dir / "metrics.jsonl").exists():
                (self.dir / "metrics.jsonl").unlink()
            return None
        try:
            # To the CPU, whatever device wrote it and whatever device this is: load_state_dict copies
            # model, master and optimizer tensors onto their parameters' devices (torch.optim keeps a
            # non-capturable optimizer's `step` on the CPU, where it expects it), and the RNG states
            # must stay CPU ByteTensors (set_rng_state).
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"checkpoint {path} is unreadable ({type(e).__name__}); delete it to restart the run") from None
        written = sd.pop("checksum", None)
        if written is None:  # every checkpoint this code writes has one: edited by hand, or from elsewhere
            raise UserError(f"checkpoint {path} has no checksum, so its contents cannot be verified (it was not "
                            "written by this code's save, or was edited since); delete it to restart the run")
        if written != state_checksum(sd):
            raise UserError(f"checkpoint {path} is damaged (its contents do not match the checksum written with it); "
                            "restore it from a copy, or delete it to restart the run")
        if sd.get("cell_id") != self.cell:
            raise UserError(f"checkpoint {path} belongs to another config; delete the run directory to restart")
        return sd

    def truncate_metrics(self, step: int, done: bool) -> None:
        """Rank 0 at resume: drop the metric lines written after the checkpoint at `step` by the
        interrupted process, and a line torn by a kill or a full disk mid-append (said). A checkpoint at
        the last step (`done`) follows the final evaluation, which the loop repeats when it resumes there
        (killed before the summary said completed): that eval line goes, or the result would hold it twice."""
        mp = self.dir / "metrics.jsonl"
        if not self.main or not mp.exists():
            return
        lines, torn = read_jsonl(mp)
        keep = [x for x in lines if isinstance(x.get("step"), int) and x["step"] <= step
                and not (done and x["step"] == step and x.get("kind") == "eval")]
        atomic_write_text(mp, "".join(json.dumps(x, default=str) + "\n" for x in keep))
        if torn:
            print(f"dropped {torn} unreadable (torn) line(s) of {mp}", file=sys.stderr)

    # -- failures ------------------------------------------------------------------------------------
    def record_failure(self, e: BaseException, progress: dict, traceback_file: bool) -> None:
        """Rank 0: summary.json says why the run ended ("failed" with the error's one-line cause, or
        "interrupted" after a second Ctrl-C); error.txt keeps the traceback. A failure to write these
        (the disk that just filled up) must not hide the error being reported."""
        extra = {}
        if isinstance(e, KeyboardInterrupt):
            status, error = "interrupted", "aborted by a second Ctrl-C; resumes from the last checkpoint"
        else:
            status, error = "failed", one_line(e)
            if self.world > 1:
                # Rank 0's own error is often only the consequence (a collective whose peer died): name
                # the rank that failed first, with its cause.
                others = {k: v for k, v in rank_failures(self.dir, wait_s=5.0).items() if k != self.rank}
                if others:
                    k = min(others)
                    error = f"rank {k} failed on {others[k].get('host')}: {others[k].get('error')} (rank 0: {error})"
                    extra["rank_errors"] = {str(k): v.get("error") for k, v in others.items()}
        try:
            if traceback_file:
                atomic_write_text(self.dir / "error.txt", traceback.format_exc())
            self.write_summary(progress, status=status, error=error, **extra)
        except Exception as e2:  # noqa: BLE001
            print(f"could not record the failure in {self.dir}: {one_line(e2)}", file=sys.stderr)

    def record_rank_failure(self, e: BaseException, step: int) -> None:
        """Rank r > 0 failed (an OOM on rank 3): only rank 0 writes summary.json, and rank 0 may be
        waiting in a collective that will never complete (until the process group's timeout), so the
        failing rank leaves its own record: failure.rank<r>.json (one line of cause, host, step) and
        error.rank<r>.txt. Rank 0 names it in summary.json when it fails in turn; slurm.status reads it."""
        if isinstance(e, (KeyboardInterrupt, SystemExit, RankZeroRefused)):
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.dir / f"error.rank{self.rank}.txt", traceback.format_exc())
            atomic_write_json(self.dir / f"{RANK_FAILURE}{self.rank}.json",
                              {"rank": self.rank, "world": self.world, "host": socket.gethostname(), "pid": os.getpid(),
                               "step": step, "error": one_line(e), "time": now()})
        except Exception as e2:  # noqa: BLE001 -- the error being reported matters more
            print(f"rank {self.rank}: could not record its failure in {self.dir}: {one_line(e2)}", file=sys.stderr)


class RankZeroRefused(UserError):
    """Rank 0 could not claim the run directory (told to the other ranks): rank 0's error, not theirs."""


def rank_failures(run_dir, wait_s: float = 0.0) -> dict[int, dict]:
    """read_rank_failures, waiting up to wait_s for a record to appear (a peer's collective error can
    reach rank 0 a moment before the peer's file does)."""
    deadline = time.time() + wait_s
    while True:
        out = read_rank_failures(run_dir)
        if out or time.time() >= deadline:
            return out
        time.sleep(0.2)
