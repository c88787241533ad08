"""Weights & Biases logging that never stops training.

Online when WANDB_API_KEY is set (or wandb.mode=online), offline otherwise: the run is written under
the run directory and can be browsed with `wandb leet <run dir>/wandb` and uploaded later with
`wandb sync <run dir>/wandb/offline-run-*`. The wandb run id is derived from the run's content id,
so a resumed or requeued run continues the same wandb run. Only rank 0 logs. The API key is read by
wandb from the environment and never written into configs or logs."""
from __future__ import annotations

import os
import sys
import warnings


class WandbLogger:
    def __init__(self, cfg, run_dir, run_id: str, run_name: str, config: dict, rank: int = 0):
        self.run = None
        mode = cfg.wandb.mode
        if rank != 0 or mode == "disabled":
            return
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        try:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb
            self.run = wandb.init(
                project=cfg.wandb.project, entity=cfg.wandb.entity or None, mode=mode, dir=str(run_dir),
                id=run_id, resume="allow", name=run_name, group=cfg.experiment, job_type=cfg.precision,
                tags=[cfg.profile, cfg.model, cfg.precision, cfg.impl, *cfg.wandb.tags], config=config,
                settings=wandb.Settings(console="off", x_disable_stats=True, init_timeout=120),
            )
        except Exception as e:  # noqa: BLE001 -- wandb must never fail a training run
            self._fail("init", e)

    def _fail(self, what: str, e: Exception) -> None:
        warnings.warn(f"wandb {what} failed, continuing without wandb: {type(e).__name__}: {e}")
        self.run = None

    def log(self, data: dict, step: int) -> None:
        if self.run is None:
            return
        try:
            out = {}
            for k, v in data.items():
                if k.endswith("/hist") and isinstance(v, list):
                    lo, hi = data.get("numerics/hist_lo", 0), data.get("numerics/hist_hi", len(v) - 1)
                    edges = [lo + i for i in range(len(v) + 1)] if hi - lo + 1 == len(v) else list(range(len(v) + 1))
                    out[k] = self._wandb.Histogram(np_histogram=(v, edges))
                elif isinstance(v, (int, float, bool)):
                    out[k] = v
            self.run.log(out, step=step)
        except Exception as e:  # noqa: BLE001
            self._fail("log", e)

    def image(self, name: str, path, step: int, caption: str = "") -> None:
        """An image the run wrote (a sample grid) as wandb.Image under `samples/<name>`."""
        if self.run is None:
            return
        try:
            self.run.log({f"samples/{name}": self._wandb.Image(str(path), caption=caption or None)}, step=step)
        except Exception as e:  # noqa: BLE001
            self._fail("image", e)

    def summary(self, data: dict) -> None:
        if self.run is None:
            return
        try:
            for k, v in data.items():
                if isinstance(v, (int, float, str, bool)) or v is None:
                    self.run.summary[k] = v
        except Exception as e:  # noqa: BLE001
            self._fail("summary", e)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001
            print(f"wandb finish failed: {e}", file=sys.stderr)
        self.run = None
