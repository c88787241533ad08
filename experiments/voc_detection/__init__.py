"""Table 2: PASCAL VOC detection with SSD300 and Faster R-CNN (VGG-16), paper section 4.2."""
from experiments.voc_detection.task import Task, TaskCfg
from mpt.registry import register

EXPERIMENT = register("voc_detection", Task, TaskCfg)  # config.yaml beside task.py


def main(overrides: list[str]) -> dict:
    from mpt.cli import main as _main

    return _main(EXPERIMENT, overrides)
