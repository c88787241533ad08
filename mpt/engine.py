"""The one training loop every experiment uses: Run (setup, checkpoints, the loop) and run().

An experiment supplies a Task (mpt/task.py: the contract, its lifecycle and defaults); precision lives entirely
in the recipe (mpt.precision), so nothing here branches on it. A run writes its directory
(config.yaml, env.json, metrics.jsonl, summary.json, checkpoint.pt: see README "Configs and runs")
and resumes from its checkpoint when started again -- bit-identically in FP32 on the CPU.

The pieces around it, one concern per file: mpt/step.py (what a task's step and evaluation see, and
the default iteration), mpt/optim.py (optimizers and schedules from the config), mpt/ranks.py (rank,
device, random streams), mpt/signals.py (stopping cleanly on a signal), mpt/rundir.py (atomic files,
the run lock, env.json).
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader

from mpt import config
from mpt import precision
from mpt.data import EpochSampler, SeededDataset, _mix
from mpt.errors import UserError, cli, one_line
from mpt.memory import SavedTensorBytes
from mpt.task import Task
from mpt.rundir import (FINAL, RANK_FAILURE, RunLock, append_jsonl, atomic_torch_save,
                        atomic_write_json, atomic_write_text, env_info, now, read_json_or_none, read_jsonl,
                        read_rank_failures, remove_stale_temp_files, state_checksum, storage_error)
from mpt.wandb_log import WandbLogger
from mpt.ranks import distributed_env, pick_device, rank_seed, rng_state, set_rng_state, to_cpu, to_device
from mpt.signals import STOP, install_stop_handlers, _worker_init
from mpt.step import EvalContext, StepContext



# ------------------------------------------------------------------------------------------------
# the run


class Run:
    def __init__(self, cfg, task: Task):
        if not isinstance(task, Task):  # the engine calls Task's methods; their defaults live there
            raise TypeError(f"{type(task).__qualname__} must subclass mpt.task.Task (see mpt/task.py)")
        self.cfg, self.task = cfg, task
        self.rank, self.world, self.local_rank = distributed_env()
        self.device = pick_device(cfg.device, self.local_rank)
        self.channels_last = precision.channels_last_pays(cfg, self.device, task.channels_last)
        self.main = self.rank == 0
        self.dir = config.run_dir(cfg)
        self.name = config.run_name(cfg)
        self.cell = config.cell_id(cfg)
        self.created = time.time()
        self.lock: RunLock | None = None  # held by rank 0 from setup to the end of run()
        self.prev_summary: dict | None = None  # the summary an earlier invocation left (read under the lock)
        self.final: dict | None = None  # that summary when it is a final result, on every rank (setup)

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
            "skipped_per_optimizer": dict(getattr(self, "skipped", {})),
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
        """Everything before the first step, in this order (each a method below): the process and its
        run directory; the data (Task.datasets, under the run's seed) and its loaders; the model, its
        optimizers, the precision recipe and the schedules; DDP; then each rank's own random stream,
        numerics sampling, the checkpoint to resume from and the wandb run."""
        cfg = self.cfg
        self._start_process()
        if self.final is not None:  # a kept result: nothing to build (see _start_process)
            return
        torch.manual_seed(cfg.seed)
        train_ds, val_ds = self.task.datasets(cfg)
        self._build_loaders(train_ds, val_ds)
        self._build_training()
        self._distribute()
        # The model starts identical on every rank (seeded with cfg.seed, then DDP's broadcast); what is
        # drawn from here on -- dropout masks, a sampled softmax's negatives, a GAN's noise -- must
        # differ between ranks, or N GPUs draw the same numbers N times (the bigLSTM's 8,192 negatives
        # would be the same on every GPU). Rank 0 keeps cfg.seed's stream, so a one-process run is
        # unchanged; each other rank gets its own stream. Data augmentation is seeded per sample
        # (SeededDataset), not here.
        if self.rank > 0:
            torch.manual_seed(rank_seed(cfg.seed, self.rank))
        self.numerics = None
        if cfg.numerics.every > 0:
            from mpt.numerics import Numerics

            self.numerics = Numerics(self.model, every=cfg.numerics.every, lo=cfg.numerics.hist_lo,
                                     hi=cfg.numerics.hist_hi)
        self.step, self.wall, self.act_bytes = 0, 0.0, None
        # The divergence rule's counters, kept on the device across log windows (see iterate()).
        self._zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self._bad = torch.zeros((), dtype=torch.int64, device=self.device)
        self._diverged_at = torch.full((), -1, dtype=torch.int64, device=self.device)
        self._new_window()
        self.resume()
        self.wandb = WandbLogger(cfg, self.dir, self.cell[:32], self.name, config.to_dict(cfg), self.rank) \
            if self.main else WandbLogger(cfg, self.dir, "", "", {}, rank=self.rank)


    def _start_process(self) -> None:
        """This process's GPU and process group, TF32 off unless asked, the run directory claimed
        (rank 0; the others stop if it could not be), config.yaml and env.json written."""
        cfg = self.cfg
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before NCCL starts: its communicator binds to this GPU
            torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
        if self.world > 1 and not dist.is_initialized():
            # An explicit timeout: a rank that died (an OOM on rank 3) must fail the others' collectives
            # in minutes, so the job ends and its failure is recorded, instead of rank 0 waiting on.
            import datetime

            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(minutes=cfg.train.dist_timeout_min),
                                    device_id=self.device if self.device.type == "cuda" else None)
        # TF32 off unless asked, FP16/BF16 products reduced in FP32; recorded in env.json.
        precision.set_backend_flags(cfg.tf32)
        self.check_identity()
        # Rank 0 claims the directory and reads what an earlier invocation left. A final result
        # (completed, diverged) is kept as it is: a later invocation writes nothing into its directory
        # (config.yaml and env.json name what produced it; a diverged run's NaN history must not be cut
        # back to its last checkpoint) and returns its summary.
        claim_error, final = None, None
        if self.main:
            try:
                self.claim_dir()
            except UserError as e:  # another copy holds the lock, or the directory cannot be written
                claim_error = e
            else:
                final = self.prev_summary if (self.prev_summary or {}).get("status") in FINAL else None
        if self.world > 1:  # one broadcast tells every rank both, so none waits alone in a collective
            box = [None if claim_error is None else str(claim_error), final]
            dist.broadcast_object_list(box, src=0)
            if box[0] is not None and claim_error is None:
                raise RankZeroRefused(box[0])
            final = box[1]
        if claim_error is not None:
            raise claim_error
        self.final = final
        if final is not None:
            return
        self.env = {**env_info(self.device, self.world, cfg), "channels_last": self.channels_last}
        if self.main:
            atomic_write_text(self.dir / "config.yaml", config.dump_yaml(cfg))
            atomic_write_json(self.dir / "env.json", self.env)

    def _build_loaders(self, train_ds, val_ds) -> None:
        """The batch split (global -> per rank -> micro-batches), the epoch's length, and the loaders."""
        cfg = self.cfg
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
        self.sampler = EpochSampler(len(train_ds), cfg.seed, self.task.shuffle_train, self.rank, self.world,
                                    self.per_rank, order=self.task.train_order, with_epoch=True)
        self.steps_per_epoch = len(self.sampler) // self.per_rank
        if self.steps_per_epoch == 0:
            raise UserError(f"train.batch_size={t.batch_size} is larger than the training set ({len(train_ds)})")
        self.total_steps = t.max_steps or max(1, round(t.epochs * self.steps_per_epoch))
        self.total_epochs = self.total_steps / self.steps_per_epoch
        self.eval_every = max(1, round(t.eval_every_epochs * self.steps_per_epoch))
        # Each DataLoader iterator draws a worker seed when created (every epoch, every evaluation, at
        # resume); from its own generator, not the global RNG that dropout uses, so resume stays exact.
        # Persistent workers: a paper run would otherwise start t.num_workers processes (imports, dataset
        # copies) at every epoch and every evaluation. The epoch reaches them with each index
        # (EpochSampler(with_epoch=True)), never through state set after they started.
        lkw = dict(num_workers=t.num_workers, pin_memory=self.device.type == "cuda",
                   generator=torch.Generator().manual_seed(cfg.seed), collate_fn=self.task.collate,
                   worker_init_fn=_worker_init if t.num_workers > 0 else None,
                   persistent_workers=t.num_workers > 0)
        self.train_loader = DataLoader(self.train_ds, batch_size=self.micro, sampler=self.sampler, drop_last=True, **lkw)
        self.val_loader = DataLoader(val_ds, batch_size=max(self.micro, 1), shuffle=False,
                                     sampler=EpochSampler(len(val_ds), 0, False, self.rank, self.world, drop_last=False), **lkw)

    def _build_training(self) -> None:
        """The model, its named optimizers, the precision recipe around both, one schedule each."""
        cfg = self.cfg
        model = self.task.build_model(cfg).to(self.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.optimizers = self.build_optimizers(model)
        self.optimizer = next(iter(self.optimizers.values()))  # the first: its lr is the logged "lr"
        self.recipe = precision.build(cfg, self.device)
        # One recipe and one loss scaler for every optimizer (torch.amp's multi-optimizer rules).
        self.model = self.recipe.prepare(model, list(self.optimizers.values()))
        # Each optimizer has its own schedule, a function of its *applied* updates: a step skipped for
        # overflow (3.2) does not advance the learning rate (stepped only when the update was applied).
        self.scheds = dict(self.task.schedules(self.optimizers, cfg, self.steps_per_epoch, self.total_epochs))
        if set(self.scheds) != set(self.optimizers):
            raise UserError(f"{type(self.task).__qualname__}.schedules() gives {sorted(self.scheds)}; it must give "
                            f"one scheduler per optimizer: {sorted(self.optimizers)}")
        self.skipped = {k: 0 for k in self.optimizers}  # overflow-skipped updates per optimizer

    def _distribute(self) -> None:
        """DDP around the model (each model of a ModuleDict on its own) when there are several ranks."""
        self.ddp = self.model
        if self.world > 1:
            # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets instead of
            # a second copy of every gradient (one model's worth of memory; 4 x 0.8 B parameters for the
            # bigLSTM's embedding alone in FP32).
            kw = dict(device_ids=[self.device.index] if self.device.type == "cuda" else None,
                      gradient_as_bucket_view=True)
            if isinstance(self.model, nn.ModuleDict):
                # Each model wrapped on its own; in a phase that leaves one model without gradients
                # (a GAN's generator while the discriminator trains) DDP must not wait for them.
                self.ddp = nn.ModuleDict({k: nn.parallel.DistributedDataParallel(
                    m, find_unused_parameters=len(self.optimizers) > 1, **kw)
                    for k, m in self.model.items()})
            else:
                self.ddp = nn.parallel.DistributedDataParallel(self.model, **kw)
            # DDP broadcast rank 0's model; the recipe's FP32 masters (impl=paper) must follow it.
            self.recipe.broadcast_masters()

    def build_optimizers(self, model) -> dict[str, torch.optim.Optimizer]:
        """The task's named optimizers (Task.optimizers), each named after the model it trains."""
        opts = dict(self.task.optimizers(model, self.cfg))
        if len(opts) > 1 and isinstance(model, nn.ModuleDict) and set(opts) - set(model.keys()):
            # Numerics sampling takes each optimizer's gradients from the model of the same name; a
            # name without a model would sample every parameter under that optimizer's name.
            raise UserError(f"{type(self.task).__qualname__}.optimizers() names {sorted(set(opts) - set(model.keys()))}, "
                            f"which the model has no entry for; name each optimizer after the model it trains "
                            f"({', '.join(model.keys())})")
        return opts

    def no_sync(self):
        """DDP's no_sync on every wrapped model (gradient accumulation: all-reduce on the last micro-batch)."""
        if self.world == 1:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for m in (self.ddp.values() if isinstance(self.ddp, nn.ModuleDict) else [self.ddp]):
            stack.enter_context(m.no_sync())
        return stack

    def claim_dir(self) -> None:
        """Rank 0: create the run directory, lock it against a second copy of this run (RunLock),
        read what an earlier invocation left, and delete the temp files of a writer killed mid-write."""
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

    def release(self) -> None:
        from mpt.torch_private import shutdown_loader_workers

        for loader in (getattr(self, "train_loader", None), getattr(self, "val_loader", None)):
            if loader is not None:  # persistent workers inherited the lock's descriptor: stop them first
                shutdown_loader_workers(loader)
        if self.lock is not None:
            self.lock.release()
            self.lock = None

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
        diff = config.config_difference(stored, self.cfg) if isinstance(stored, dict) else "config.yaml unreadable"
        if diff:
            raise UserError(f"run directory {self.dir} holds another config ({diff}); use another out_dir "
                            "or delete that directory to start over")

    # -- checkpoints ----------------------------------------------------------------------------
    def rank_state(self) -> dict:
        """What differs between ranks and must survive a restart: the random streams (dropout, sampled
        negatives) and the task's state (the bigLSTM's recurrent state of this rank's streams)."""
        return {"rng": rng_state(self.device),
                "task": self.task.state_dict()}

    def gather_rank_states(self) -> list[dict] | None:
        """Every rank's rank_state(), on rank 0 (None elsewhere). A collective: every rank calls it at
        the same step (checkpoints are taken at steps all ranks agree on, see loop())."""
        mine = to_cpu(self.rank_state())
        if self.world == 1:
            return [mine]
        out = [None] * self.world if self.main else None
        dist.gather_object(mine, out, dst=0)
        return out

    def state(self, ranks: list[dict]) -> dict:
        return {
            # Every model (one state_dict; a ModuleDict's keys carry the model names), every named
            # optimizer and schedule, the recipe (scaler, FP32 masters) and per-optimizer skip counts.
            "model": self.model.state_dict(), "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
            "recipe": self.recipe.state_dict(), "scheds": {k: v.state_dict() for k, v in self.scheds.items()},
            "skipped": dict(self.skipped), "step": self.step,
            "wall": self.wall + (time.time() - self.t_start), "act_bytes": self.act_bytes,
            "cell_id": self.cell,
            # Per rank (index = rank): random state and task state (e.g. recurrent state carried
            # across batches), so that every rank, not only rank 0, continues where it stopped.
            "ranks": ranks,
        }

    def save(self) -> None:
        ranks = self.gather_rank_states()  # every rank takes part
        if self.main:
            state = self.state(ranks)
            state["checksum"] = state_checksum(state)  # verified at resume: damaged bytes are refused
            atomic_torch_save(self.dir / "checkpoint.pt", state)
        self.last_ckpt = time.time()

    def _restore_rank(self, sd: dict, path) -> None:
        """This rank's random and task state from the checkpoint (older checkpoints: rank 0's only)."""
        ranks = sd.get("ranks")
        if ranks is None:  # written before per-rank state (one process's rng_cpu / rng_cuda / task)
            ranks = [{"rng": {"cpu": sd["rng_cpu"], "cuda": sd["rng_cuda"]}, "task": sd.get("task")}]
        if len(ranks) == self.world:
            mine = ranks[self.rank]
        else:
            # Another world size than the run was checkpointed with: the data split differs anyway, so
            # the continuation cannot equal an uninterrupted run. Each rank gets a stream of its own
            # (from the step, so it is not a replay of the first one) and rank 0's task state.
            if self.main:
                print(f"warning: {path} was written by {len(ranks)} rank(s), this run has {self.world}: the "
                      "continuation is not the uninterrupted run's (other data split, new random streams)",
                      file=sys.stderr)
            mine = {"rng": None, "task": ranks[0].get("task")}
            torch.manual_seed(_mix(rank_seed(self.cfg.seed, self.rank), sd["step"]))
        if mine.get("task") is not None:
            self.task.load_state_dict(mine["task"])
        if mine.get("rng") is not None:
            set_rng_state(mine["rng"], self.device)

    def resume(self) -> None:
        path = self.dir / "checkpoint.pt"
        if not path.exists():  # (a final result never gets here: setup returned before)
            if self.main and (self.dir / "metrics.jsonl").exists():
                (self.dir / "metrics.jsonl").unlink()  # a run that died before its first checkpoint
            return
        try:
            # To the CPU, whatever device wrote it and whatever device this is: load_state_dict copies
            # model, master and optimizer tensors onto their parameters' devices (torch.optim keeps a
            # non-capturable optimizer's `step` on the CPU, where it expects it), and the RNG states
            # must stay CPU ByteTensors (set_rng_state).
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"checkpoint {path} is unreadable ({type(e).__name__}); delete it to restart the run") from None
        stored = sd.pop("checksum", None)  # checkpoints written before checksums have none
        if stored is not None and stored != state_checksum(sd):
            raise UserError(f"checkpoint {path} is damaged (its contents do not match the checksum written with it); "
                            "restore it from a copy, or delete it to restart the run")
        if sd.get("cell_id") != self.cell:
            raise UserError(f"checkpoint {path} belongs to another config; delete the run directory to restart")
        self.model.load_state_dict(sd["model"])
        for k, o in self.optimizers.items():
            o.load_state_dict(sd["optimizers"][k])
            self.scheds[k].load_state_dict(sd["scheds"][k])
        self.recipe.load_state_dict(sd["recipe"])
        self.skipped.update(sd.get("skipped", {}))
        self.step, self.wall, self.act_bytes = sd["step"], sd["wall"], sd["act_bytes"]
        self._restore_rank(sd, path)
        if self.main:  # drop metric lines written after the checkpoint by the interrupted process
            mp = self.dir / "metrics.jsonl"
            if mp.exists():
                import json

                # A line torn by a kill or a full disk mid-append is dropped too (and said).
                lines, torn = read_jsonl(mp)
                # A checkpoint at the last step follows the final evaluation, which the loop repeats when
                # it resumes there (killed before the summary said completed): that eval line goes, or
                # the result would hold it twice.
                done = self.step >= self.total_steps
                keep = [x for x in lines if isinstance(x.get("step"), int) and x["step"] <= self.step
                        and not (done and x["step"] == self.step and x.get("kind") == "eval")]
                atomic_write_text(mp, "".join(json.dumps(x, default=str) + "\n" for x in keep))
                if torn:
                    print(f"dropped {torn} unreadable (torn) line(s) of {mp}", file=sys.stderr)
            print(f"resuming {self.name} at step {self.step}/{self.total_steps}", file=sys.stderr)

    # -- train / eval -------------------------------------------------------------------------------
    def batches(self):
        """Yield (epoch, batch) from self.step on, restarting mid-epoch on resume."""
        while True:
            epoch, within = divmod(self.step, self.steps_per_epoch)
            self.sampler.set_epoch(epoch, start=within * self.per_rank)
            # The main process's copy (and through it the base dataset's own layout for the epoch);
            # workers get the epoch with each index (EpochSampler(with_epoch=True)).
            self.train_ds.set_epoch(epoch)
            for b in self.train_loader:
                yield epoch, b

    def train_step(self, micro_batches) -> tuple[dict, int, dict, dict]:
        """One iteration: Task.train_step (its default: the loss step over task.loss), then one scale
        update and zero_grad. Returns (logs: device tensors, items, {optimizer: applied}, numerics
        stats). The logs stay on the device (the loop reads them once per log step); the host reads
        in an iteration are the loss scaler's overflow flag, one per optimizer step (mpt.precision),
        and, on sampled steps only, the numerics statistics."""
        recipe = self.recipe
        self._sample = self.numerics is not None and self.numerics.should_sample(self.step)
        self._stats, self._applied = {}, {}
        if self._sample:
            self.numerics.begin(self.step)
        meter = SavedTensorBytes(self.model) if self.act_bytes is None else None  # the first step only
        ctx = StepContext(self, len(micro_batches), meter)
        micro = [to_device(b, self.device, self.channels_last) for b in micro_batches]
        logs, n = self.task.train_step(ctx, micro)
        self._close_phases()
        recipe.update()  # once per iteration, after every optimizer's step (GradScaler's rule)
        recipe.zero_grad()
        if meter is not None:
            self.act_bytes = meter.bytes
        return logs, n, self._applied, self._stats

    def _close_phases(self) -> None:
        if self._sample and len(self.optimizers) > 1:
            self.numerics.end([], None)  # drop the hooks of a phase that never stepped

    def optimizer_step(self, name: str, clip: float) -> bool:
        recipe, opt = self.recipe, self.optimizers[name]
        single = len(self.optimizers) == 1
        if self._sample:
            # One sample per optimizer: the gradients its phase produced, under the S of that backward.
            named = list(self.model.named_parameters()) if single or not isinstance(self.model, nn.ModuleDict) \
                or name not in self.model else list(self.model[name].named_parameters(prefix=name))
            stats = self.numerics.end(named, recipe.loss_scale)
            # The trained weights (FP32 masters; fp16_pure's FP16 weights) before the step (3.1).
            before = [w.detach().clone() for w in recipe.weights_of(opt)]
        applied = recipe.step(opt, clip)
        if applied:
            self.scheds[name].step()
        else:
            self.skipped[name] += 1
        self._applied[name] = applied
        if self._sample:
            # The update the optimizer intended (params_of) against what the weights received.
            stats.update(self.numerics.swamping(before, recipe.params_of(opt), recipe.weights_of(opt)))
            stats["numerics/skipped"] = not applied
            if not applied:
                stats["numerics/overflow_param"] = recipe.last_overflow
            if single:
                self._stats.update(stats)
            else:
                self._stats.update({k.replace("numerics/", f"numerics/{name}/", 1): v for k, v in stats.items()})
                self.numerics.begin(self.step)  # the next phase's backward
        return applied

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        metrics = dict(self.task.evaluate(EvalContext(self)))
        self.model.train()
        return metrics

    def iterate(self, micro_batches) -> dict:
        """One iteration of the loop: the train step, then, on the device, the divergence rule and the
        log window (read once per log step by read_window). Returns the numerics stats (sampled steps)."""
        logs, n, _, stats = self.train_step(micro_batches)
        self.step += 1
        ok = torch.isfinite(logs["loss"])
        # Consecutive non-finite losses and the step at which they reached train.diverge_after.
        self._bad = torch.where(ok, 0, self._bad + 1)
        self._diverged_at = torch.where((self._diverged_at < 0) & (self._bad >= self.cfg.train.diverge_after),
                                        self.step, self._diverged_at)
        zero = self._zero
        for k, v in logs.items():
            self._win[k] = self._win.get(k, zero) + torch.where(ok, v.detach().to(torch.float64), zero)
        self._finite = self._finite + ok
        self._win_items += n
        return stats

    def _new_window(self) -> None:
        self._win, self._win_items, self._win_t = {}, 0, time.time()
        self._finite = torch.zeros((), dtype=torch.int64, device=self.device)

    def read_window(self) -> tuple[dict, int, bool, bool, bool]:
        """The one device read per log step: the window's mean logs, its finite steps, whether
        the divergence rule fired, whether to stop and whether a timed checkpoint is due. With DDP
        every rank gets the same answer (the logged loss is the global batch's; a stop signal reaches
        ranks at different steps, clocks differ, and a rank leaving early or checkpointing alone would
        hang the others in a collective): one small all-reduce."""
        keys = sorted(self._win)
        flags = [STOP.reason is not None, self.ckpt_due_by_time()]
        t = torch.cat([torch.stack([self._win[k] for k in keys] + [
            self._finite.to(torch.float64), (self._diverged_at >= 0).to(torch.float64)]),
            torch.tensor(flags, dtype=torch.float64, device=self.device)])
        if self.world > 1:
            dist.all_reduce(t)
        v = t.tolist()
        nf = int(round(v[len(keys)]))
        means = {k: (v[i] / nf if nf > 0 else float("nan")) for i, k in enumerate(keys)}
        return means, nf, v[len(keys) + 1] > 0, v[len(keys) + 2] > 0, v[len(keys) + 3] > 0

    def ckpt_due_by_time(self) -> bool:
        m = self.cfg.train.ckpt_every_minutes
        return m > 0 and time.time() - self.last_ckpt > 60 * m

    def loop(self) -> dict:
        t = self.cfg.train
        self.model.train()
        self.t_start = self.last_ckpt = time.time()
        bar = None
        if self.main and t.progress:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step, desc=self.name, unit="step",
                       dynamic_ncols=True, file=sys.stderr, mininterval=2.0)
        self._new_window()
        metrics, last_eval, throughput = {}, -1, None
        it = self.batches()
        while self.step < self.total_steps:
            stats = self.iterate([next(it)[1] for _ in range(t.accum_steps)])
            if stats:
                self.log({"kind": "numerics", "step": self.step, **stats})
            if bar is not None:
                bar.update(1)
            at_log = self.step % t.log_every == 0 or self.step == self.total_steps
            stop = diverged = due_time = False
            if at_log:
                means, nf, diverged, stop, due_time = self.read_window()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                dt = time.time() - self._win_t
                throughput = self._win_items * self.world / dt if dt > 0 else None
                line = {"kind": "train", "step": self.step, "epoch": self.step / self.steps_per_epoch, **means,
                        "lr": self.optimizer.param_groups[0]["lr"], "loss_scale": self.recipe.loss_scale,
                        "skipped_steps": self.recipe.skipped_steps, "throughput": throughput,
                        "time": self.wall + time.time() - self.t_start}
                if len(self.optimizers) > 1:
                    for k, o in self.optimizers.items():
                        line[f"lr/{k}"], line[f"skipped/{k}"] = o.param_groups[0]["lr"], self.skipped[k]
                self.log(line)
                if bar is not None:
                    bar.set_postfix(loss=f"{means['loss']:.3f}", S=f"{self.recipe.loss_scale:g}",
                                    ips=f"{throughput or 0:.0f}", refresh=False)
                self._new_window()
            if self.world == 1:  # a single process acts at once; DDP ranks agree at log steps (read_window)
                stop, due_time = STOP.reason is not None, self.ckpt_due_by_time()
            if diverged:
                # The paper's "diverges" cells: stop instead of burning GPU hours on NaNs.
                at = int(self._diverged_at.item())
                at = at if at >= 0 else self.step  # another rank's loss diverged
                return self.finish("diverged", metrics, throughput,
                                   error=f"loss non-finite for {t.diverge_after} consecutive steps at step {at}")
            if self.step % self.eval_every == 0 or self.step == self.total_steps:
                metrics = self.evaluate()
                last_eval = self.step
                self.log({"kind": "eval", "step": self.step, "epoch": self.step / self.steps_per_epoch, **metrics})
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
        # A run whose last losses or final metrics are not finite is never "completed": fewer than
        # diverge_after NaN steps at the very end (a NaN at step 5 of 20 with diverge_after=20) would
        # otherwise record a broken model as a result.
        tail = self._bad.clone()
        if self.world > 1:
            dist.all_reduce(tail, op=dist.ReduceOp.MAX)
        tail = int(tail.item())
        bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
        if tail or bad:
            why = [f"the last {tail} loss(es) non-finite"] if tail else []
            why += [f"final {', '.join(bad)} non-finite"] if bad else []
            return self.finish("diverged", metrics, throughput, error=f"{' and '.join(why)} at step {self.step}")
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
    try:
        return _run(r)
    finally:
        r.release()
        if r.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _run(r: Run) -> dict:
    try:
        r.setup()
    except BaseException as e:
        # A run that got as far as a summary keeps it: a later invocation that cannot even start
        # (a wrong path, a missing dataset) must not turn a completed or interrupted result into
        # "failed". Nothing is written without the directory's lock (another copy may be running).
        if r.main and r.lock is not None and r.prev_summary is None:
            _record_failure(r, e, traceback_file=False)
        elif not r.main:
            _record_rank_failure(r, e)
        raise
    if r.final is not None:
        return r.final  # a result is final: nothing to redo, nothing a later failure may replace
    try:
        if r.main:
            r.write_summary(step=r.step, total_steps=r.total_steps)
        return r.loop()
    except BaseException as e:
        if r.main:
            _record_failure(r, e, traceback_file=True)
            r.wandb.finish(1)
        else:
            _record_rank_failure(r, e)
        raise


