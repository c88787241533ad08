"""python -m data_prep.voc --archives DIR --out DIR [--force]"""
from __future__ import annotations

from ..command import prep_command
from .prepare import ARCHIVES, prepare

main = prep_command(
    "voc",
    'Check the official PASCAL VOC archives and unpack their detection parts into the VOCdevkit tree '
    'torchvision.datasets.VOCDetection reads. Safe to re-run; resumes.', prepare,
    source="--archives",
    source_help=f"folder holding {', '.join(ARCHIVES)} (the 2012 one optional)",
    out_help='output folder (about 2.8 GB for VOC07 + VOC12)')

if __name__ == "__main__":
    main()
