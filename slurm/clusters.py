"""Cluster profiles: everything that differs between SLURM clusters, and nothing else.

slurm/clusters/<name>.yaml (pass --cluster <name> or --cluster path/to/file.yaml). Keys:

    partition           partition for GPU runs (and CPU runs unless cpu_partition is set)
    cpu_partition       partition for runs with gpus: 0 (optional)
    account, qos, constraint          passed to sbatch when set
    gpus_per_node       GPUs on one node; runs needing more span several nodes (one task per GPU)
    gpu_flag            how GPUs are asked for: gpus-per-node (--gpus-per-node=N, the default; needs
                        select/cons_tres) or gres (--gres=gpu:N: clusters on select/cons_res, or
                        whose docs say so)
    cpus_per_task       CPU cores per task (data-loading workers + 1); also passed to srun (below)
    mem_gb_per_task     memory per task in GB
    time_min            time limit of one job in minutes; longer runs checkpoint and requeue
    max_array_size      the cluster's MaxArraySize: larger grids are split into several arrays
    array_parallelism   at most this many tasks of one array run at once
    signal_delay_s      SLURM sends USR2 this many seconds before the time limit (checkpoint + requeue)
    max_requeues        stop requeuing a run after this many restarts (a run that never progresses)
    ckpt_every_minutes  periodic checkpoints (train.ckpt_every_minutes): bounds what a hard kill loses
    setup               shell lines run in the job before srun (module load ..., source venv/bin/activate)
    python              the interpreter on the nodes (default: the one running slurm.submit)
    sbatch              extra sbatch options as a mapping, e.g. {exclusive: true, mail-type: END}
    gpu                 the GPU's name as torch reports it (torch.cuda.get_device_name), e.g. NVIDIA H200
                        (optional): --dry-run compares each cell's data loader with that GPU's step rate
                        from a committed gpu_check result (slurm/feed.py)
    kill_on_bad_exit    true (default): when one task of a run exits with an error, srun ends the
                        others (--kill-on-bad-exit=1) instead of leaving them waiting in a collective
                        until NCCL's timeout; false passes --kill-on-bad-exit=0

The srun line of every job carries --cpus-per-task=<cpus_per_task>: from SLURM 22.05 to 23.02 srun
no longer inherits it from sbatch, so without it each task (a DDP rank and its DataLoader workers)
gets one core. The srun option, rather than exporting SRUN_CPUS_PER_TASK in the job (the variable
23.11's sbatch sets again), works with every SLURM version: srun older than 22.05 do not read that
variable, and an explicit option equals what 23.11 sets.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field, fields

import yaml

from mpt.errors import UserError

HERE = pathlib.Path(__file__).resolve().parent


@dataclass
class Cluster:
    name: str = ""
    partition: str | None = None
    cpu_partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb_per_task: float = 4.0
    time_min: int = 60
    max_array_size: int = 1000
    array_parallelism: int = 256
    signal_delay_s: int = 120
    max_requeues: int = 100
    ckpt_every_minutes: float | None = None
    setup: list[str] = field(default_factory=list)
    python: str | None = None
    sbatch: dict = field(default_factory=dict)
    gpu_flag: str = "gpus-per-node"
    kill_on_bad_exit: bool = True
    gpu: str | None = None


GPU_FLAGS = ("gpus-per-node", "gres")


_INT = {"gpus_per_node": 0, "cpus_per_task": 1, "time_min": 1, "max_array_size": 1, "array_parallelism": 1,
        "signal_delay_s": 0, "max_requeues": 0}


def path_of(name: str) -> pathlib.Path:
    p = pathlib.Path(name)
    if p.suffix in (".yaml", ".yml") or "/" in name:
        return p
    return HERE / "clusters" / f"{name}.yaml"


def load(name: str) -> Cluster:
    path = path_of(name)
    if not path.is_file():
        known = sorted(p.stem for p in (HERE / "clusters").glob("*.yaml"))
        raise UserError(f"cluster profile {name!r} not found ({path}); choose one of: {', '.join(known)} "
                        "or give a path to a YAML file")
    from mpt.config_parse import safe_load, yaml_error

    try:
        d = safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise UserError(f"cluster profile {path} is not valid YAML: {yaml_error(e)}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"cluster profile {path} is not UTF-8 text (byte {e.start})") from None
    if not isinstance(d, dict):
        raise UserError(f"cluster profile {path} must be a mapping of keys (see slurm/clusters.py)")
    allowed = {f.name for f in fields(Cluster)} - {"name"}
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise UserError(f"cluster profile {path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    c = Cluster(name=path.stem, **d)
    for k, lo in _INT.items():
        v = getattr(c, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise UserError(f"cluster profile {path}: {k} must be an integer >= {lo}, got {v!r}")
    if not isinstance(c.mem_gb_per_task, (int, float)) or c.mem_gb_per_task <= 0:
        raise UserError(f"cluster profile {path}: mem_gb_per_task must be a positive number")
    if not isinstance(c.setup, list) or not all(isinstance(s, str) for s in c.setup):
        raise UserError(f"cluster profile {path}: setup must be a list of shell lines")
    if not isinstance(c.sbatch, dict):
        raise UserError(f"cluster profile {path}: sbatch must be a mapping of extra sbatch options")
    if c.gpu_flag not in GPU_FLAGS:
        raise UserError(f"cluster profile {path}: gpu_flag must be gpus-per-node (--gpus-per-node=N) or gres "
                        f"(--gres=gpu:N), got {c.gpu_flag!r}")
    if c.gpu is not None and (not isinstance(c.gpu, str) or not c.gpu.strip()):
        raise UserError(f"cluster profile {path}: gpu must be the GPU's name as torch reports it (e.g. NVIDIA H200) "
                        f"or null, got {c.gpu!r}")
    if not isinstance(c.kill_on_bad_exit, bool):
        raise UserError(f"cluster profile {path}: kill_on_bad_exit must be true or false, got {c.kill_on_bad_exit!r}")
    return c


def sbatch_parameters(c: Cluster, *, job_name: str, nodes: int, tasks_per_node: int, gpus: int, chdir: str) -> dict:
    """submitit.SlurmExecutor parameters for one run (every task of an array gets the same)."""
    partition = c.cpu_partition if (gpus == 0 and c.cpu_partition) else c.partition
    mem_mb = int(round(c.mem_gb_per_task * 1024 * tasks_per_node))
    params = {
        "job_name": job_name,
        "time": c.time_min,
        "nodes": nodes,
        "ntasks_per_node": tasks_per_node,
        "cpus_per_task": c.cpus_per_task,
        "mem": f"{mem_mb}MB",
        "signal_delay_s": c.signal_delay_s,
        "array_parallelism": c.array_parallelism,
        "setup": list(c.setup),
        # --requeue: the job may be put back in the queue (by us at the time limit, or by a
        # preemption); --chdir: jobs import this repository's packages.
        "additional_parameters": {"requeue": True, "chdir": chdir, **c.sbatch},
        # srun options (the module docstring says why): each task gets its cores, and one task's
        # failure ends the run's other tasks.
        "srun_args": [f"--cpus-per-task={c.cpus_per_task}", f"--kill-on-bad-exit={int(c.kill_on_bad_exit)}"],
    }
    if gpus > 0:
        if c.gpu_flag == "gres":
            params["gres"] = f"gpu:{tasks_per_node}"
        else:
            params["gpus_per_node"] = tasks_per_node
    for k in ("account", "qos", "constraint"):
        if getattr(c, k):
            params[k] = getattr(c, k)
    if partition:
        params["partition"] = partition
    return params
