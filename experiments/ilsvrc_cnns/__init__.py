"""Table 1: ILSVRC12 classification CNNs, FP32 vs mixed precision (paper section 4.1)."""
from experiments.ilsvrc_cnns.task import Task, TaskCfg
from mpt.registry import register

EXPERIMENT = register("ilsvrc_cnns", Task, TaskCfg)  # config.yaml beside task.py


def main(overrides: list[str]) -> dict:
    from mpt.cli import main as _main

    return _main(EXPERIMENT, overrides)
