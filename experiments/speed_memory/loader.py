"""How fast an experiment's training data arrives: its configured training pipeline, as the engine
builds it, in one process on one thread and then with N DataLoader workers.

    python -m experiments.speed_memory.loader EXPERIMENT [key=value ...] [--workers N] [--samples K]
        [--out experiments/speed_memory/results] [--tag TAG]

The config is resolved as the training entry point resolves it (same key=value overrides, profiles and
checks: mpt.config.resolve); the pipeline is the Task's datasets() training set wrapped by the engine's
own loader (mpt.engine.train_loader_of and loader_options: SeededDataset, EpochSampler, the task's collate) at the run's
micro-batch on one rank -- nothing here knows how a task decodes or augments its samples. Timed after
one warm-up batch per process (worker start-up and first-batch latency are one-time costs of a run with
persistent workers), over at least K samples, epochs following each other as in a run.

It prints a table -- samples/s, ms/sample, bytes per sample of the collated batch -- and, on its last
line, the one-process, one-thread rate: `<x> samples/s per core`. That figure times the cores a GPU
gets (less one for the main process) is what the loader can feed it; slurm.submit --dry-run compares
it with the GPU's step rate. Results: results/cpu-<cpu>-<date>-loader-<experiment>-<model>[-<tag>]
.{json,md}; the tag defaults to the values of the command line's task.* keys (task.data_root aside).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import pathlib
import re
import shlex
import sys
import time

import torch

from mpt.rundir import cpu_model

SCHEMA = "speed_memory_loader/1"
OUT = "experiments/speed_memory/results"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def batch_bytes(batch) -> int:
    """Bytes of every tensor in a collated batch (tensors, or tuples / lists / dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(b) for b in batch)
    if isinstance(batch, dict):
        return sum(batch_bytes(b) for b in batch.values())
    return 0


