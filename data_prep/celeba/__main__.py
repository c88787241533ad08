"""python -m data_prep.celeba --archives DIR --out DIR [--force]"""
from __future__ import annotations

from ..command import prep_command
from .prepare import ATTR, PARTITION, ZIP, prepare

main = prep_command(
    "celeba", "Check the official CelebA release and unpack it into the layout torchvision.datasets.CelebA "
    "reads. Safe to re-run; resumes an interrupted run.", prepare,
    source="--archives", source_help=f"folder holding {ZIP}, {PARTITION} [and {ATTR}]",
    out_help="output folder (about 1.4 GB for the real set)")

if __name__ == "__main__":
    main()
