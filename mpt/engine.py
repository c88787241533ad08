"""The one training loop every experiment uses: Run (setup in order, then the loop) and run().

An experiment supplies a Task (mpt/task.py: the contract, its lifecycle and defaults); precision lives
entirely in the recipe (mpt.precision), so nothing here branches on it. Read top to bottom: setup
builds, in order, the process and its run directory, the data, the model with its optimizers, recipe
and schedules (one TrainStep, mpt/step.py, which owns an iteration), DDP, the random streams, the
checkpoint to resume from; the loop then iterates, logs once per log window, evaluates, checkpoints
and stops on divergence or a signal. A run resumes from its checkpoint when started again --
bit-identically in FP32 on the CPU.

The pieces around it, one concern per file: mpt/step.py (the iteration and what a task sees of it),
mpt/record.py (everything the run directory holds), mpt/optim.py (optimizers and schedules),
mpt/ranks.py (rank, device, random streams), mpt/signals.py (stopping cleanly on a signal),
mpt/cli.py (the command line).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader

from mpt import precision
from mpt.data import EpochSampler, SeededDataset, mix_seeds
from mpt.errors import UserError
from mpt.ranks import distributed_env, loader_workers, pick_device, rank_seed, rng_state, set_rng_state
from mpt.record import RankZeroRefused, RunRecord
from mpt.rundir import env_info
from mpt.signals import STOP, worker_init
from mpt.step import EvalContext, TrainStep
from mpt.task import Task


@dataclasses.dataclass
class Data:
    """This rank's loaders and the batch arithmetic: global batch = world x per_rank, per_rank =
    accum_steps x micro."""
    train_ds: SeededDataset
    sampler: EpochSampler
    train_loader: DataLoader
    val_loader: DataLoader
    per_rank: int
    steps_per_epoch: int


def loader_options(task: Task, num_workers: int, pin_memory: bool) -> dict:
    """The DataLoader options of every loader of a run (training and evaluation)."""
    # Each DataLoader iterator draws a worker seed when created (every epoch, every evaluation, at
    # resume); from its own generator, not the global RNG that dropout uses, so resume stays exact.
    # Persistent workers: a paper run would otherwise start num_workers processes (imports, dataset
    # copies) at every epoch and every evaluation. The epoch reaches them with each index
    # (EpochSampler(with_epoch=True)), never through state set after they started.
    return dict(num_workers=num_workers, pin_memory=pin_memory,
                generator=torch.Generator().manual_seed(task.cfg.seed), collate_fn=task.collate,
                worker_init_fn=worker_init if num_workers > 0 else None, persistent_workers=num_workers > 0)


def train_loader_of(task: Task, train_ds, micro: int, options: dict, *, rank: int = 0, world: int = 1,
                    per_rank: int | None = None) -> tuple[SeededDataset, EpochSampler, DataLoader]:
    """The training set as a rank reads it: each sample's augmentation seeded from (seed, epoch,
    index) (SeededDataset), the rank's share of the epoch's order (EpochSampler, the tail dropped to
    whole batches of per_rank, default micro), micro-batches collated by the task, with the
    loader_options `options`. The engine's and the loader benchmark's
    (experiments/speed_memory/loader.py) one pipeline."""
    seed = task.cfg.seed
    # A task whose samples must stay in order (a language model carrying recurrent state across
    # batches) sets shuffle_train = False.
    sampler = EpochSampler(len(train_ds), seed, task.shuffle_train, rank, world, per_rank or micro,
                           order=functools.partial(task.train_order, train_ds), with_epoch=True)
    seeded = SeededDataset(train_ds, seed)
    loader = DataLoader(seeded, batch_size=micro, sampler=sampler, drop_last=True, **options)
    return seeded, sampler, loader


class LogWindow:
    """The loop's device-side bookkeeping between two log steps: the sum of each logged value over the
    window's finite steps, the finite-step count, and the divergence rule's counters (consecutive
    non-finite losses, kept across windows, and the step at which they reached diverge_after). Nothing
    here reads the device; read() is the one read per log step."""

    def __init__(self, device: torch.device, diverge_after: int):
        self.device, self.diverge_after = device, diverge_after
        self.zero = torch.zeros((), dtype=torch.float64, device=device)
        self.bad = torch.zeros((), dtype=torch.int64, device=device)
        self.diverged_at = torch.full((), -1, dtype=torch.int64, device=device)
        self.open()

    def open(self) -> None:
        self.sums, self.finite = {}, torch.zeros((), dtype=torch.int64, device=self.device)
        self.restart_clock()

    def restart_clock(self) -> None:
        """Throughput counts the items and the time since this process opened the window or resumed."""
        self.items, self.t0 = 0, time.monotonic()

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the window: a resume inside a log window (log_every=5, stopped at
        step 7) must log at step 10 the mean of steps 6-10, as the uninterrupted run does, not of 8-10;
        and the consecutive non-finite count goes on where it stood. Not the clock or the item count
        (throughput is of this process)."""
        return {"sums": dict(self.sums), "finite": self.finite, "bad": self.bad, "diverged_at": self.diverged_at}

    def load_state_dict(self, sd: dict) -> None:
        self.sums = {k: v.to(self.device, torch.float64) for k, v in sd["sums"].items()}
        self.finite, self.bad, self.diverged_at = (sd[k].to(self.device, torch.int64)
                                                   for k in ("finite", "bad", "diverged_at"))
        self.restart_clock()

    def add(self, logs: dict, items: int, step: int) -> None:
        ok = torch.isfinite(logs["loss"])
        self.bad = torch.where(ok, 0, self.bad + 1)
        self.diverged_at = torch.where((self.diverged_at < 0) & (self.bad >= self.diverge_after), step, self.diverged_at)
        for k, v in logs.items():
            self.sums[k] = self.sums.get(k, self.zero) + torch.where(ok, v.detach().to(torch.float64), self.zero)
        self.finite = self.finite + ok
        self.items += items

    def read(self, flags: list[bool], world: int) -> tuple[dict, int, bool, list[bool]]:
        """The window's mean logs, its finite steps, whether the divergence rule fired, and `flags`
        or-ed over ranks. With DDP every rank gets the same answer (the logged loss is the global
        batch's; a stop signal reaches ranks at different steps, clocks differ, and a rank leaving early
        or checkpointing alone would hang the others in a collective): one small all-reduce."""
        keys = sorted(self.sums)
        t = torch.cat([torch.stack([self.sums[k] for k in keys] + [
            self.finite.to(torch.float64), (self.diverged_at >= 0).to(torch.float64)]),
            torch.tensor(flags, dtype=torch.float64, device=self.device)])
        if world > 1:
            dist.all_reduce(t)
        v = t.tolist()
        nf = int(round(v[len(keys)]))
        means = {k: (v[i] / nf if nf > 0 else float("nan")) for i, k in enumerate(keys)}
        return means, nf, v[len(keys) + 1] > 0, [x > 0 for x in v[len(keys) + 2:]]


