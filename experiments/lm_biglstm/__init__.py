"""Figure 5: the bigLSTM language model on the One Billion Word benchmark, FP32 vs FP16 without loss
scaling vs loss scale 128 (paper section 4.5)."""
from experiments.lm_biglstm.task import Task, TaskCfg
from mpt.registry import register

EXPERIMENT = register("lm_biglstm", Task, TaskCfg)  # config.yaml beside task.py


def main(overrides: list[str]) -> dict:
    from mpt.cli import main as _main

    return _main(EXPERIMENT, overrides)
