"""Multi-scale sliced Wasserstein distance (SWD) between two image sets: Karras et al. 2018,
"Progressive Growing of GANs", section 5 and appendix D (their metrics/sliced_wasserstein.py
describes the same recipe; this is our own code).

Why this metric: it needs no downloaded network (FID needs Inception weights), it compares the
distributions of local image patches at several scales -- colour and shape statistics at coarse
levels, edges and texture at fine ones -- and it is cheap enough to run at every evaluation.

Recipe: a Laplacian pyramid of each image from full size down to 16x16; at every level, 128 random
7x7 neighbourhoods per image (descriptors of 3 x 49 values), normalised per colour channel over each
set; then the sliced Wasserstein distance: project both descriptor sets on 512 random unit directions,
sort each projection, take the mean absolute difference; repeated 4 times. Reported x 1e3 (as
Karras et al. do), per level and averaged over levels. Lower is better; two samples of the same
distribution give a small positive value.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

PATCH, PER_IMAGE, DIRECTIONS, REPEATS, MIN_RES = 7, 128, 512, 4, 16


def _blur(x: torch.Tensor) -> torch.Tensor:
    k1 = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0], device=x.device) / 16  # the binomial 5-tap Gaussian
    k = (k1[:, None] * k1[None, :]).expand(x.shape[1], 1, 5, 5)
    return F.conv2d(F.pad(x, (2, 2, 2, 2), mode="reflect"), k, groups=x.shape[1])


def _down(x):
    return _blur(x)[:, :, ::2, ::2]


def _up(x):
    y = torch.zeros(x.shape[0], x.shape[1], x.shape[2] * 2, x.shape[3] * 2, device=x.device, dtype=x.dtype)
    y[:, :, ::2, ::2] = x * 4
    return _blur(y)


def laplacian_pyramid(x: torch.Tensor, min_res: int = MIN_RES) -> list[torch.Tensor]:
    levels = []
    while x.shape[-1] > min_res:
        d = _down(x)
        levels.append(x - _up(d))
        x = d
    levels.append(x)
    return levels


def _descriptors(level: torch.Tensor, per_image: int, g: torch.Generator) -> torch.Tensor:
    n, c, h, w = level.shape
    ys = torch.randint(0, h - PATCH + 1, (n, per_image), generator=g).to(level.device)
    xs = torch.randint(0, w - PATCH + 1, (n, per_image), generator=g).to(level.device)
    r = torch.arange(PATCH, device=level.device)
    yy = (ys[:, :, None, None] + r[None, None, :, None]).expand(n, per_image, PATCH, PATCH)
    xx = (xs[:, :, None, None] + r[None, None, None, :]).expand(n, per_image, PATCH, PATCH)
    nn_ = torch.arange(n, device=level.device)[:, None, None, None].expand_as(yy)
    d = level.permute(0, 2, 3, 1)[nn_, yy, xx]  # (n, per_image, 7, 7, c)
    d = d.reshape(-1, PATCH * PATCH, c)
    d = (d - d.mean(dim=(0, 1))) / d.std(dim=(0, 1)).clamp_min(1e-8)  # per channel, over the set
    return d.reshape(d.shape[0], -1)


def _sorted_rows(x: torch.Tensor) -> torch.Tensor:
    # Sorting is nearly all of SWD's cost. Rows, not columns: a contiguous sort is 2x faster, and on a
    # CPU NumPy's vectorised sort is another 5x faster than torch's (25,600 x 512 floats: 0.14 s
    # against 0.70 s, and 1.7 s for torch along columns; 2026-11-25, one thread). Sorted values are
    # unique, so the result is the same whichever sorts them.
    if x.device.type == "cpu":
        return torch.from_numpy(np.sort(x.numpy(), axis=1))
    return x.sort(dim=1).values


def sliced_wasserstein(a: torch.Tensor, b: torch.Tensor, g: torch.Generator) -> float:
    out = 0.0
    for _ in range(REPEATS):
        dirs = torch.randn(a.shape[1], DIRECTIONS, generator=g).to(a.device)
        dirs = dirs / dirs.norm(dim=0, keepdim=True)
        # (DIRECTIONS, N): each direction's projections of the whole set, sorted along the row
        pa, pb = _sorted_rows((dirs.T @ a.T).contiguous()), _sorted_rows((dirs.T @ b.T).contiguous())
        out += (pa - pb).abs().mean().item()
    return out / REPEATS


@torch.no_grad()
def multiscale_swd(fake: torch.Tensor, real: torch.Tensor, seed: int = 0, per_image: int = PER_IMAGE) -> dict:
    """{"swd": mean over levels, "swd_<res>": per level} x 1e3, for two equally sized sets of
    (N, 3, H, W) images in [-1, 1]. Deterministic given seed."""
    if fake.shape != real.shape:
        raise ValueError(f"SWD needs sets of the same shape, got {tuple(fake.shape)} and {tuple(real.shape)}")
    g = torch.Generator().manual_seed(seed)
    out = {}
    for lf, lr in zip(laplacian_pyramid(fake.float()), laplacian_pyramid(real.float())):
        gs = g.get_state()
        da = _descriptors(lf, per_image, g)
        g.set_state(gs)  # the same patch positions in both sets
        db = _descriptors(lr, per_image, g)
        out[f"swd_{lf.shape[-1]}"] = 1e3 * sliced_wasserstein(da, db, g)
    out["swd"] = sum(out.values()) / len(out)
    return out