class Run:
    # Observers (mpt.step.Observer) every run of this process adds after its own: what a test injects into
    # the iteration (a stop request at a given step), without a seam in the loop.
    extra_observers: tuple = ()

    def __init__(self, cfg, task: Task, on_result=None):
        if not isinstance(task, Task):  # the engine calls Task's methods; their defaults live there
            raise TypeError(f"{type(task).__qualname__} must subclass mpt.task.Task (see mpt/task.py)")
        if task.cfg is not cfg:  # the hooks read task.cfg: one config for the run and its task
            raise TypeError(f"{type(task).__qualname__} was built with another config; build it with the run's: "
                            f"Task(cfg)")
        self.cfg, self.task = cfg, task
        self.on_result = on_result  # called with the summary as soon as it says how the run ended (finish)
        self.rank, self.world, self.local_rank = distributed_env()
        self.main = self.rank == 0
        self.device = pick_device(cfg.device, self.local_rank)
        self.channels_last = precision.channels_last_pays(cfg, self.device, task.channels_last)
        self.num_workers = loader_workers(cfg.train.num_workers)  # train.num_workers=auto: this node's count
        self.record = RunRecord(cfg, task, self.rank, self.world)
        self.final: dict | None = None  # an earlier invocation's final result, kept as it is (setup)
        # Built by setup(), in this order:
        self.data: Data | None = None
        self.total_steps: int | None = None
        self.eval_every = 0
        self.train: TrainStep | None = None
        # mpt.numerics.FidelityObserver when numerics.sqnr_every > 0, then NumericsObserver when
        # numerics.every > 0 (in that order: the SQNR passes run before numerics' hooks are on)
        self.observers: list = []
        self.window: LogWindow | None = None
        self.wall = 0.0  # training seconds of earlier invocations (from the checkpoint)
        # Intervals (training time, timed checkpoints, throughput) on the monotonic clock: a wall clock
        # stepped back by NTP would give a negative time and stop timed checkpoints until it caught up.
        self.t_start = self.last_ckpt = time.monotonic()

    @property
    def step(self) -> int:
        """Iterations done (the TrainStep's count)."""
        return self.train.iteration if self.train is not None else 0

    def progress(self) -> dict:
        """What summary.json says of the training so far."""
        t = self.train
        if t is None:
            return {"step": 0, "total_steps": self.total_steps}
        return {"step": t.iteration, "total_steps": self.total_steps, "skipped_steps": t.recipe.skipped_steps,
                "skipped_per_optimizer": dict(t.skipped), "final_loss_scale": t.recipe.loss_scale,
                "activation_bytes": t.act_bytes}

    # -- setup, in order ----------------------------------------------------------------------------
    def setup(self):
        """Everything before the first step: the process and its run directory; the data (Task.datasets,
        under the run's seed) and its loaders; the model, its optimizers, the precision recipe and the
        schedules; DDP; each rank's own random stream; numerics sampling; the training step; the
        checkpoint to resume from; the wandb run."""
        cfg = self.cfg
        if cfg.train.cuda_graphs:  # before anything is written: the device, the ranks, the task
            from mpt import graphs

            graphs.check(device=self.device, world=self.world, accum=cfg.train.accum_steps, task=self.task)
        self._start_process()
        if self.final is not None:  # a kept result: nothing to build
            return
        torch.manual_seed(cfg.seed)
        train_ds, val_ds = self.task.datasets()
        self._build_loaders(train_ds, val_ds)
        model, optimizers, recipe, scheds = self._build_training()
        ddp = self._distribute(model, optimizers, recipe)
        # The model starts identical on every rank (seeded with cfg.seed, then DDP's broadcast); what is
        # drawn from here on -- dropout masks, a sampled softmax's negatives, a GAN's noise -- must
        # differ between ranks, or N GPUs draw the same numbers N times (the bigLSTM's 8,192 negatives
        # would be the same on every GPU). Rank 0 keeps cfg.seed's stream, so a one-process run is
        # unchanged; each other rank gets its own stream. Data augmentation is seeded per sample
        # (SeededDataset), not here.
        if self.rank > 0:
            torch.manual_seed(rank_seed(cfg.seed, self.rank))
        self.observers += list(recipe.observers(self.total_steps))  # first: what the recipe runs, the others see
        if cfg.numerics.sqnr_every > 0:
            from mpt.numerics import FidelityObserver

            self.observers.append(FidelityObserver(self.task, cfg.numerics.sqnr_every))
        if cfg.numerics.every > 0:
            from mpt.numerics import Numerics, NumericsObserver

            self.observers.append(NumericsObserver(Numerics(model, every=cfg.numerics.every, lo=cfg.numerics.hist_lo,
                                                            hi=cfg.numerics.hist_hi)))
        self.observers += list(self.extra_observers)
        self.train = TrainStep(None if self.task.own_step else self.task.loss, model, optimizers, recipe,
                               body=self.task.train_step if self.task.own_step else None, ddp=ddp, scheds=scheds,
                               clip_grad_norm=cfg.train.clip_grad_norm, device=self.device,
                               channels_last=self.channels_last, world=self.world, observers=tuple(self.observers),
                               cuda_graphs=cfg.train.cuda_graphs)
        self.window = LogWindow(self.device, cfg.train.diverge_after)
        self.resume()
        self.record.open_wandb()

    def _start_process(self) -> None:
        """This process's GPU and process group, the math flags, the run directory claimed (rank 0;
        the others stop if it could not be), config.yaml and env.json written."""
        cfg, rec = self.cfg, self.record
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
        rec.check_identity()
        # Rank 0 claims the directory and reads what an earlier invocation left. A final result
        # (completed, diverged) is kept as it is: a later invocation writes nothing into its directory
        # (config.yaml and env.json name what produced it; a diverged run's NaN history must not be cut
        # back to its last checkpoint) and returns its summary.
        claim_error, final = None, None
        if self.main:
            try:
                rec.claim()
            except UserError as e:  # another copy holds the lock, or the directory cannot be written
                claim_error = e
            else:
                final = rec.final_result()
        if self.world > 1:  # one broadcast tells every rank both, so none waits alone in a collective
            box = [None if claim_error is None else str(claim_error), final]
            dist.broadcast_object_list(box, src=0)
            if box[0] is not None and claim_error is None:
                raise RankZeroRefused(box[0])
            final = box[1]
        if claim_error is not None:
            raise claim_error
        self.final = final
        if final is None:
            rec.write_start({**env_info(self.device, self.world, cfg), "channels_last": self.channels_last,
                             "num_workers": self.num_workers})

    def _build_loaders(self, train_ds, val_ds) -> None:
        """The batch split (global -> per rank -> micro-batches), the epoch's length, and the loaders."""
        cfg = self.cfg
        t = cfg.train
        if t.batch_size % (self.world * t.accum_steps):
            raise UserError(f"train.batch_size={t.batch_size} must divide by world size {self.world} x "
                            f"train.accum_steps {t.accum_steps}")
        per_rank = t.batch_size // self.world
        micro = per_rank // t.accum_steps
        if self.main and self.world > 1:
            print(f"global batch {t.batch_size} = {self.world} ranks x {per_rank} "
                  f"({t.accum_steps} micro-batches of {micro})", file=sys.stderr)
        # One set of options, one worker-seed generator, for both loaders.
        lkw = loader_options(self.task, self.num_workers, pin_memory=self.device.type == "cuda")
        seeded, sampler, train_loader = train_loader_of(self.task, train_ds, micro, lkw, rank=self.rank,
                                                        world=self.world, per_rank=per_rank)
        steps_per_epoch = len(sampler) // per_rank
        if steps_per_epoch == 0:
            raise UserError(f"train.batch_size={t.batch_size} is larger than the training set ({len(train_ds)})")
        self.total_steps = t.max_steps or max(1, round(t.epochs * steps_per_epoch))
        self.eval_every = max(1, round(t.eval_every_epochs * steps_per_epoch))
        val_loader = DataLoader(val_ds, batch_size=max(micro, 1), shuffle=False,
                                sampler=EpochSampler(len(val_ds), 0, False, self.rank, self.world, drop_last=False),
                                **lkw)
        self.data = Data(seeded, sampler, train_loader, val_loader, per_rank, steps_per_epoch)

    def _build_training(self):
        """The model, its named optimizers, the precision recipe around both, one schedule each."""
        cfg = self.cfg
        model = self.task.build_model().to(self.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        optimizers = dict(self.task.optimizers(model))
        if len(optimizers) > 1 and isinstance(model, nn.ModuleDict) and set(optimizers) - set(model.keys()):
            # Numerics sampling takes each optimizer's gradients from the model of the same name; a
            # name without a model would sample every parameter under that optimizer's name.
            raise UserError(f"{type(self.task).__qualname__}.optimizers() names {sorted(set(optimizers) - set(model.keys()))}, "
                            f"which the model has no entry for; name each optimizer after the model it trains "
                            f"({', '.join(model.keys())})")
        recipe = precision.build(cfg, self.device)
        # One recipe and one loss scaler for every optimizer (torch.amp's multi-optimizer rules).
        model = recipe.prepare(model, list(optimizers.values()))
        # Each optimizer has its own schedule, a function of its *applied* updates: a step skipped for
        # overflow (3.2) does not advance the learning rate (stepped only when the update was applied).
        spe = self.data.steps_per_epoch
        scheds = dict(self.task.schedules(optimizers, spe, self.total_steps / spe))
        if set(scheds) != set(optimizers):
            raise UserError(f"{type(self.task).__qualname__}.schedules() gives {sorted(scheds)}; it must give "
                            f"one scheduler per optimizer: {sorted(optimizers)}")
        return model, optimizers, recipe, scheds

    def _distribute(self, model, optimizers, recipe):
        """DDP around the model (each model of a ModuleDict on its own) when there are several ranks."""
        if self.world == 1:
            return model
        # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets instead of a
        # second copy of every gradient (one model's worth of memory; 4 x 0.8 B parameters for the
        # bigLSTM's embedding alone in FP32).
        kw = dict(device_ids=[self.device.index] if self.device.type == "cuda" else None,
                  gradient_as_bucket_view=True)
        if isinstance(model, nn.ModuleDict):
            # Each model wrapped on its own; in a phase that leaves one model without gradients (a
            # GAN's generator while the discriminator trains) DDP must not wait for them.
            ddp = nn.ModuleDict({k: nn.parallel.DistributedDataParallel(m, find_unused_parameters=len(optimizers) > 1, **kw)
                                 for k, m in model.items()})
        else:
            ddp = nn.parallel.DistributedDataParallel(model, **kw)
        # DDP broadcast rank 0's model; the recipe's FP32 masters (impl=paper) must follow it.
        recipe.broadcast_masters()
        return ddp

    def resume(self) -> None:
        """The checkpoint, if any: the training step's state (models, optimizers, schedules, recipe,
        skip counts, iteration), the training time so far, and this rank's random and task state."""
        sd = self.record.load()
        if sd is None:
            return
        self.train.load_state_dict(sd)
        self.wall = sd["wall"]
        ranks = sd["ranks"]
        if len(ranks) == self.world:
            mine = ranks[self.rank]
        else:
            # Another world size than the run was checkpointed with: the data split differs anyway, so
            # the continuation cannot equal an uninterrupted run. Each rank gets a stream of its own
            # (from the step, so it is not a replay of the first one) and rank 0's task state.
            if self.main:
                print(f"warning: {self.record.dir / 'checkpoint.pt'} was written by {len(ranks)} rank(s), this run "
                      f"has {self.world}: the continuation is not the uninterrupted run's (other data split, new "
                      "random streams)", file=sys.stderr)
            mine = {"rng": None, "task": ranks[0].get("task"), "window": None}
            torch.manual_seed(mix_seeds(rank_seed(self.cfg.seed, self.rank), sd["step"]))
        if mine.get("task") is not None:
            self.task.load_state_dict(mine["task"])
        if mine.get("rng") is not None:
            set_rng_state(mine["rng"], self.device)
        if mine.get("window") is not None:  # absent from checkpoints older than it: the window starts empty
            self.window.load_state_dict(mine["window"])
        self.record.truncate_metrics(self.step, done=self.step >= self.total_steps)
        if self.main:
            print(f"resuming {self.record.name} at step {self.step}/{self.total_steps}", file=sys.stderr)

    def save(self) -> None:
        """A checkpoint (every rank takes part: the rank states are gathered on rank 0)."""
        self.record.save({**self.train.state_dict(), "wall": self.wall + (time.monotonic() - self.t_start)},
                         # What differs between ranks and must survive a restart: the random streams
                         # (dropout, sampled negatives) and the task's state (the bigLSTM's recurrent
                         # state of this rank's streams).
                         # and the open log window's partial sums (a resume logs the same lines).
                         {"rng": rng_state(self.device), "task": self.task.state_dict(),
                          "window": self.window.state_dict()})
        self.last_ckpt = time.monotonic()

    def release(self) -> None:
        from mpt.torch_private import shutdown_loader_workers

        if self.data is not None:  # persistent workers inherited the lock's descriptor: stop them first
            shutdown_loader_workers(self.data.train_loader)
            shutdown_loader_workers(self.data.val_loader)
        self.record.release()

    # -- the loop -----------------------------------------------------------------------------------
    def batches(self):
        """Yield (epoch, batch) from self.step on, restarting mid-epoch on resume."""
        d = self.data
        while True:
            epoch, within = divmod(self.step, d.steps_per_epoch)
            d.sampler.set_epoch(epoch, start=within * d.per_rank)
            # The main process's copy (and through it the base dataset's own layout for the epoch);
            # workers get the epoch with each index (EpochSampler(with_epoch=True)).
            d.train_ds.set_epoch(epoch)
            with open_files_limit(self.cfg):
                for b in d.train_loader:
                    yield epoch, b

    @torch.no_grad()
    def evaluate(self) -> dict:
        t, step = self.train, self.step
        write = (lambda fname, png, name, caption: self.record.image(fname, png, name, caption, step)) \
            if self.main else None
        ev = EvalContext(step=step, model=t.model, recipe=t.recipe, val_loader=self.data.val_loader,
                         device=self.device, channels_last=self.channels_last, rank=self.rank, world=self.world,
                         run_dir=self.record.dir, eval_max_batches=self.cfg.train.eval_max_batches, write_image=write)
        t.model.eval()
        with open_files_limit(self.cfg):
            metrics = dict(self.task.evaluate(ev))
        t.model.train()
        return metrics

    def ckpt_due_by_time(self) -> bool:
        m = self.cfg.train.ckpt_every_minutes
        return m > 0 and time.monotonic() - self.last_ckpt > 60 * m

    def epoch(self) -> float:
        return self.step / self.data.steps_per_epoch

    def loop(self) -> dict:
        """Train from self.step to total_steps: each iteration the step (TrainStep: forward, backward, the
        update), its logs into the window (on the device), the numerics sample; at log steps the window's
        line, at eval steps the metrics, checkpoints as due; stopped by divergence or a signal."""
        t = self.cfg.train
        self.train.model.train()
        self.t_start = self.last_ckpt = time.monotonic()
        bar = self._progress_bar()
        # Not open(): the window holds what resume() restored of a log window the checkpoint fell inside.
        self.window.restart_clock()
        metrics, last_eval, throughput = {}, -1, None
        it = self.batches()
        while self.step < self.total_steps:
            logs, items = self.train([next(it)[1] for _ in range(t.accum_steps)])
            self.window.add(logs, items, self.step)  # the divergence rule and the log window, on the device
            stats = {k: v for o in self.observers for k, v in getattr(o, "stats", {}).items()}
            if stats:
                self.record.log({"kind": "numerics", "step": self.step, **stats})
            if bar is not None:
                bar.update(1)
            stop = diverged = due_time = False
            if self.step % t.log_every == 0 or self.step == self.total_steps:
                throughput, diverged, stop, due_time = self._log_line(bar)
            if self.world == 1:  # a single process acts at once; DDP ranks agree at log steps (LogWindow.read)
                stop, due_time = STOP.reason is not None, self.ckpt_due_by_time()
            if diverged:  # the paper's "diverges" cells: stop instead of burning GPU hours on NaNs
                at = int(self.window.diverged_at.item())
                at = at if at >= 0 else self.step  # another rank's loss diverged
                return self.finish("diverged", metrics, throughput,
                                   error=f"loss non-finite for {t.diverge_after} consecutive steps at step {at}")
            if self.step % self.eval_every == 0 or self.step == self.total_steps:
                metrics, last_eval = self._evaluate_and_log(), self.step
            due_step = t.ckpt_every_steps > 0 and self.step % t.ckpt_every_steps == 0
            if (due_time or due_step or self.step % self.eval_every == 0) and self.step < self.total_steps:
                self.save()
                self.record.write_summary(self.progress(), metrics=metrics)
            # Checked after a step, so a process always makes progress before it can be stopped
            # (a job signalled at every start would otherwise requeue forever).
            if stop and self.step < self.total_steps:
                self.save()
                return self.finish("interrupted", metrics, throughput, error=f"stopped: {STOP.reason or 'another rank'}")
        if bar is not None:
            bar.close()
        return self._end(metrics if last_eval == self.step else self._evaluate_and_log(), throughput)

    def _progress_bar(self):
        if not (self.main and self.cfg.train.progress):
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.step, desc=self.record.name, unit="step",
                    dynamic_ncols=True, file=sys.stderr, mininterval=2.0)

    def _log_line(self, bar) -> tuple:
        """A log step: the window's means read (the one host read of the losses, ranks agreeing on stop and
        timed checkpoint), its train line written, the window reopened. -> (throughput, diverged, stop,
        timed checkpoint due)."""
        win = self.window
        means, nf, diverged, (stop, due_time) = win.read([STOP.reason is not None, self.ckpt_due_by_time()],
                                                         self.world)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.monotonic() - win.t0
        throughput = win.items * self.world / dt if dt > 0 else None
        recipe, opts = self.train.recipe, self.train.optimizers
        line = {"kind": "train", "step": self.step, "epoch": self.epoch(), **means,
                "lr": next(iter(opts.values())).param_groups[0]["lr"], "loss_scale": recipe.loss_scale,
                "skipped_steps": recipe.skipped_steps, "throughput": throughput,
                "time": self.wall + time.monotonic() - self.t_start}
        if len(opts) > 1:
            for k, o in opts.items():
                line[f"lr/{k}"], line[f"skipped/{k}"] = o.param_groups[0]["lr"], self.train.skipped[k]
        self.record.log(line)
        if bar is not None:
            bar.set_postfix(loss=f"{means['loss']:.3f}", S=f"{recipe.loss_scale:g}", ips=f"{throughput or 0:.0f}",
                            refresh=False)
        win.open()
        return throughput, diverged, stop, due_time

    def _evaluate_and_log(self) -> dict:
        metrics = self.evaluate()
        self.record.log({"kind": "eval", "step": self.step, "epoch": self.epoch(), **metrics})
        return metrics

    def _end(self, metrics: dict, throughput) -> dict:
        """The run's end: a run whose last losses or final metrics are not finite is never "completed":
        fewer than diverge_after NaN steps at the very end (a NaN at step 5 of 20 with diverge_after=20)
        would otherwise record a broken model as a result."""
        tail = self.window.bad.clone()
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
        wall = self.wall + time.monotonic() - self.t_start
        rec = self.record
        s = rec.write_summary(self.progress(), status=status, metrics=metrics, throughput=throughput,
                              peak_gpu_mem_bytes=peak, wall_time_s=wall, error=error)
        if self.on_result is not None:
            # Before wandb's finish and the loaders' teardown (seconds): a record kept beside the summary
            # (slurm.job's job.json) says how the run ended even if the process is killed during them.
            self.on_result(s)
        rec.wandb.summary({"status": status, "step": self.step, "skipped_steps": self.train.recipe.skipped_steps,
                           "throughput": throughput, "activation_bytes": self.train.act_bytes, "peak_gpu_mem_bytes": peak,
                           **{f"final/{k}": v for k, v in metrics.items()}})
        rec.wandb.finish(0 if status in ("completed", "interrupted") else 1)
        return s


