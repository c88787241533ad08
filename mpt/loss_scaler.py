"""The loss scale S of impl=paper (section 3.2): the loss is multiplied by S before the backward pass
so that small gradients survive FP16, and the weight gradients are divided by S before the update.
impl=autocast uses torch.amp.GradScaler, with the same rules and defaults.
"""
from __future__ import annotations


class LossScaler:
    """Loss scale S with the paper's overflow rule (section 3.2): if any weight gradient is inf/nan,
    skip the update. mode 'none' is S = 1 without checks, 'static' a constant S, 'dynamic' backs off
    by `backoff` on overflow and grows by `growth` after `interval` clean steps."""

    def __init__(self, mode: str, scale: float = 1.0, growth: float = 2.0, backoff: float = 0.5, interval: int = 2000):
        self.mode, self.scale = mode, float(scale)
        self.growth, self.backoff, self.interval = growth, backoff, interval
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if self.mode != "dynamic":
            return
        if found_inf:
            self.scale *= self.backoff
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.interval:
                self.scale *= self.growth
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"mode": self.mode, "scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.clean_steps = float(sd["scale"]), int(sd["clean_steps"])
