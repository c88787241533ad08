"""Models whose FP16 answer is known, for `python -m mpt.doctor mpt.doctor.examples:<name>` (README, "Check
your own model") and its tests. Each function is the form the doctor takes: it returns (model, loss, batches,
optimizer), with loss(model, batch) -> mean loss and optimizer(model) -> a torch optimizer.

  healthy    a small MLP regression: FP16 at S = 1 loses nothing (the paper's Table 1 finding, in small)
  underflow  the same regression with its loss multiplied by 2^-22 and the learning rate by 2^22, so FP32
             trains exactly as `healthy` while every gradient sits 2^22 times lower, mostly below FP16's
             2^-24: FP16 at S = 1 flushes them and does not learn; a loss scale brings them back (3.2)
  big_gradients  the same regression with its loss multiplied by 2^20 and the learning rate by 2^-20: FP32
             trains as `healthy`, while the largest gradients sit above 65504 at S = 1 (inf in FP16); a loss
             scale below 1 brings them back into range (3.2's rule read downwards)
  stalled    `underflow`'s scaled loss under the doctor's default optimizer (SGD, lr 0.01): the update is 2^22
             times too small and FP32 itself barely moves the loss in 20 steps, so no replay's progress can be
             judged (the report says so instead of dividing two numbers near zero)
  overflow   a layer with large weights (as a BF16- or FP32-pretrained layer may have, transformers #5651):
             its outputs exceed 65504, inf in FP16 whatever the loss scale; BF16 holds them
  overflow_inside  an RMS norm over large activations (as T5's layer norm in FP16): every module's output stays
             small, but the sum of squares inside the norm exceeds 65504: inf in FP16, fine in BF16
  UnderflowTask  `underflow` as an mpt.task.Task (the `module:TaskClass` form; trainable by the engine)
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from mpt.task import Task

N_BATCHES, BATCH, DIM = 8, 32, 16


def _data(seed: int = 0, scale: float = 1.0) -> list:
    """Batches of (x, y): y a smooth function of x, learnable by a small MLP in a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(DIM, 1, generator=g) / DIM**0.5
    out = []
    for _ in range(N_BATCHES):
        x = torch.randn(BATCH, DIM, generator=g)
        out.append((x * scale, torch.tanh(x @ w * 2)))
    return out


def _mlp(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))


def _sgd(lr: float):
    return lambda model: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def healthy():
    def loss(model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    return _mlp(), loss, _data(), _sgd(0.05)


# The loss is multiplied by 2^-22 and the learning rate by 2^22: SGD's update lr x grad is unchanged (both
# powers of two, so exactly), FP32 trains as `healthy` does, and only where the gradients sit moves. At 2^-20
# the output layer's largest weight gradients stay above 2^-24 and FP16 at S = 1 still
# gets 44% of FP32's loss reduction in 20 steps (81% in 40); at 2^-22 it gets none.
UNDERFLOW_SHIFT = 2.0**-22


def underflow():
    def loss(model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y) * UNDERFLOW_SHIFT

    return _mlp(), loss, _data(), _sgd(0.05 / UNDERFLOW_SHIFT)


# The other way round: gradients 2^20 times larger, the output layer's up to ~8e5 -- above FP16's 65504 at
# S = 1, so every FP16 step overflows; S = 2^-5 holds them and still keeps the smallest.
OVERFLOW_SHIFT = 2.0**20


def big_gradients():
    def loss(model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y) * OVERFLOW_SHIFT

    return _mlp(), loss, _data(), _sgd(0.05 / OVERFLOW_SHIFT)


def stalled():
    def loss(model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y) * UNDERFLOW_SHIFT

    return _mlp(), loss, _data()  # no optimizer: the doctor's default, whose lr does not go with the scaled loss


class _Pretrained(nn.Module):
    """A wide-range first layer (weights x 2000, as after BF16 pretraining) whose outputs a LayerNorm
    brings back to order 1: fine in FP32 and BF16 (8 exponent bits), inf in FP16 (5)."""

    def __init__(self, width: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.big = nn.Linear(DIM, width)
        with torch.no_grad():
            self.big.weight.mul_(2000.0)
            self.big.bias.zero_()
        self.norm = nn.LayerNorm(width)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, x):
        return self.head(self.norm(self.big(x)))


def overflow():
    def loss(model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    return _Pretrained(), loss, _data(scale=20.0), _sgd(0.05)


class _RMSNorm(nn.Module):
    """x / sqrt(mean(x * x)): its output is of order 1 whatever x is, but x * x is computed in x's dtype
    (autocast computes pow in FP32; a product it leaves in FP16)."""

    def forward(self, x):
        return x / (x * x).mean(-1, keepdim=True).add(1e-6).sqrt()


def overflow_inside():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 64), _RMSNorm(), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        model[0].weight.mul_(200.0)  # outputs of several hundred: below 65504, their squares (> 256^2) above it

    def loss(model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    return model, loss, _data(), _sgd(0.05)


class UnderflowTask(Task):
    """`underflow` as a Task (the doctor's `module:TaskClass` form, and what tests/test_doctor.py trains through
    the engine with the static S the doctor advises): the same batches, model, scaled loss and SGD."""
    primary_metric, higher_is_better = "mse", False

    def datasets(self):
        batches = _data()
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        return TensorDataset(x, y), TensorDataset(x, y)

    def build_model(self):
        return _mlp()

    def optimizers(self, model):
        return {"main": _sgd(0.05 / UNDERFLOW_SHIFT)(model)}  # the lr that goes with the scaled loss

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y) * UNDERFLOW_SHIFT, len(x)

    def eval_sums(self, model, batch):
        x, y = batch
        return {"se": F.mse_loss(model(x).float(), y, reduction="sum"), "n": y.numel()}

    def eval_metrics(self, sums):
        return {"mse": sums["se"] / sums["n"]}
