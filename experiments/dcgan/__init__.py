"""Figure 6: DCGAN on CelebA faces, FP32 next to mixed precision (paper section 4.6)."""
from experiments.dcgan.task import Task, TaskCfg
from mpt.registry import register

EXPERIMENT = register("dcgan", Task, TaskCfg)  # config.yaml beside task.py


def main(overrides: list[str]) -> dict:
    from mpt.cli import main as _main

    return _main(EXPERIMENT, overrides)