@contextlib.contextmanager
def open_files_limit(cfg):
    """Running out of file descriptors in a loader (EMFILE: its workers' shared-memory tensors travel as
    descriptors, persistent workers hold theirs) as a one-line error naming the limit and the fixes,
    not a traceback from inside torch's multiprocessing."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if getattr(e, "errno", None) != errno.EMFILE and "Too many open files" not in str(e):
            raise
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # The half-started loader iterator fails in its own __del__ at exit ("Exception ignored ...
        # '_MultiProcessingDataLoaderIter' object has no attribute '_workers_status'"): a torch error after
        # ours, not the user's to read. Silence that one report only.
        hook = sys.unraisablehook

        def quiet(u):
            if not (isinstance(u.exc_value, AttributeError) and "_MultiProcessingDataLoaderIter" in repr(u.object)):
                hook(u)

        sys.unraisablehook = quiet
        raise UserError(f"the data loader ran out of file descriptors (this process may open {soft}; the hard "
                        f"limit is {hard}): raise it with `ulimit -n {min(hard, max(4 * soft, 4096))}` before the "
                        f"run, or lower train.num_workers={cfg.train.num_workers}") from None


def run(cfg, task: Task, on_result=None) -> dict:
    """Train one run to completion (or divergence / interruption) and return its summary.
    on_result(summary), if given, is called on every rank as soon as the summary says how the run ended,
    before the run's teardown."""
    r = Run(cfg, task, on_result)
    try:
        return _run(r)
    finally:
        r.release()
        if r.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _run(r: Run) -> dict:
    rec = r.record
    try:
        r.setup()
    except BaseException as e:
        # A run that got as far as a summary keeps it: a later invocation that cannot even start
        # (a wrong path, a missing dataset) must not turn a completed or interrupted result into
        # "failed". Nothing is written without the directory's lock (another copy may be running).
        if r.main and rec.lock is not None and rec.prev_summary is None:
            rec.record_failure(e, r.progress(), traceback_file=False)
        elif not r.main:
            rec.record_rank_failure(e, r.step)
        raise
    if r.final is not None:
        return r.final  # a result is final: nothing to redo, nothing a later failure may replace
    try:
        if r.main:
            rec.write_summary(r.progress())
        return r.loop()
    except BaseException as e:
        if r.main:
            rec.record_failure(e, r.progress(), traceback_file=True)
            rec.wandb.finish(1)
        else:
            rec.record_rank_failure(e, r.step)
        raise
