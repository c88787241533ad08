"""The doctor's probe of the values themselves: where forward activations and weights fall in FP16's range, per
layer (mpt.bands' counts, as the numerics sampler keeps them for gradients)."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from mpt.bands import HIST_HI, HIST_LO, Tally, check_range, hook_targets, tensors_in


class ValueRanges:
    """Where the values themselves (not their gradients) fall relative to FP16's range, per layer:
    forward activations (`recording()`: the outputs of the modules `hook_targets` names, for every
    forward pass inside the context) and weights (`add`). An activation above 65504 is inf in FP16
    -- the forward-pass overflow of a model pretrained in BF16 or FP32 -- and one at or below 2^-25
    is zero. Counted like the gradients (FP64 copies, bands by what FP16 rounding stores); an
    output that is the unchanged input of a non-in-place module is counted once, at its producer.

    summary() -> {layer: {"count", "frac_<band>" for each of BANDS, "nonfinite", "max_abs", "hist"}}
    (hist: counts of exponents lo..hi, end bins holding everything beyond)."""

    def __init__(self, lo: int = HIST_LO, hi: int = HIST_HI):
        check_range(lo, hi)
        self.lo, self.hi = int(lo), int(hi)
        self._groups: dict[str, Tally] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        if t.numel() == 0:
            return
        with torch.no_grad():
            group = self._groups.get(name)
            if group is None:
                group = self._groups[name] = Tally(t.device)
            group.add(t.detach(), 1.0)

    @contextlib.contextmanager
    def recording(self, model: nn.Module):
        handles = [m.register_forward_hook(self._hook(name, bool(getattr(m, "inplace", False))))
                   for name, m in hook_targets(model)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name: str, inplace: bool):
        def hook(mod, inputs, output):
            ins = list(tensors_in(inputs))
            for t in tensors_in(output):
                if t.is_floating_point() and (inplace or not any(t is x for x in ins)):
                    self.add(name, t)

        return hook

    def summary(self) -> dict[str, dict]:
        out = {}
        for name, g in self._groups.items():
            row = g.summary(self.lo, self.hi)
            out[name] = {**{k: v for k, v in row.items() if k != "hist"}, "hist": row["hist"]}
        return out