class RankZeroRefused(UserError):
    """Rank 0 could not claim the run directory (told to the other ranks): rank 0's error, not theirs."""


def _record_rank_failure(r: Run, e: BaseException) -> None:
    """Rank r > 0 failed (an OOM on rank 3): only rank 0 writes summary.json, and rank 0 may be waiting
    in a collective that will never complete (until the process group's timeout), so the failing rank
    leaves its own record: failure.rank<r>.json (one line of cause, host, step) and error.rank<r>.txt.
    Rank 0 names it in summary.json when it fails in turn; slurm.status reads it in any case."""
    if isinstance(e, (KeyboardInterrupt, SystemExit, RankZeroRefused)):
        return
    try:
        import socket

        r.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(r.dir / f"error.rank{r.rank}.txt", traceback.format_exc())
        atomic_write_json(r.dir / f"{RANK_FAILURE}{r.rank}.json",
                          {"rank": r.rank, "world": r.world, "host": socket.gethostname(), "pid": os.getpid(),
                           "step": getattr(r, "step", 0), "error": one_line(e), "time": now()})
    except Exception as e2:  # noqa: BLE001 -- the error being reported matters more
        print(f"rank {r.rank}: could not record its failure in {r.dir}: {one_line(e2)}", file=sys.stderr)


