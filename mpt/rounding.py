"""Writing the optimizer's FP32 result into FP16/BF16 weights that have no FP32 master copy
(precision=fp16_pure, bf16_pure; `rounding=`). Round to nearest loses every update smaller than half
an ulp of the weight (section 3.1); the two roundings here do not (Zamirai et al. 2020, "Revisiting
BFloat16 Training"): stochastic rounding is unbiased in expectation, Kahan summation carries what each
rounding lost into the next update.
"""
from __future__ import annotations

import torch


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """x (FP32) rounded to `dtype` stochastically: to the nearer neighbour r or the farther one r'
    with probability |x - r| / |r' - r|, so that E[result] = x exactly (up to the FP32 rounding of
    that probability). Exact values stay as they are; non-finite ones round to nearest."""
    x = x.float()
    r = x.to(dtype)
    rf = r.float()
    d = x - rf  # exact: x and its nearest neighbour in a narrower format are within one of its ulps
    other = torch.nextafter(r, torch.where(d > 0, torch.inf, -torch.inf).to(dtype))
    gap = other.float() - rf
    p = torch.where((d != 0) & torch.isfinite(gap), d / gap, torch.zeros_like(d))
    u = torch.rand(x.shape, generator=generator, device=x.device)
    return torch.where(u < p, other, r)


def kahan_round_(w: torch.Tensor, target: torch.Tensor, comp: torch.Tensor) -> None:
    """Write the FP32 `target` (= w + the optimizer's update) into the low-precision weights `w`
    with Kahan compensation (Zamirai et al. 2020): y = (target - w) - comp, t = round(w + y),
    comp = round((t - w) - y), w = t. `comp` (same dtype as w) holds what the last roundings lost,
    so a stream of updates each too small to move w still adds up. In place on w and comp."""
    wf = w.float()
    y = (target.float() - wf) - comp.float()
    t = (wf + y).to(w.dtype)
    comp.copy_((t.float() - wf) - y)
    w.copy_(t)
