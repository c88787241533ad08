"""Where this process runs: its rank, its device, its random stream, and moving batches and state
between devices. No collective here (mpt/engine.py owns the process group)."""
from __future__ import annotations

import os

import torch

from mpt.data import mix_seeds
from mpt.errors import UserError


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s random stream after model initialisation (rank 0 keeps `seed`)."""
    return seed if rank == 0 else mix_seeds(seed, rank, 0x52414E4B)


def rng_state(device: torch.device) -> dict:
    """This process's random state: the CPU generator and, on a GPU, its generator (both CPU uint8)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(st: dict, device: torch.device) -> None:
    """Restore rng_state()'s result. torch wants CPU ByteTensors here, on any device: a checkpoint loaded
    with map_location=<a GPU> would hand over CUDA tensors and fail ("RNG state must be a
    torch.ByteTensor"), so the states are brought to the CPU first whatever they arrived as."""
    torch.set_rng_state(st["cpu"].to("cpu", torch.uint8))
    if st.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(st["cuda"].to("cpu", torch.uint8), device)


def distributed_env() -> tuple[int, int, int]:
    """(rank, world, local_rank) from RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun, or by slurm.job
    from SLURM's variables), else a single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    return 0, 1, 0


def usable_cpus() -> int:
    """The CPU cores this process may run on: its affinity mask (taskset, a cgroup's cpuset, SLURM's
    task binding), and at most SLURM_CPUS_PER_TASK under SLURM, whose allocation a node without task
    binding does not show in the mask. Without SLURM, the ranks torchrun starts on one node
    (LOCAL_WORLD_SIZE) share one mask: each gets its share, not all of it."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call (macOS): every core
        n = os.cpu_count() or 1
    env = os.environ
    slurm, local = env.get("SLURM_CPUS_PER_TASK", ""), env.get("LOCAL_WORLD_SIZE", "")
    if slurm.isdigit() and int(slurm) > 0:
        n = min(n, int(slurm))
    elif local.isdigit() and int(local) > 1:
        n //= int(local)
    return max(n, 1)


def loader_workers(setting) -> int:
    """train.num_workers as a count: an integer as it is; auto = the cores this process may use
    (usable_cpus) less one for the main process, which runs the training step, at least 0."""
    if setting == "auto":
        return max(usable_cpus() - 1, 0)
    return int(setting)


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """device=auto|cpu|cuda|cuda:N -> a torch device with an index.

    auto: this process's GPU when there is one, else the CPU. `cuda` (no index) means the same GPU
    as auto: under DDP each rank must own one GPU, and a bare "cuda" would put every rank on GPU 0.
    Which GPU is this process's: with one visible GPU, that one -- a cluster that binds one GPU to
    each task (CUDA_VISIBLE_DEVICES per task, `--gpus-per-task`, `--gpu-bind`) shows every rank a
    single cuda:0, whatever its local rank; with several visible, the local rank's."""
    if name == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        dev = torch.device("cuda" if name == "auto" else name)
    except RuntimeError:
        raise UserError(f"device={name!r} is not a torch device; use auto, cpu or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"device={name}: only cpu and cuda devices are supported")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise UserError(f"device={name} but CUDA is not available on this machine (no CUDA GPU is visible; torch "
                            f"{torch.__version__}, CUDA build {torch.version.cuda}); use device=auto or device=cpu")
        if dev.index is None:
            if n > 1 and local_rank >= n:
                raise UserError(f"local rank {local_rank} but this node shows {n} GPUs (CUDA_VISIBLE_DEVICES="
                                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most one task per GPU")
            dev = torch.device("cuda", 0 if n == 1 else local_rank)
        elif dev.index >= n:
            raise UserError(f"device={name} but this machine has {n} GPU(s) (cuda:0..cuda:{n - 1})")
    return dev


def to_cpu(obj):
    """Tensors anywhere in nested dicts/lists/tuples, moved to the CPU (to pickle them across ranks)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def to_device(batch, device, channels_last: bool):
    """Tensors anywhere in a batch's lists, tuples and dicts, on `device`; 4-D images (float, or uint8 that
    the task normalises on the device) in NHWC when channels_last. Other objects pass unchanged (e.g.
    encoded JPEGs that the task decodes on the GPU from host memory)."""
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device, non_blocking=True)
        if channels_last and batch.dim() == 4 and (batch.is_floating_point() or batch.dtype == torch.uint8):
            batch = batch.contiguous(memory_format=torch.channels_last)
        return batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, channels_last) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, channels_last) for k, v in batch.items()}
    return batch
