"""The training step and the evaluation as a task sees them: StepContext (what Task.train_step gets),
EvalContext (what Task.evaluate gets), and forward_backward / loss_step, the default iteration shared by
the engine, the speed/memory benchmark and the bigLSTM memory estimate.

Names: an *iteration* is one Run.train_step (all micro-batches, every optimizer, one scale update); a
*loss step* is forward_backward plus the one optimizer's update; `ctx.step(name)` is one optimizer's
update (unscale, inf-check, clip, step, schedule)."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mpt import precision
from mpt.memory import SavedTensorBytes
from mpt.ranks import to_device
from mpt.rundir import atomic_write_bytes

if TYPE_CHECKING:  # the engine imports this module
    from mpt.engine import Run


class StepContext:
    """What a task's own training step sees: the named models (DDP-wrapped when distributed: call
    these), the named optimizers, and the recipe's calls. Neither the task nor the loop branches on
    precision. One loss scaler serves every optimizer with torch.amp's rules: each optimizer is
    unscaled and inf-checked on its own, an overflow skips only that optimizer's update (section
    3.2), and the scale is updated once per iteration (by the engine, after the task's step)."""

    def __init__(self, run: "Run", accum: int, meter: SavedTensorBytes | None = None):
        self._run = run
        self._meter = meter  # the first iteration only: activation bytes (summary's activation_bytes)
        self.iteration = run.step  # iterations before this one (skipped updates included)
        self.accum = accum  # micro-batches in this step
        self.models = run.ddp  # a module or an nn.ModuleDict of modules
        self.optimizers = run.optimizers

    def autocast(self):
        """The recipe's autocast; in the first iteration it also counts the tensors saved for backward."""
        if self._meter is None:
            return self._run.recipe.autocast()
        stack = contextlib.ExitStack()
        stack.enter_context(self._meter.measure())
        stack.enter_context(self._run.recipe.autocast())
        return stack

    def loss_step(self, loss_fn, micro_batches: list) -> tuple[dict, int]:
        """Task.train_step's default body: forward_backward over loss_fn(models, batch) -> (mean loss,
        items), then the first (only) optimizer's step. Returns ({"loss": mean loss}, items)."""
        loss, n = forward_backward(self._run.recipe, lambda b: loss_fn(self.models, b), micro_batches,
                                   sync=self.sync, meter=self._meter)
        self.step(next(iter(self.optimizers)))
        return {"loss": loss}, n

    def backward(self, loss: torch.Tensor) -> None:
        self._run.recipe.backward(loss)

    def sync(self, i: int):
        """Context for micro-batch i: DDP all-reduces gradients only on the last one."""
        return self._run.no_sync() if i < self.accum - 1 else contextlib.nullcontext()

    def step(self, name: str, clip_grad_norm: float | None = None) -> bool:
        """Unscale, inf-check, clip and update optimizer `name`; advance its schedule when applied.
        Returns whether the update was applied. The task zeroes gradients it must not carry into
        the next phase (ctx.zero_grad)."""
        clip = self._run.cfg.train.clip_grad_norm if clip_grad_norm is None else clip_grad_norm
        return self._run.optimizer_step(name, clip)

    def zero_grad(self) -> None:
        self._run.recipe.zero_grad()


class EvalContext:
    """What a task's own evaluate() sees. Every rank calls it; only rank 0 writes files."""

    def __init__(self, run: "Run"):
        self._run = run
        self.step, self.device, self.rank, self.world = run.step, run.device, run.rank, run.world
        self.model = run.model  # unwrapped: evaluation runs no collectives
        self.val_loader = run.val_loader  # this rank's share of the validation set
        self.val_dataset = run.val_loader.dataset
        self.run_dir = run.dir
        self.images: dict[str, str] = {}  # name -> file written, for the eval log line

    def autocast(self):
        return self._run.recipe.autocast()

    def batches(self):
        """This rank's validation batches as the loader yields them (on the CPU), at most
        train.eval_max_batches of them (0: all)."""
        limit = self._run.cfg.train.eval_max_batches
        for i, b in enumerate(self.val_loader):
            if limit and i >= limit:
                return
            yield b

    def sums(self, eval_sums) -> dict[str, float]:
        """Additive statistics eval_sums(model, batch) -> {name: number}, summed over this rank's
        validation batches (batches()) under autocast, then over ranks."""
        run, sums = self._run, {}
        for b in self.batches():
            b = to_device(b, self.device, run.channels_last)
            with run.recipe.autocast():
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
        if not self._run.main:
            return
        import io

        from PIL import Image

        arr = (grid.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy())
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        fname = f"{name}_{self.step:07d}.png"
        atomic_write_bytes(self._run.dir / fname, buf.getvalue())
        self.images[name] = fname
        self._run.wandb.image(name, self._run.dir / fname, self.step, caption)


def forward_backward(recipe: precision.Recipe, loss_fn, micro_batches: list, *, sync=None, meter=None):
    """For each of the k micro-batches: forward under the recipe's autocast and backward of loss / k
    (`sync(i)`: DDP all-reduces only on the last). `meter` (mpt.memory.SavedTensorBytes) measures
    micro-batch 0. loss_fn(batch) -> (mean loss, items). Returns (mean loss over the micro-batches, a
    float64 device tensor: nothing here reads a device value; items)."""
    total, n, k = None, 0, len(micro_batches)
    for i, b in enumerate(micro_batches):
        with (sync(i) if sync is not None else contextlib.nullcontext()), \
                (meter.measure() if meter is not None and i == 0 else contextlib.nullcontext()):
            with recipe.autocast():
                loss, items = loss_fn(b)
            recipe.backward(loss / k)
        part = loss.detach().to(torch.float64) / k  # float64: the Python float sum it replaces
        total = part if total is None else total + part
        n += items
    return total, n


def loss_step(recipe: precision.Recipe, loss_fn, micro_batches: list, step, *, sync=None, meter=None):
    """The default training iteration outside the engine, in the engine's order (the speed/memory
    benchmark, the bigLSTM memory estimate): forward_backward, then `step()`, the optimizer step(s) --
    its result is returned, so a caller can also read what exists between the update and zero_grad
    (gradients, optimizer state) -- then recipe.update() once and recipe.zero_grad().
    Returns (mean loss, items, step()'s result)."""
    total, n = forward_backward(recipe, loss_fn, micro_batches, sync=sync, meter=meter)
    out = step()
    recipe.update()  # once per iteration, after every optimizer's step (GradScaler's rule)
    recipe.zero_grad()
    return total, n, out
