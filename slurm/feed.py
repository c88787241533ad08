"""Whether a cell's GPUs are fed: the data loader's expected rate against the GPU's step rate, from the
committed benchmark results (experiments/speed_memory/results/). `slurm.submit --dry-run` prints it.

    loader rate  = cores per GPU for DataLoader workers (the cluster's cpus_per_task less one, fewer when
                   the cell sets train.num_workers lower; at least the main process's one)
                   x the one-process, one-thread samples/s of the experiment's training pipeline
                   (experiments/speed_memory/loader.py results: the same experiment and, where the task
                   has one, the same task.augment; the latest day's when several, and of that day's
                   CPUs the slowest: the estimate promises no more than the slower CPU measured feeds)
    GPU rate     = samples/s of one training step on the cluster's GPU (its `gpu` key, the name torch
                   reports) for the cell's model and precision, from a gpu_check result: the `headline`
                   part (ResNet-50, batch 256) or the `models` part (each model at its paper batch per
                   GPU); a row at the cell's own batch per GPU first, and the memory layout the cell
                   gets on CUDA (channels_last=auto)

"fed" when the loader keeps up, "data-bound, ~x%" (x = loader rate / GPU rate) when it does not, and
"unknown" when either figure is missing. An estimate: the loader figure is from another CPU, on the
benchmark's data (ImageNet-sized photographs for the ILSVRC CNNs), and assumes the cores scale.
"""
from __future__ import annotations

import functools
import json
import pathlib

from mpt import REPO

RESULTS = REPO / "experiments" / "speed_memory" / "results"


@functools.lru_cache(maxsize=8)
def _results(folder: str, kind: str, stamp: tuple) -> list[tuple[str, dict]]:
    """(file name, content) of the results of one kind in `folder` (loader | gpu_check), once per
    version of the folder's files (`stamp`); a file that is not a results JSON is skipped."""
    out = []
    for p in sorted(pathlib.Path(folder).glob(f"*{kind}*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and str(d.get("schema", "")).startswith(("speed_memory_loader/", "gpu_check/")):
            out.append((p.name, d))
    return out


def results(kind: str, folder: pathlib.Path | None = None) -> list[tuple[str, dict]]:
    folder = pathlib.Path(folder or RESULTS)
    stamp = tuple((p.name, p.stat().st_mtime_ns) for p in sorted(folder.glob(f"*{kind}*.json")))
    return _results(str(folder), kind, stamp)


def per_core_rate(cfg, folder=None) -> tuple[float, str] | None:
    """(samples/s of one core, results file) for the cell's experiment and augmentation, or None."""
    augment = getattr(cfg.task, "augment", None)
    found = [(str(d.get("date", ""))[:10], d["per_core_samples_per_s"], name) for name, d in results("loader", folder)
             if d.get("experiment") == cfg.experiment and d.get("augment") == augment
             and isinstance(d.get("per_core_samples_per_s"), (int, float))]
    if not found:
        return None
    newest = max(date for date, _, _ in found)
    rate, name = min((rate, name) for date, rate, name in found if date == newest)
    return rate, name


def loader_cores(cfg, cpus_per_task: int) -> int:
    """The cores a rank's loader gets: cpus_per_task less one for the main process (auto), or the
    cell's own worker count when lower; one (the main process loads) when that leaves none."""
    cores = cpus_per_task - 1
    if cfg.train.num_workers != "auto":
        cores = min(cores, int(cfg.train.num_workers))
    return max(cores, 1)


def gpu_rate(cfg, gpu: str, world: int, folder=None) -> tuple[float, str] | None:
    """(samples/s of one GPU's training step, results file) for the cell's model and precision on the
    GPU named `gpu`, or None."""
    import torch

    from mpt import precision, registry

    per_gpu = cfg.train.batch_size // max(world, 1) // max(cfg.train.accum_steps, 1)
    try:
        cnn = registry.get_experiment(cfg.experiment).task.channels_last
    except Exception:  # noqa: BLE001 -- an unregistered experiment: no layout preference
        cnn = False
    nhwc = precision.channels_last_pays(cfg, torch.device("cuda"), cnn)
    best = None
    for name, d in results("gpu_check", folder):
        if str(((d.get("env") or {}).get("gpu") or {}).get("name", "")).lower() != gpu.lower():
            continue
        parts = d.get("parts") or {}
        for part in ("headline", "models"):
            for r in ((parts.get(part) or {}).get("result") or {}).get("rows") or []:
                ms = (r.get("step_ms") or {}).get("median") if isinstance(r.get("step_ms"), dict) else None
                if (r.get("model") != cfg.model or r.get("precision") != cfg.precision or r.get("status") != "ok"
                        or r.get("impl") not in (None, cfg.impl) or not ms or not r.get("batch")):
                    continue
                # preference: the cell's batch per GPU, its layout, then the newest file
                key = (r["batch"] == per_gpu, bool(r.get("channels_last")) == nhwc, d.get("date", ""))
                if best is None or key > best[0]:
                    best = (key, 1e3 * r["batch"] / ms, name)
    return None if best is None else (best[1], best[2])


def feed_note(cfg, cluster, world: int, folder=None) -> str:
    """fed | data-bound, ~x% | unknown, for one cell on `cluster` (see the module docstring)."""
    core = per_core_rate(cfg, folder)
    gpu = gpu_rate(cfg, cluster.gpu, world, folder) if cluster.gpu else None
    if core is None or gpu is None:
        return "unknown"
    loader = core[0] * loader_cores(cfg, cluster.cpus_per_task)
    return "fed" if loader >= gpu[0] else f"data-bound, ~{loader / gpu[0]:.0%}"


def sources(cells, cluster, world: int, folder=None) -> str:
    """One line naming the figures behind the cells' notes (or what is missing)."""
    loaders = sorted({x[1] for c in cells if (x := per_core_rate(c.cfg, folder))})
    gpus = sorted({x[1] for c in cells if cluster.gpu and (x := gpu_rate(c.cfg, cluster.gpu, world, folder))})
    where = "experiments/speed_memory/results"
    no_gpu = (f"no gpu_check result for {cluster.gpu!r}" if cluster.gpu else "unknown: the cluster profile names no gpu")
    return (f"data: loader = ({cluster.cpus_per_task} CPUs per task - 1) x the per-core samples/s of "
            f"{', '.join(loaders) or f'no loader result in {where} (python -m experiments.speed_memory.loader)'}; "
            f"GPU = {'step samples/s of ' + ', '.join(gpus) if gpus else no_gpu}")
