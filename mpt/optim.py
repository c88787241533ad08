"""Optimizers and learning-rate schedules from the config (optim.*, sched.*)."""
from __future__ import annotations

import math

import torch

from mpt.errors import UserError


def build_optimizer(o, params) -> torch.optim.Optimizer:
    """The optimizer optim.name names, with its multi-tensor (foreach) step: a handful of ops for all
    parameters instead of 3-5 per parameter. torch picks foreach by itself only where every parameter
    is on a GPU; on a CPU its per-parameter loop gives the same bits (tests/test_precision.py checks
    each optimizer against it), so foreach is asked for everywhere."""
    name = o.name.lower()
    if name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay,
                               foreach=True)
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, foreach=True)
    if name == "adagrad":
        return _Adagrad(params, lr=o.lr, weight_decay=o.weight_decay, eps=o.eps,
                        initial_accumulator_value=o.initial_accumulator_value, foreach=True)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=o.lr, alpha=o.alpha, eps=o.eps, momentum=o.momentum,
                                   weight_decay=o.weight_decay, foreach=True)
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


def clip_groups(optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook (optimizer.register_step_pre_hook(clip_groups)): clip each param group
    that names its own clip_grad_norm (the bigLSTM's LSTM weights only). It runs inside
    optimizer.step(), i.e. after every recipe has unscaled the gradients and skipped overflowing
    steps, so the norm is of the true gradients."""
    for g in optimizer.param_groups:
        if g.get("clip_grad_norm", 0) > 0:
            torch.nn.utils.clip_grad_norm_([p for p in g["params"] if p.grad is not None], g["clip_grad_norm"],
                                           foreach=True)


# Learning-rate schedules by name (sched.name): factor(cfg.sched, epoch, total_epochs) -> multiplier of
# the base learning rate at a fractional epoch. Open: a workload registers its own with @schedule("name")
# and selects it in its config; warm-up (sched.warmup_epochs) applies on top of every one.
SCHEDULES: dict = {}


def schedule(name: str):
    def register(fn):
        SCHEDULES[name] = fn
        return fn
    return register


schedule("constant")(lambda s, epoch, total: 1.0)
schedule("step")(lambda s, epoch, total: s.gamma ** math.floor(epoch / s.step_epochs))
schedule("multistep")(lambda s, epoch, total: s.gamma ** sum(epoch >= m for m in s.milestones))
schedule("poly")(lambda s, epoch, total: max(0.0, 1.0 - epoch / total) ** s.power)
schedule("cosine")(lambda s, epoch, total: 0.5 * (1 + math.cos(math.pi * min(epoch, total) / total)))
# annealing by a constant factor per epoch, applied smoothly (Deep Speech 2's)
schedule("exponential")(lambda s, epoch, total: s.gamma ** epoch)


def lr_factor(s, epoch: float, total_epochs: float) -> float:
    """Multiplier of the base learning rate at a (fractional) epoch."""
    if s.name not in SCHEDULES:
        raise UserError(f"unknown schedule sched.name={s.name!r}; choose one of: {', '.join(SCHEDULES)}")
    f = SCHEDULES[s.name](s, epoch, total_epochs)
    if s.warmup_epochs > 0 and epoch < s.warmup_epochs:
        f *= epoch / s.warmup_epochs
    return f


def update_factor(s, steps_per_epoch: int, total_epochs: float):
    """lr_factor as a function of the applied updates so far (what LambdaLR passes its lambda)."""
    return lambda updates: lr_factor(s, updates / steps_per_epoch, total_epochs)
