"""Figure 6: DCGAN on CelebA faces, FP32 next to mixed precision (paper section 4.6)."""
from experiments.dcgan.task import Task, TaskCfg  # noqa: F401


def main(overrides: list[str]) -> dict:
    from mpt.cli import main as _main

    return _main("dcgan", overrides)
