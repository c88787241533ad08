"""The toy GAN run as a command (mpt.cli.cli_run: the stop signals, the exit status), slowed
down so that a test can signal it mid-run (tests/test_reliability.py).

    python tests/toy_cli.py OUT_DIR MAX_STEPS SECONDS_PER_STEP
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from mpt import cli
from toy_gan import ToyGan, config, run_task


class SlowToyGan(ToyGan):
    def __init__(self, cfg, pause: float):
        super().__init__(cfg)
        self.pause = pause

    def train_step(self, ctx, micro):
        time.sleep(self.pause)  # no effect on the numbers: the same run as ToyGan, only slower
        return super().train_step(ctx, micro)


torch.set_num_threads(1)
out, steps, pause = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
cli.cli_run(lambda: run_task(config(out, train={"max_steps": steps}), SlowToyGan, pause))
