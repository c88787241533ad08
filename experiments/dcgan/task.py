"""Task glue for Figure 6: DCGAN on CelebA. Two named models and two Adams stepped alternately under
one loss scaler (the engine's StepContext), sample grids from fixed latents and the multi-scale SWD
at every evaluation."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchvision import transforms
from torchvision.utils import make_grid

from experiments.dcgan.swd import multiscale_swd
from mpt.config import infra
from mpt.optim import build_optimizer
from mpt.errors import UserError
from mpt.task import Task as BaseTask

GRID_SEED, SWD_SEED = 1234, 4321  # fixed latents / patch positions: every evaluation compares alike


@dataclass
class TaskCfg:
    data_root: str = infra("data/celeba")  # output of `python -m data_prep.celeba`
    image_size: int = 128  # the paper's 128x128 faces (section 4.6)
    latent: int = 100  # Radford et al. 2016
    grid: int = 64  # uncurated samples per grid (8 x 8), from the same latents at every evaluation
    eval_samples: int = 2048  # generated and held-out real images the SWD compares
    cache_images: bool = infra(False)  # keep decoded images in memory (small datasets, num_workers=0)


def transform(size: int):
    # The 128x128 face crop (data_prep.celeba.dataset.CROP_BOX), resized for other sizes, to [-1, 1]
    # for the generator's tanh (Radford et al. 2016, section 4).
    resize = [] if size == 128 else [transforms.Resize(size, antialias=True)]
    return transforms.Compose([*resize, transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)])


@torch.no_grad()
def generate(generator, n: int, latent: int, seed: int, device, autocast, batch: int = 256) -> torch.Tensor:
    """n images from the fixed latents of `seed`, in FP32 on `device`."""
    z = torch.randn(n, latent, generator=torch.Generator().manual_seed(seed)).to(device)
    out = []
    for i in range(0, n, batch):
        with autocast():
            out.append(generator(z[i:i + batch]).float())
    return torch.cat(out)


def _d_loss(D, real, fake):
    """The discriminator's loss, real -> 1, generated -> 0 (Goodfellow et al. 2014), and its logits on
    both. Logits are reduced in FP32 (3.3): the sigmoid and log of the loss in FP16 would lose small
    probabilities."""
    d_real, d_fake = D(real).float(), D(fake.detach()).float()
    loss = F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real)) + \
        F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))
    return loss, d_real, d_fake


def _g_loss(D, fake):
    """The generator's non-saturating loss: generated -> 1 (Goodfellow et al. 2014, section 3)."""
    d_gen = D(fake).float()
    return F.binary_cross_entropy_with_logits(d_gen, torch.ones_like(d_gen))


class Task(BaseTask):
    prepared_data = ("celeba", "celeba")  # prepared.json's "dataset", by data_prep.celeba
    primary_metric = "swd"  # multi-scale sliced Wasserstein distance x 1e3 (Karras et al. 2018)
    channels_last = True  # a CNN on images: NHWC on CUDA (channels_last=auto)
    higher_is_better = False

    def __init__(self, cfg, facts=None):
        super().__init__(cfg, facts)
        self._real = None  # the SWD's held-out reference images, read at the first evaluation

    @classmethod
    def check(cls, cfg):
        if cfg.train.accum_steps != 1:
            raise UserError("dcgan alternates D and G updates per batch: train.accum_steps must be 1")
        if cfg.task.grid < 1 or cfg.task.eval_samples < 2:
            raise UserError("task.grid must be >= 1 and task.eval_samples >= 2")

    def datasets(self):
        from data_prep.celeba.dataset import CelebA

        c = self.cfg.task
        train = CelebA(c.data_root, "train", transform(c.image_size), cache=c.cache_images)
        val = CelebA(c.data_root, "valid", transform(c.image_size), cache=c.cache_images)
        return train, val

    def build_model(self):
        import models

        cfg = self.cfg
        return models.build(cfg.model, size=cfg.task.image_size, width=cfg.width)

    def optimizers(self, model):
        # Two Adams with the same settings (Radford et al. 2016: lr 2e-4, beta1 0.5). The
        # discriminator's comes first: it is stepped first in every iteration.
        opt = self.cfg.optim
        return {"discriminator": build_optimizer(opt, model["discriminator"].parameters()),
                "generator": build_optimizer(opt, model["generator"].parameters())}

    def train_step(self, ctx, micro):
        (real,) = micro
        G, D = ctx.models["generator"], ctx.models["discriminator"]
        n = real.shape[0]
        z = torch.randn(n, self.cfg.task.latent, device=real.device)
        with ctx.autocast():
            fake = G(z)
            loss_d, d_real, d_fake = _d_loss(D, real, fake)
        ctx.backward(loss_d)
        ctx.step("discriminator")  # an overflow here skips the discriminator only (one scaler, 3.2)
        # Generator: the non-saturating loss, generated -> 1, through the just-updated discriminator.
        # The discriminator's gradients from this loss are never applied (zeroed after the iteration).
        with ctx.autocast():
            loss_g = _g_loss(D, fake)
        ctx.backward(loss_g)
        ctx.step("generator")
        loss_d, loss_g = loss_d.detach(), loss_g.detach()
        return {"loss": loss_d + loss_g, "loss_D": loss_d, "loss_G": loss_g,
                "D_real": torch.sigmoid(d_real.detach()).mean(), "D_fake": torch.sigmoid(d_fake.detach()).mean()}, n

    def measured_loss(self, model, real):
        """Each optimizer's loss as train_step computes it, both through the discriminator before its
        update (one set of weights for the measurement), with the same latent draw."""
        G, D = model["generator"], model["discriminator"]
        fake = G(torch.randn(real.shape[0], self.cfg.task.latent, device=real.device))
        return {"discriminator": _d_loss(D, real, fake)[0], "generator": _g_loss(D, fake)}

    def real_images(self, dataset, n: int, device) -> torch.Tensor:
        """The first n held-out (valid split) images: the fixed reference set of the SWD."""
        if self._real is None or self._real.shape[0] != n:
            self._real = torch.stack([dataset[i] for i in range(n)])
        return self._real.to(device)

    def evaluate(self, ev):
        c = self.cfg.task
        G = ev.model["generator"]
        grid = generate(G, c.grid, c.latent, GRID_SEED, ev.device, ev.autocast)
        ev.image("samples", make_grid((grid + 1) / 2, nrow=max(1, int(math.sqrt(c.grid))), padding=2),
                 caption=f"{self.cfg.precision} step {ev.step}")
        n = min(c.eval_samples, len(ev.val_dataset))
        real = self.real_images(ev.val_dataset, n, ev.device)
        fake = generate(G, n, c.latent, SWD_SEED, ev.device, ev.autocast)
        return {k: round(v, 4) for k, v in multiscale_swd(fake, real, seed=SWD_SEED).items()}