def time_loader(sampler, loader, micro: int, samples: int, warmup: int) -> dict:
    """Iterate `loader` epoch after epoch (set_epoch as the engine does): `warmup` batches untimed, then
    whole batches until at least `samples` samples; the rate and the collated batch's bytes per sample."""
    epoch, seen, t0, timed, nbytes = 0, 0, None, 0, 0
    need = warmup + math.ceil(samples / micro)
    while seen < need:
        sampler.set_epoch(epoch)
        for batch in loader:
            seen += 1
            if seen == warmup:
                t0 = time.perf_counter()
            elif seen > warmup:
                timed += micro
                nbytes = batch_bytes(batch)
            if seen >= need:
                break
        epoch += 1
    dt = time.perf_counter() - t0
    return {"samples": timed, "seconds": round(dt, 3), "samples_per_s": timed / dt, "ms_per_sample": 1e3 * dt / timed,
            "bytes_per_sample": nbytes // micro, "epochs_touched": epoch}


def measure(experiment: str, overrides: list[str], workers: int | None = None, samples: int = 1024) -> dict:
    """The result of one benchmark (what the JSON holds)."""
    from mpt import config, registry
    from mpt.engine import loader_options, train_loader_of
    from mpt.errors import UserError
    from mpt.ranks import loader_workers, usable_cpus
    from mpt.rundir import env_info, now

    if samples < 1:
        raise UserError(f"--samples {samples}: time at least one sample (default 1024)")
    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers}: give at least one worker (leave it out for auto: this process's "
                        f"cores less one)")
    exp = registry.get_experiment(experiment)
    cfg = config.resolve(exp, overrides)  # as python -m experiments.<name> resolves it
    task = exp.task(cfg)  # reads its facts from the prepared data (a missing set: one line naming the prep)
    t = cfg.train
    micro = t.batch_size // t.accum_steps  # one rank: the run's micro-batch
    torch.manual_seed(cfg.seed)  # as Run.setup, before datasets()
    train_ds, _ = task.datasets()
    if len(train_ds) < micro:
        raise UserError(f"train.batch_size={t.batch_size} (micro-batch {micro}) is larger than the training set "
                        f"({len(train_ds)}) at task.data_root; give a smaller train.batch_size=")
    n_workers = workers if workers is not None else max(loader_workers("auto"), 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = []
        for n in (0, n_workers):
            sampler_loader = train_loader_of(task, train_ds, micro, loader_options(task, n, pin_memory=False))[1:]
            # one warm-up batch per process: with n workers, n batches are in flight from the start
            row = time_loader(*sampler_loader, micro, samples, warmup=max(n, 1))
            rows.append({"workers": n, "mode": "1 process, 1 thread" if n == 0 else f"{n} worker(s)", **row})
            del sampler_loader  # ends the workers before the next measurement
            gc.collect()
    finally:
        torch.set_num_threads(threads)
    c = cfg.task
    env = env_info(torch.device("cpu"))
    return {
        "schema": SCHEMA, "date": now(),
        "command": "python -m experiments.speed_memory.loader " + shlex.join([experiment, *overrides]),
        "experiment": exp.name, "model": cfg.model, "profile": cfg.profile,
        # what slurm.submit --dry-run matches a cell on (the experiment and, where it has one, its augmentation)
        "augment": getattr(c, "augment", None),
        "task": config.to_dict(c) if c is not None else None, "micro_batch": micro, "seed": cfg.seed,
        "data": {"data_root": getattr(c, "data_root", None), "fingerprint": cfg.data_fingerprint,
                 "train_samples": len(train_ds)},
        "cpu": cpu_model(), "usable_cpus": usable_cpus(), "load_avg_1min": _load_avg(),
        "env": {k: env[k] for k in ("git_commit", "git_dirty", "python", "torch", "torchvision", "hostname")},
        "rows": rows, "per_core_samples_per_s": rows[0]["samples_per_s"],
    }


def _load_avg():
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def table(r: dict) -> list[str]:
    lines = ["| pipeline | samples | s | samples/s | ms/sample | bytes/sample (collated) |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['mode']} | {row['samples']} | {row['seconds']:.1f} | {row['samples_per_s']:.1f} | "
                     f"{row['ms_per_sample']:.2f} | {row['bytes_per_sample']:,} |")
    return lines


def markdown(r: dict) -> str:
    head = [f"# Training data loader: {r['experiment']} {r['model']}" + (f", augment {r['augment']}" if r["augment"] else ""),
            "", f"`{r['command']}`", "",
            f"- CPU: {r['cpu']}, {r['usable_cpus']} core(s) usable, load average {r['load_avg_1min']} at the end; "
            f"commit {r['env']['git_commit'][:7]}{' dirty' if r['env']['git_dirty'] else ''}, torch {r['env']['torch']}, "
            f"torchvision {r['env']['torchvision']}",
            f"- data: {r['data']['data_root']} ({r['data']['train_samples']} training samples, fingerprint "
            f"{r['data']['fingerprint']}); micro-batch {r['micro_batch']}", ""]
    return "\n".join(head + table(r) + ["", f"{r['per_core_samples_per_s']:.1f} samples/s per core", ""])


def main(argv=None) -> dict:
    from mpt.rundir import atomic_write_json, atomic_write_text

    p = argparse.ArgumentParser(prog="python -m experiments.speed_memory.loader",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", help="e.g. ilsvrc_cnns")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for a run")
    p.add_argument("--workers", type=int, help="DataLoader workers of the second measurement (default: auto, "
                   "this process's cores less one, at least 1)")
    p.add_argument("--samples", type=int, default=1024, help="samples timed per measurement (default 1024)")
    p.add_argument("--out", default=OUT, help=f"folder of the results files (default {OUT})")
    p.add_argument("--tag", help="end of the results file's name (default: the task.* values of the command line)")
    a = p.parse_args(argv)
    from experiments.speed_memory import check_tag

    tag = check_tag(a.tag if a.tag is not None else "-".join(
        o.split("=", 1)[1] for o in a.overrides if o.startswith("task.") and not o.startswith("task.data_root=")),
        "--tag ")
    r = measure(a.experiment, a.overrides, a.workers, a.samples)
    r["command"] = "python -m experiments.speed_memory.loader " + shlex.join(sys.argv[1:] if argv is None else argv)
    name = f"cpu-{slug(r['cpu'])}-{r['date'][:10]}-loader-{r['experiment']}-{r['model']}" + (f"-{tag}" if tag else "")
    out = pathlib.Path(a.out)
    atomic_write_json(out / f"{name}.json", r)
    atomic_write_text(out / f"{name}.md", markdown(r))
    print(f"{r['experiment']} {r['model']}" + (f" augment={r['augment']}" if r["augment"] else "")
          + f", micro-batch {r['micro_batch']}, on {r['cpu']} ({r['usable_cpus']} usable core(s)); wrote {out / name}.json")
    print("\n".join(table(r)))
    print(f"{r['per_core_samples_per_s']:.1f} samples/s per core")  # the last line, by contract
    return r


if __name__ == "__main__":
    from mpt.errors import cli

    cli(main)(sys.argv[1:])