def rank_failures(run_dir, wait_s: float = 0.0) -> dict[int, dict]:
    """read_rank_failures, waiting up to wait_s for a record to appear (a peer's collective error can
    reach rank 0 a moment before the peer's file does)."""
    deadline = time.time() + wait_s
    while True:
        out = read_rank_failures(run_dir)
        if out or time.time() >= deadline:
            return out
        time.sleep(0.2)


def _record_failure(r: Run, e: BaseException, traceback_file: bool) -> None:
    """summary.json says why the run ended ("failed" with the error's one-line cause, or
    "interrupted" after a second Ctrl-C); error.txt keeps the traceback. A failure to write these
    (the disk that just filled up) must not hide the error being reported."""
    extra = {}
    if isinstance(e, KeyboardInterrupt):
        status, error = "interrupted", "aborted by a second Ctrl-C; resumes from the last checkpoint"
    else:
        status, error = "failed", one_line(e)
        if r.world > 1:
            # Rank 0's own error is often only the consequence (a collective whose peer died): name the
            # rank that failed first, with its cause.
            others = {k: v for k, v in rank_failures(r.dir, wait_s=5.0).items() if k != r.rank}
            if others:
                k = min(others)
                error = f"rank {k} failed on {others[k].get('host')}: {others[k].get('error')} (rank 0: {error})"
                extra["rank_errors"] = {str(k): v.get("error") for k, v in others.items()}
    try:
        if traceback_file:
            atomic_write_text(r.dir / "error.txt", traceback.format_exc())
        r.write_summary(status=status, error=error, step=getattr(r, "step", 0), **extra)
    except Exception as e2:  # noqa: BLE001
        print(f"could not record the failure in {r.dir}: {one_line(e2)}", file=sys.stderr)


