"""Figure 4: WMT15 English-French attention LSTM translation, FP32 vs mixed precision with and without
loss scaling (paper section 4.4)."""
from experiments.wmt_translation.task import Task, TaskCfg
from mpt.registry import register

EXPERIMENT = register("wmt_translation", Task, TaskCfg)  # config.yaml beside task.py


def main(overrides: list[str]) -> dict:
    from mpt.cli import main as _main

    return _main(EXPERIMENT, overrides)
