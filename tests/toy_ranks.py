"""A toy task whose training step uses randomness the way the paper's workloads do -- a dropout mask
and a sampled softmax's negatives (models.lm.sample_log_uniform) -- and carries per-rank task state
through checkpoints (a running sum over this rank's batches, like the bigLSTM's recurrent state of
this rank's streams). For the multi-rank tests of tests/test_cluster_ready.py."""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from models.lm import sample_log_uniform
from mpt.task import Task


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 1)
        self.mask = None  # the last training forward's dropout mask

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.training:
            self.mask = F.dropout(torch.ones_like(h), 0.5, training=True)
            h = h * self.mask
        return self.b(h)


class RankToy(Task):
    primary_metric = "mse"
    higher_is_better = False

    def __init__(self, cfg, fail_rank: int = -1, fail_at: int = -1):
        super().__init__(cfg)
        self.fail_rank, self.fail_at = fail_rank, fail_at
        self.acc = torch.zeros(())  # per-rank task state: sum of this rank's inputs and negatives
        self.calls = 0
        self.first = None  # (dropout mask, negatives) of this rank's first step

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        y = x @ torch.randn(8, 1, generator=g)
        return TensorDataset(x, y), TensorDataset(x[:16], y[:16])

    def build_model(self):
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.model = _Net()
        return self.model

    def loss(self, model, batch):
        x, y = batch
        self.calls += 1
        if int(os.environ.get("RANK", 0)) == self.fail_rank and self.calls == self.fail_at:
            raise RuntimeError(f"injected failure on rank {self.fail_rank} at call {self.calls}")
        out = model(x)
        neg, _ = sample_log_uniform(4, 1000, x.device)
        if self.first is None:
            net = getattr(model, "module", model)  # DDP-wrapped under several ranks
            self.first = (net.mask.ne(0).to(torch.uint8), neg.clone())
        self.acc += x.sum() + neg.sum()
        return F.mse_loss(out.float(), y), x.shape[0]

    def evaluate(self, ev):
        x, y = ev.val_dataset.tensors
        return {"mse": F.mse_loss(ev.model(x).float(), y).item()}

    def state_dict(self):
        return {"acc": self.acc.clone()}

    def load_state_dict(self, sd):
        self.acc = sd["acc"].clone()
