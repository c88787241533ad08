"""A two-model, two-optimizer task small enough for engine tests (and the 2-rank gloo worker):
the engine seam DCGAN uses, on 4-d vectors instead of images."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from mpt import engine
from mpt.config import Config, TrainCfg, WandbCfg
from mpt.task import Task


def run_task(cfg, task_cls, *args, **kw) -> dict:
    """engine.run of a task_cls built with the run's config: task_cls(cfg, *args, **kw)."""
    return engine.run(cfg, task_cls(cfg, *args, **kw))


def config(out_dir, **kw) -> Config:
    train = dict(batch_size=16, max_steps=12, eval_every_epochs=1.0, log_every=1, num_workers=0, progress=False,
                 ckpt_every_minutes=0)
    train.update(kw.pop("train", {}))
    return Config(experiment="toy_gan", model="toy", out_dir=str(out_dir), device="cpu", train=TrainCfg(**train),
                  wandb=WandbCfg(mode="disabled"), **kw)


class ToyGan(Task):
    primary_metric = "gap"
    higher_is_better = False

    def __init__(self, cfg, inf_at: int = -1):
        super().__init__(cfg)
        self.inf_at = inf_at  # the iteration whose discriminator loss is made infinite (overflow test)

    def datasets(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)) * 0.5 + 1.0
        return TensorDataset(x), TensorDataset(x[:16])

    def build_model(self):
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        return nn.ModuleDict({"generator": nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 4)),
                              "discriminator": nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.LeakyReLU(0.2),
                                                             nn.Linear(8, 1))})

    def optimizers(self, model):
        return {"discriminator": torch.optim.Adam(model["discriminator"].parameters(), lr=1e-2),
                "generator": torch.optim.SGD(model["generator"].parameters(), lr=1e-2, momentum=0.9)}

    def train_step(self, ctx, micro):
        ((real,),) = micro
        G, D = ctx.models["generator"], ctx.models["discriminator"]
        n = real.shape[0]
        z = torch.randn(n, 2)
        with ctx.autocast():
            fake = G(z)
            loss_d = F.softplus(-D(real).float()).mean() + F.softplus(D(fake.detach()).float()).mean()
        ctx.backward(loss_d * float("inf") if ctx.iteration == self.inf_at else loss_d)
        ctx.step("discriminator")
        with ctx.autocast():
            loss_g = F.softplus(-D(fake).float()).mean()
        ctx.backward(loss_g)
        ctx.step("generator")
        return {"loss": loss_d.detach() + loss_g.detach(), "loss_D": loss_d.detach(), "loss_G": loss_g.detach()}, n

    def evaluate(self, ev):
        z = torch.randn(16, 2, generator=torch.Generator().manual_seed(1))
        with ev.autocast():
            fake = ev.model["generator"](z).float()
        real = torch.stack([ev.val_dataset[i][0] for i in range(len(ev.val_dataset))])
        ev.image("samples", torch.sigmoid(fake[:12].reshape(3, 4, 4)))
        return {"gap": (fake.mean(0) - real.mean(0)).abs().mean().item()}
