"""The one training loop every experiment uses: train_step / evaluate / run.

An experiment supplies a Task (model, datasets, loss, evaluation metric); precision lives entirely
in the recipe (mpt.precision), so nothing here branches on it. A run writes its directory
(config.yaml, env.json, metrics.jsonl, summary.json, checkpoint.pt: see README "Run directories")
and resumes from its checkpoint when started again -- bit-identically in FP32 on the CPU.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
import traceback
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader

from mpt import config as C
from mpt import precision
from mpt.data import EpochSampler, SeededDataset
from mpt.errors import UserError, cli
from mpt.memory import SavedTensorBytes
from mpt.rundir import append_jsonl, atomic_torch_save, atomic_write_json, atomic_write_text, env_info, now, read_json
from mpt.wandb_log import WandbLogger


class Task(Protocol):
    """What an experiment provides. Batches are whatever its datasets' default collation yields.
    Optional: `shuffle_train = False` keeps samples in order (the train dataset may then define
    `set_epoch(epoch)`); `state_dict()` / `load_state_dict()` put task state (e.g. recurrent state)
    into the checkpoint; `param_groups(model, cfg)` returns torch optimizer param groups (per-group
    settings, and an optional per-group "clip_grad_norm")."""

    primary_metric: str  # key of evaluate()'s metrics shown in tables, e.g. "top1"
    higher_is_better: bool

    def build_model(self, cfg) -> nn.Module: ...

    def datasets(self, cfg) -> tuple[Any, Any]: ...  # (train, val)

    def loss(self, model, batch) -> tuple[torch.Tensor, int]: ...  # (mean loss, items in batch)

    def eval_sums(self, model, batch) -> dict[str, float]: ...  # additive statistics of one batch

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]: ...


class _Stop:
    """Set from a signal handler (SLURM's pre-timeout signal, preemption): the loop checkpoints
    at the next step boundary and returns with status "interrupted"."""

    def __init__(self):
        self.reason: str | None = None

    def request(self, reason: str = "signal") -> None:
        self.reason = reason

    def clear(self) -> None:
        self.reason = None


STOP = _Stop()


# ------------------------------------------------------------------------------------------------
# setup helpers


def distributed_env() -> tuple[int, int, int]:
    """(rank, world, local_rank) from torchrun's variables, else SLURM's, else a single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    return 0, 1, 0


def pick_device(cfg, local_rank: int) -> torch.device:
    if cfg.device != "auto":
        try:
            return torch.device(cfg.device)
        except RuntimeError:
            raise UserError(f"device={cfg.device!r} is not a torch device; use auto, cpu or cuda:N") from None
    return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def build_optimizer(o, params) -> torch.optim.Optimizer:
    name = o.name.lower()
    if name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay)
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    if name == "adagrad":
        return _Adagrad(params, lr=o.lr, weight_decay=o.weight_decay, eps=o.eps,
                        initial_accumulator_value=o.initial_accumulator_value)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=o.lr, alpha=o.alpha, eps=o.eps, momentum=o.momentum,
                                   weight_decay=o.weight_decay)
    raise UserError(f"unknown optimizer optim.name={o.name!r}; choose one of: sgd, adam, adamw, adagrad, rmsprop")


class _Adagrad(torch.optim.Adagrad):
    """torch's Adagrad with its state created at the first step instead of in __init__, from each
    param group's own initial_accumulator_value. torch fills the state eagerly with the constructor's
    value, so impl=paper could not swap in its FP32 master copies (it wraps optimizers before their
    first step) and groups could not start from different accumulators."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.state.clear()
        # A pre-hook, not an overridden step(): torch wraps step() to run hooks, and an override calling
        # an already-wrapped Adagrad.step would run every step hook twice.
        self.register_step_pre_hook(_adagrad_lazy_state)


@torch.no_grad()
def _adagrad_lazy_state(opt, args, kwargs) -> None:
    for g in opt.param_groups:
        for p in g["params"]:
            if p.grad is not None and len(opt.state[p]) == 0:
                opt.state[p]["step"] = torch.tensor(0.0)
                opt.state[p]["sum"] = torch.full_like(p, g["initial_accumulator_value"],
                                                      memory_format=torch.preserve_format)


def _clip_groups(optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: clip each param group that names its own clip_grad_norm (e.g. only a
    language model's LSTM weights). It runs inside optimizer.step(), i.e. after every recipe has
    unscaled the gradients and skipped overflowing steps, so the norm is of the true gradients."""
    for g in optimizer.param_groups:
        if g.get("clip_grad_norm", 0) > 0:
            torch.nn.utils.clip_grad_norm_([p for p in g["params"] if p.grad is not None], g["clip_grad_norm"],
                                           foreach=True)


