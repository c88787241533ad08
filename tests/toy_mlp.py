"""A one-optimizer regression task small enough for precision-through-the-engine tests (numerics,
swamping) and the 2-rank gloo worker of tests/ddp_paper_worker.py."""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from mpt.config import Config, NumericsCfg, OptimCfg, TrainCfg, WandbCfg
from mpt.task import Task


def config(out_dir, optim=None, numerics=0, **kw) -> Config:
    train = dict(batch_size=16, max_steps=3, eval_every_epochs=1.0, log_every=1, num_workers=0, progress=False,
                 ckpt_every_minutes=0)
    train.update(kw.pop("train", {}))
    return Config(experiment="toy_mlp", model="toy", out_dir=str(out_dir), device="cpu", train=TrainCfg(**train),
                  optim=OptimCfg(**(optim or {})),
                  numerics=NumericsCfg(**(numerics if isinstance(numerics, dict) else {"every": numerics})),
                  wandb=WandbCfg(mode="disabled"), **kw)


class ToyMLP(Task):
    primary_metric = "mse"
    higher_is_better = False

    def __init__(self, cfg, seed_per_rank: bool = False, dump_dir=None):
        super().__init__(cfg)
        self.seed_per_rank = seed_per_rank  # every rank initialises its own, different weights
        self.dump_dir = dump_dir  # evaluate() writes this rank's model there

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(64, 1, generator=g)
        return TensorDataset(x, y), TensorDataset(x[:16], y[:16])

    def build_model(self):
        cfg = self.cfg
        rank = int(os.environ.get("RANK", 0)) if self.seed_per_rank else 0
        torch.manual_seed(cfg.seed + 1000 * rank)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.initial = {k: v.clone() for k, v in model.state_dict().items()}
        return model

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y), x.shape[0]

    def evaluate(self, ev):
        x, y = ev.val_dataset.tensors
        with ev.autocast():
            mse = F.mse_loss(ev.model(x).float(), y).item()
        if self.dump_dir is not None:
            torch.save({"initial": self.initial, "final": ev.model.state_dict()},
                       os.path.join(self.dump_dir, f"rank{ev.rank}.pt"))
        return {"mse": mse}
