"""Table 3 and Figure 2: DeepSpeech 2 (English, Mandarin) and the FP32 master-copy ablation (paper sections 3.1, 4.3)."""
from experiments.deepspeech2.task import Task, TaskCfg
from mpt.registry import register

EXPERIMENT = register("deepspeech2", Task, TaskCfg)  # config.yaml beside task.py


def main(overrides: list[str]) -> dict:
    from mpt.cli import main as _main

    return _main(EXPERIMENT, overrides)