def lr_factor(s, epoch: float, total_epochs: float) -> float:
    """Multiplier of the base learning rate at a (fractional) epoch."""
    if s.name == "constant":
        f = 1.0
    elif s.name == "step":
        f = s.gamma ** math.floor(epoch / s.step_epochs)
    elif s.name == "multistep":
        f = s.gamma ** sum(epoch >= m for m in s.milestones)
    elif s.name == "poly":
        f = max(0.0, 1.0 - epoch / total_epochs) ** s.power
    elif s.name == "cosine":
        f = 0.5 * (1 + math.cos(math.pi * min(epoch, total_epochs) / total_epochs))
    else:
        raise UserError(f"unknown schedule sched.name={s.name!r}; choose one of: constant, step, multistep, poly, cosine")
    if s.warmup_epochs > 0 and epoch < s.warmup_epochs:
        f *= epoch / s.warmup_epochs
    return f


def _to_device(batch, device, channels_last: bool):
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device, non_blocking=True)
        if channels_last and batch.dim() == 4 and batch.is_floating_point():
            batch = batch.contiguous(memory_format=torch.channels_last)
        return batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device, channels_last) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device, channels_last) for k, v in batch.items()}
    return batch


# ------------------------------------------------------------------------------------------------
# the run


class Run:
    def __init__(self, cfg, task: Task):
        self.cfg, self.task = cfg, task
        self.rank, self.world, self.local_rank = distributed_env()
        self.device = pick_device(cfg, self.local_rank)
        self.main = self.rank == 0
        self.dir = C.run_dir(cfg)
        self.name = C.run_name(cfg)
        self.cell = C.cell_id(cfg)

    # -- files ------------------------------------------------------------------------------
    def write_summary(self, **kw) -> dict:
        s = {
            "status": "running", "experiment": self.cfg.experiment, "model": self.cfg.model,
            "precision": self.cfg.precision, "impl": self.cfg.impl, "loss_scale": self.cfg.loss_scale,
            "tf32": self.cfg.tf32, "seed": self.cfg.seed, "profile": self.cfg.profile, "cell_id": self.cell,
            "run_name": self.name, "primary_metric": self.task.primary_metric,
            "higher_is_better": self.task.higher_is_better, "metrics": {},
            "step": getattr(self, "step", 0), "total_steps": getattr(self, "total_steps", None),
            "skipped_steps": self.recipe.skipped_steps if hasattr(self, "recipe") else 0,
            "final_loss_scale": self.recipe.loss_scale if hasattr(self, "recipe") else None,
            "throughput": None, "peak_gpu_mem_bytes": None, "activation_bytes": getattr(self, "act_bytes", None),
            "wall_time_s": None, "error": None, "env": getattr(self, "env", None),
        }
        s.update(kw)
        s["updated"] = now()
        if self.main:
            atomic_write_json(self.dir / "summary.json", s)
        return s

    def log(self, line: dict) -> None:
        if self.main:
            append_jsonl(self.dir / "metrics.jsonl", line)
            self.wandb.log({k: v for k, v in line.items() if k not in ("kind",)} if line["kind"] != "eval"
                           else {f"eval/{k}": v for k, v in line.items() if k not in ("kind", "step")}, line["step"])

    # -- setup --------------------------------------------------------------------------------
    def setup(self):
        cfg = self.cfg
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cudnn.benchmark = True
        # TF32 is a separate baseline: off unless asked, and recorded in env.json (paper notes).
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
        self.env = env_info(self.device, self.world)
        self.check_identity()
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.dir / "config.yaml", C.dump_yaml(cfg))
            atomic_write_json(self.dir / "env.json", self.env)

        torch.manual_seed(cfg.seed)
        train_ds, val_ds = self.task.datasets(cfg)
        t = cfg.train
        if t.batch_size % (self.world * t.accum_steps):
            raise UserError(f"train.batch_size={t.batch_size} must divide by world size {self.world} x "
                            f"train.accum_steps {t.accum_steps}")
        self.per_rank = t.batch_size // self.world
        self.micro = self.per_rank // t.accum_steps
        if self.main and self.world > 1:
            print(f"global batch {t.batch_size} = {self.world} ranks x {self.per_rank} "
                  f"({t.accum_steps} micro-batches of {self.micro})", file=sys.stderr)
        self.train_ds = SeededDataset(train_ds, cfg.seed)
        # A task whose samples must stay in order (a language model carrying recurrent state across
        # batches) sets shuffle_train = False.
        shuffle = getattr(self.task, "shuffle_train", True)
        self.sampler = EpochSampler(len(train_ds), cfg.seed, shuffle, self.rank, self.world, self.per_rank)
        self.steps_per_epoch = len(self.sampler) // self.per_rank
        if self.steps_per_epoch == 0:
            raise UserError(f"train.batch_size={t.batch_size} is larger than the training set ({len(train_ds)})")
        self.total_steps = t.max_steps or max(1, round(t.epochs * self.steps_per_epoch))
        self.total_epochs = self.total_steps / self.steps_per_epoch
        self.eval_every = max(1, round(t.eval_every_epochs * self.steps_per_epoch))
        # Each DataLoader iterator draws a worker seed when created (every epoch, every evaluation, at
        # resume); from its own generator, not the global RNG that dropout uses, so resume stays exact.
        lkw = dict(num_workers=t.num_workers, pin_memory=self.device.type == "cuda",
                   generator=torch.Generator().manual_seed(cfg.seed))
        self.train_loader = DataLoader(self.train_ds, batch_size=self.micro, sampler=self.sampler, drop_last=True, **lkw)
        self.val_loader = DataLoader(val_ds, batch_size=max(self.micro, 1), shuffle=False,
                                     sampler=EpochSampler(len(val_ds), 0, False, self.rank, self.world, drop_last=False), **lkw)

        model = self.task.build_model(cfg).to(self.device)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        # A task may split the parameters into groups with their own optimizer settings (torch param
        # groups), and give a group its own "clip_grad_norm" (applied by _clip_groups).
        params = self.task.param_groups(model, cfg) if hasattr(self.task, "param_groups") else model.parameters()
        self.optimizer = build_optimizer(cfg.optim, params)
        if any(g.get("clip_grad_norm", 0) > 0 for g in self.optimizer.param_groups):
            self.optimizer.register_step_pre_hook(_clip_groups)
        self.recipe = precision.build(cfg, self.device)
        self.model = self.recipe.prepare(model, [self.optimizer])
        # The schedule is a function of *applied* updates: a step skipped for overflow (3.2) does not
        # advance the learning rate (sched.step() is called only when the update was applied).
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda u: lr_factor(cfg.sched, u / self.steps_per_epoch, self.total_epochs))
        self.ddp = self.model
        if self.world > 1:
            self.ddp = nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.numerics = None
        if cfg.numerics.every > 0:
            from mpt.numerics import Numerics

            self.numerics = Numerics(self.model, every=cfg.numerics.every)
        self.step, self.wall, self.act_bytes = 0, 0.0, None
        self.resume()
        self.wandb = WandbLogger(cfg, self.dir, self.cell[:32], self.name, C.to_dict(cfg), self.rank) \
            if self.main else WandbLogger(cfg, self.dir, "", "", {}, rank=self.rank)

    def check_identity(self) -> None:
        """A run directory holds one config: continuing it with another (other data, another recipe)
        would mix two runs in one result. Checked before anything in it is written."""
        import yaml

        path = self.dir / "config.yaml"
        if not path.is_file():
            return
        try:
            stored = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            stored = None
        diff = C.config_difference(stored, self.cfg) if isinstance(stored, dict) else "config.yaml unreadable"
        if diff:
            raise UserError(f"run directory {self.dir} holds another config ({diff}); use another out_dir "
                            "or delete that directory to start over")

    # -- checkpoints ----------------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "recipe": self.recipe.state_dict(), "sched": self.sched.state_dict(), "step": self.step,
            "wall": self.wall + (time.time() - self.t_start), "act_bytes": self.act_bytes,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "cell_id": self.cell,
            # Task state that must survive a restart (e.g. recurrent state carried across batches).
            "task": self.task.state_dict() if hasattr(self.task, "state_dict") else None,
        }

    def save(self) -> None:
        if self.main:
            atomic_torch_save(self.dir / "checkpoint.pt", self.state())
        self.last_ckpt = time.time()

    def resume(self) -> None:
        path = self.dir / "checkpoint.pt"
        if not path.exists():
            if self.main and (self.dir / "metrics.jsonl").exists():
                (self.dir / "metrics.jsonl").unlink()  # a run that died before its first checkpoint
            return
        try:
            sd = torch.load(path, map_location=self.device, weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"checkpoint {path} is unreadable ({type(e).__name__}); delete it to restart the run") from None
        if sd.get("cell_id") != self.cell:
            raise UserError(f"checkpoint {path} belongs to another config; delete the run directory to restart")
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.recipe.load_state_dict(sd["recipe"])
        self.sched.load_state_dict(sd["sched"])
        self.step, self.wall, self.act_bytes = sd["step"], sd["wall"], sd["act_bytes"]
        if sd.get("task") is not None and hasattr(self.task, "load_state_dict"):
            self.task.load_state_dict(sd["task"])
        torch.set_rng_state(sd["rng_cpu"])
        if sd["rng_cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(sd["rng_cuda"], self.device)
        if self.main:  # drop metric lines written after the checkpoint by the interrupted process
            mp = self.dir / "metrics.jsonl"
            if mp.exists():
                import json

                keep = [ln for ln in mp.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= self.step]
                atomic_write_text(mp, "".join(ln + "\n" for ln in keep))
            print(f"resuming {self.name} at step {self.step}/{self.total_steps}", file=sys.stderr)

    # -- train / eval -------------------------------------------------------------------------------
    def batches(self):
        """Yield (epoch, batch) from self.step on, restarting mid-epoch on resume."""
        while True:
            epoch, within = divmod(self.step, self.steps_per_epoch)
            self.sampler.set_epoch(epoch, start=within * self.per_rank)
            self.train_ds.set_epoch(epoch)
            # An ordered dataset may lay out its samples differently each epoch (a language model's
            # token streams with the shard order reshuffled every pass).
            getattr(self.train_ds.base, "set_epoch", lambda e: None)(epoch)
            for b in self.train_loader:
                yield epoch, b

    def train_step(self, micro_batches) -> tuple[float, int, bool, dict]:
        cfg, recipe = self.cfg, self.recipe
        sample = self.numerics is not None and self.numerics.should_sample(self.step)
        if sample:
            self.numerics.begin(self.step)
        measure = self.act_bytes is None
        total, n = 0.0, 0
        k = len(micro_batches)
        for i, b in enumerate(micro_batches):
            b = _to_device(b, self.device, cfg.channels_last)
            sync = contextlib.nullcontext() if (self.world == 1 or i == k - 1) else self.ddp.no_sync()
            meter = SavedTensorBytes(self.model) if measure and i == 0 else None
            with sync, (meter.measure() if meter is not None else contextlib.nullcontext()):
                with recipe.autocast():
                    loss, items = self.task.loss(self.ddp, b)
                recipe.backward(loss / k)
            if measure and i == 0:
                self.act_bytes = meter.bytes
            total += loss.detach().float().item() / k
            n += items
        stats = {}
        if sample:
            stats = self.numerics.end(list(self.model.named_parameters()), recipe.loss_scale)
            before = [p.detach().clone() for p in recipe.master_params()]
        applied = recipe.step(self.optimizer, cfg.train.clip_grad_norm)
        recipe.update()
        if applied:
            self.sched.step()
        if sample:
            stats.update(self.numerics.swamping(before, recipe.master_params()))
            stats["numerics/skipped"] = not applied
            if not applied:
                stats["numerics/overflow_param"] = recipe.last_overflow
        recipe.zero_grad()
        return total, n, applied, stats

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        sums: dict[str, float] = {}
        for i, b in enumerate(self.val_loader):
            if self.cfg.train.eval_max_batches and i >= self.cfg.train.eval_max_batches:
                break
            b = _to_device(b, self.device, self.cfg.channels_last)
            with self.recipe.autocast():
                for key, v in self.task.eval_sums(self.model, b).items():
                    sums[key] = sums.get(key, 0.0) + float(v)
        if self.world > 1:
            keys = sorted(sums)
            t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            sums = dict(zip(keys, t.tolist()))
        self.model.train()
        return self.task.eval_metrics(sums)

    def agree(self, loss: float) -> tuple[float, bool]:
        """With DDP, every rank must see the same mean loss (logged: the global batch's loss; and
        the divergence rule) and the same stop decision (a signal reaches ranks at different steps;
        a rank leaving early would hang the others in all-reduce). One small all-reduce per step."""
        if self.world == 1:
            return loss, STOP.reason is not None
        t = torch.tensor([loss, 1.0 if STOP.reason is not None else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t[0].item() / self.world, t[1].item() > 0

    def loop(self) -> dict:
        t = self.cfg.train
        self.model.train()
        self.t_start = self.last_ckpt = time.time()
        bar = None
        if self.main and t.progress:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step, desc=self.name, unit="step",
                       dynamic_ncols=True, file=sys.stderr, mininterval=2.0)
        win_loss, win_n, win_steps, win_t = 0.0, 0, 0, time.time()
        bad, metrics, last_eval, throughput = 0, {}, -1, None
        it = self.batches()
        while self.step < self.total_steps:
            micro = [next(it)[1] for _ in range(t.accum_steps)]
            loss, n, applied, stats = self.train_step(micro)
            self.step += 1
            loss, stop = self.agree(loss)
            bad = bad + 1 if not math.isfinite(loss) else 0
            win_loss += loss if math.isfinite(loss) else 0.0
            win_n, win_steps = win_n + n, win_steps + 1
            if stats:
                self.log({"kind": "numerics", "step": self.step, **stats})
            if bar is not None:
                bar.update(1)
            if self.step % t.log_every == 0 or self.step == self.total_steps or bad:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                dt = time.time() - win_t
                throughput = win_n * self.world / dt if dt > 0 else None
                finite = win_steps - (1 if bad else 0)
                self.log({"kind": "train", "step": self.step, "epoch": self.step / self.steps_per_epoch,
                          "loss": (win_loss / finite) if finite > 0 else float("nan"),
                          "lr": self.optimizer.param_groups[0]["lr"], "loss_scale": self.recipe.loss_scale,
                          "skipped_steps": self.recipe.skipped_steps, "throughput": throughput,
                          "time": self.wall + time.time() - self.t_start})
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.3f}", S=f"{self.recipe.loss_scale:g}",
                                    ips=f"{throughput or 0:.0f}", refresh=False)
                win_loss, win_n, win_steps, win_t = 0.0, 0, 0, time.time()
            if bad >= t.diverge_after:
                # The paper's "diverges" cells: stop instead of burning GPU hours on NaNs.
                return self.finish("diverged", metrics, throughput,
                                   error=f"loss non-finite for {bad} consecutive steps at step {self.step}")
            if self.step % self.eval_every == 0 or self.step == self.total_steps:
                metrics = self.evaluate()
                last_eval = self.step
                self.log({"kind": "eval", "step": self.step, "epoch": self.step / self.steps_per_epoch, **metrics})
            due_time = t.ckpt_every_minutes > 0 and time.time() - self.last_ckpt > 60 * t.ckpt_every_minutes
            due_step = t.ckpt_every_steps > 0 and self.step % t.ckpt_every_steps == 0
            if (due_time or due_step or self.step % self.eval_every == 0) and self.step < self.total_steps:
                self.save()
                self.write_summary(step=self.step, metrics=metrics)
            # Checked after a step, so a process always makes progress before it can be stopped
            # (a job signalled at every start would otherwise requeue forever).
            if stop and self.step < self.total_steps:
                self.save()
                return self.finish("interrupted", metrics, throughput, error=f"stopped: {STOP.reason or 'another rank'}")
        if bar is not None:
            bar.close()
        if last_eval != self.step:
            metrics = self.evaluate()
            self.log({"kind": "eval", "step": self.step, "epoch": self.step / self.steps_per_epoch, **metrics})
        self.save()
        return self.finish("completed", metrics, throughput)

    def finish(self, status: str, metrics: dict, throughput, error: str | None = None) -> dict:
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        wall = self.wall + time.time() - self.t_start
        s = self.write_summary(status=status, metrics=metrics, throughput=throughput,
                               peak_gpu_mem_bytes=peak, wall_time_s=wall, error=error)
        self.wandb.summary({"status": status, "step": self.step, "skipped_steps": self.recipe.skipped_steps,
                            "throughput": throughput, "activation_bytes": self.act_bytes, "peak_gpu_mem_bytes": peak,
                            **{f"final/{k}": v for k, v in metrics.items()}})
        self.wandb.finish(0 if status in ("completed", "interrupted") else 1)
        return s


