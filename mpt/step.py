"""One training iteration, and what a task sees of it.

TrainStep owns everything an iteration changes: the models (DDP-wrapped when distributed), the named
optimizers and their schedules, the precision recipe (its loss scale and FP32 masters), the skip count
of each optimizer and the iteration counter. The engine's loop, the speed/memory benchmark and the
doctor all train through it, so the order below is written once:

    for each micro-batch:  forward under autocast, backward of loss / k (scaled by S, section 3.2)
    for each optimizer:    unscale, skip on inf/nan, clip, step, advance its schedule if applied
    once:                  update the loss scale, zero the gradients

A task writes the first two lines its own way when it has several losses or optimizers (a GAN):
its Task.train_step is the step's body, gets a StepContext, a view of the TrainStep, and calls
ctx.step(name) per optimizer. The loop calls the step; the step calls the update, the update the recipe,
the recipe the optimizer.
Observers (numerics sampling, a memory probe) hook in around each optimizer update instead of living
inside it. The activation-memory meter is an argument of the call, not an Observer: it must wrap exactly
micro-batch 0's forward and backward in the default body (later micro-batches reuse freed storage), every
autocast region of a task's own body but not its ctx.backward (whose loss-scale multiply saves the scale),
and force an eager pass under CUDA graphs -- scopes no hook around an update gives.
EvalContext is what Task.evaluate sees.

Names: an *iteration* is one TrainStep call (all micro-batches, every optimizer, one scale update);
an *update* is one optimizer's unscale/skip/clip/step/schedule."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from mpt import cpu_gru
from mpt.graphs import autocast_cache_off as graphs_cache_off
from mpt.memory import SavedTensorBytes
from mpt.ranks import to_device


class Observer:
    """Hooks around an iteration, each a no-op by default, called in this order:
      begin(step, micro_batches)           before the first forward; the iteration's micro-batches,
                                           on the device
      before_update(step, name, opt)       gradients complete (still multiplied by S), not yet
                                           unscaled or clipped
      after_update(step, name, opt, ok)    after the optimizer's step (ok: applied, not skipped for
                                           overflow) and its schedule; before zero_grad
      end(step)                            after every update, before the loss-scale update
    `step` is the TrainStep; step.iteration counts the iterations before this one."""

    def begin(self, step: "TrainStep", micro_batches: list) -> None: ...

    def before_update(self, step: "TrainStep", name: str, opt: torch.optim.Optimizer) -> None: ...

    def after_update(self, step: "TrainStep", name: str, opt: torch.optim.Optimizer, applied: bool) -> None: ...

    def end(self, step: "TrainStep") -> None: ...


class TrainStep:
    """One iteration at a time, for a loss function loss(models, batch) -> (mean loss, items): forward and
    backward of each micro-batch, then the one optimizer's update -- the default, run here. A task with
    several losses or optimizers (a GAN) gives its own `body(ctx, micro_batches) -> (logs, items)` instead
    (its Task.train_step), which drives the same calls through a StepContext."""

    def __init__(self, loss: Callable | None, model: nn.Module, optimizers: dict, recipe, *, body: Callable | None = None,
                 ddp: nn.Module | None = None,
                 scheds: dict | None = None, clip_grad_norm: float = 0.0, device=torch.device("cpu"),
                 channels_last: bool = False, world: int = 1, observers: tuple[Observer, ...] = (),
                 measure_first: bool = True, cuda_graphs: bool = False, graph_backend=None):
        if (loss is None) == (body is None):
            raise TypeError("TrainStep: give a loss function or a body, one of them")
        self.loss, self.body = loss, body
        self.model = model  # unwrapped: state_dicts, evaluation, numerics
        self.models = model if ddp is None else ddp  # what forward calls (DDP all-reduces in backward)
        self.optimizers = optimizers
        # name -> scheduler; an optimizer without one keeps its lr. A scheduler with observe(logs) gets
        # every iteration's logs (device tensors) after the task's body.
        self.scheds = scheds or {}
        self.recipe = recipe
        self.clip_grad_norm = clip_grad_norm
        self.device, self.channels_last, self.world = device, channels_last, world
        self.observers = list(observers)
        self.iteration = 0  # iterations run, skipped updates included
        self.skipped = {k: 0 for k in optimizers}  # updates skipped for overflow, per optimizer
        self.applied: dict[str, bool] = {}  # this iteration's updates
        self.measure_first = measure_first  # the first iteration's activation bytes, for the summary
        self.act_bytes: int | None = None  # tensors saved for backward in the first iteration
        # train.cuda_graphs: each micro-batch's forward/backward replayed from a CUDA graph (mpt.graphs);
        # graph_backend: a stand-in for the CUDA graph (mpt.graphs.EagerGraph: the CPU tests)
        self.graphs = None
        if cuda_graphs:
            from mpt import graphs

            graphs.check(device=device, world=world, recipe=recipe, observers=observers,
                         fake=graph_backend is not None)
            self.graphs = graphs.GraphRunner(model, recipe, graph_backend or graphs.CudaGraph, device)
        # A model with a GRU on a CPU: torch.gru's training case computed by mpt.cpu_gru (1.49x torch.gru's
        # speed at the tiny Mandarin profile's batch of 8), entered beneath the recipe's modes so that every
        # precision runs the same kernel.
        self.cpu_gru = cpu_gru.mode_for(model, device)

    def __call__(self, micro_batches: list, meter: SavedTensorBytes | None = None) -> tuple[dict, int]:
        """One iteration over k micro-batches (this rank's share of the global batch) -> (logs: name ->
        device tensor, holding "loss"; items). Nothing here reads a device value except the recipe's
        overflow flag, once per update (the skip decision). `meter`: measure activation memory in
        this iteration (by default the first iteration is measured, for the summary)."""
        with self.cpu_gru if self.cpu_gru is not None else contextlib.nullcontext():
            return self._iteration(micro_batches, meter)

    def _iteration(self, micro_batches: list, meter: SavedTensorBytes | None) -> tuple[dict, int]:
        own_meter = meter is None and self.measure_first and self.act_bytes is None
        if own_meter:
            meter = SavedTensorBytes(self.model)
        self.applied = {}
        micro = [to_device(b, self.device, self.channels_last) for b in micro_batches]
        for o in self.observers:
            o.begin(self, micro)
        if self.body is None:  # the default: forward/backward of each micro-batch, the one optimizer's update
            loss, items = self.forward_backward(self.loss, micro, meter)
            self.update(next(iter(self.optimizers)))
            logs = {"loss": loss}
        else:  # a task's own (several losses or optimizers), through the same calls
            logs, items = self.body(StepContext(self, len(micro), meter), micro)
        # A schedule that follows the training loss (the translation reference's decay on a plateau)
        # reads it from here: it holds its own state, the task none.
        for s in self.scheds.values():
            if hasattr(s, "observe"):
                s.observe(logs)
        for o in self.observers:
            o.end(self)
        # The loss scale moves once per iteration, after every optimizer's update (torch.amp's rule
        # for several optimizers sharing one scaler; section 3.2's S for one).
        self.recipe.update()
        # Gradients are freed, not zeroed: the next backward allocates them afresh.
        self.recipe.zero_grad()
        if own_meter:
            self.act_bytes = meter.bytes
        self.iteration += 1
        return logs, items

    def forward_backward(self, loss_fn: Callable, micro_batches: list, meter=None) -> tuple[torch.Tensor, int]:
        """loss_fn(models, batch) -> (mean loss, items) on each micro-batch under autocast, and the
        backward of loss / k: the gradients of the mean over the k micro-batches. DDP all-reduces only
        in the last backward. Returns (mean loss as a float64 device tensor, items)."""
        total, n, k = None, 0, len(micro_batches)
        if self.graphs is not None and k > 1:  # (the device was checked when the step was built)
            from mpt import graphs

            graphs.check(device=self.device, accum=k, fake=True)
        for i, b in enumerate(micro_batches):
            if self.graphs is not None and meter is None:  # a measured pass needs eager autograd's hooks
                loss, items = self.graphs(lambda batch: self._micro(loss_fn, batch, k, graphed=True), b)
            else:
                with self.no_sync() if i < k - 1 else contextlib.nullcontext(), \
                        (meter.measure() if meter is not None and i == 0 else contextlib.nullcontext()):
                    loss, items = self._micro(loss_fn, b, k)
                if self.graphs is not None:  # an eager first pass: the next one may capture
                    self.graphs.eager_calls += 1
            part = loss.detach().to(torch.float64) / k  # float64: the Python float sum it replaces
            total = part if total is None else total + part
            n += items
        return total, n

    def _micro(self, loss_fn: Callable, b, k: int, graphed: bool = False) -> tuple[torch.Tensor, int]:
        """One micro-batch's forward under autocast and the backward of loss / k: the region a CUDA graph
        captures (graphed: autocast's weight-cast cache off, mpt.graphs.autocast_cache_off)."""
        with self.recipe.autocast():
            with graphs_cache_off(self.device.type) if graphed else contextlib.nullcontext():
                loss, items = loss_fn(self.models, b)
        self.recipe.backward(loss / k)  # x S inside (3.2): small gradients stay representable
        return loss, items

    def update(self, name: str, clip_grad_norm: float | None = None) -> bool:
        """Optimizer `name`'s update: unscale its gradients into the FP32 masters, skip on inf/nan
        (3.2), clip, step; its schedule advances only when the update was applied, so a skipped step
        does not move the learning rate. Returns whether it was applied."""
        opt = self.optimizers[name]
        clip = self.clip_grad_norm if clip_grad_norm is None else clip_grad_norm
        for o in self.observers:
            o.before_update(self, name, opt)
        applied = self.recipe.step(opt, clip)
        if applied:
            if name in self.scheds:
                self.scheds[name].step()
        else:
            self.skipped[name] += 1
        self.applied[name] = applied
        for o in self.observers:
            o.after_update(self, name, opt, applied)
        return applied

    def no_sync(self):
        """DDP's no_sync on every wrapped model (gradient accumulation: all-reduce on the last micro-batch)."""
        if self.world == 1:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for m in (self.models.values() if isinstance(self.models, nn.ModuleDict) else [self.models]):
            stack.enter_context(m.no_sync())
        return stack

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Every model (one state_dict; a ModuleDict's keys carry the model names), every named
        optimizer and schedule, the recipe (scaler, FP32 masters), the skip counts, the iteration."""
        return {"model": self.model.state_dict(), "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
                "recipe": self.recipe.state_dict(), "scheds": {k: v.state_dict() for k, v in self.scheds.items()},
                "skipped": dict(self.skipped), "step": self.iteration, "act_bytes": self.act_bytes}

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])
        for k, o in self.optimizers.items():
            o.load_state_dict(sd["optimizers"][k])
            self.scheds[k].load_state_dict(sd["scheds"][k])
        self.recipe.load_state_dict(sd["recipe"])
        self.skipped.update(sd["skipped"])
        self.iteration, self.act_bytes = sd["step"], sd["act_bytes"]
        if self.graphs is not None:  # the weights were written outside the recipe's step: capture afresh
            self.graphs.reset()


class StepContext:
    """What a task's own training step sees of the TrainStep: the named models (DDP-wrapped when
    distributed: call these), the named optimizers, and the calls of one iteration. Neither the task
    nor the loop branches on precision. One loss scaler serves every optimizer with torch.amp's rules:
    each optimizer is unscaled and inf-checked on its own, an overflow skips only that optimizer's
    update (section 3.2), and the scale moves once per iteration, after the task's step."""

    def __init__(self, step: TrainStep, accum: int, meter: SavedTensorBytes | None = None):
        self._step = step
        self._meter = meter  # activation memory of this iteration's first micro-batch, when measured
        self.iteration = step.iteration  # iterations before this one (skipped updates included)
        self.accum = accum  # micro-batches in this step
        self.models = step.models  # a module or an nn.ModuleDict of modules
        self.optimizers = step.optimizers

    def autocast(self):
        """The recipe's autocast; in a measured iteration it also counts the tensors saved for backward."""
        if self._meter is None:
            return self._step.recipe.autocast()
        stack = contextlib.ExitStack()
        stack.enter_context(self._meter.measure())
        stack.enter_context(self._step.recipe.autocast())
        return stack

    def loss_step(self, loss_fn, micro_batches: list) -> tuple[dict, int]:
        """What TrainStep runs by default, for a task's own train_step that adds to it (super().train_step):
        forward_backward over loss_fn(models, batch) -> (mean loss, items), then the first (only)
        optimizer's update. Returns ({"loss": mean loss}, items)."""
        loss, n = self._step.forward_backward(loss_fn, micro_batches, meter=self._meter)
        self.step(next(iter(self.optimizers)))
        return {"loss": loss}, n

    def backward(self, loss: torch.Tensor) -> None:
        self._step.recipe.backward(loss)

    def sync(self, i: int):
        """Context for micro-batch i: DDP all-reduces gradients only on the last one."""
        return self._step.no_sync() if i < self.accum - 1 else contextlib.nullcontext()

    def step(self, name: str, clip_grad_norm: float | None = None) -> bool:
        """Optimizer `name`'s update (TrainStep.update). Returns whether it was applied. The task zeroes
        gradients it must not carry into the next phase (ctx.zero_grad)."""
        return self._step.update(name, clip_grad_norm)

    def zero_grad(self) -> None:
        self._step.recipe.zero_grad()


class EvalContext:
    """What a task's own evaluate() sees. Every rank calls it; only rank 0 writes files."""

    def __init__(self, *, step: int, model: nn.Module, recipe, val_loader, device, channels_last: bool,
                 rank: int, world: int, run_dir, eval_max_batches: int, write_image=None):
        self.step, self.device, self.rank, self.world = step, device, rank, world
        self.model = model  # unwrapped: evaluation runs no collectives
        self.val_loader = val_loader  # this rank's share of the validation set
        self.val_dataset = val_loader.dataset
        self.run_dir = run_dir
        self.images: dict[str, str] = {}  # name -> file written, for the eval log line
        self._recipe, self._channels_last, self._limit = recipe, channels_last, eval_max_batches
        self._write_image = write_image  # (name, png bytes, caption) -> file name; None on ranks > 0

    def autocast(self):
        return self._recipe.autocast()

    def batches(self):
        """This rank's validation batches as the loader yields them (on the CPU), at most
        train.eval_max_batches of them (0: all)."""
        for i, b in enumerate(self.val_loader):
            if self._limit and i >= self._limit:
                return
            yield b

    def sums(self, eval_sums) -> dict[str, float]:
        """Additive statistics eval_sums(model, batch) -> {name: number}, summed over this rank's
        validation batches (batches()) under autocast, then over ranks."""
        sums = {}
        for b in self.batches():
            b = to_device(b, self.device, self._channels_last)
            with self._recipe.autocast():
                for key, v in eval_sums(self.model, b).items():
                    sums[key] = sums.get(key, 0.0) + float(v)
        if self.world > 1:
            keys = sorted(sums)
            t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            sums = dict(zip(keys, t.tolist()))
        return sums

    def image(self, name: str, grid: torch.Tensor, caption: str = "") -> None:
        """Write a (3, H, W) image in [0, 1] as <run dir>/<name>_<step>.png (atomically) and to wandb."""
        if self._write_image is None:
            return
        import io

        from PIL import Image

        arr = (grid.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy())
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        self.images[name] = self._write_image(f"{name}_{self.step:07d}.png", buf.getvalue(), name, caption)
