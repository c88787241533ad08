"""watch()'s checks of a loop's setup, made as it runs (one line each, said once): FP16 compute without loss
scaling (no GradScaler, a disabled one, or its scale at 1), the scheduler stepped on a step the scaler skipped,
w.step() called before the optimizer's step, a checkpoint without the scaler's state. A scale that fell from
above 1 to 1 or below is no setup mistake but gradients overflowing at every scale the GradScaler tried:
"k of n steps skipped; S fell from 2^16 to 2^-4"."""
from __future__ import annotations

import math
from typing import Callable

from mpt.errors import UserError

SETUP = ("fp16_unscaled", "schedule", "checkpoint", "order")  # findings that are mistakes in the loop's setup


class SetupChecks:
    """The optimizer, GradScaler and scheduler a loop gave watch(), watched: `find(kind, line)` gets each
    finding (the Watch says each kind once)."""

    def __init__(self, optimizer, scaler, scheduler, find: Callable[[str, str], None]):
        self.optimizer, self.scaler, self.scheduler, self.find = optimizer, scaler, scheduler, find
        self.opt_steps = 0  # the optimizer's steps (counted where it is given)
        self.skipped = 0  # updates the GradScaler skipped (counted where the optimizer is given)
        self.scale0: float | None = None  # the GradScaler's scale as the loop began
        self._opt_steps_before = 0
        self._sched_before = None
        self._handle = None

    def scaled(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def attach(self) -> None:
        if self.optimizer is not None:
            self._handle = self.optimizer.register_step_post_hook(self._count_step)
        self._opt_steps_before = self.opt_steps
        self._sched_before = self._sched_epoch()
        if self.scaled():
            self.scale0 = float(self.scaler.get_scale())  # (one host read, once)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def updated(self, step: int) -> bool:
        """As step `step` ends: did the optimizer step? Counts an update the scaler skipped; checks the schedule."""
        stepped = self.opt_steps != self._opt_steps_before
        self.skipped += self.optimizer is not None and self.scaler is not None and self.scaler.is_enabled() \
            and not stepped
        now = self._sched_epoch()
        if self.optimizer is not None and self.scheduler is not None and now != self._sched_before and not stepped:
            self.find("schedule", f"step {step}: the scheduler stepped though the optimizer did not (the "
                                  f"GradScaler skipped the update for inf/nan): the schedule runs ahead of the "
                                  f"updates; step it only when the update was applied (scaler.get_scale() did not "
                                  f"drop in scaler.update())")
        self._sched_before = now
        return stepped

    def step_ended(self, step: int, stepped: bool) -> None:
        """After the step's sample is read: the order of the calls in the first step; the next step's count."""
        if self.optimizer is not None and step == 0 and not stepped and \
                (self.scaler is None or not self.scaler.is_enabled()):  # (a scaler may skip step 0: not told apart)
            self.find("order", "the optimizer given to watch() did not step before w.step() in the first step: "
                               "call w.step() last in the iteration, and give watch() the optimizer the loop steps")
        self._opt_steps_before = self.opt_steps

    def check_fp16(self, step: int, scale: float | None) -> None:
        """A sampled step computed in FP16: is it loss-scaled? `scale`: the GradScaler's, read with the sample."""
        if self.scaler is None or not self.scaler.is_enabled():
            what = "no GradScaler given to watch()" if self.scaler is None else "the GradScaler is disabled"
            self.find("fp16_unscaled", f"FP16 compute with {what}: gradients below 2^-24 flush to zero "
                                       f"(section 3.2); use torch.amp.GradScaler() (enabled) or BF16")
        elif scale is not None and scale <= 1.0 and self.fell(scale):
            self.find("scale_fell", self.fell(scale, step + 1))
        elif scale is not None and scale <= 1.0:
            self.find("fp16_unscaled", f"FP16 compute with the GradScaler's scale at {scale:g} (step {step}): "
                                       f"it does not scale the gradients; create it with the default "
                                       f"init_scale (2^16) and let it move, or use BF16")

    def fell(self, scale: float, steps: int | None = None) -> str | None:
        """The line for a GradScaler scale that fell from above 1 to `scale` <= 1 (None: it did not fall): the
        gradients overflowed at every scale it tried -- not a scale set to 1 by mistake."""
        if self.scale0 is None or self.scale0 <= 1.0 or scale >= self.scale0:
            return None
        skipped = f"{self.skipped} of {steps} steps skipped; " if self.optimizer is not None and steps else ""
        return (f"{skipped}S fell from {_pow2(self.scale0)} to {_pow2(scale)}: the gradients overflow FP16 (inf/nan) "
                f"at every scale the GradScaler tried -- find what makes them (the first non-finite value), or "
                f"use BF16")

    def check_checkpoint(self, checkpoint: dict) -> bool:
        """Does the dict the loop saves hold the GradScaler's state? (Watch.check_checkpoint)"""
        if not isinstance(checkpoint, dict):
            raise UserError(f"check_checkpoint: got a {type(checkpoint).__name__}; give the dict passed to "
                            f"torch.save")
        if self.scaler is None or not self.scaler.is_enabled():
            return True
        keys = set(self.scaler.state_dict())
        if _holds(checkpoint, keys):
            return True
        self.find("checkpoint", f"the checkpoint dict (keys {', '.join(map(str, list(checkpoint)[:6]))}) has no "
                                f"GradScaler state: a resumed run restarts the loss scale at its initial value; save "
                                f"scaler.state_dict() in it and call scaler.load_state_dict() on resume")
        return False

    def _count_step(self, opt, args, kwargs) -> None:
        self.opt_steps += 1

    def _sched_epoch(self):
        return getattr(self.scheduler, "last_epoch", None)


def _pow2(s: float) -> str:
    k = math.log2(s) if s > 0 else math.nan
    return f"2^{round(k)}" if k == round(k) else f"{s:g}"


def _holds(obj, keys: set, depth: int = 0) -> bool:
    """Somewhere in the (nested) checkpoint, a dict with every key of the scaler's state."""
    if isinstance(obj, dict):
        if keys <= set(obj):
            return True
        return depth < 4 and any(_holds(v, keys, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)) and depth < 4:
        return any(_holds(v, keys, depth + 1) for v in obj)
    return False