def run(cfg, task: Task) -> dict:
    """Train one run to completion (or divergence / interruption) and return its summary."""
    r = Run(cfg, task)
    had_summary = (r.dir / "summary.json").exists()
    try:
        r.setup()
    except BaseException as e:
        # A run that got as far as a summary keeps it: a later invocation that cannot even start
        # (a wrong path, another config) must not turn a completed or interrupted result into "failed".
        if r.main and r.dir.exists() and not had_summary:
            r.write_summary(status="failed", error=f"{type(e).__name__}: {e}")
        raise
    if r.main:
        prev = r.dir / "summary.json"
        if prev.exists() and read_json(prev).get("status") == "completed" and r.step >= r.total_steps:
            return read_json(prev)  # nothing left to do
        r.write_summary(step=r.step, total_steps=r.total_steps)
    try:
        return r.loop()
    except BaseException as e:
        if r.main:
            atomic_write_text(r.dir / "error.txt", traceback.format_exc())
            r.write_summary(status="failed", error=f"{type(e).__name__}: {e}", step=r.step)
            r.wandb.finish(1)
        raise
    finally:
        if r.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def main(experiment: str, overrides: list[str]) -> dict:
    cfg = C.resolve(experiment, overrides)
    mod = C.experiment_module(experiment)
    return run(cfg, mod.Task())


def cli_main(experiment: str, argv: list[str] | None = None) -> None:
    """`python -m experiments.<name> key=value ...`"""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: python -m experiments.{experiment} [key=value ...]\n"
              f"e.g.   python -m experiments.{experiment} profile=tiny precision=mixed\n"
              f"keys:  see mpt/config.py and experiments/{experiment}/config.yaml")
        return
    # SLURM/torchrun stop signals: checkpoint at the next step boundary instead of losing work.
    signal.signal(signal.SIGUSR1, lambda *a: STOP.request("SIGUSR1"))
    s = cli(main)(experiment, argv)
    print(f"{s['status']}: {s['run_name']} {s['metrics']} -> {C.run_dir(C.resolve(experiment, argv))}")
    if s["status"] == "failed":
        raise SystemExit(1)