def main(experiment: str, overrides: list[str]) -> dict:
    cfg = config.resolve(experiment, overrides)
    mod = config.experiment_module(experiment)
    return run(cfg, mod.Task())


def exit_code(summary: dict) -> int:
    """A command's exit status for a run's summary: 0 for a result (completed or diverged), 1 for a
    failure, 128 + the signal for a run a signal stopped (130 Ctrl-C, 143 SIGTERM), as a shell
    reports a process killed by it -- so a scheduler or script sees that the run is not done."""
    status = summary.get("status")
    if status in FINAL:
        return 0
    if status == "interrupted":
        return 128 + (STOP.signum or signal.SIGTERM)
    return 1


def cli_main(experiment: str, argv: list[str] | None = None) -> None:
    """`python -m experiments.<name> key=value ...`"""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: python -m experiments.{experiment} [--print-config] [key=value ...]\n"
              f"e.g.   python -m experiments.{experiment} profile=tiny precision=mixed\n"
              f"keys:  see mpt/config.py and experiments/{experiment}/config.yaml\n"
              f"--print-config: print the resolved config and its run directory; run nothing\n"
              f"SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 checkpoint at the next step and stop (exit 128 + signal); "
              f"starting the same command again resumes")
        return
    if argv and argv[0] == "--print-config":
        # What a grid cell will do, before it does it (the same resolution as a run).
        cfg = cli(config.resolve)(experiment, argv[1:])
        print(config.dump_yaml(cfg), end="")
        print(f"# run directory: {config.run_dir(cfg)}")
        return
    cli_run(lambda: main(experiment, argv), where=lambda: config.run_dir(config.resolve(experiment, argv)))


def cli_run(start, where=None) -> None:
    """Run `start()` (-> a run's summary) as a command: stop signals checkpoint instead of losing work,
    user errors are one line, and the exit status says how the run ended (exit_code)."""
    install_stop_handlers()
    try:
        s = cli(start)()
    except KeyboardInterrupt:
        print("aborted (second Ctrl-C): the run resumes from its last checkpoint", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"{s['status']}: {s['run_name']} {s['metrics']}" + (f" ({s['error']})" if s.get("error") else "")
          + (f" -> {where()}" if where is not None else ""))
    code = exit_code(s)
    if code:
        raise SystemExit(code)
